"""The oracle engine is exact: batched masked eviction equals physical deletion, row for row."""

from __future__ import annotations

import polars as pl
import pytest
import torch

from kvdiag.core.errors import UserError
from kvdiag.label import LabelConfig, OracleEngine, Row, candidate_rows, divergences, label_trace
from kvdiag.label.reference import reference_logprobs

T_CKPT, H = 40, 5


def _ids(n=60, seed=0):
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("granularity", ["token", "layer", "head"])
def test_batched_equals_physical_deletion(tiny_model, granularity):
    """Relative error <= 1e-4 on kl_steps, plus an absolute 1e-6 for the fp32 resolution of a KL sum
    (both paths differ by ~2e-7 nats on every row, which matters only for labels near zero)."""
    ids = _ids()
    eng = OracleEngine(tiny_model, ids, horizon=H, batch_size=5)
    rows = candidate_rows([0, 1, 17, T_CKPT - 1], granularity, eng.num_layers, eng.num_kv_heads)
    got, _ = eng.label(T_CKPT, rows)
    prefix, logp_full = eng.golden(T_CKPT)
    targets = eng.ids[T_CKPT + 1 : T_CKPT + H + 1]
    for j, row in enumerate(rows):
        ref = reference_logprobs(tiny_model.model, eng.ids, T_CKPT, H, prefix, row)
        want = divergences(logp_full, ref[None], targets)
        torch.testing.assert_close(got["kl"][j], want["kl"][0], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(got["nll_delta"][j], want["nll_delta"][0], rtol=1e-4, atol=1e-5)
        assert got["flips"][j] == want["flips"][0]
    assert got["kl"].mean() > 1e-3  # the evictions really do something on this model


def test_null_eviction_is_below_1e6(tiny_model):
    eng = OracleEngine(tiny_model, _ids(), horizon=H)
    _, noise = eng.label(T_CKPT, [Row(3)])
    assert 0 <= noise <= 1e-6
    prefix, logp_full = eng.golden(T_CKPT)
    null = eng.evicted_logits(T_CKPT, prefix, [Row(-1)])
    assert divergences(logp_full, null, eng.ids[T_CKPT + 1 : T_CKPT + H + 1])["kl"].max() <= 1e-6


def test_entry_no_query_reads_changes_nothing(tiny_llama):
    """A KV head whose attention output the model discards (its query heads' o_proj columns are zero):
    no later query can read its entries, so evicting one there changes nothing, while the same
    eviction in a live head does."""
    import copy

    from kvdiag.model.load import LoadedModel

    model = copy.deepcopy(tiny_llama.model)
    attn = model.model.layers[0].self_attn
    d, g = attn.head_dim, model.config.num_attention_heads // model.config.num_key_value_heads
    with torch.no_grad():
        attn.o_proj.weight[:, 0 : g * d] = 0.0  # query heads of KV head 0
    lm = LoadedModel(model, tiny_llama.tokenizer, "tiny:llama-deaf", "float32", "cpu", None, "x", "y")
    eng = OracleEngine(lm, _ids(), horizon=H)
    got, noise = eng.label(T_CKPT, [Row(10, 0, 0), Row(10, 0, 1)])
    assert got["kl"][0].max() <= max(noise, 1e-7) * 10
    assert got["kl"][1].mean() > 1e-4 and got["kl"][1].mean() > 1000 * got["kl"][0].mean()


def test_batch_size_does_not_matter(tiny_qwen3):
    rows = candidate_rows(list(range(0, T_CKPT, 3)), "token", 2, 2)
    a, na = OracleEngine(tiny_qwen3, _ids(), horizon=H, batch_size=64).label(T_CKPT, rows)
    b, nb = OracleEngine(tiny_qwen3, _ids(), horizon=H, batch_size=3).label(T_CKPT, rows)
    torch.testing.assert_close(a["kl"], b["kl"], rtol=1e-5, atol=1e-7)
    assert abs(na - nb) < 1e-7


@pytest.mark.parametrize("before", [20, T_CKPT - 2, T_CKPT + 3])
def test_golden_run_is_the_same_however_it_is_reached(tiny_llama, before):
    """Checkpoints visited in order extend one cache (20: through the horizon, P_full from the extension;
    T-2: T lies inside the cache, P_full from a forward over its first T entries; T+3: an earlier
    checkpoint); prefix K/V and P_full must equal those of a fresh run."""
    ids = _ids()
    eng = OracleEngine(tiny_llama, ids, horizon=H)
    eng.golden(before)
    prefix, logp_full = eng.golden(T_CKPT)
    fresh_prefix, fresh_logp = OracleEngine(tiny_llama, ids, horizon=H).golden(T_CKPT)
    for (k1, v1), (k2, v2) in zip(prefix, fresh_prefix, strict=True):
        assert k1.shape == k2.shape == (tiny_llama.model.config.num_key_value_heads, T_CKPT, k2.shape[-1])
        torch.testing.assert_close(k1, k2, rtol=0, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=0, atol=1e-5)
    torch.testing.assert_close(logp_full, fresh_logp, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "t, rows, needle",
    [(0, [Row(0)], "outside"), (60 - H + 1, [Row(0)], "outside"), (T_CKPT, [Row(T_CKPT)], "candidates must lie")],
)
def test_bad_checkpoints_and_candidates(tiny_llama, t, rows, needle):
    with pytest.raises(UserError, match=needle):
        OracleEngine(tiny_llama, _ids(), horizon=H).label(t, rows)


def test_non_finite_logits_name_the_checkpoint(tiny_llama):
    import copy

    from kvdiag.model.load import LoadedModel

    model = copy.deepcopy(tiny_llama.model)
    with torch.no_grad():
        model.lm_head.weight[5] = float("inf")
    lm = LoadedModel(model, tiny_llama.tokenizer, "tiny", "float16", "cpu", None, "x", "y")
    with pytest.raises(UserError, match="checkpoint 40.*float32"):
        OracleEngine(lm, _ids(), horizon=H).label(T_CKPT, [Row(1)])
    # the same when only the evicted rows overflow (the full-cache run is finite)
    eng = OracleEngine(tiny_llama, _ids(), horizon=H)
    chunks = eng._chunks

    def overflowing(t, prefix, exclude, n, *args, **kw):  # the candidate batch (2 rows) overflows, the null row not
        for span, logits in chunks(t, prefix, exclude, n, *args, **kw):
            yield span, logits.index_fill_(2, torch.tensor([3]), float("nan")) if n == 2 else logits

    eng._chunks = overflowing
    with pytest.raises(UserError, match="checkpoint 40.*float32"):
        eng.label(T_CKPT, [Row(1), Row(2)])


def test_runner_resumes_without_redoing_items(tiny_llama, tiny_trace, tmp_path):
    cfg = LabelConfig(checkpoints="every:10", w_obs=10, horizon=4, candidates="6")
    out = tmp_path / "labels.parquet"
    calls = []

    def interrupt_after_first(k):
        calls.append(k)
        if len(calls) == 2:  # the second checkpoint is interrupted mid-way
            raise KeyboardInterrupt

    import kvdiag.label.run as runner

    orig = runner.label_item
    runner.label_item = lambda *a, **kw: orig(*a, **{**kw, "progress": interrupt_after_first})
    try:
        with pytest.raises(KeyboardInterrupt):
            label_trace(tiny_trace, tiny_llama, out, cfg, show_progress=False)
    finally:
        runner.label_item = orig
    parts = sorted((tmp_path / "labels.parquet.parts").glob("*.parquet"))
    assert len(parts) == 1 and not out.exists()
    mtime = parts[0].stat().st_mtime_ns
    label_trace(tiny_trace, tiny_llama, out, cfg, show_progress=False)
    assert parts[0].stat().st_mtime_ns == mtime  # finished work kept, not redone
    df = pl.read_parquet(out)
    assert df.select("prompt_id", "checkpoint", "position").is_duplicated().sum() == 0
    n_items = df.select("prompt_id", "checkpoint").unique().height
    assert n_items > 2 and df.height == 6 * n_items
    assert (df["age"] == df["checkpoint"] - df["position"]).all() and (df["position"] < df["checkpoint"]).all()
    # the same labels from scratch (a resumed prompt prefills its prefix in one go instead of extending
    # it, which moves KL by float rounding only)
    from polars.testing import assert_frame_equal

    fresh = tmp_path / "fresh.parquet"
    label_trace(tiny_trace, tiny_llama, fresh, cfg, show_progress=False)
    assert_frame_equal(pl.read_parquet(fresh), df, rel_tol=1e-4, abs_tol=1e-6)


def test_runner_refuses_bad_schedule_and_other_model(tiny_trace, tiny_qwen3, tiny_llama, tmp_path):
    with pytest.raises(UserError, match="not the model of the Trace"):
        label_trace(tiny_trace, tiny_qwen3, tmp_path / "l.parquet", LabelConfig(), show_progress=False)
    with pytest.raises(UserError, match="beyond the end"):
        label_trace(tiny_trace, tiny_llama, tmp_path / "l.parquet", LabelConfig(horizon=10_000), show_progress=False)
    with pytest.raises(UserError, match="outside|positive positions"):  # 0 is refused with the options
        label_trace(tiny_trace, tiny_llama, tmp_path / "l.parquet", LabelConfig(checkpoints="0,5"), show_progress=False)


def test_divergences_match_textbook_formulas():
    """KL, JS (via m = (p+q)/2), NLL delta and flips against direct float64 formulas."""
    g = torch.Generator().manual_seed(1)
    lf = torch.log_softmax(torch.randn(3, 50, generator=g) * 3, -1)
    logits = lf[None] + 3.0 + torch.randn(5, 3, 50, generator=g) * torch.tensor([0, 1e-3, 0.1, 1, 5])[:, None, None]
    targets = torch.tensor([4, 7])
    got = divergences(lf, logits, targets, chunk=2)  # raw logits: normalized inside, chunk by chunk
    le = torch.log_softmax(logits.double(), -1)
    p, q = lf.double().exp()[None], le.exp()
    m = (p + q) / 2
    kl = (p * (p.log() - q.log())).sum(-1)
    js = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    # atol: fp32 log-softmax of the logits vs the float64 reference (~1e-7 nats)
    torch.testing.assert_close(got["kl"].double(), kl, rtol=1e-4, atol=5e-7)
    torch.testing.assert_close(got["js"].double(), js, rtol=1e-4, atol=5e-7)
    torch.testing.assert_close(
        got["nll_delta"].double(), lf[[0, 1], targets].double() - le[:, [0, 1], targets], rtol=0, atol=1e-6
    )
    assert got["kl"][0].abs().max() < 1e-6 and got["js"][0].abs().max() < 1e-6
    assert got["flips"].tolist() == (le.argmax(-1) != lf.argmax(-1)).sum(-1).tolist()


def test_include_labels_listed_positions_as_all_candidates_would(tiny_llama, tiny_trace, tmp_path):
    """--include adds each listed position before a checkpoint to its sample; its label is the one `--candidates all`
    gives the same entry (the batch differs, so equal within float rounding: rel 1e-4, abs 1e-6)."""
    pid = tiny_trace.prompt_ids[0]
    base = {"checkpoints": "every:10", "w_obs": 10, "horizon": 4}
    sample = label_trace(tiny_trace, tiny_llama, tmp_path / "s.parquet", LabelConfig(**base, candidates="3"),
                         show_progress=False)
    first = pl.read_parquet(sample).filter(pl.col("prompt_id") == pid)["checkpoint"].min()
    listed = [0, first - 1, first + 5]  # the last is past the first checkpoint: labeled from the next one on
    out = label_trace(tiny_trace, tiny_llama, tmp_path / "i.parquet",
                      LabelConfig(**base, candidates="3", include={pid: listed}), show_progress=False)
    both = pl.read_parquet(out)
    every = pl.read_parquet(label_trace(tiny_trace, tiny_llama, tmp_path / "a.parquet",
                                        LabelConfig(**base, candidates="all"), show_progress=False))
    keys = ["prompt_id", "checkpoint", "position"]
    have = set(map(tuple, both.select(keys).rows()))
    want = set(map(tuple, pl.read_parquet(sample).select(keys).rows()))
    want |= {(pid, t, p) for t in both.filter(pl.col("prompt_id") == pid)["checkpoint"].unique() for p in listed
             if p < t}
    assert have == want and (pid, first, first + 5) not in have
    from polars.testing import assert_frame_equal

    joined = both.select(*keys, "kl_mean").join(every.select(*keys, "kl_mean"), on=keys, suffix="_all")
    assert joined.height == both.height
    assert_frame_equal(joined.select(pl.col("kl_mean").alias("kl")), joined.select(pl.col("kl_mean_all").alias("kl")),
                       rel_tol=1e-4, abs_tol=1e-6)


def test_the_command_refuses_parts_of_other_settings_before_the_model_loads(tiny_trace, tmp_path, monkeypatch,
                                                                            capsys):
    """kvdiag label into an --out whose parts were made with another horizon: one line, exit 2, the model never
    loaded; the same command again goes on (its stamp is the one the check builds)."""
    from tests.conftest import exits_2

    out = tmp_path / "l.parquet"
    base = ["label", "--trace", str(tiny_trace.path), "--out", str(out), "--checkpoints", "every:10", "--w-obs", "10",
            "--candidates", "6"]
    import kvdiag.cli.main

    with pytest.raises(SystemExit) as done:
        kvdiag.cli.main.main([*base, "--horizon", "4"])
    assert done.value.code == 0 and out.is_file()
    import kvdiag.label.run

    load = kvdiag.label.run.load_model
    loads = []
    monkeypatch.setattr(kvdiag.label.run, "load_model", lambda *a, **k: loads.append(a) or load(*a, **k))
    capsys.readouterr()
    assert "holds parts made with other settings" in exits_2(capsys, *base, "--horizon", "3")
    assert loads == []
    with pytest.raises(SystemExit) as again:
        kvdiag.cli.main.main([*base, "--horizon", "4"])
    assert again.value.code == 0 and len(loads) == 1


def test_a_model_that_is_not_the_traced_one_is_named(tiny_llama, tiny_qwen3, tiny_trace, tmp_path):
    """label_trace refuses a model whose weights are not the Trace's, saying which case it is: another --model
    (drop it or pass --force), or the Trace's own model spec loading other weights than were traced (its files
    changed, or manifest.json was edited: the message named a --model the user had not passed)."""
    import json
    import shutil

    from kvdiag.core.errors import UserError
    from kvdiag.label import LabelConfig, label_trace
    from kvdiag.trace import Trace

    cfg = LabelConfig(checkpoints="every:10", w_obs=10, horizon=2, candidates="4")
    with pytest.raises(UserError, match="--model tiny:qwen3 is not the model of the Trace .* drop --model or pass"):
        label_trace(Trace(tiny_trace.path), tiny_qwen3, tmp_path / "a.parquet", cfg, show_progress=False)
    copy = tmp_path / "trace"
    shutil.copytree(tiny_trace.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["model"]["weights_hash"] = "0" * 16
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=f"its model tiny:llama loads with weights {tiny_llama.weights_hash}, the "
                                        "Trace records 0000000000000000"):
        label_trace(Trace(copy), tiny_llama, tmp_path / "b.parquet", cfg, show_progress=False)
    assert not (tmp_path / "a.parquet").exists() and not (tmp_path / "b.parquet").exists()

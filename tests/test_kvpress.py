"""``kvpress:<Press>`` scorers: kvpress's own score() graded like kvdiag's rules, on a tiny random Trace.

Skipped without kvpress (``pip install 'kvdiag[kvpress]' && pip install --no-deps kvpress==0.5.5``). kvpress is
imported only through ``kvdiag.scorers.kvpress_press`` (which undoes its global attention patch), never here.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import polars as pl
import pytest
import torch
from scipy.stats import spearmanr
from typer.testing import CliRunner

import kvdiag.cli.main
from kvdiag.core.errors import UserError
from kvdiag.core.io import read_table, write_table
from kvdiag.scorers import SCORERS, checkpoint_keys, get_scorer, parse_params, resolve_scorers, score_trace
from tests.conftest import make_trace
from tests.test_conformance import EXACT, MATRIX

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("kvpress") is None,
    reason="kvpress not installed: pip install 'kvdiag[kvpress]' && pip install --no-deps kvpress==0.5.5")

# kvdiag rule -> the kvpress press that should rank the same (SnapKV at kvdiag's window of 32 queries)
TWINS = {"knorm": "kvpress:KnormPress", "h2o": "kvpress:ObservedAttentionPress", "snapkv": "kvpress:SnapKVPress"}
HIDDEN = ["kvpress:ExpectedAttentionPress", "kvpress:LeverageScorePress", "kvpress:CriticalKVPress",
          "kvpress:NonCausalAttnPress", "kvpress:CapPress", "kvpress:CompactorPress"]


@pytest.fixture(scope="module", autouse=True)
def restore_registry():
    """``kvpress:`` scorers register on first use: drop them after this module (other tests list SCORERS)."""
    before = dict(SCORERS)
    yield
    SCORERS.clear()
    SCORERS.update(before)


@pytest.fixture(scope="module")
def trace(tiny_llama, tmp_path_factory):
    return make_trace(tiny_llama, tmp_path_factory.mktemp("kvpress") / "trace", n_prompts=2, max_new_tokens=40)


@pytest.fixture(scope="module")
def scored(trace):
    """Head-granularity scores of the twins and the hidden-state presses at two checkpoints per prompt."""
    cps = {pid: [trace.prompt_len(pid) + 20, trace.length(pid)] for pid in trace.prompt_ids}
    keys = checkpoint_keys(trace, cps, ["head"])
    names = list(TWINS) + list(TWINS.values()) + HIDDEN
    df, meta = score_trace(trace, keys=keys, scorers=names, params={"kvpress:SnapKVPress": {"window_size": 32}})
    return df, meta


def test_twins_rank_like_kvdiag_rules(scored):
    """Spearman >= 0.98 in every (prompt, checkpoint, layer, KV head): the press scores the same cache entries
    the same way (Knorm and ObservedAttention are identical formulas; SnapKV recomputes its window queries from
    the hidden states, so this also checks the hidden states, module and RoPE a press receives)."""
    df, meta = scored
    for ours, press in TWINS.items():
        rhos = [spearmanr(g[ours].to_numpy(), g[press].to_numpy())[0]
                for _, g in df.group_by(["prompt_id", "checkpoint", "layer", "kv_head"])]
        assert len(rhos) == 2 * 2 * 2 * 2 and min(rhos) >= 0.98, (ours, press, min(rhos))
    assert meta["scorers"]["kvpress:SnapKVPress"]["window_size"] == 32
    assert meta["scorer_classes"]["kvpress:KnormPress"].startswith("kvdiag.scorers.kvpress_press.")


def test_hidden_state_presses_give_finite_varied_scores(scored):
    df, _ = scored
    for name in HIDDEN:
        assert np.isfinite(df[name].to_numpy()).all(), name
        for _, g in df.group_by(["prompt_id", "checkpoint", "layer", "kv_head"]):
            assert g[name].n_unique() > 1, name


def test_hook_inputs_reproduce_the_trace(trace):
    """The captured attention input, through the layer's own q_proj and RoPE, gives the Trace's queries
    (fp32, two code paths: atol 1e-4 relative to the queries' scale)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kvdiag.scorers.kvpress_press import ModelRun

    run = ModelRun(trace)
    pid = trace.prompt_ids[0]
    for layer in range(trace.num_layers):
        hidden, (cos, sin) = run.inputs(pid, layer)
        module = run.modules[layer]
        q = module.q_proj(hidden).view(1, hidden.shape[1], -1, module.head_dim).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        want = trace.layer(pid, layer).q.float()
        assert torch.allclose(q[0], want, atol=1e-4 * float(want.abs().max()))
        assert module.rotary_emb is not None and module.layer_idx == layer


def test_kvpress_leaves_kvdiag_attention_alone():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as funcs

    from kvdiag.scorers.kvpress_press import kvpress_module

    before = {key: funcs[key] for key in funcs}
    kvpress_module()
    assert all(funcs[key] is func for key, func in before.items())


def test_names_params_and_listing():
    assert parse_params(["kvpress:SnapKVPress.window_size=64"]) == {"kvpress:SnapKVPress": {"window_size": "64"}}
    scorer = get_scorer("kvpress:SnapKVPress", window_size="64")
    assert scorer.window_size == 64 and scorer.params["window_size"] == 64
    critical = get_scorer("kvpress:CriticalKVPress", press="ExpectedAttentionPress", compression_ratio="0.5")
    assert critical._press.compression_ratio == 0.5 and not critical._press.press.use_vnorm
    names = list(resolve_scorers("kvpress:all"))
    assert len(names) >= 12 and {"kvpress:ExpectedAttentionPress", "kvpress:KeyDiffPress", "kvpress:LagKVPress",
                                 "kvpress:CriticalKVPress"} <= set(names)
    assert not any(name.startswith("kvpress:") for name in resolve_scorers("all"))  # "all": built-ins and plugins
    code, out = run("score", "--list")
    assert code == 0, out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines()}
    assert rows["rkv"] == ["built-in", "gradable"] and rows["kvpress:KeyDiffPress"] == ["kvpress", "gradable"]
    assert rows["kvpress:AdaKVPress"] == ["kvpress", "refused"] and rows["kvpress:QFilterPress"] == [
        "kvpress", "refused",
    ]


@pytest.mark.parametrize("name, params, message", [
    ("kvpress:Nope", {}, "unknown kvpress press 'Nope': use kvpress:all or one of CURPress,"),
    ("kvpress:AdaKVPress", {}, "kvpress:AdaKVPress cannot be graded: wrapper"),
    ("kvpress:ComposedPress", {}, "cannot be graded: wrapper"),
    ("kvpress:QFilterPress", {}, "cannot be graded: needs trained Q-Filters"),
    ("kvpress:SnapKVPress", {"windows": "3"}, "has no parameter 'windows': its parameters are compression_ratio, "
                                              "hidden_window, kernel_size, window_size"),
    ("kvpress:SnapKVPress", {"compression_ratio": "2"}, "kvpress refuses these parameters (Compression ratio must be "
                                                        "between 0 and 1)"),
    ("kvpress:CriticalKVPress", {"press": "AdaKVPress"}, "--param kvpress:CriticalKVPress.press=AdaKVPress: use a "
                                                         "gradable press"),
])
def test_bad_names_and_params(name, params, message):
    with pytest.raises(UserError) as err:
        get_scorer(name, **params)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_missing_kvpress_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # `import kvpress` raises ImportError
    monkeypatch.delitem(SCORERS, "kvpress:KeyDiffPress", raising=False)
    with pytest.raises(UserError, match=r"need kvpress .*pip install 'kvdiag\[kvpress\]' && pip install --no-deps "
                                        r"kvpress==0.5.5"):
        get_scorer("kvpress:KeyDiffPress")
    code, out = run("score", "--list")
    assert code == 0 and "kvpress:*" in out and "not installed" in out


def run(*args):
    result = CliRunner().invoke(kvdiag.cli.main.app, [str(a) for a in args])
    return result.exit_code, result.output


def test_cli_scores_presses_beside_rules(trace, tmp_path):
    out = tmp_path / "s.parquet"
    t = trace.prompt_len(trace.prompt_ids[0]) + 30
    code, text = run(
        "score", "--trace", trace.path, "--checkpoints", t, "--scorers", "kvpress:KeyDiffPress,rkv,kvpress:SnapKVPress",
        "--param", "kvpress:SnapKVPress.window_size=16", "--out", out,
    )
    assert code == 0, text
    df, meta = read_table(out)
    assert [c for c in df.columns if c in ("rkv", "kvpress:KeyDiffPress", "kvpress:SnapKVPress")] == [
        "kvpress:KeyDiffPress", "rkv", "kvpress:SnapKVPress"]
    assert meta["scorers"]["kvpress:SnapKVPress"]["window_size"] == 16


@pytest.mark.parametrize("args, message", [
    (["--scorers", "kvpress:Nope"], "unknown kvpress press 'Nope'"),
    (["--scorers", "kvpress:KnormPress", "--param", "kvpress:KnormPress.x=1"], "has no parameter 'x'"),
    (["--scorers", "kvpress:KnormPress", "--param", "kvpress:TOVAPress.compression_ratio=0.5"], "is not in --scorers"),
])
def test_cli_bad_input_exits_2_before_writing(trace, tmp_path, capsys, args, message):
    out = tmp_path / "s.parquet"
    with pytest.raises(SystemExit) as err:
        kvdiag.cli.main.main(
            ["score", "--trace", str(trace.path), "--checkpoints", "default", "--out", str(out), *args]
        )
    assert err.value.code == 2 and not out.exists()
    assert message in " ".join(capsys.readouterr().err.split())


def test_replay_refuses_presses_in_one_line():
    from kvdiag.replay import check_live_scorer, make_scorer

    with pytest.raises(UserError, match="reads the Trace's model") as err:
        check_live_scorer(make_scorer("kvpress:KnormPress", w_obs=16))
    assert "\n" not in str(err.value)


def test_rank_eval_takes_press_columns(tmp_path):
    """rank-eval treats a ``kvpress:`` column like any scorer (no kvpress needed for this)."""
    rng = np.random.default_rng(0)
    n = 4 * 2 * 30
    labels = pl.DataFrame({
        "prompt_id": np.repeat([f"p{i}" for i in range(4)], 60), "checkpoint": np.tile(np.repeat([256, 384], 30), 4),
        "position": np.tile(np.arange(30), 8), "granularity": "token", "layer": -1, "kv_head": -1,
        "kl_mean": np.exp(rng.normal(-5, 2, n)), "noise_floor": 0.0})
    logkl = np.log(labels["kl_mean"].to_numpy())
    scores = labels.select("prompt_id", "checkpoint", "position", "granularity", "layer", "kv_head").with_columns(
        pl.Series("kvpress:KeyDiffPress", logkl + rng.normal(0, 3, n)), avokv_e=pl.Series(logkl + rng.normal(0, 1, n)))
    trace = {"path": "trace", "fingerprint": "f00"}
    lp = write_table(labels, tmp_path / "labels.parquet", {"kind": "labels", "trace": trace})
    sp = write_table(scores, tmp_path / "scores.parquet", {"kind": "scores", "trace": trace})
    code, text = run("rank-eval", "--labels", lp, "--scores", sp, "--out", tmp_path / "eval", "--bootstrap", "20")
    assert code == 0, text
    assert "kvpress:KeyDiffPress" in (tmp_path / "eval" / "table.md").read_text()


def test_hidden_window_gives_the_decoding_buffer(trace):
    """hidden_window=N hands the press only the last N hidden states (kvpress's DecodingPress buffer);
    prefill-only presses refuse that in one line."""
    pid = trace.prompt_ids[0]
    cps = {pid: [trace.length(pid)]}
    df, _ = score_trace(trace, checkpoints=cps, granularity=["head"], scorers="kvpress:ExpectedAttentionPress",
                        params={"kvpress:ExpectedAttentionPress": {"hidden_window": 16}})
    assert np.isfinite(df["kvpress:ExpectedAttentionPress"].to_numpy()).all()
    with pytest.raises(UserError, match=r"kvpress:LeverageScorePress failed at layer 0, .*AssertionError: "
                                        r"LeverageScorePress only supports prefill"):
        score_trace(trace, checkpoints=cps, scorers="kvpress:LeverageScorePress",
                    params={"kvpress:LeverageScorePress": {"hidden_window": 16}})
    with pytest.raises(UserError, match="hidden_window=-1 must be 0"):
        get_scorer("kvpress:KnormPress", hidden_window="-1")


@pytest.mark.parametrize("family", [f for f, v in MATRIX.items() if v == EXACT])
def test_every_press_runs_on_every_family_or_is_refused_before_work(family, tmp_path):
    """Presses reach the model only through the adapter (attention modules, decoder layers, the per-layer rotary
    embedding): on every exact family each gradable press gives finite [Hkv, t] scores, or the family is refused for
    presses in one line (``Family.kvpress``) before the model loads."""
    from kvdiag.model.adapters import FAMILIES
    from kvdiag.model.load import load_model
    from kvdiag.scorers.kvpress_press import gradable_presses

    lm = load_model(f"tiny:{family}")
    trace = make_trace(lm, tmp_path / "trace", n_prompts=1, max_new_tokens=24)
    pid = trace.prompt_ids[0]
    keys = checkpoint_keys(trace, {pid: [trace.length(pid)]}, ["head"])
    presses = ["kvpress:" + p for p in gradable_presses()]
    reason = FAMILIES[lm.attention.family].kvpress
    if reason:
        for press in presses:
            with pytest.raises(UserError, match=f"{press} cannot be graded on {lm.attention.family} models") as err:
                score_trace(trace, keys=keys, scorers=[press])
            assert "\n" not in str(err.value)
        return
    df, _ = score_trace(trace, keys=keys, scorers=presses)
    for press in presses:
        values = df[press].to_numpy()
        assert np.isfinite(values).all(), (family, press)

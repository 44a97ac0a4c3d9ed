"""``score_trace``, ``kvdiag score`` and ``kvdiag bench score`` on a tiny Trace; plugins; bad input exits 2."""

from __future__ import annotations

import json
import re
from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from typer.testing import CliRunner

import kvdiag.cli.main
import kvdiag.core.registry as registry_mod
from kvdiag.core.io import read_table, write_table
from kvdiag.scorers import (
    ENTRY_POINT_GROUP,
    SCORERS,
    ScoreContext,
    checkpoint_keys,
    get_scorer,
    percentile_rank,
    score_trace,
)
from kvdiag.scorers import run as score_mod
from tests.conftest import make_trace

DOCS = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def trace(tiny_llama, tmp_path_factory):
    return make_trace(tiny_llama, tmp_path_factory.mktemp("scores") / "trace", n_prompts=2, max_new_tokens=150)


@pytest.fixture(scope="module")
def labels(trace, tmp_path_factory):
    """A labels-shaped table: a seeded sample of candidates at every granularity, with the Trace's provenance."""
    keys = checkpoint_keys(trace, "default", ["token", "layer", "head"])
    keys = keys.sample(n=min(400, keys.height), seed=0, shuffle=True)
    df = keys.with_columns(kl_mean=pl.lit(0.01), noise_floor=pl.lit(0.001),
                           age=pl.col("checkpoint") - pl.col("position"))
    path = tmp_path_factory.mktemp("labels") / "labels.parquet"
    write_table(df, path, {"kind": "labels", "trace": trace.provenance})
    return path


@pytest.fixture
def clean_registry():
    before = dict(SCORERS)
    yield
    SCORERS.clear()
    SCORERS.update(before)


def run(*args):
    """Run the CLI in-process; returns (exit code, output)."""
    result = CliRunner().invoke(kvdiag.cli.main.app, [str(a) for a in args])
    return result.exit_code, result.output


def exits_2(capsys, *args) -> str:
    with pytest.raises(SystemExit) as err:
        kvdiag.cli.main.main([str(a) for a in args])
    assert err.value.code == 2
    return " ".join(capsys.readouterr().err.split())


def direct_scores(trace, pid, t, layer, name, **params):
    """[Hkv, t] scores of one scorer computed directly from the Trace's tensors (no history sharing)."""
    qkv = trace.layer(pid, layer)
    ctx = ScoreContext(qkv.q[:, :t], qkv.k[:, :t], qkv.v[:, :t], trace.scale, trace.prompt_len(pid), layer, pid)
    return get_scorer(name, **params).scores(ctx)


def test_rows_follow_the_aggregation(trace, labels):
    keys, _ = read_table(labels)
    names = ["attention", "h2o", "avokv_e", "random"]
    df, meta = score_trace(trace, keys, scorers=names)
    assert df.select(score_mod.KEY_COLUMNS).equals(keys.select(score_mod.KEY_COLUMNS))
    assert meta["aggregation"] == "mean_rank" and list(meta["scorers"]) == names
    for gran in ("token", "layer", "head"):
        row = df.filter(pl.col("granularity") == gran).row(0, named=True)
        pid, t, i, layer, h = row["prompt_id"], row["checkpoint"], row["position"], row["layer"], row["kv_head"]
        for name in names:
            ranks = [percentile_rank(direct_scores(trace, pid, t, l, name)) for l in range(trace.num_layers)]
            if gran == "token":
                expected = torch.stack(ranks)[:, :, i].mean()
            elif gran == "layer":
                expected = ranks[layer][:, i].mean()
            else:
                expected = ranks[layer][h, i]
            assert row[name] == pytest.approx(expected.item(), abs=1e-6), (gran, name)


def test_mean_raw_head_rows_are_raw_scores(trace):
    pid = trace.prompt_ids[0]
    t = trace.prompt_len(pid) + 128
    df, meta = score_trace(trace, checkpoints=[t], scorers=["rkv"], aggregation="mean_raw", granularity=["head"])
    assert meta["aggregation"] == "mean_raw"
    got = df.filter((pl.col("prompt_id") == pid) & (pl.col("layer") == 1) & (pl.col("kv_head") == 0)).sort("position")
    np.testing.assert_allclose(got["rkv"].to_numpy(), direct_scores(trace, pid, t, 1, "rkv")[0].numpy(), rtol=1e-6)


def test_cli_scores_every_labeled_candidate_with_all_scorers(trace, labels, tmp_path):
    out = tmp_path / "scores.parquet"
    code, output = run(
        "score", "--trace", trace.path, "--labels", labels, "--out", out, "--param", "rkv.mix_lambda=0.5"
    )
    assert code == 0, output
    df, meta = read_table(out)
    keys, _ = read_table(labels)
    assert df.height == keys.height
    every = [name for name, cls in SCORERS.items() if cls.in_all]  # `all`: the rules that need no setting
    assert df.columns == score_mod.KEY_COLUMNS + every
    values = df.select(every).to_numpy()
    assert np.isfinite(values).all() and values.min() >= 0 and values.max() <= 1  # mean percentile ranks
    assert meta["kind"] == "scores" and meta["trace"]["fingerprint"] == trace.fingerprint
    assert meta["scorers"]["rkv"]["mix_lambda"] == 0.5 and meta["scorers"]["rkv"]["window"] == 8
    assert meta["aggregation"] == "mean_rank"


def test_cli_checkpoints_without_labels(trace, tmp_path):
    out = tmp_path / "s.parquet"
    pid = trace.prompt_ids[0]
    t = trace.prompt_len(pid) + 100
    code, output = run("score", "--trace", trace.path, "--checkpoints", t, "--scorers", "knorm,streamingllm",
                       "--granularity", "token,head", "--out", out)
    assert code == 0, output
    df, _ = read_table(out)
    per_prompt = t * (1 + trace.num_layers * trace.num_kv_heads)
    assert df.height == per_prompt * len(trace.prompt_ids)
    assert df.columns == score_mod.KEY_COLUMNS + ["knorm", "streamingllm"]
    token = df.filter((pl.col("prompt_id") == pid) & (pl.col("granularity") == "token")).sort("position")
    assert token["position"].to_list() == list(range(t))
    assert token["streamingllm"][-1] > token["streamingllm"][t // 2]  # recent entries rank high


def test_bad_input_exits_2(trace, labels, tmp_path, capsys):
    base = ["score", "--trace", trace.path, "--out", tmp_path / "s.parquet"]
    err = exits_2(capsys, *base, "--labels", labels, "--scorers", "attention,nope")
    assert "unknown scorer 'nope'" in err and "avokv_e_no_redundancy" in err
    err = exits_2(capsys, *base, "--labels", labels, "--scorers", "rkv", "--param", "rkv.lam=0.1")
    assert "rkv has no parameter 'lam'" in err and "mix_lambda" in err
    assert "not in --scorers" in exits_2(
        capsys, *base, "--labels", labels, "--scorers", "rkv", "--param", "h2o.normalize=0"
    )
    assert "not in the Trace" in exits_2(capsys, *base, "--checkpoints", "100000")
    assert "exactly one of" in exits_2(capsys, *base)
    assert "exactly one of" in exits_2(capsys, *base, "--labels", labels, "--checkpoints", "default")
    assert "comma-separated" in exits_2(capsys, *base, "--checkpoints", "soon")
    assert "aggregation" in exits_2(capsys, *base, "--labels", labels, "--aggregation", "median")


def test_labels_from_another_trace_or_out_of_range(trace, labels, tmp_path, capsys):
    keys, meta = read_table(labels)
    base = ["score", "--trace", trace.path, "--out", tmp_path / "s.parquet", "--labels"]
    other = tmp_path / "other.parquet"
    write_table(keys, other, {**meta, "trace": {**meta["trace"], "fingerprint": "0123456789abcdef"}})
    assert "another Trace" in exits_2(capsys, *base, other)
    late = tmp_path / "late.parquet"
    write_table(keys.head(1).with_columns(position=pl.col("checkpoint")), late, meta)  # one row: keys unique
    assert "is not cached at checkpoint" in exits_2(capsys, *base, late)
    stranger = tmp_path / "stranger.parquet"
    write_table(keys.head(1).with_columns(prompt_id=pl.lit("ghost")), stranger, meta)
    assert "'ghost'" in exits_2(capsys, *base, stranger)
    deep = tmp_path / "deep.parquet"
    write_table(keys.filter(pl.col("granularity") == "head").head(1).with_columns(layer=pl.lit(99)), deep, meta)
    assert "does not fit" in exits_2(capsys, *base, deep)


def readme_plugin(tmp_path) -> Path:
    """The plugin example of the README, written to a file as a user would."""
    block = re.search(r"```python\n(# my_scorer\.py.*?)```", DOCS.read_text(), re.DOTALL).group(1)
    assert len(block.strip().splitlines()) <= 15
    path = tmp_path / "my_scorer.py"
    path.write_text(block)
    return path


def test_readme_plugin_is_scored_like_a_builtin(trace, labels, tmp_path, clean_registry):
    plugin = readme_plugin(tmp_path)
    out = tmp_path / "s.parquet"
    code, output = run("score", "--trace", trace.path, "--labels", labels, "--out", out,
                       "--scorers", "knorm,value_key_ratio", "--plugin", plugin, "--param", "value_key_ratio.eps=0.5")
    assert code == 0, output
    df, meta = read_table(out)
    assert meta["scorers"]["value_key_ratio"] == {"eps": 0.5}
    head = df.filter(pl.col("granularity") == "head").row(0, named=True)
    qkv = trace.layer(head["prompt_id"], head["layer"])
    t, i, h = head["checkpoint"], head["position"], head["kv_head"]
    ratio = qkv.v[h, :t].float().norm(dim=-1) / (qkv.k[h, :t].float().norm(dim=-1) + 0.5)
    assert head["value_key_ratio"] == pytest.approx(percentile_rank(ratio[None])[0, i].item())


def test_plugin_by_module_name_and_entry_point(trace, tmp_path, monkeypatch, clean_registry):
    plugin = readme_plugin(tmp_path)
    (tmp_path / "kv_plugin_mod.py").write_text(plugin.read_text().replace("value_key_ratio", "by_module"))
    (tmp_path / "kv_plugin_ep.py").write_text(plugin.read_text().replace('@register_scorer("value_key_ratio")\n', ""))
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = EntryPoint(name="from_entry_point", value="kv_plugin_ep:ValueKeyRatio", group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry_mod, "entry_points", lambda group: [ep] if group == ENTRY_POINT_GROUP else [])
    pid = trace.prompt_ids[0]
    df, meta = score_trace(trace, checkpoints={pid: [trace.prompt_len(pid) + 64]}, plugins=["kv_plugin_mod"],
                           scorers=["by_module", "from_entry_point"])
    assert df["by_module"].to_list() == df["from_entry_point"].to_list()
    assert meta["scorer_classes"]["from_entry_point"] == "kv_plugin_ep.ValueKeyRatio"


def test_broken_plugin_is_a_user_error(trace, tmp_path, capsys, clean_registry):
    base = ["score", "--trace", trace.path, "--out", tmp_path / "s.parquet", "--checkpoints", "default"]
    assert "cannot import" in exits_2(capsys, *base, "--plugin", "no_such_plugin_module")
    assert "file not found" in exits_2(capsys, *base, "--plugin", tmp_path / "missing.py")


def test_bench_score_reports_time_per_checkpoint(trace, tmp_path):
    out = tmp_path / "bench.json"
    code, output = run("bench", "score", "--trace", trace.path, "--scorers", "attention,rkv,lazyeviction", "--out", out)
    assert code == 0, output
    assert "s / checkpoint" in output and "peak RSS" in output
    report = json.loads(out.read_text())
    assert report["checkpoints"] == sum(
        len(score_mod.default_checkpoints(trace.prompt_len(p), trace.length(p))) for p in trace.prompt_ids)
    assert set(report["scorer_seconds_per_checkpoint"]) == {"attention", "rkv", "lazyeviction"}
    assert report["seconds_per_checkpoint"] > 0


def test_wo_payload_needs_the_traces_model(trace, tmp_path, capsys):
    base = ["score", "--trace", trace.path, "--out", tmp_path / "s.parquet", "--checkpoints", "default",
            "--scorers", "value_norm", "--param", "value_norm.kind=wo_l2"]
    assert "needs the model" in exits_2(capsys, *base)
    assert "not the Trace's model" in exits_2(capsys, *base, "--model", "tiny:qwen3")
    code, output = run(*base, "--model", "tiny:llama")
    assert code == 0, output

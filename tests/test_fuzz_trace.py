"""A generated fuzz suite of a Trace's contents: every field of manifest.json and every column of tokens.parquet,
replaced by hostile values drawn by Hypothesis, and a stored layer file's values or shapes altered, then read by the
real readers and stages that take a Trace (no stubs): ``TraceFiles``, ``Trace.layer``, ``Trace.attention`` and the
scorers at one checkpoint. Each draw must either read and score with finite scores, or be refused with one
``UserError`` (exit 2 on the command line); any other exception is a bug report a user would have seen ("internal
error"). tests/test_fuzz_cli.py does the same for the command line's options and the labels' and scores' contents.

Found by hand first (2026-12-08, an ad hoc script through score, label, figures and fit): a layer's attention record
with a scale, window or sinks no trace writes, a null token id, tokens of a prompt the manifest does not list, a
token beyond the vocabulary, a NaN or inf stored value: each ended in "internal error" or in silently wrong numbers.
Draws are derandomized (the same examples on every run).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvdiag.core.errors import UserError

HOSTILE = [None, True, 0, -1, -(2**63), 2**64, 10**12, 0.5, -0.0, float("nan"), float("inf"), float("-inf"), 1e-300,
           "", "x", "0", "full", "../../etc", "\u202e", [], [None], [1, 2], {}, {"mode": "all"}]
values = st.one_of(st.sampled_from(HOSTILE), st.integers(-(2**40), 2**40), st.text(max_size=12),
                   st.lists(st.integers(-3, 300), max_size=4))


def leaves(node, path=()):
    """Every (path, value) of a JSON value: objects and lists are leaves too (replaced whole), free prompt texts
    and the generation settings' instruction are kept (read by no stage that reads a Trace)."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            if k not in ("text", "instruction", "created", "attn_implementation", "tensors", "prompts_source"):
                yield from leaves(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node[:3]):
            yield from leaves(v, (*path, i))


def replaced(node, path, value):
    if not path:
        return value
    out = dict(node) if isinstance(node, dict) else list(node)
    out[path[0]] = replaced(node[path[0]], path[1:], value)
    return out


def exercise(path: Path) -> None:
    """What the stages read of a Trace: its files, each stored layer, attention with the recorded semantics, and
    three scorers (attention-based, norm-based, windowed) at one checkpoint per prompt; scores must be finite."""
    from kvdiag.scorers import score_trace
    from kvdiag.trace import Trace
    from kvdiag.trace.manifest import TraceFiles

    TraceFiles(path)
    tr = Trace(path)
    for pid in tr.prompt_ids:
        T = tr.length(pid)
        for layer in range(tr.num_layers):
            tr.layer(pid, layer)
            assert bool(tr.attention(pid, layer, [T - 1]).isfinite().all())
    checkpoints = {pid: [tr.length(pid) - 4] for pid in tr.prompt_ids if tr.length(pid) > 8}
    if checkpoints:
        scores, _ = score_trace(tr, checkpoints=checkpoints, scorers=["h2o", "knorm", "snapkv"])
        values = scores.select("h2o", "knorm", "snapkv").to_numpy()
        assert all(math.isfinite(x) for x in values.ravel()), "non-finite scores from a Trace that was read"


@pytest.fixture(scope="module")
def base(tiny_trace, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-trace") / "base"
    shutil.copytree(tiny_trace.path, root)
    exercise(root)  # as written, every step passes
    return root


def copy(base: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("draw") / "trace"
    shutil.copytree(base, out)
    return out


def refused_or_read(path: Path) -> None:
    try:
        exercise(path)
    except UserError as err:
        assert "\n" not in str(err).strip(), "a refusal is one line"


@settings(max_examples=120, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hostile_manifest_fields(base, tmp_path_factory, data):
    manifest = json.loads((base / "manifest.json").read_text())
    fields = [p for p, _ in leaves(manifest) if p]
    field = data.draw(st.sampled_from(fields), label="field")
    value = data.draw(values, label="value")
    path = copy(base, tmp_path_factory)
    (path / "manifest.json").write_text(json.dumps(replaced(manifest, field, value)))
    refused_or_read(path)


COLUMNS = ("prompt_id", "position", "token_id")


@settings(max_examples=40, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(column=st.sampled_from(COLUMNS), row=st.integers(0, 40),
       value=st.one_of(st.none(), st.integers(-(2**40), 2**40), st.sampled_from([0, 258, 259, 10**6, -1])))
def test_hostile_token_values(base, tmp_path_factory, column, row, value):
    path = copy(base, tmp_path_factory)
    tokens = pl.read_parquet(path / "tokens.parquet")
    if column == "prompt_id":  # a prompt id as text: another prompt's, or none
        value = None if value is None else str(value)
    new = pl.when(pl.int_range(pl.len()) == row).then(pl.lit(value, dtype=tokens.schema[column])).otherwise(column)
    tokens.with_columns(new.alias(column)).write_parquet(path / "tokens.parquet")
    refused_or_read(path)


@settings(max_examples=24, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from("qkv"), layer=st.integers(0, 1),
       change=st.sampled_from(["nan", "inf", "-inf", "huge", "heads", "dim", "positions", "rank", "dtype"]))
def test_hostile_layer_files(base, tmp_path_factory, name, layer, change):
    import torch
    from safetensors.torch import load_file, save_file

    from kvdiag.trace.writer import layer_file

    path = copy(base, tmp_path_factory)
    pid = json.loads((path / "manifest.json").read_text())["prompts"]
    pid = next(iter(pid))
    file = layer_file(path, pid, layer)
    tensors = load_file(str(file))
    x = tensors[name].clone()
    if change in ("nan", "inf", "-inf", "huge"):
        x[0, 3, 0] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "huge": 3e38}[change]
    elif change == "heads":
        x = x[:1]
    elif change == "dim":
        x = x[..., :-1]
    elif change == "positions":
        x = x[:, :-1]
    elif change == "rank":
        x = x[0]
    else:
        x = x.to(torch.int32)
    save_file({**tensors, name: x.contiguous()}, str(file))
    refused_or_read(path)

"""``kvdiag trace --store all|kv|none|LAYERS``: what each mode writes, and that ``Trace.layer`` returns the same
q/k/v whatever the mode (stored tensors read as recorded, the rest rebuilt by one prefill per prompt).

Tolerance of rebuilt tensors (fp16 storage): rtol = atol = 1e-3. The recorded rows come from step-by-step
decoding (one query over a growing cache), the rebuilt ones from one prefill (all queries at once): other
matmul shapes, so fp32 results differ by ~1e-6 relative, and a value near an fp16 rounding boundary can land
one fp16 ulp (2^-10 relative, i.e. <= 9.8e-4·|x|) away. Stored tensors are read back bitwise equal.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from kvdiag.core.errors import UserError
from kvdiag.tasks.prompts import load_prompts
from kvdiag.trace import GenerationSettings, Trace, trace_prompts
from kvdiag.trace import reader as reader_mod
from kvdiag.trace.writer import stored_names

MODES = ["all", "kv", "none", "1"]  # "1": q/k/v of layer 1 only (the tiny model has layers 0, 1)
TOL = dict(rtol=1e-3, atol=1e-3)  # see the module docstring
N_PROMPTS, NEW = 2, 40


def settings(store: str) -> GenerationSettings:
    return GenerationSettings(max_new_tokens=NEW, chat=False, instruction=None, storage_dtype="float16", store=store)


@pytest.fixture(scope="module")
def traces(tiny_llama, tmp_path_factory) -> dict[str, Trace]:
    root = tmp_path_factory.mktemp("store")
    prompts = load_prompts("builtin:arith", limit=N_PROMPTS)
    for mode in MODES:
        trace_prompts(tiny_llama, prompts, root / mode, settings(mode), show_progress=False)
    return {mode: Trace(root / mode) for mode in MODES}


def test_manifest_records_the_store(traces):
    assert traces["all"].manifest["store"] == {"mode": "all", "layers": [0, 1]}
    assert traces["kv"].manifest["store"] == {"mode": "kv", "layers": [0, 1]}
    assert traces["none"].manifest["store"] == {"mode": "none", "layers": []}
    assert traces["1"].manifest["store"] == {"mode": "layers", "layers": [1]}


@pytest.mark.parametrize("mode", MODES)
def test_layer_is_the_same_in_every_mode(traces, mode):
    """Stored tensors bitwise equal to the ``all`` Trace's, rebuilt ones within TOL; same dtype and shapes."""
    ref, tr = traces["all"], traces[mode]
    assert ref.token_ids(ref.prompt_ids[0]).tolist() == tr.token_ids(tr.prompt_ids[0]).tolist()
    rebuilt = 0
    for pid in ref.prompt_ids:
        for layer in range(ref.num_layers):
            want, got = ref.layer(pid, layer), tr.layer(pid, layer)
            for name in "qkv":
                a, b = getattr(want, name), getattr(got, name)
                assert b.dtype == torch.float16 and b.shape == a.shape
                if name in stored_names(tr.store, layer):
                    assert torch.equal(a, b), (pid, layer, name)
                else:
                    rebuilt += 1
                    torch.testing.assert_close(b.float(), a.float(), **TOL)
    assert rebuilt == {"all": 0, "kv": 4, "none": 12, "1": 6}[mode]


def test_one_prefill_per_prompt(traces, monkeypatch):
    """Reading every layer of every prompt (twice) rebuilds each prompt once, and only one prompt is kept."""
    tr = Trace(traces["none"].path, model=traces["none"].model())
    calls = []
    real = reader_mod.rebuild_layers
    monkeypatch.setattr(reader_mod, "rebuild_layers", lambda lm, ids, *a: calls.append(len(ids)) or real(lm, ids, *a))
    for pid in tr.prompt_ids:
        for _ in range(2):
            for layer in range(tr.num_layers):
                tr.layer(pid, layer)
        assert tr._rebuilt[0] == pid
    assert calls == [tr.length(pid) for pid in tr.prompt_ids]


def test_chunked_rebuild_matches(traces):
    """Prefill in chunks of 7 positions over a cache (the long-trace path) gives the one-forward result within TOL."""
    ref, tr = traces["all"], Trace(traces["none"].path, model=traces["none"].model())
    tr.rebuild_chunk = 7
    pid = ref.prompt_ids[0]
    for layer in range(ref.num_layers):
        for name in "qkv":
            torch.testing.assert_close(
                getattr(tr.layer(pid, layer), name).float(), getattr(ref.layer(pid, layer), name).float(), **TOL
            )


@pytest.mark.parametrize("mode", ["kv", "none"])
def test_score_trace_same_scores(traces, mode):
    """Scores on rebuilt tensors equal those on the recorded ones: rtol 1e-2, atol 1e-4 (the inputs differ by
    at most one fp16 ulp, ~1e-3 relative; attention-derived scores move by about that much), or one rank step: the
    values are mean percentile ranks (steps of 1/(t - 1)), and a perturbation of ~1e-3 can swap two near-tied
    entries (seen on AMD: one TOVA row of 946 moved by one step)."""
    from kvdiag.scorers.run import score_trace

    ref = traces["all"]
    cps = {pid: [ref.prompt_len(pid) + 20, ref.length(pid)] for pid in ref.prompt_ids}
    want, _ = score_trace(ref, checkpoints=cps, scorers="all")
    got, _ = score_trace(traces[mode], checkpoints=cps, scorers="all")
    assert want.columns == got.columns and want.height == got.height > 0
    keys = ["prompt_id", "checkpoint", "position", "granularity", "layer", "kv_head"]
    assert want.select(keys).equals(got.select(keys))
    step = 1.0 / (want["checkpoint"].to_numpy() - 1)  # one percentile-rank step at the row's checkpoint
    for col in want.columns:
        if col not in keys and want[col].dtype.is_float():
            g, w = got[col].to_numpy(), want[col].to_numpy()
            bad = np.abs(g - w) > np.maximum(1e-2 * np.abs(w) + 1e-4, 1.001 * step)
            assert not bad.any(), (col, np.flatnonzero(bad)[:5], g[bad][:5], w[bad][:5])


def _tensor_bytes(tr: Trace) -> tuple[int, int]:
    """(bytes of every tensor file, bytes of their safetensors headers: 8-byte length + JSON)."""
    total = header = 0
    for f in (tr.path / "tensors").rglob("*.safetensors"):
        total += f.stat().st_size
        header += 8 + int.from_bytes(f.read_bytes()[:8], "little")
    return total, header


def test_bytes_per_token_match_the_arithmetic(traces):
    """all = L·(H+2·Hkv)·d·2 bytes per token (fp16), kv = L·2·Hkv·d·2, LAYERS = |layers|·(H+2·Hkv)·d·2,
    none = no tensor file; file headers are the only overhead (< 1 KiB per file)."""
    ref = traces["all"]
    L, H, Hkv, d = ref.num_layers, ref.num_heads, ref.num_kv_heads, ref.head_dim
    tokens = sum(ref.length(pid) for pid in ref.prompt_ids)
    per_token = {"all": L * (H + 2 * Hkv) * d * 2, "kv": L * 2 * Hkv * d * 2, "none": 0, "1": (H + 2 * Hkv) * d * 2}
    for mode, tr in traces.items():
        total, header = _tensor_bytes(tr)
        files = len(list((tr.path / "tensors").rglob("*.safetensors")))
        assert total - header == per_token[mode] * tokens, mode  # the tensor payload, exactly
        assert header <= 1024 * files, mode
        assert files == {"all": L, "kv": L, "none": 0, "1": 1}[mode] * N_PROMPTS
    # none: tokens.parquet and the manifest are all there is (tokens.parquet within a few % of the all Trace's)
    none_tokens = (traces["none"].path / "tokens.parquet").stat().st_size
    assert abs(none_tokens - (ref.path / "tokens.parquet").stat().st_size) <= 0.05 * none_tokens


def test_rerun_with_another_store_is_refused(tiny_llama, traces, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(traces["kv"].path, out)
    with pytest.raises(UserError, match="other generation settings"):
        trace_prompts(
            tiny_llama, load_prompts("builtin:arith", limit=N_PROMPTS), out, settings("all"), show_progress=False
        )
    trace_prompts(
        tiny_llama, load_prompts("builtin:arith", limit=N_PROMPTS + 1), out, settings("kv"), show_progress=False
    )
    assert len(Trace(out).prompt_ids) == N_PROMPTS + 1  # the same --store continues it


def test_layer_beyond_the_model_is_refused_before_writing(tiny_llama, tmp_path):
    with pytest.raises(UserError, match="--store 0,2: layer 2 does not exist"):
        trace_prompts(
            tiny_llama, load_prompts("builtin:arith", limit=1), tmp_path / "t", settings("0,2"), show_progress=False
        )
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    "value, fragment", [("some", "--store some"), ("0,0", "twice"), ("-1", "--store -1"), ("", "--store")]
)
def test_bad_store_refused(value, fragment):
    with pytest.raises(UserError, match=fragment):
        settings(value)


def test_wrong_model_refused(traces, tiny_qwen3):
    with pytest.raises(UserError, match="not the Trace's model"):
        Trace(traces["none"].path, model=tiny_qwen3)


def test_unloadable_model_names_what_is_missing(traces, tmp_path):
    """A Trace whose model cannot be loaded here: reading a stored layer works, a missing one is one line."""
    out = tmp_path / "moved"
    shutil.copytree(traces["1"].path, out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["model"]["spec"] = "/no/such/model"
    (out / "manifest.json").write_text(json.dumps(manifest))
    tr = Trace(out)
    pid = tr.prompt_ids[0]
    tr.layer(pid, 1)  # stored: needs no model
    with pytest.raises(UserError) as err:
        tr.layer(pid, 0)
    msg = str(err.value)
    assert "\n" not in msg and "q, k, v of layer 0" in msg and "/no/such/model" in msg and "--store layers" in msg


def test_attention_goes_through_the_rebuild(traces):
    ref, tr = traces["all"], traces["none"]
    pid = ref.prompt_ids[0]
    pos = list(range(ref.prompt_len(pid), ref.length(pid), 5))
    torch.testing.assert_close(tr.attention(pid, 1, pos), ref.attention(pid, 1, pos), rtol=1e-2, atol=1e-4)

"""Every scorer on every checkpoint of a ~2,048-token trace of the embedded model, in bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import needs_smollm2

TOKENS = 2048
# Bound on the peak RSS of the `kvdiag bench score` process, imports and torch included (measured: ~0.7-0.85 GiB).
# Materializing [H, t, t] attention per layer would add ~150 MiB per layer at t = 2048 and grow with T².
PEAK_RSS_MIB = 2048


def forced_generate(model, continuation: torch.Tensor, chunk: int = 256):
    """A stand-in for ``model.generate`` as ``trace_prompts`` calls it, that writes ``continuation`` instead of
    decoding: the prompt is prefilled as generate prefills it, then the continuation is teacher-forced in forwards
    of ``chunk`` tokens over the same positioned cache, through the same recording attention, and every logits
    processor (the writer's TokenStats: logprob, entropy) sees each step's raw scores as generate would show them.

    The Trace written is then the one ``kvdiag trace`` writes for a model that generated ``continuation``: the same
    files, manifest, token rows and q/k/v up to the rounding of a batched forward against per-token decoding
    (``test_forced_generation_writes_the_trace_that_generation_writes`` checks this on a short real generation). A
    2,048-token trace costs one prefill's worth of matmuls (~10 s on one core) instead of ~1,950 weight-bandwidth-
    bound decode steps (~150 s)."""

    @torch.no_grad()
    def generate(input_ids, logits_processor=(), cache=None, **_):
        P = input_ids.shape[1]
        seq = torch.cat([input_ids, continuation.view(1, -1).to(input_ids.device)], dim=1)
        T = seq.shape[1]
        # generate() never feeds its last token (the writer records it with one more step): positions 0 .. T - 2
        bounds = [0, P, *range(P + chunk, T - 1, chunk), T - 1]
        for start, end in pairwise(bounds):
            first = max(start, P - 1)  # the first position whose logits choose a generated token
            pos = torch.arange(start, end, device=seq.device).view(1, -1)
            logits = model(seq[:, start:end], cache=cache, position_ids=pos, use_cache=True,
                           logits_to_keep=end - first).logits
            for j in range(first, end):  # step j + 1 - P: scores for the token at j + 1, given tokens 0 .. j
                for processor in logits_processor:
                    processor(seq[:, : j + 1], logits[:, j - first].float())
        return SimpleNamespace(sequences=seq, past_key_values=cache)

    return generate


@pytest.fixture(scope="module")
def smollm2():
    from kvdiag.model.load import load_model

    return load_model("smollm2")


@pytest.mark.slow
@needs_smollm2
def test_forced_generation_writes_the_trace_that_generation_writes(smollm2, tmp_path, monkeypatch):
    """What the 2,048-token test below relies on: forcing the tokens a real greedy generation wrote gives the same
    Trace (manifest but its creation time, token rows exactly but logprob/entropy, which agree to ~1e-5; q/k/v
    within the float16 storage's rounding)."""
    import polars as pl
    from polars.testing import assert_frame_equal
    from safetensors.torch import load_file

    from kvdiag.tasks.prompts import load_prompts
    from kvdiag.trace import GenerationSettings, Trace, trace_prompts

    prompts = load_prompts("builtin:arith", limit=1)
    settings = GenerationSettings(max_new_tokens=24)
    real = Trace(trace_prompts(smollm2, prompts, tmp_path / "real", settings, show_progress=False))
    pid = real.prompt_ids[0]
    P = real.prompt_len(pid)
    assert real.length(pid) == P + 24
    monkeypatch.setattr(smollm2.model, "generate",
                        forced_generate(smollm2.model, torch.as_tensor(real.token_ids(pid))[P:], chunk=8))
    forced = trace_prompts(smollm2, prompts, tmp_path / "forced", settings, show_progress=False)
    strip = lambda path: {k: v for k, v in json.loads((path / "manifest.json").read_text()).items() if k != "created"}
    assert strip(forced) == strip(real.path)
    want, got = pl.read_parquet(real.path / "tokens.parquet"), pl.read_parquet(forced / "tokens.parquet")
    assert_frame_equal(got.drop("logprob", "entropy"), want.drop("logprob", "entropy"))
    assert_frame_equal(got, want, rel_tol=0, abs_tol=1e-4)
    for layer in range(real.num_layers):
        name = f"tensors/{pid}/layer_{layer:03d}.safetensors"
        a, b = load_file(forced / name), load_file(real.path / name)
        assert a.keys() == b.keys()
        for key in a:  # float16 rows (|x| < 32): one unit in the last place is at most 2**-5
            torch.testing.assert_close(a[key].float(), b[key].float(), rtol=0, atol=2**-5)


@pytest.mark.slow
@needs_smollm2
def test_all_scorers_on_a_2048_token_trace(smollm2, tmp_path, monkeypatch):
    """The trace is the builtin arith prompt (chat template and instruction, as `kvdiag trace` writes it) followed by
    TOKENS - P real text tokens written by the model under :func:`forced_generate` (the builtin problems
    concatenated, no EOS): a Trace of the embedded model of exactly TOKENS tokens, every one after the prompt
    recorded as generated, so the default schedule has as many checkpoints as a ~2,048-token generation and the
    scorers see the same shapes (30 layers, 9 query and 3 KV heads, t up to 2,048) as on one. The bounded-memory
    claim is about those shapes, not about which tokens the model chose."""
    from kvdiag.label.bench import bench_tokens
    from kvdiag.tasks.prompts import encode_prompt, load_prompts
    from kvdiag.trace import GenerationSettings, Trace, trace_prompts

    prompts = load_prompts("builtin:arith", limit=1)
    defaults = GenerationSettings()
    prompt_len = len(encode_prompt(smollm2.tokenizer, prompts[0], chat=defaults.chat,
                                   instruction=defaults.instruction))
    settings = GenerationSettings(max_new_tokens=TOKENS - prompt_len)
    monkeypatch.setattr(smollm2.model, "generate",
                        forced_generate(smollm2.model, bench_tokens(smollm2, TOKENS - prompt_len)))
    trace = Trace(trace_prompts(smollm2, prompts, tmp_path / "trace", settings, show_progress=False))
    pid = trace.prompt_ids[0]
    assert trace.length(pid) == TOKENS and trace.prompt_len(pid) == prompt_len  # no early EOS: the whole length
    report = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvdiag.cli.main", "bench", "score", "--trace", str(trace.path), "--out", str(report)],
        capture_output=True, text=True, timeout=3000,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # one thread, like this worker (conftest): xdist fills the cores
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    bench = json.loads(report.read_text())
    assert bench["checkpoints"] == (trace.length(pid) - trace.prompt_len(pid)) // 128
    assert bench["layers"] == 30 and len(bench["scorer_seconds_per_checkpoint"]) >= 18
    assert bench["peak_rss_mib"] < PEAK_RSS_MIB, bench
    print(f"\nT = {trace.length(pid)}: {bench['seconds_per_checkpoint']:.2f} s per checkpoint, peak RSS "
          f"{bench['peak_rss_mib']:.0f} MiB")

"""Every scorer on every checkpoint of a ~2,048-token trace of the embedded model, in bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import needs_smollm2

TOKENS = 2048
# Bound on the peak RSS of the `kvdiag bench score` process, imports and torch included (measured: ~0.7 GiB).
# Materializing [H, t, t] attention per layer would add ~150 MiB per layer at t = 2048 and grow with T².
PEAK_RSS_MIB = 2048


@pytest.mark.slow
@needs_smollm2
def test_all_scorers_on_a_2048_token_trace(tmp_path):
    from kvdiag.model.load import load_model
    from kvdiag.tasks.prompts import encode_prompt, load_prompts
    from kvdiag.trace import GenerationSettings, Trace, trace_prompts

    lm = load_model("smollm2")
    prompts = load_prompts("builtin:arith", limit=1)
    defaults = GenerationSettings()
    prompt_len = len(encode_prompt(lm.tokenizer, prompts[0], chat=defaults.chat, instruction=defaults.instruction))
    settings = GenerationSettings(max_new_tokens=TOKENS - prompt_len)
    trace = Trace(trace_prompts(lm, prompts, tmp_path / "trace", settings, show_progress=False))
    del lm
    pid = trace.prompt_ids[0]
    assert trace.length(pid) > TOKENS // 2  # an early EOS would make this test weaker than it says
    report = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvdiag.cli.main", "bench", "score", "--trace", str(trace.path), "--out", str(report)],
        capture_output=True, text=True, timeout=3000,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    bench = json.loads(report.read_text())
    assert bench["checkpoints"] == (trace.length(pid) - trace.prompt_len(pid)) // 128
    assert bench["layers"] == 30 and len(bench["scorer_seconds_per_checkpoint"]) >= 18
    assert bench["peak_rss_mib"] < PEAK_RSS_MIB, bench
    print(f"\nT = {trace.length(pid)}: {bench['seconds_per_checkpoint']:.2f} s per checkpoint, peak RSS "
          f"{bench['peak_rss_mib']:.0f} MiB")

"""``kvdiag bench scale`` end to end on a tiny model: every step's peaks are recorded (the load's and the
work's after it) and a rerun continues from ``steps/`` without running anything again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdiag.bench import scale

PROMPTS = Path(__file__).parents[1] / "data" / "math500-first20.jsonl"


def test_bench_scale_records_load_and_work_peaks_and_resumes(tmp_path, monkeypatch):
    plan = scale.ScalePlan("tiny:llama", str(PROMPTS), [320], ["none"], tmp_path / "scale")
    text = scale.bench_scale(plan)
    steps = {p.stem: json.loads(p.read_text()) for p in (plan.out / "steps").glob("*.json")}
    assert set(steps) == {
        "baseline__trace-none", "T320__trace-none", "T320__label", "T320__score-none", "T320__figures",
    }
    for name, s in steps.items():
        if s["load_peak_mb"] is None:  # figures loads no model: its peak is the whole process's
            assert name == "T320__figures" and s["work_peak_mb"] is None
            continue
        # the child restarted its high-water mark after the load: the whole peak is the larger of the two
        assert 0 < s["work_peak_mb"] <= s["peak_rss_mb"] and 0 < s["load_peak_mb"] <= s["peak_rss_mb"]
        assert s["peak_rss_mb"] == pytest.approx(max(s["load_peak_mb"], s["work_peak_mb"]), abs=0.1)
    assert "| 320 | trace | none |" in text and (plan.out / "scale.csv").exists()

    def must_not_run(argv, log):
        raise AssertionError(f"step reran: {argv}")

    monkeypatch.setattr(scale, "_run", must_not_run)
    assert scale.bench_scale(plan) == text  # every step is kept: the rerun only renders the same tables


def test_memory_growth_is_per_interval_against_kv_plus_rows():
    """SmolLM2's shape: KV 30 layers × 3 heads × 64 × 2 × 4 B = 46,080 B/token (float32), recorded rows
    (9 + 3 + 3) × 64 × 30 × 2 B = 57,600 B/token (float16). A flat peak gives 0; a peak growing by exactly
    the bound gives ratio 1."""
    from kvdiag.trace.cost import ModelShape

    shape = ModelShape(
        "smollm2", layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152
    )
    per_token = 46_080 + 57_600
    mb = lambda T: (1300 * 2**20 + per_token * (T - 4096)) / 2**20
    steps = [scale.Step(f"T{T}/trace-all", "trace", T, "all", 1.0, max(1300, mb(T)), 1.0, 1200.0, max(1300, mb(T)))
             for T in (1024, 4096, 8192)]
    growth = scale.memory_growth(steps, shape, "float32")
    assert growth["T"].to_list() == ["least squares over 1024,4096,8192", "1024 -> 4096", "4096 -> 8192"]
    assert (
        growth["KV cache KB/token"].to_list() == [46.1] * 3 and growth["recorded rows KB/token"].to_list() == [57.6] * 3
    )
    assert growth["measured / (KV + rows)"].to_list()[1:] == [0.0, 1.0]
    assert 0 < growth["measured / (KV + rows)"][0] < 1  # the slope through a flat start and a bound-rate rise

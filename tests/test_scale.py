"""``kvdiag bench scale`` end to end on a tiny model: every step's peaks are recorded (the load's and the
work's after it) and a rerun continues from ``steps/`` without running anything again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdiag import scale

PROMPTS = Path(__file__).parents[1] / "data" / "math500-first20.jsonl"


def test_bench_scale_records_load_and_work_peaks_and_resumes(tmp_path, monkeypatch):
    plan = scale.ScalePlan("tiny:llama", str(PROMPTS), [320], ["none"], tmp_path / "scale")
    text = scale.bench_scale(plan)
    steps = {p.stem: json.loads(p.read_text()) for p in (plan.out / "steps").glob("*.json")}
    assert set(steps) == {"baseline__trace-none", "T320__trace-none", "T320__label", "T320__score-none", "T320__figures"}
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

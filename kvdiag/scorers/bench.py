"""``kvdiag bench score``: seconds per checkpoint of every scorer on a Trace (token granularity, every cached
entry at every checkpoint), and the peak memory of the process."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from kvdiag.kernels.bench import rss_kb
from kvdiag.scorers.run import checkpoint_keys, score_trace


@dataclass
class ScoreBenchResult:
    """``scorer_seconds``: seconds per scorer over all checkpoints (shared features are charged to the first
    scorer that needs them); ``seconds``: the whole scoring, reading included."""

    checkpoints: int
    layers: int
    entries: int
    seconds: float
    scorer_seconds: dict[str, float]
    peak_rss_mib: float

    def to_json(self, trace: str) -> dict:
        n = self.checkpoints
        return {
            "trace": trace, "checkpoints": n, "layers": self.layers, "entries": self.entries,
            "seconds_total": self.seconds, "seconds_per_checkpoint": self.seconds / n,
            "scorer_seconds_per_checkpoint": {k: v / n for k, v in self.scorer_seconds.items()},
            "peak_rss_mib": self.peak_rss_mib,
        }


def run_score_bench(trace, scorers: str | Iterable[str] = "all", checkpoints: str | list[int] = "default",
                    params: dict[str, dict] | None = None, plugins: Iterable[str] = ()) -> ScoreBenchResult:
    """Score every cached entry at ``checkpoints`` of the Trace ``trace`` with ``scorers`` and time it."""
    keys = checkpoint_keys(trace, checkpoints)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    score_trace(trace, keys=keys, scorers=scorers, params=params, plugins=plugins, timings=timings, progress=True)
    seconds = time.perf_counter() - start
    return ScoreBenchResult(keys.select("prompt_id", "checkpoint").n_unique(), trace.num_layers, keys.height, seconds,
                            timings, rss_kb("VmHWM") / 1024)

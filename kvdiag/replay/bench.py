"""``kvdiag bench replay``: batched free-running replay against one generation at a time, in one run.

The same rows (every prompt × every scorer × every sample, one budget and interval: rows of one batch share their
prompt length and schedule) are decoded alone, one ``decode`` each, and together, ``decode_batch`` ``batch_size``
rows at a time; the batched tokens must equal the alone tokens (a row that differs is counted and reported, never
hidden).
Each method runs once per repeat, alternating, and the best time is kept; peak memory is each method's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiag.generate.policy import Policy
from kvdiag.kernels.bench import cpu_peak_probe, peak_mb, seconds
from kvdiag.models import LoadedModel
from kvdiag.replay.decoding import batches, decode, decode_batch
from kvdiag.replay.sampling import Sampling


@dataclass
class ReplayBenchResult:
    rows: int
    batch_size: int
    alone_s: float
    batched_s: float
    tokens: int  # generated tokens over all rows (alone)
    same_tokens: int  # rows whose batched tokens equal the alone tokens
    alone_peak_mb: float | None
    batched_peak_mb: float | None

    @property
    def speedup(self) -> float:
        return self.alone_s / self.batched_s

    def to_json(self) -> dict:
        return {**self.__dict__, "speedup": self.speedup}


@torch.no_grad()
def run_replay_bench(lm: LoadedModel, prompts: list[list[int]], prompt_ids: list[str], policies: list[Policy | None],
                     max_new_tokens: int, batch_size: int, repeats: int = 1, sampling: Sampling | None = None,
                     samples: int = 1) -> ReplayBenchResult:
    """Rows: every prompt (equal lengths) under every policy (one budget and interval, or all None), ``samples``
    generations each (``sampling``: the replay's coupled draws, so a row draws the same tokens alone or batched)."""
    rows = [(p, pid, pol, s) for p, pid in zip(prompts, prompt_ids, strict=True) for pol in policies
            for s in range(samples)]
    out: dict[str, list] = {}

    def alone():
        out["alone"] = [decode(lm, p, pol, max_new_tokens, pid, sampling=sampling, sample=s).token_ids
                        for p, pid, pol, s in rows]

    def batched():
        got: list = [None] * len(rows)  # in the rows' order, as the alone tokens
        key = lambda i: (len(rows[i][0]), None if rows[i][2] is None else rows[i][2].budget)  # noqa: E731
        for chunk in batches(range(len(rows)), batch_size, key):
            runs = decode_batch(lm, [rows[i][0] for i in chunk], [rows[i][2] for i in chunk], max_new_tokens,
                                [rows[i][1] for i in chunk], sampling=sampling, samples=[rows[i][3] for i in chunk])
            for i, run in zip(chunk, runs, strict=True):
                got[i] = run.token_ids
        out["batched"] = got

    device, reset = lm.model.device, cpu_peak_probe()
    times: dict[str, list[float]] = {"alone": [], "batched": []}
    peaks: dict[str, float | None] = {}
    for _ in range(repeats):  # each call is timed; its peak memory is read around the same call
        for name, fn in (("alone", alone), ("batched", batched)):
            peak = peak_mb(lambda fn=fn, name=name: times[name].append(seconds(fn, device)), device, reset)
            peaks[name] = peak if peaks.get(name) is None else max(peaks[name], peak)
    same = sum(a == b for a, b in zip(out["alone"], out["batched"], strict=True))
    tokens = sum(len(ids) - len(r[0]) for ids, r in zip(out["alone"], rows, strict=True))
    return ReplayBenchResult(len(rows), batch_size, min(times["alone"]), min(times["batched"]), tokens, same,
                             peaks["alone"], peaks["batched"])

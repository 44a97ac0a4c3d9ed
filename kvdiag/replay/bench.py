"""``kvdiag bench replay``: replay's batched loop against one generation at a time and against ``model.generate``
under an EvictingCache, in one run.

The same rows (every prompt × every scorer × every sample, one budget and interval: rows of one batch share their
prompt length and schedule) are decoded by each arm: ``alone`` (the loop, one ``decode`` per row), ``batched`` (the
loop, ``decode_batch`` ``batch_size`` rows at a time) and ``generate`` (``generate_batch``: ``model.generate`` with
an EvictingCache, the same batches). Every arm's tokens are compared with the batched loop's (a row that differs is
counted and reported, never hidden). The arms alternate once per repeat and the best time of each is kept; peak
memory is each arm's own; so is its process CPU time (on a shared machine wall time follows the others' load).
The generate arm also reports the host time its caches spent scoring and choosing, and
compacting, summed over its batches (of its best run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvdiag.generate.policy import Policy
from kvdiag.kernels.bench import cpu_peak_probe, peak_mb, seconds
from kvdiag.model.load import LoadedModel
from kvdiag.replay.decoding import batches, decode, decode_batch
from kvdiag.replay.generating import generate_batch
from kvdiag.replay.sampling import Sampling

ARMS = ("alone", "batched", "generate")


@dataclass
class ReplayBenchResult:
    rows: int
    batch_size: int
    tokens: int  # generated tokens over all rows (batched loop)
    seconds: dict[str, float]  # arm -> best seconds
    peak_mb: dict[str, float | None]  # arm -> peak extra memory of one run
    same_tokens: dict[str, int]  # arm -> rows whose tokens equal the batched loop's
    compaction_s: dict[str, float] = field(default_factory=dict)  # generate: score_choose, compact (best run)
    cpu_s: dict[str, float] = field(default_factory=dict)  # arm -> least process CPU seconds of a run (all threads)

    @property
    def alone_s(self) -> float:
        return self.seconds["alone"]

    @property
    def batched_s(self) -> float:
        return self.seconds["batched"]

    @property
    def speedup(self) -> float | None:
        """alone / batched seconds (None without the alone arm)."""
        return self.seconds["alone"] / self.seconds["batched"] if "alone" in self.seconds else None

    @property
    def generate_ratio(self) -> float | None:
        """Throughput of generate over the batched loop's (batched / generate seconds; >= 0.9 is the target)."""
        return self.seconds["batched"] / self.seconds["generate"] if "generate" in self.seconds else None

    @property
    def compaction_share(self) -> float | None:
        """The generate arm's checkpoint time (scoring, choosing, compacting) over its decode time."""
        return sum(self.compaction_s.values()) / self.seconds["generate"] if self.compaction_s else None

    @property
    def compact_share(self) -> float | None:
        """The compaction itself (``compact_kv``, no scoring) over the generate arm's decode time."""
        return self.compaction_s["compact"] / self.seconds["generate"] if self.compaction_s else None

    def to_json(self) -> dict:
        per_arm = {f"{a}_{k}": v for a in self.seconds for k, v in (("s", self.seconds[a]),
                                                                      ("peak_mb", self.peak_mb[a]),
                                                                      ("same_tokens", self.same_tokens[a]),
                                                                      ("tokens_per_s", self.tokens / self.seconds[a]))}
        cpu = {f"{a}_cpu_s": v for a, v in self.cpu_s.items()}
        cpu_ratio = self.cpu_s["batched"] / self.cpu_s["generate"] if "generate" in self.cpu_s else None
        return {"rows": self.rows, "batch_size": self.batch_size, "tokens": self.tokens, **per_arm, **cpu,
                "speedup": self.speedup, "generate_ratio": self.generate_ratio, "generate_cpu_ratio": cpu_ratio,
                "compaction_s": self.compaction_s or None, "compaction_share": self.compaction_share,
                "compact_share": self.compact_share}


@torch.no_grad()
def run_replay_bench(lm: LoadedModel, prompts: list[list[int]], prompt_ids: list[str], policies: list[Policy | None],
                     max_new_tokens: int, batch_size: int, repeats: int = 1, sampling: Sampling | None = None,
                     samples: int = 1, arms: tuple[str, ...] = ("alone", "batched")) -> ReplayBenchResult:
    """Rows: every prompt (equal lengths) under every policy (one budget and interval, or all None), ``samples``
    generations each (``sampling``: the replay's coupled draws, so a row draws the same tokens in every arm)."""
    arms = tuple(a for a in ARMS if a in set(arms) | {"batched"})
    rows = [(p, pid, pol, s) for p, pid in zip(prompts, prompt_ids, strict=True) for pol in policies
            for s in range(samples)]
    key = lambda i: (len(rows[i][0]), None if rows[i][2] is None else rows[i][2].budget)  # noqa: E731
    chunks = batches(range(len(rows)), batch_size, key)
    out: dict[str, list] = {}
    spent: dict[str, float] = {}

    def alone():
        out["alone"] = [decode(lm, p, pol, max_new_tokens, pid, sampling=sampling, sample=s).token_ids
                        for p, pid, pol, s in rows]

    def together(decoder, caches: list | None = None):
        got: list = [None] * len(rows)  # in the rows' order
        for chunk in chunks:
            extra = {} if caches is None else {"cache_out": caches}
            runs = decoder(lm, [rows[i][0] for i in chunk], [rows[i][2] for i in chunk], max_new_tokens,
                           [rows[i][1] for i in chunk], sampling=sampling, samples=[rows[i][3] for i in chunk],
                           **extra)
            for i, run in zip(chunk, runs, strict=True):
                got[i] = run.token_ids
        return got

    def batched():
        out["batched"] = together(decode_batch)

    def generate():
        caches: list = []
        out["generate"] = together(generate_batch, caches)
        spent.clear()
        for cache in caches:
            for part, s in getattr(cache, "seconds", {}).items():
                spent[part] = spent.get(part, 0.0) + s

    fns = {"alone": alone, "batched": batched, "generate": generate}
    device, reset = lm.model.device, cpu_peak_probe()
    times: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {a: [] for a in arms}  # on a shared machine wall time follows the load; CPU less
    peaks: dict[str, float | None] = {}
    compaction: dict[str, float] = {}
    for _ in range(repeats):  # each call is timed; its peak memory is read around the same call
        for name in arms:
            start = time.process_time()
            peak = peak_mb(lambda name=name: times[name].append(seconds(fns[name], device)), device, reset)
            cpu[name].append(time.process_time() - start)
            peaks[name] = peak if peaks.get(name) is None else max(peaks[name], peak)
            if name == "generate" and times[name][-1] == min(times[name]):
                compaction = dict(spent)
    same = {a: sum(x == y for x, y in zip(out[a], out["batched"], strict=True)) for a in arms}
    tokens = sum(len(ids) - len(r[0]) for ids, r in zip(out["batched"], rows, strict=True))
    return ReplayBenchResult(len(rows), batch_size, tokens, {a: min(t) for a, t in times.items()}, peaks, same,
                             compaction, {a: min(c) for a, c in cpu.items()})

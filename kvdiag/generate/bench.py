"""``kvdiag bench padded`` (#58): :class:`~kvdiag.generate.EvictingCache` in ``model.generate`` on a left-padded
batch against the same rows unpadded, as tokens/s ratios in one run.

The batch: ``len(LENGTHS)`` rows of random token ids (seeded; the ids of the former
``reports/bench/evicting_padded.py``), each ``max(LENGTHS)`` tokens long. *Unpadded* feeds them whole; *padded*
replaces the first ``max(LENGTHS) - n`` ids of the row of length ``n`` by padding, masked out, so the two runs feed
tensors of one shape and write the same number of tokens (greedy, EOS suppressed: every row writes exactly
``new_tokens``). Both run ``prefill="once"`` (the prompt in one forward, one compaction at its end, as kvpress).

Timing: one untimed run of each first (allocator, lazy initialisation; its peak memory and tokens are read there),
then ``repeats`` pairs in ABBA order (the first of a pair alternates: padded first in pairs 0, 2, ..., unpadded
first in 1, 3, ...), so a drift of the machine's speed over the run does not favour one side. Each pair gives the
ratio padded / unpadded tokens/s (= unpadded seconds / padded seconds: the same tokens); the summary is their median
and range. Process CPU seconds are kept beside wall seconds (on a shared machine wall time follows the others' load).

Memory: the peak resident set (``VmHWM`` of /proc/self/status, reset before each untimed run through
``/proc/self/clear_refs``: :func:`kvdiag.kernels.bench.peak_mb`), as MB over the resident set before the run, and the
process's peak over the whole command (the model's load included). Not tracemalloc (torch allocates outside
Python's allocator) and not ``getrusage``'s ``ru_maxrss`` (the reset of the high-water mark lowers it too).

Tokens: each row of the padded batch is generated alone (batch of one, its prompt without padding, the same cache
settings) and its new tokens are compared with the batch's.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from kvdiag.generate.evicting import EvictingCache
from kvdiag.kernels.bench import cpu_peak_probe, peak_mb, rss_kb
from kvdiag.model.load import LoadedModel

LENGTHS = (96, 90, 84, 78, 72, 66, 60, 54)  # the prompt lengths of the padded rows (the first: every unpadded row's)
TOKEN_RANGE = (100, 20000)  # the random prompt ids (below the vocabulary's size where it is smaller)
PAD_ID = 0
SIDES = ("padded", "unpadded")
TARGET = 0.9  # #58: padded tokens/s at least 0.9x the unpadded


@dataclass
class Run:
    """One timed ``generate``: wall and process CPU seconds, and the cache's host time at its checkpoints."""

    seconds: float
    cpu_s: float
    checkpoint_s: float  # EvictingCache.seconds: scoring, choosing and compacting


@dataclass
class PaddedBenchResult:
    lengths: list[int]
    new_tokens: int
    pairs: list[dict[str, Run]]  # per pair: side -> its run
    firsts: list[str]  # per pair: the side timed first
    peak_mb: dict[str, float | None] = field(default_factory=dict)  # side -> peak RSS over the RSS before its run
    peak_rss_mb: float | None = None  # the process's peak RSS over the command (model load included)
    load_rss_mb: float | None = None  # the process's peak RSS by the end of the model load
    same_tokens: int | None = None  # padded rows whose new tokens equal their prompt's generation alone

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        """New tokens of one run (every row writes ``new_tokens``)."""
        return self.rows * self.new_tokens

    def tokens_per_s(self, side: str) -> list[float]:
        return [self.tokens / p[side].seconds for p in self.pairs]

    @property
    def ratios(self) -> list[float]:
        """Per pair: padded / unpadded tokens/s."""
        return pair_ratios([(p["padded"].seconds, p["unpadded"].seconds) for p in self.pairs])

    @property
    def cpu_ratios(self) -> list[float]:
        """Per pair: the same ratio from process CPU seconds."""
        return pair_ratios([(p["padded"].cpu_s, p["unpadded"].cpu_s) for p in self.pairs])

    def summary(self) -> dict:
        s = summarize(self.ratios)
        return {**s, "cpu_median": statistics.median(self.cpu_ratios),
                **{f"{side}_tokens_per_s_median": statistics.median(self.tokens_per_s(side)) for side in SIDES},
                **{f"{side}_checkpoint_s_median": statistics.median(p[side].checkpoint_s for p in self.pairs)
                   for side in SIDES}}

    def to_json(self) -> dict:
        return {"lengths": self.lengths, "prompt_len": max(self.lengths), "new_tokens": self.new_tokens,
                "tokens_per_run": self.tokens, "target": TARGET,
                "pairs": [{"first": first, "ratio": r, "cpu_ratio": c,
                           **{f"{side}_{k}": getattr(p[side], k) for side in SIDES
                              for k in ("seconds", "cpu_s", "checkpoint_s")},
                           **{f"{side}_tokens_per_s": self.tokens / p[side].seconds for side in SIDES}}
                          for p, first, r, c in zip(self.pairs, self.firsts, self.ratios, self.cpu_ratios,
                                                    strict=True)],
                "summary": self.summary(), "peak_mb": self.peak_mb, "peak_rss_mb": self.peak_rss_mb,
                "load_rss_mb": self.load_rss_mb, "same_tokens": self.same_tokens, "rows": self.rows,
                "memory": "VmHWM of /proc/self/status, reset before each untimed run (/proc/self/clear_refs)"}


def pair_ratios(pairs: list[tuple[float, float]]) -> list[float]:
    """(padded, unpadded) seconds of one token count -> padded / unpadded tokens/s per pair."""
    return [unpadded / padded for padded, unpadded in pairs]


def summarize(ratios: list[float], target: float = TARGET) -> dict:
    """The median, range and count at or above ``target`` of the pairs' ratios."""
    return {"pairs": len(ratios), "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "at_target": sum(r >= target for r in ratios), "median_meets_target": statistics.median(ratios) >= target,
            "min_meets_target": min(ratios) >= target}


def abba(repeats: int) -> list[tuple[str, str]]:
    """The order of each pair: padded first, then unpadded first, alternating (A B, B A, A B, ...)."""
    return [SIDES if i % 2 == 0 else SIDES[::-1] for i in range(repeats)]


def batch(vocab: int, lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> dict[str, tuple[torch.Tensor, ...]]:
    """side -> (input_ids, attention_mask) [rows, max(lengths)]: the same random ids, the padded rows' left part
    replaced by ``PAD_ID`` and masked."""
    generator = torch.Generator().manual_seed(seed)
    L = max(lengths)
    ids = torch.randint(TOKEN_RANGE[0], min(TOKEN_RANGE[1], vocab), (len(lengths), L), generator=generator)
    padded, mask = ids.clone(), torch.ones_like(ids)
    for row, n in enumerate(lengths):
        padded[row, : L - n] = PAD_ID
        mask[row, : L - n] = 0
    return {"padded": (padded, mask), "unpadded": (ids, torch.ones_like(ids))}


@torch.no_grad()
def generate(lm: LoadedModel, rule, budget: int, interval: int, ids: torch.Tensor, mask: torch.Tensor,
             new_tokens: int) -> tuple[torch.Tensor, EvictingCache]:
    """Greedy ``model.generate`` of exactly ``new_tokens`` per row under a fresh EvictingCache: (new tokens, cache)."""
    cache = EvictingCache(lm.model, rule, budget=budget, interval=interval, prefill="once")
    out = lm.model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens,
                            min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_ID)
    return out[:, ids.shape[1]:].cpu(), cache


def run_padded_bench(lm: LoadedModel, rule, budget: int, interval: int, repeats: int, new_tokens: int,
                     lengths: tuple[int, ...] = LENGTHS, check_tokens: bool = True) -> PaddedBenchResult:
    """Time the padded and unpadded batch in ``repeats`` ABBA pairs (module docstring); ``rule``: a scorer or name."""
    inputs = batch(lm.model.config.vocab_size, lengths)
    load_rss = rss_kb("VmHWM") / 1024 if (reset := cpu_peak_probe()) is not None else None
    device = lm.model.device
    first: dict[str, torch.Tensor] = {}

    def once(side: str) -> Run:
        ids, mask = (t.to(device) for t in inputs[side])
        cpu, start = time.process_time(), time.perf_counter()
        first[side], cache = generate(lm, rule, budget, interval, ids, mask, new_tokens)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return Run(time.perf_counter() - start, time.process_time() - cpu, sum(cache.seconds.values()))

    peaks, top = {}, [] if reset is None else [load_rss]
    for side in SIDES:  # untimed: warm-up, peak memory, the tokens checked
        peaks[side] = peak_mb(lambda side=side: once(side), device, reset)
        if reset is not None:
            top.append(rss_kb("VmHWM") / 1024)
    pairs, firsts = [], []
    for order in abba(repeats):
        pairs.append({side: once(side) for side in order})
        firsts.append(order[0])
    if reset is not None:
        top.append(rss_kb("VmHWM") / 1024)  # the timed runs' peak (no reset since the last untimed run)
    same = None
    if check_tokens:
        same = 0
        L = max(lengths)
        padded = inputs["padded"][0]
        for row, n in enumerate(lengths):
            ids = padded[row : row + 1, L - n :].to(device)
            alone, _ = generate(lm, rule, budget, interval, ids, torch.ones_like(ids), new_tokens)
            same += bool(torch.equal(alone[0], first["padded"][row]))
    return PaddedBenchResult(list(lengths), new_tokens, pairs, firsts, peaks, max(top) if top else None, load_rss,
                             same)

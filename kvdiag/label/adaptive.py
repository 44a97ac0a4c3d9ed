"""``kvdiag label --method hybrid --miss-rate R``: hybrid labels that label exactly down the fast ranking, in rounds,
until an upper confidence bound on the top-decile miss rate is below R (torch-free: the numbers only).

Over the whole run (every checkpoint pooled):

- **harmful**: the top decile of the exact labels of every candidate, the k = ceil(N / 10) largest of the N;
  a harmful entry is **missed** when its row keeps the fast estimate (``method = fast``).
- **round 0**: each checkpoint's exact top (``--exact-frac F`` or ``--exact-top M``, by fast label) and the
  **audit**: a seeded uniform sample of its other candidates, A in all, allotted to the checkpoints in proportion to
  their other candidates (:func:`allot`), so that pooled it is a proportional stratified sample of the rest.
- **bound**: thr, the k-th largest exact-top label, is at most the true threshold (a subset's k-th largest is at
  most the whole set's; -inf while the exact top holds fewer than k), so every missed entry lies outside the exact
  top with a label >= thr. Of the A' audited entries still outside the exact top, X have labels >= thr; the
  one-sided **Clopper-Pearson** upper bound p of X / A' (``kvdiag.core.stats.clopper_pearson_upper``) bounds the share
  of
  such entries among the R' entries outside the exact top, so at most p R' - X entries are missed (the audited ones
  have exact labels) and the miss rate is at most (p R' - X) / k. Its level is 1 - alpha / looks (Bonferroni over
  every round that could stop, :func:`looks`), so the bound at the round that stops holds at 1 - alpha = 95 %.
- **rounds**: while the bound is >= R, every checkpoint labels exactly the next ``STEP`` share of its candidates
  down the fast ranking (the exact top grows to F + r STEP; audited rows it reaches are exact already).
- **minimum audit**: at round 0 with X = 0 the bound is (1 - a^(1/A)) R0 / k (a = alpha / looks, R0 the entries
  outside the exact top); it can fall below R only when A > ln(a) / ln(1 - R k / R0) (:func:`min_audit`): with
  F = 0.1 and R = 0.05 about 1,050 entries whatever N (about 3 R0 / (R k) times the Bonferroni factor). A smaller
  audit could not stop before nearly every entry is exact; it is refused before any work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvdiag.core.stats import clopper_pearson_upper

ALPHA = 0.05  # the bound's error, split over the looks (Bonferroni)
STEP = 0.05  # each round adds this share of every checkpoint's candidates to its exact top
DECILE = 0.1  # harmful: the top decile of the pooled exact labels


def harmful_count(n: int) -> int:
    """k: the harmful entries among ``n`` pooled candidates (the top decile)."""
    return max(1, math.ceil(DECILE * n))


def shares(first: float) -> list[float]:
    """The exact-top share of each round: ``first`` (round 0), then + ``STEP`` until every candidate is exact."""
    out = [first]
    while out[-1] < 1:
        out.append(min(1.0, round(out[-1] + STEP, 10)))
    return out


def looks(first: float) -> int:
    """The rounds whose bound could stop the run (round 0 to every candidate exact)."""
    return len(shares(first))


def min_audit(target: float, rest: int, n: int, first: float, alpha: float = ALPHA) -> int:
    """The smallest pooled audit A whose bound can fall below ``target`` at round 0 (X = 0; ``rest`` R0 entries
    outside the exact top of ``n`` candidates): A > ln(a) / ln(1 - target k / R0), a = alpha / looks."""
    k, a = harmful_count(n), alpha / looks(first)
    q = 1 - target * k / rest if rest else 0.0
    return 1 if q <= 0 else math.floor(math.log(a) / math.log(q)) + 1


def allot(total: int, rests: list[int]) -> list[int]:
    """``total`` audit entries over checkpoints with ``rests`` entries outside their exact top, in proportion (largest
    remainders; never more than a checkpoint has)."""
    pool = sum(rests)
    if total >= pool:
        return list(rests)
    exact = [total * r / pool for r in rests]
    out = [math.floor(x) for x in exact]
    for i in sorted(range(len(rests)), key=lambda i: (out[i] - exact[i], i))[: total - sum(out)]:
        out[i] += 1
    return out


@dataclass
class Checkpoint:
    """One checkpoint's state: fast [n] estimates, exact [n] labels (NaN where not labeled exactly), top [n] (the
    exact top so far), audit [n] (the audit sample)."""

    fast: np.ndarray
    exact: np.ndarray
    top: np.ndarray
    audit: np.ndarray

    def top_rows(self, share: float) -> np.ndarray:
        return top_rows(self.fast, share)


def top_rows(fast: np.ndarray, share: float) -> np.ndarray:
    """The rows of the exact top at ``share`` of ``fast`` [n]: the ceil(share n) largest (ties: the first row)."""
    m = math.ceil(round(share * len(fast), 10))
    return np.argsort(-fast, kind="stable")[:m]


def bound(ckpts: list[Checkpoint], first: float, alpha: float = ALPHA) -> dict:
    """The upper bound on the pooled top-decile miss rate (module docstring) and what it is made of."""
    n = sum(len(c.fast) for c in ckpts)
    k = harmful_count(n)
    top = np.concatenate([c.exact[c.top] for c in ckpts])
    thr = float(np.sort(top)[-k]) if len(top) >= k else -math.inf
    rest = sum(int((~c.top).sum()) for c in ckpts)
    audited = np.concatenate([c.exact[c.audit & ~c.top] for c in ckpts])
    x, a = int((audited >= thr).sum()), len(audited)
    level = 1 - alpha / looks(first)
    p = clopper_pearson_upper(x, a, level) if rest else 0.0
    exact = int(sum((c.top | c.audit).sum() for c in ckpts))
    return {"bound": min(1.0, max(0.0, p * rest - x) / k), "threshold": thr, "harmful": k, "rest": rest,
            "audited": a, "over_threshold": x, "level": level, "exact": exact, "candidates": n}


@dataclass
class Control:
    """The rounds of one run: per round the exact-top share, the bound and its parts; stopped: bound < target."""

    target: float
    first: float
    rounds: list[dict] = field(default_factory=list)

    @property
    def stopped(self) -> bool:
        return bool(self.rounds) and self.rounds[-1]["bound"] < self.target

    def as_dict(self) -> dict:
        last = self.rounds[-1]
        return {"target": self.target, "stopped": self.stopped, "bound": last["bound"], "alpha": ALPHA, "step": STEP,
                "looks": looks(self.first), "exact_share": last["exact"] / last["candidates"],
                "bound_kind": "one-sided Clopper-Pearson, Bonferroni over the looks", "rounds": self.rounds}


def control(ckpts: list[Checkpoint], target: float, first: float,
            label: Callable[[list[tuple[int, np.ndarray]]], list[np.ndarray]]) -> Control:
    """Rounds down the fast ranking until the bound is below ``target`` (or every candidate is exact). ``ckpts``
    hold round 0 (exact top at share ``first``, the audit); ``label([(checkpoint index, rows)])`` returns the exact
    labels of those rows. Updates ``ckpts`` in place."""
    ctl = Control(target, first)
    for r, share in enumerate(shares(first)):
        if r:  # the next rows down the fast ranking
            asks = []
            for i, c in enumerate(ckpts):
                rows = c.top_rows(share)
                new = rows[np.isnan(c.exact[rows])]
                c.top[rows] = True
                if len(new):
                    asks.append((i, new))
            for (i, rows), values in zip(asks, label(asks) if asks else [], strict=True):
                ckpts[i].exact[rows] = values
        ctl.rounds.append({"round": r, "share": share, **bound(ckpts, first)})
        if ctl.stopped:
            break
    return ctl


def measured_miss(exact: list[np.ndarray], exact_rows: list[np.ndarray]) -> dict:
    """The miss rate measured against exact labels of every entry: harmful (the pooled top decile of ``exact``,
    per checkpoint [n]) entries outside ``exact_rows`` (bool [n] per checkpoint): missed, harmful, miss_rate and
    per_checkpoint (each checkpoint's missed over its harmful)."""
    pooled = np.concatenate(exact)
    thr = np.sort(pooled)[-harmful_count(len(pooled))]
    per = [int(((e >= thr) & ~rows).sum()) for e, rows in zip(exact, exact_rows, strict=True)]
    harmful = int((pooled >= thr).sum())
    return {"missed": sum(per), "harmful": harmful, "miss_rate": sum(per) / harmful,
            "per_checkpoint": [m / max(1, int((e >= thr).sum())) for m, e in zip(per, exact, strict=True)]}

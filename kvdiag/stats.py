"""Cluster bootstrap over prompts, percentile intervals and paired p-values.

Candidates of one prompt share a cache and a model state, so they are not independent: the
bootstrap resamples *prompts* with replacement and keeps all their checkpoints and candidates. A
resample is a vector of prompt multiplicities; a prompt drawn twice counts as two clusters (its
checkpoints count twice in macro averages, its rows twice in pooled metrics). Scorers are compared on
the *same* resamples (paired bootstrap).
"""

from __future__ import annotations

import numpy as np


def prompt_multiplicities(n_prompts: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """How often each prompt is drawn when ``n_prompts`` prompts are resampled with replacement,
    ``n_boot`` times: int [B, P], every row sums to P."""
    return rng.multinomial(n_prompts, np.full(n_prompts, 1.0 / n_prompts), size=n_boot)


def percentile_ci(reps: np.ndarray, level: float = 0.95) -> tuple[float, float, int]:
    """Percentile interval of the defined (finite) bootstrap replicates ``reps [B]``.

    Returns (low, high, number of defined replicates); (NaN, NaN, 0) when none is defined.
    """
    ok = reps[np.isfinite(reps)]
    if ok.size == 0:
        return float("nan"), float("nan"), 0
    alpha = (1.0 - level) / 2
    low, high = np.quantile(ok, [alpha, 1.0 - alpha])
    return float(low), float(high), int(ok.size)


def paired_p_value(diffs: np.ndarray) -> float:
    """Two-sided bootstrap p-value of a paired difference being 0, from its replicates ``diffs [B]``.

    ``2 * min(share of replicates <= 0, share >= 0)``, capped at 1; NaN replicates are dropped.
    Its resolution is ``2 / B``: 0 means "below 2 / B".
    """
    ok = diffs[np.isfinite(diffs)]
    if ok.size == 0:
        return float("nan")
    return float(min(1.0, 2.0 * min(np.mean(ok <= 0), np.mean(ok >= 0))))


def holm(p: np.ndarray) -> np.ndarray:
    """Holm step-down adjusted p-values of one family of tests ``p [m]`` (NaN entries stay NaN and are
    not counted in the family)."""
    p = np.asarray(p, dtype=float)
    out = np.full(p.shape, np.nan)
    idx = np.flatnonzero(np.isfinite(p))
    order = idx[np.argsort(p[idx], kind="stable")]
    m = len(order)
    out[order] = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    return out


class PromptBootstrap:
    """The cluster bootstrap of one run: prompts sorted, multiplicities ``mult [B, P]`` (None when ``n_boot`` is 0)."""

    def __init__(self, prompts: list[str], n_boot: int, seed: int, level: float):
        self.prompts = sorted(prompts)
        self.index = {p: i for i, p in enumerate(self.prompts)}
        self.mult = prompt_multiplicities(len(self.prompts), n_boot, np.random.default_rng(seed)) if n_boot else None
        self.level = level

    def mean(self, values: np.ndarray, prompts: np.ndarray) -> tuple[float, np.ndarray]:
        """(mean of ``values [N]``, its replicates [B]); each value weighs its prompt's multiplicity."""
        if not len(values):
            return float("nan"), np.full(0 if self.mult is None else len(self.mult), np.nan)
        if self.mult is None:
            return float(values.mean()), np.empty(0)
        w = self.mult[:, [self.index[p] for p in prompts]].astype(float)  # [B, N]
        with np.errstate(invalid="ignore", divide="ignore"):
            return float(values.mean()), (w @ values) / w.sum(1)

    def ci(self, reps: np.ndarray) -> tuple[float, float]:
        low, high, _ = percentile_ci(reps, self.level) if len(reps) else (float("nan"), float("nan"), 0)
        return low, high

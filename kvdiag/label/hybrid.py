"""``kvdiag label --method hybrid``: every entry labeled, the ones that matter exactly, with a measured miss rate.

At each checkpoint:

1. every candidate gets the Fisher label (``kvdiag.label.fast``: one forward and K + 1 backward passes);
2. the M candidates the Fisher label ranks most harmful get the exact label (``exact-top``);
3. a seeded uniform sample of N of the others gets the exact label too (``exact-audit``): an unbiased look at what
   the Fisher ranking left out.

Each row says which method gave its value (``method``). From the audit, :func:`miss_rate` estimates the share of the
exact-harmful entries (``kvdiag.core.harm``'s threshold, estimated over the exact labels with the audit weighted by the
entries it stands for) that lie outside the exact set, with a cluster-bootstrap CI over prompts. Every row carries
the checkpoint's measured noise floor (the exact engine's null row), so rank-eval treats an estimate below it as
unresolved, as it would the exact label.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import polars as pl
import torch

from kvdiag.core.errors import UserError
from kvdiag.core.harm import HarmSpec, parse_harm
from kvdiag.core.schema import CHUNK
from kvdiag.core.stats import percentile_ci, prompt_multiplicities
from kvdiag.label.config import HybridParams  # noqa: F401  (hybrid's API)
from kvdiag.label.engine import OracleEngine, Row
from kvdiag.label.fast import FisherLabeler, FisherParams
from kvdiag.model.load import LoadedModel

METHODS = ("exact-top", "exact-audit", "fast")


class HybridLabeler:
    """Labels one prompt's checkpoints with ``hybrid``; build once per prompt (its two engines extend their caches
    checkpoint by checkpoint)."""

    def __init__(self, lm: LoadedModel, token_ids: torch.Tensor, horizon: int | str, params: HybridParams,
                 seed: int = 0, batch_size: int = 64, backend: str = "auto", chunk: int = CHUNK):
        params.validate()
        self.params, self.seed = params, seed
        self.fisher = FisherLabeler(lm, token_ids, horizon, FisherParams(params.samples), seed, chunk)
        self.batch_size, self.backend, self.chunk = batch_size, backend, chunk
        self.exact = OracleEngine(lm, token_ids, horizon, batch_size, backend, chunk=chunk)
        self.num_layers, self.num_kv_heads = self.exact.num_layers, self.exact.num_kv_heads
        self.horizon = horizon

    def steps(self, t: int) -> int:
        return self.exact.steps(t)

    def golden(self, t: int):
        self.fisher.golden(t)
        return self.exact.golden(t)

    def label(self, t: int, rows: list[Row], progress=None, audit: int | None = None) -> dict:
        """Per row: ``method``, ``kl [N]`` (the exact kl_mean, or the Fisher estimate), ``fast_kl`` [N] (the Fisher
        estimate of every row), ``nll_delta``, and for the exact rows ``kl_steps`` [H], ``js``, ``flips``; the
        checkpoint's ``noise`` floor; the audit's ``rest`` size. ``audit``: its size here (default ``params.audit``)."""
        n = len(rows)
        fast = self.fisher.label(t, rows)
        est = fast["kl"].double()
        m = self.params.top_count(n)
        top = torch.sort(est, descending=True, stable=True).indices[:m].tolist()  # ties: the older candidate first
        rest = sorted(set(range(n)) - set(top))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + t + 7)
        size = self.params.audit if audit is None else audit
        audit = sorted(rest[i] for i in torch.randperm(len(rest), generator=gen)[:size].tolist())
        chosen = sorted(top) + audit
        method = ["fast"] * n
        for j in top:
            method[j] = "exact-top"
        for j in audit:
            method[j] = "exact-audit"
        exact, noise = self.exact.label(t, [rows[j] for j in chosen], progress) if chosen else ({}, float("nan"))
        if not chosen:
            _, noise = self.exact.label_sets(t, [torch.tensor([-1])])  # the null row alone: the floor
        kl = est.clone()
        nll = fast["nll_delta"].double().clone()
        steps: list[list[float] | None] = [None] * n
        js: list[float | None] = [None] * n
        flips: list[int | None] = [None] * n
        kl_max: list[float | None] = [None] * n
        for k, j in enumerate(chosen):
            row_kl = exact["kl"][k].double()
            kl[j] = row_kl.mean()
            nll[j] = exact["nll_delta"][k].double().mean()
            steps[j], kl_max[j] = row_kl.tolist(), float(row_kl.max())
            js[j], flips[j] = float(exact["js"][k].double().mean()), int(exact["flips"][k])
        if progress is not None:
            progress(n - len(chosen))
        return {"method": method, "kl": kl.tolist(), "fast_kl": est.tolist(),
                "nll_delta": nll.tolist(), "kl_steps": steps, "kl_max": kl_max,
                "js_mean": js, "top1_flips": flips, "noise": noise, "rest": len(rest)}


def params_dict(params: HybridParams) -> dict:
    return asdict(params)


# --------------------------------------------------------------------------- the miss rate


def _weights(labels: pl.DataFrame) -> pl.DataFrame:
    """The exact rows with the number of entries each stands for: 1 for exact-top, (rest / audit) for exact-audit."""
    exact = labels.filter(pl.col("method") != "fast")
    audit_n = exact.filter(pl.col("method") == "exact-audit").group_by("prompt_id", "checkpoint").agg(a=pl.len())
    rest_n = labels.filter(pl.col("method") != "exact-top").group_by("prompt_id", "checkpoint").agg(r=pl.len())
    w = exact.join(audit_n, on=["prompt_id", "checkpoint"], how="left").join(rest_n, on=["prompt_id", "checkpoint"],
                                                                            how="left")
    return w.with_columns(weight=pl.when(pl.col("method") == "exact-top").then(1.0)
                          .otherwise(pl.col("r") / pl.col("a")))


def weighted_quantile(x: np.ndarray, w: np.ndarray, q: float) -> float:
    """The ``q``-quantile of ``x`` weighted by ``w`` (the inverse of the weighted empirical distribution)."""
    order = np.argsort(x, kind="stable")
    x, w = x[order], w[order]
    cum = np.cumsum(w) / w.sum()
    return float(x[min(np.searchsorted(cum, q, side="left"), len(x) - 1)])


def miss_rate(labels: pl.DataFrame, harm: HarmSpec | None = None, n_boot: int = 1000, seed: int = 0,
              level: float = 0.95) -> dict:
    """The estimated share of exact-harmful entries outside the exact set (M per checkpoint), from the audit.

    The harm threshold is ``harm``'s over the estimated distribution of exact labels of every entry (exact-top rows
    weigh 1, each audit row the number of unaudited entries it stands for); harmful entries outside the exact set =
    the audit's harmful ones, weighted the same way. CI: cluster bootstrap over prompts (the threshold re-estimated
    in every resample). Returns the estimate, its CI, the threshold and the counts.
    """
    harm = harm or HarmSpec()
    w = _weights(labels)
    if w.filter(pl.col("method") == "exact-audit").height == 0:
        raise UserError("a miss-rate estimate needs an audit: label with --audit N > 0")
    kind, value = parse_harm(harm.harm)
    prompts = sorted(w["prompt_id"].unique().to_list())
    index = {p: i for i, p in enumerate(prompts)}
    x = w["kl_mean"].to_numpy()
    base_w = w["weight"].to_numpy()
    audit = (w["method"] == "exact-audit").to_numpy()
    pid = np.array([index[p] for p in w["prompt_id"].to_list()])

    def estimate(mult: np.ndarray | None) -> tuple[float, float]:
        ww = base_w * (1.0 if mult is None else mult[pid])
        keep = ww > 0
        thr = weighted_quantile(x[keep], ww[keep], value) if kind == "quantile" else value
        harmful = x > thr
        missed = float((ww * (harmful & audit)).sum())
        total = float((ww * harmful).sum())
        return (missed / total if total else float("nan")), thr

    rate, threshold = estimate(None)
    reps = np.full(0, np.nan)
    if n_boot:
        mult = prompt_multiplicities(len(prompts), n_boot, np.random.default_rng(seed))
        reps = np.array([estimate(m.astype(float))[0] for m in mult])
    low, high, _ = percentile_ci(reps, level) if len(reps) else (float("nan"), float("nan"), 0)
    return {"miss_rate": rate, "ci_low": low, "ci_high": high, "threshold": threshold, "harm": harm.harm,
            "exact_top": int((w["method"] == "exact-top").sum()), "audit": int(audit.sum()),
            "fast": labels.filter(pl.col("method") == "fast").height, "n_boot": n_boot, "level": level}

"""Component figure: the paper's Table 4 in diagnostic form — the ranking metrics (rank-eval, with cluster-
bootstrap CIs) of AvoKV-E, each of its four ablations and the R-KV anchor, side by side.

The dotted line of each panel is the random scorer's expected value: AUROC 0.5; AP, top-k recall and the
false-safe rate all equal the prevalence of harmful labels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import seaborn as sns

from kvdiag.core.errors import UserError
from kvdiag.core.plotting import new_figure, note_on, save_figure, style
from kvdiag.figures.config import FigureParams
from kvdiag.figures.registry import Drawn, FigureContext, register_figure
from kvdiag.rankeval import metrics_where, rank_eval

# (scorer, row label) in the paper's Table 4 order
VARIANTS = (
    ("avokv_e", "AvoKV-E"), ("avokv_e_no_payload", "− payload (λ_b = 0)"),
    ("avokv_e_no_delay", "− delay (W_delay = W_obs)"), ("avokv_e_raw", "− rank norm. (raw)"),
    ("avokv_e_no_redundancy", "− redundancy (λ_r = 0)"), ("rkv", "R-KV-style anchor"),
)
RANDOM_SCORER = "random_baseline"
TABLE_SCHEMA = {"scorer": pl.String, "variant": pl.String, "metric": pl.String, "scope": pl.String, "value": pl.Float64,
                "ci_low": pl.Float64, "ci_high": pl.Float64, "n": pl.Int64, "note": pl.String}


def component_metrics(labels: pl.DataFrame, scores: pl.DataFrame | None, params: FigureParams,
                      scores_meta: dict | None = None) -> tuple[pl.DataFrame | None, str]:
    """rank-eval metrics of the variants present in ``scores`` on the candidates ``params`` selects (None and a note
    when none is, or when rank-eval cannot rank them, e.g. no harmful label)."""
    if scores is None:
        return None, "no scores given: pass --scores to draw the component figure"
    present = [name for name, _ in VARIANTS if name in scores.columns]
    if not present:
        return None, f"the scores hold none of {', '.join(n for n, _ in VARIANTS)}: score them with kvdiag score"
    try:
        result = rank_eval(
            labels, scores, harm=params.harm, rho=params.rho, reference=None, n_boot=params.n_boot, seed=params.seed,
            include_unresolved=params.include_unresolved, noise_mult=params.noise_mult, ci_level=params.ci_level,
            granularity="token", scorers=tuple(present), min_age=params.min_age, max_age=params.max_age,
            eligible=params.eligible, scores_meta=scores_meta,
        )
    except UserError as err:  # too few or degenerate labels: say so in the figure instead of failing
        return None, f"rank-eval could not rank the variants: {err}"
    return result.metrics, ""


def component_table(metrics: pl.DataFrame | None, scope: str, rho: float, note: str = "") -> pl.DataFrame:
    """One row per (variant, metric flagged ``figure``) from rank-eval ``metrics`` (its metrics.csv columns) and the
    random scorer's expected values at eviction fraction ``rho`` (``random_baseline``). Variants without metrics get NaN
    and a note (``note`` when given)."""
    m = metrics.filter(pl.col("scope") == scope) if metrics is not None else pl.DataFrame(schema=TABLE_SCHEMA)
    nan = float("nan")
    rows = []
    for name, label in VARIANTS:
        for metric in (m.name for m in metrics_where("figure")):
            hit = m.filter((pl.col("scorer") == name) & (pl.col("metric") == metric))
            if hit.height:
                r = hit.row(0, named=True)
                rows.append(
                    dict(
                        scorer=name, variant=label, metric=metric, scope=scope, value=r["value"], ci_low=r["ci_low"],
                        ci_high=r["ci_high"], n=r["n"], note=r["note"] or "",
                    )
                )
            else:
                rows.append(
                    dict(
                        scorer=name, variant=label, metric=metric, scope=scope, value=nan, ci_low=nan, ci_high=nan,
                        n=None, note=note or f"{name} is not in the scores",
                    )
                )
    prevalence = m.filter(pl.col("metric") == "prevalence")["value"]
    prev = float(prevalence[0]) if len(prevalence) else nan
    for m in metrics_where("figure"):
        rows.append(dict(scorer=RANDOM_SCORER, variant="random scorer (expected)", metric=m.name, scope=scope,
                         value=m.random(prev, rho), ci_low=nan, ci_high=nan, n=None,
                         note="AUROC 0.5; AP, top-k recall and FSR = prevalence"))
    return pl.DataFrame(rows, schema=TABLE_SCHEMA)


def plot_components(table: pl.DataFrame, note: str, params: FigureParams, out_dir: Path) -> list[Path]:
    """One panel per metric: point + CI bar per variant (Table 4 order, top to bottom)."""
    with style():
        metrics = metrics_where("figure")
        fig, axes = new_figure(len(metrics), 3 * len(metrics), 3.2)
        colors = dict(zip((label for _, label in VARIANTS), sns.color_palette("deep", len(VARIANTS)), strict=True))
        for ax, m in zip(axes, metrics, strict=True):
            t = table.filter((pl.col("metric") == m.name) & (pl.col("scorer") != RANDOM_SCORER))
            for i, r in enumerate(t.iter_rows(named=True)):
                if not np.isfinite(r["value"]):
                    ax.text(
                        0.5, i, "n/a", transform=ax.get_yaxis_transform(), ha="center", va="center", fontsize=7,
                        color="grey",
                    )
                    continue
                ok = np.isfinite(r["ci_low"])
                err = [[r["value"] - r["ci_low"]], [r["ci_high"] - r["value"]]] if ok else None
                ax.errorbar(r["value"], i, xerr=err, fmt="o", color=colors[r["variant"]], capsize=3, ms=5)
            base = table.filter((pl.col("metric") == m.name) & (pl.col("scorer") == RANDOM_SCORER))["value"]
            if len(base) and np.isfinite(base[0]):
                ax.axvline(base[0], color="grey", ls=":", lw=1)
            ref = t.filter(pl.col("scorer") == "avokv_e")["value"]
            if np.isfinite(ref[0]):
                ax.axvline(ref[0], color=colors[VARIANTS[0][1]], ls="--", lw=0.8, alpha=0.6)
            ax.set_yticks(range(t.height), t["variant"].to_list() if ax is axes[0] else [""] * t.height)
            ax.set_ylim(t.height - 0.5, -0.5)
            ax.set_title(m.title + (" (lower = better)" if m.lower_is_better else ""), fontsize=9)
            ax.tick_params(labelsize=7)
        if note:
            note_on(axes[1], note, width=38)
        fig.suptitle(
            f"AvoKV-E components: {params.scope} ranking metrics, {params.ci_level:.0%} CI over prompts "
            f"(FSR at rho = {params.rho:g}; dotted: random scorer); candidates: {candidate_set(params)}",
            fontsize=9,
        )
        return save_figure(fig, out_dir, "components")


def candidate_set(params: FigureParams) -> str:
    """The candidate filters of the component figure, in words (rank-eval's summary says the same at length)."""
    parts = [f"age >= {params.min_age}"] * (params.min_age is not None) + [f"age <= {params.max_age}"] * (
        params.max_age is not None
    )
    parts += [f"eligible under {params.eligible}"] * (params.eligible is not None)
    return ", ".join(parts) or "all"


@register_figure("components", "AvoKV-E components (Table 4, diagnostic form)", ("components.csv",))
def components_figure(ctx: FigureContext) -> Drawn:
    """components.{png,pdf} and components.csv (the plotted values, CIs and notes), from the given rank-eval
    metrics or, without them, from one ``rank_eval`` of the variants."""
    params, out_dir = ctx.params, ctx.out
    metrics, note = ((ctx.given_metrics, "") if ctx.given_metrics is not None
                     else component_metrics(ctx.labels, ctx.scores, params, ctx.scores_meta))
    table = component_table(metrics, params.scope, params.rho, note)
    table.write_csv(out_dir / "components.csv")
    notes = list(dict.fromkeys(n for n in table.filter(pl.col("value").is_nan())["note"].to_list() if n))
    return Drawn(table.to_dicts(), notes, [*plot_components(table, note, params, out_dir), out_dir / "components.csv"])

"""Figure (a): the attention-only blind spot — low-attention entries with large value payloads that are
nevertheless high-damage to evict.

Per label row (prompt, checkpoint ``t``, candidate ``i``): read pressure ``p``, value payload ``b`` and the
eviction KL. Within each checkpoint (over its analysed candidates): low attention = ``p`` strictly below the
``low_attention_quantile`` of ``p``; large payload = ``b`` strictly above the ``large_payload_quantile`` of ``b``
(linear interpolation, as ``numpy.quantile``). High damage = ``kl_mean`` strictly above the harm threshold.
Blind-spot quadrant = low attention & large payload.

Among the low-attention candidates, the 2×2 table large payload (yes/no) × high damage (yes/no) is tested with
Fisher's exact test (one-sided: large payloads are high-damage more often), its odds ratio with a conditional
MLE and CI, and the KL of large- vs small-payload candidates with a one-sided Mann–Whitney U and the
rank-biserial correlation (= Cliff's delta).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import seaborn as sns
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LogNorm, Normalize

from kvdiag.core.plotting import (
    fmt,
    new_figure,
    note_on,
    save_figure,
    stats_dict,
    style,
    write_stats,
)
from kvdiag.core.stats import fisher_greater, mann_whitney, stat
from kvdiag.figures.config import FigureParams
from kvdiag.figures.registry import Drawn, FigureContext, register_figure

POINT_COLUMNS = [
    "prompt_id", "checkpoint", "position", "read_pressure", "value_payload", "kl_mean", "low_attention_cut",
    "large_payload_cut", "low_attention", "large_payload", "high_damage", "blind_spot",
]


def blind_spot_flags(
    points: pl.DataFrame, low_attention_quantile: float, large_payload_quantile: float, harm_threshold: float
) -> pl.DataFrame:
    """``points`` (prompt_id, checkpoint, position, read_pressure, value_payload, kl_mean) with the
    per-checkpoint cuts and the flags low_attention, large_payload, high_damage, blind_spot."""
    by = ["prompt_id", "checkpoint"]
    return (
        points.with_columns(
            low_attention_cut=pl.col("read_pressure").quantile(low_attention_quantile, "linear").over(by),
            large_payload_cut=pl.col("value_payload").quantile(large_payload_quantile, "linear").over(by),
        )
        .with_columns(
            low_attention=pl.col("read_pressure") < pl.col("low_attention_cut"),
            large_payload=pl.col("value_payload") > pl.col("large_payload_cut"),
            high_damage=pl.col("kl_mean") > harm_threshold,
        )
        .with_columns(blind_spot=pl.col("low_attention") & pl.col("large_payload"))
        .select(POINT_COLUMNS)
    )


def blind_spot_stats(points: pl.DataFrame, harm_threshold: float, params: FigureParams) -> list[dict]:
    """Stats rows (statistic, value, note) of flagged ``points`` (:func:`blind_spot_flags`)."""
    n = points.height
    low = points.filter(pl.col("low_attention"))
    large, small = low.filter(pl.col("large_payload")), low.filter(~pl.col("large_payload"))
    a, b = int(large["high_damage"].sum()), large.height - int(large["high_damage"].sum())
    c, d = int(small["high_damage"].sum()), small.height - int(small["high_damage"].sum())
    cuts = points.unique(["prompt_id", "checkpoint"])["low_attention_cut"]
    rows = [
        stat("n_candidates", n, "" if n else "no analysed token-granularity label"),
        stat("n_checkpoints", points.select("prompt_id", "checkpoint").unique().height),
        stat("harm_threshold", harm_threshold), stat("prevalence", points["high_damage"].mean() if n else None),
        stat("low_attention_quantile", params.low_attention_quantile),
        stat("large_payload_quantile", params.large_payload_quantile),
        stat("median_low_attention_cut", cuts.median() if n else None), stat("n_low_attention", low.height),
        stat("n_blind_spot", large.height), stat("n_blind_spot_high_damage", a), stat("low_large_high", a),
        stat("low_large_not_high", b), stat("low_small_high", c), stat("low_small_not_high", d),
    ]
    rate_large = a / large.height if large.height else None
    rate_small = c / small.height if small.height else None
    rows += [
        stat("harm_rate_large_payload", rate_large), stat("harm_rate_small_payload", rate_small),
        stat("risk_difference", None if rate_large is None or rate_small is None else rate_large - rate_small),
    ]
    note = ""
    if min(large.height, small.height) < params.min_group:
        note = (f"too few low-attention candidates: {large.height} with large and {small.height} with small payload "
                f"(need >= {params.min_group} each)")
    elif a + c == 0 or b + d == 0:
        note = f"no {'high-damage' if a + c == 0 else 'low-damage'} candidate among the {low.height} low-attention ones"
    table = np.array([[a, b], [c, d]])
    if note:
        rows += [
            stat(s, None, note)
            for s in ("fisher_odds_ratio", "fisher_p", "odds_ratio", "odds_ratio_ci_low", "odds_ratio_ci_high")
        ]
    else:
        rows += [stat(name, value) for name, value in fisher_greater(table, params.ci_level).items()]
    mwu, _ = mann_whitney(large["kl_mean"].to_numpy(), small["kl_mean"].to_numpy(), params.min_group,
                          "KL of large- vs small-payload low-attention candidates")
    rows += mwu
    rows += [stat("median_kl_large_payload", large["kl_mean"].median() if large.height else None),
             stat("median_kl_small_payload", small["kl_mean"].median() if small.height else None)]
    return rows


def plot_blind_spot(points: pl.DataFrame, rows: list[dict], params: FigureParams, out_dir: Path) -> list[Path]:
    """Scatter of p vs KL (log-log) coloured by payload, blind-spot points ringed, and the 2×2 table."""
    s = stats_dict(rows)
    notes = [r["note"] for r in rows if r["note"]]
    with style():
        fig, (ax, ax2) = new_figure(2, 10.5, 4.2)
        fig.get_layout_engine().set(wspace=0.08)
        ax2.set_box_aspect(1)
        if points.height:
            floor = params.log_floor
            x = np.maximum(points["read_pressure"].to_numpy(), floor)
            y = np.maximum(points["kl_mean"].to_numpy(), floor)
            b = points["value_payload"].to_numpy()
            norm = (
                LogNorm(max(b.min(), floor), max(b.max(), floor * 10)) if b.min() > 0 else Normalize(b.min(), b.max())
            )
            sns.scatterplot(x=x, y=y, hue=b, hue_norm=norm, palette="viridis", s=14, linewidth=0, legend=False, ax=ax)
            spot = points["blind_spot"].to_numpy()
            ax.scatter(x[spot], y[spot], s=46, facecolors="none", edgecolors="black", linewidths=0.8,
                       label=f"blind-spot quadrant: low attention & large payload (n = {int(s['n_blind_spot'])})")
            ax.axhline(max(s["harm_threshold"], floor), color="firebrick", ls="--", lw=1,
                       label=f"high damage: KL > {fmt(s['harm_threshold'])} ({params.harm})")
            ax.axvline(max(s["median_low_attention_cut"], floor), color="grey", ls=":", lw=1,
                       label=f"median per-checkpoint low-attention cut (q = {params.low_attention_quantile:g})")
            ax.set_xscale("log")
            ax.set_yscale("log")
            fig.colorbar(ScalarMappable(norm=norm, cmap="viridis"), ax=ax, label=f"value payload b ({params.payload})")
            ax.legend(loc="lower left", fontsize=6, frameon=True)
            ax.text(
                0.02,
                0.98,
                f"low attention: {int(s['n_low_attention'])} of {int(s['n_candidates'])}\n"
                f"blind spot: {int(s['n_blind_spot'])}, of which high damage {int(s['n_blind_spot_high_damage'])}",
                transform=ax.transAxes,
                va="top",
                fontsize=7,
                bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"),
            )
        else:
            note_on(ax, "no analysed candidate: nothing to plot")
        ax.set_xlabel("read pressure p (window attention, candidate-normalized)")
        ax.set_ylabel("eviction KL (kl_mean, nats)")
        ax.set_title("(a) attention-only blind spot", fontsize=9)

        table = np.array(
            [[s["low_large_high"], s["low_large_not_high"]], [s["low_small_high"], s["low_small_not_high"]]]
        )
        sns.heatmap(table, annot=True, fmt=".0f", cmap="Blues", cbar=False, ax=ax2,
                    xticklabels=["high damage", "not high"], yticklabels=["large payload", "small payload"])
        ax2.set_title(f"low-attention candidates (n = {int(s['n_low_attention'])})", fontsize=9)
        ax2.set_xlabel(
            f"Fisher exact (one-sided) p = {fmt(s['fisher_p'])}, OR = {fmt(s['odds_ratio'])} "
            f"[{fmt(s['odds_ratio_ci_low'])}, {fmt(s['odds_ratio_ci_high'])}]\n"
            f"Mann-Whitney U on KL p = {fmt(s['mwu_p'])}, rank-biserial r = {fmt(s['rank_biserial'])}", fontsize=7)
        if notes:
            note_on(ax2, "\n".join(dict.fromkeys(notes)), y=0.5)
        return save_figure(fig, out_dir, "blind_spot")


@register_figure("blind_spot", "(a) Attention-only blind spot", ("blind_spot_stats.csv", "blind_spot_points.csv"))
def blind_spot_figure(ctx: FigureContext) -> Drawn:
    """Flags, stats and figure (a) from ``ctx.points``: writes blind_spot.{png,pdf}, blind_spot_points.csv and
    blind_spot_stats.csv (first the counts of labels left out)."""
    params, out_dir, points = ctx.params, ctx.out, ctx.points
    no_eligible = points.filter(pl.col("read_pressure").is_nan()).height
    points = points.filter(pl.col("read_pressure").is_not_nan())
    rows = [
        stat("n_token_labels", ctx.token.height),
        stat("n_unresolved_excluded", 0 if params.include_unresolved else ctx.token.filter(ctx.below_floor).height),
        stat(
            "n_no_eligible_excluded",
            no_eligible,
            f"{no_eligible} rows at checkpoints t <= w_delay = {params.w_delay} (no entry to normalize p over)"
            if no_eligible
            else "",
        ),
    ]
    flagged = blind_spot_flags(points, params.low_attention_quantile, params.large_payload_quantile, ctx.threshold)
    rows += blind_spot_stats(flagged, ctx.threshold, params)
    flagged.write_csv(out_dir / "blind_spot_points.csv")
    write_stats(rows, out_dir / "blind_spot_stats.csv")
    files = plot_blind_spot(flagged, rows, params, out_dir)
    return Drawn(stats_dict(rows), [r["note"] for r in rows if r["note"]],
                 [*files, out_dir / "blind_spot_points.csv", out_dir / "blind_spot_stats.csv"])

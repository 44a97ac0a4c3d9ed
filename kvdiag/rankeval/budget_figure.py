"""The budget-curve figure: FSR@rho and FNR@rho of every rule over a grid of rho (one rho hides where rules cross)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from kvdiag.rankeval.registry import metrics_where

MARKERS = (".", "x", "^", "s")  # rules 0-19, 20-39, ...: with the colour, one pair per rule


def budget_curves_figure(curves: pl.DataFrame, out_dir: Path, candidates: str) -> list[Path]:
    """``budget_curves.png``/``.pdf`` from ``RankEvalResult.budget_curves``: one panel per metric with a ``curve``
    (FSR, FNR), one line per rule with its CI band, the random scorer dashed."""
    import seaborn as sns

    from kvdiag.core.plotting import (  # matplotlib on first use only
        new_figure,
        save_figure,
        style,
    )

    rules = [n for n in curves["scorer"].unique(maintain_order=True) if not n.startswith("random (")]
    # tab20 has 20 colours and the zoo more rules (22 built-ins): past 20 the colours repeat, so each rule's
    # (colour, marker) pair is its own: colour i % 20, marker i // 20
    palette = sns.color_palette("tab20", 20)
    colors = {name: palette[i % 20] for i, name in enumerate(rules)}
    markers = {name: MARKERS[i // 20 % len(MARKERS)] for i, name in enumerate(rules)}
    with style():
        metrics = metrics_where("curve")
        fig, axes = new_figure(len(metrics), 5.0 * len(metrics), 4.2)
        for ax, m in zip(axes, metrics, strict=True):
            rows = curves.filter(pl.col("metric") == m.name)
            for name in rows["scorer"].unique(maintain_order=True):
                r = rows.filter(pl.col("scorer") == name).sort("rho")
                random = name.startswith("random (")
                ax.plot(
                    r["rho"], r["value"], linestyle="--" if random else "-", color="black" if random else colors[name],
                    linewidth=1.0, marker=None if random else markers[name], markersize=4, label=name,
                )
                if not random:
                    ax.fill_between(r["rho"], r["ci_low"], r["ci_high"], alpha=0.08, color=colors[name])
            ax.set_xlabel("eviction fraction ρ")
            ax.set_ylabel(m.curve)
        axes[-1].legend(fontsize=6, ncols=1, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle(f"Budget curves on {candidates}", fontsize=8)
        return save_figure(fig, out_dir, "budget_curves")

"""The budget-curve figure: FSR@rho and FNR@rho of every rule over a grid of rho (one rho hides where rules cross)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from kvdiag.rankeval.registry import metrics_where


def budget_curves_figure(curves: pl.DataFrame, out_dir: Path, candidates: str) -> list[Path]:
    """``budget_curves.png``/``.pdf`` from ``RankEvalResult.budget_curves``: one panel per metric with a ``curve``
    (FSR, FNR), one line per rule with its CI band, the random scorer dashed."""
    from kvdiag.core.plotting import (  # matplotlib on first use only
        line_styles,
        new_figure,
        save_figure,
        style,
    )

    rules = [n for n in curves["scorer"].unique(maintain_order=True) if not n.startswith("random (")]
    styles = line_styles(rules)
    with style():
        metrics = metrics_where("curve")
        fig, axes = new_figure(len(metrics), 5.0 * len(metrics), 4.2)
        for ax, m in zip(axes, metrics, strict=True):
            rows = curves.filter(pl.col("metric") == m.name)
            for name in rows["scorer"].unique(maintain_order=True):
                r = rows.filter(pl.col("scorer") == name).sort("rho")
                random = name.startswith("random (")
                ax.plot(
                    r["rho"], r["value"], linestyle="--" if random else "-",
                    color="black" if random else styles[name][0], linewidth=1.0,
                    marker=None if random else styles[name][1], markersize=4, label=name,
                )
                if not random:
                    ax.fill_between(r["rho"], r["ci_low"], r["ci_high"], alpha=0.08, color=styles[name][0])
            ax.set_xlabel("eviction fraction ρ")
            ax.set_ylabel(m.curve)
        axes[-1].legend(fontsize=6, ncols=1, loc="center left", bbox_to_anchor=(1.02, 0.5))
        fig.suptitle(f"Budget curves on {candidates}", fontsize=8)
        return save_figure(fig, out_dir, "budget_curves")

"""Appendix D diagnostics: (a) the attention-only blind spot, (b) the delayed-read effect, and the AvoKV-E
component figure (Table 4 in diagnostic form). Each figure as PNG and PDF with every plotted number in a CSV
beside it; definitions and parameters: :class:`FigureParams` and README, section Figures.

    from kvdiag.figures import FigureParams, make_figures
    stats = make_figures(Trace("run/trace"), labels_df, scores_df, "run/figures", FigureParams(w_obs=32))
"""

from __future__ import annotations

import importlib

from kvdiag.figures.params import FigureParams

__all__ = [
    "FIGURES", "VARIANTS", "FigureParams", "blind_spot_flags", "blind_spot_stats", "check_figure_inputs", "classify_reads",
    "component_metrics", "component_table", "delay_histogram", "delayed_read_stats", "first_reads",
    "layer_pressure_payload", "layer_read_strength", "make_figures", "rank_biserial", "trace_first_reads",
    "trace_pressure_payload", "writable_dir",
]


def __getattr__(name: str):
    """Everything but FigureParams loads on first use: matplotlib, seaborn and scipy take about 1.5 s to
    import, which every ``kvdiag`` command (even ``--help``) would pay through the CLI's option defaults."""
    if name in __all__:
        return getattr(importlib.import_module("kvdiag.figures.run"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

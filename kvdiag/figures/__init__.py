"""Appendix D diagnostics: (a) the attention-only blind spot, (b) the delayed-read effect, and the AvoKV-E
component figure (Table 4 in diagnostic form). Each figure as PNG and PDF with every plotted number in a CSV
beside it; definitions and parameters: :class:`FigureParams` and docs/figures.md. Each figure is one file
registered by name (``register_figure``, ``FIGURES``); adding one: docs/extending.md.

    from kvdiag.figures import FigureParams, make_figures
    stats = make_figures(Trace("run/trace"), labels_df, scores_df, "run/figures", FigureParams(w_obs=32))
"""

from __future__ import annotations

from kvdiag.core.lazy import lazy_exports
from kvdiag.figures.config import FigureParams

# the submodule that defines each exported name
_HOME = {
    "FIGURES": "run", "check_figure_inputs": "run", "make_figures": "run",  # run imports (registers) every figure
    "Drawn": "registry", "Figure": "registry", "FigureContext": "registry", "register_figure": "registry",
    "blind_spot_flags": "blind_spot", "blind_spot_stats": "blind_spot",
    "VARIANTS": "components", "component_metrics": "components", "component_table": "components",
    "classify_reads": "delayed_reads", "delay_histogram": "delayed_reads", "delayed_read_stats": "delayed_reads",
    "first_reads": "features", "layer_read_strength": "features",
    "trace_first_reads": "features", "trace_pressure_payload": "features",
}
__all__ = ["FigureParams", *_HOME]

# Everything but FigureParams loads on first use: matplotlib, seaborn and scipy take about 1.5 s to
# import, which every ``kvdiag`` command (even ``--help``) would pay through the CLI's option defaults.
__getattr__ = lazy_exports(__name__, _HOME)

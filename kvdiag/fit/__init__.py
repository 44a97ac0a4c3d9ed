"""``kvdiag fit``: a fitted ceiling for feature-based rules.

A logistic regression and gradient-boosted trees (scikit-learn) learn the harmful label from the per-entry
features kvdiag computes (``kvdiag.scorers.entry_features``), with cross-validation grouped by prompt: each
entry's out-of-fold prediction comes from a model that never saw its prompt. The out-of-fold predictions are
ranked beside the hand-made rules by ``rank_eval`` (same candidates, harm threshold and cluster bootstrap).
They say how well *any* rule on these features could rank this label: an upper reference, not a policy.
Both models refitted on every entry are saved in ``model.json`` (JSON: the regression's weights, the trees' nodes),
with the training prompts, the labels' horizon and model; it loads as the ``fitted`` rule (``fitted:DIR/model.json``),
which runs the model ``FitConfig.rule`` names (``kvdiag.scorers.fitted``, ``kvdiag.scorers.fitted_file``).
"""

from __future__ import annotations

from kvdiag.core.lazy import lazy_exports
from kvdiag.fit.config import FitConfig, check_config

# the submodule that defines each exported name
_HOME = {"MODELS": "run", "feature_table": "run", "fit_ceiling": "run", "fit_features": "run", "fit_files": "run",
         "rank_fitted": "run", "load_summary": "run",
         "cross_validate": "run", "importance_table": "run", "boosted_json": "run"}
__all__ = ["FitConfig", "check_config", *_HOME]

# The config loads at once, the stage on first use (numpy, polars, scikit-learn, and torch for the features):
# the CLI checks its arguments (FitConfig) before.
__getattr__ = lazy_exports(__name__, _HOME)

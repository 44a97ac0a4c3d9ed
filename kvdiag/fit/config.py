"""How ``kvdiag fit`` fits its ceiling (:class:`FitConfig`) and the checks that need no table or model: the CLI
runs them before polars, numpy and torch are imported."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvdiag.core.errors import UserError
from kvdiag.core.harm import HarmSpec
from kvdiag.core.schema import HARM, N_BOOT, NOISE_MULT

AGGREGATIONS = ("mean_raw", "cells")  # token rows of cell-mean features, or one row per cell


@dataclass(frozen=True)
class FitConfig:
    """How the ceiling is fitted (written to config.json and model.json)."""

    features: tuple[str, ...] = ()  # empty: every feature of entry_features.FEATURES
    harm: str = HARM  # the harmful label, as rank-eval defines it (on the resolved labels)
    include_unresolved: bool = False
    noise_mult: float = NOISE_MULT
    n_splits: int = 5  # grouped folds (at most the number of prompts)
    seed: int = 0
    n_boot: int = N_BOOT  # rank-eval's cluster bootstrap of the out-of-fold metrics
    logreg_c: float = 1.0  # inverse L2 strength of the logistic regression
    gbt_max_iter: int = 200  # boosting iterations of HistGradientBoostingClassifier
    gbt_learning_rate: float = 0.05
    gbt_max_leaf_nodes: int = 15
    rule: str = "logistic"  # the model model.json's fitted rule runs: logistic or boosted (both are saved)
    aggregation: str = "mean_raw"  # token rows: mean of the features over layers and KV heads (linear: the fitted
    # scorer's logit, averaged the same way, is exactly the model's); "cells": one row per (layer, KV head) cell of
    # each labelled token, with the token's label (the rule then scores each cell as it was fitted, trees too)
    extra: dict = field(default_factory=dict)

    @property
    def harm_spec(self) -> HarmSpec:
        return HarmSpec(self.harm, self.noise_mult, self.include_unresolved)


def check_config(cfg: FitConfig) -> tuple[str, ...]:
    """The features ``cfg`` fits (all when none are named); bad settings are a ``UserError``, before torch."""
    from kvdiag.scorers.fitted_file import RULES
    from kvdiag.scorers.names import CELL_FEATURES
    from kvdiag.scorers.names import ENTRY_FEATURES as FEATURES  # the names, without torch

    cfg.harm_spec  # noqa: B018  (checks the harm settings)
    names = cfg.features or tuple(f for f in FEATURES if cfg.aggregation == "cells" or f not in CELL_FEATURES)
    unknown = [f for f in names if f not in FEATURES]
    if unknown:
        raise UserError(f"--features {','.join(unknown)}: unknown; use some of {', '.join(FEATURES)}")
    if cfg.aggregation not in AGGREGATIONS:
        raise UserError(f"aggregation {cfg.aggregation}: use one of {', '.join(AGGREGATIONS)}")
    if cfg.aggregation != "cells" and (cell := [f for f in names if f in CELL_FEATURES]):
        raise UserError(f"--features {','.join(cell)}: constant within a cell, so the token rows' mean carries "
                        "nothing; add --per-cell or drop them")
    if cfg.rule not in RULES:
        raise UserError(f"--rule-model {cfg.rule}: use one of {', '.join(RULES)}")
    if cfg.n_splits < 2:
        raise UserError(f"--folds {cfg.n_splits}: cross-validation needs at least 2 folds")
    return names

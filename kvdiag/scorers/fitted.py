"""The fitted rule: a logistic regression on per-entry features (``kvdiag fit``), loaded from its JSON file."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import torch

from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.entry_features import FEATURES, entry_features
from kvdiag.scorers.names import read_fitted_model
from kvdiag.scorers.registry import SCORERS, register_scorer


@register_scorer("fitted")
@dataclass
class Fitted(Scorer):
    """``logit P(harmful)`` of the model ``kvdiag fit`` saved at ``path`` (``model.json``): keep what would hurt
    to evict (higher = keep).

    The model is linear in standardized features, so the mean of its per-(layer, KV head) logits
    (``--aggregation mean_raw``) is exactly the logit of the mean features it was fitted on. An upper reference
    for feature-based rules under the label it was fitted to, not an eviction policy. No protected entries.

    Parameters
    ----------
    path : model.json written by ``kvdiag fit`` (required).
    """

    in_all: ClassVar[bool] = False  # needs its model path

    path: str = ""
    _model: dict = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self._model = read_fitted_model(self.path)

    @property
    def needs_history(self) -> bool:
        """A model fitted on features of every past query needs them."""
        return any(FEATURES[f].history for f in self._model["features"])

    @property
    def query_window(self) -> int:
        return max([FEATURES[f].window for f in self._model["features"]] + [0])

    @property
    def params(self) -> dict:
        return {"path": self.path}

    @cached_property
    def _weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        m = self._model
        return (torch.tensor(m["mean"]), torch.tensor(m["scale"]), torch.tensor(m["coef"]), float(m["intercept"]))

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        mean, scale, coef, intercept = self._weights
        x = entry_features(ctx, self._model["features"])  # [F, Hkv, t]
        logit = torch.einsum("f,fht->ht", coef / scale, x - mean[:, None, None]) + intercept
        return logit


def register_fitted(name: str) -> type[Scorer]:
    """Register ``fitted:PATH``: the ``fitted`` scorer with ``path`` = PATH (checked now: one UserError line)."""
    path = name.split(":", 1)[1]
    Fitted(path=path)  # a missing or foreign model is refused before anything runs
    cls = dataclasses.make_dataclass("FittedAt", [("path", str, field(default=path))], bases=(Fitted,),
                                     namespace={"__module__": __name__, "__doc__": f"the fitted rule of {path}"})
    return register_scorer(cls, name)


SCORERS.add_resolver("fitted:", register_fitted)

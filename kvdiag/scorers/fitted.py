"""The fitted rule: a model ``kvdiag fit`` learned on per-entry features (a logistic regression or gradient-boosted
trees), loaded from its JSON file (``kvdiag.scorers.fitted_file``) and evaluated in torch, in float64, as
scikit-learn's ``decision_function`` computes it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import torch

from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.entry_features import FEATURES, entry_features
from kvdiag.scorers.fitted_file import read_fitted_model
from kvdiag.scorers.registry import SCORERS, register_scorer

MAX_GATHER = 1 << 24  # elements of one [trees, entries] walk of the boosted trees (chunks of trees beyond it)


@dataclass(frozen=True)
class Logistic:
    """A standardized logistic regression (scikit-learn's ``StandardScaler`` + ``LogisticRegression``): the logit
    ``coef · (x - mean) / scale + intercept``; ``mean``, ``scale``, ``coef``: [F] float64."""

    mean: torch.Tensor
    scale: torch.Tensor
    coef: torch.Tensor
    intercept: float

    @classmethod
    def from_json(cls, section: dict) -> Logistic:
        return cls(*(torch.tensor(section[k], dtype=torch.float64) for k in ("mean", "scale", "coef")),
                   float(section["intercept"]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[N] the logit of the features ``x [F, N]`` (float64)."""
        mean, scale, coef = (w.to(x.device) for w in (self.mean, self.scale, self.coef))
        return coef @ ((x - mean[:, None]) / scale[:, None]) + self.intercept


@dataclass(frozen=True)
class Boosted:
    """Gradient-boosted trees (scikit-learn's ``HistGradientBoostingClassifier`` on raw features): the logit
    ``baseline`` plus, per tree, the value of the leaf an entry reaches from the root (node ``i`` sends
    ``x[feature] <= threshold`` left, NaN left where ``missing_left``, the rest right).

    The trees are padded to one node count ``M``: ``feature``, ``left``, ``right`` [T, M] long, ``threshold``,
    ``value`` [T, M] float64, ``missing_left`` [T, M] bool. A leaf (and padding) is its own left and right child, so
    ``depth`` steps from the root (the deepest leaf's) bring every entry to its leaf in every tree at once.
    """

    baseline: float
    feature: torch.Tensor
    threshold: torch.Tensor
    missing_left: torch.Tensor
    left: torch.Tensor
    right: torch.Tensor
    value: torch.Tensor
    depth: int

    @classmethod
    def from_json(cls, section: dict) -> Boosted:
        """From a checked ``boosted`` section (``fitted_file``: children follow their parent, so one pass in node
        order finds each node's depth)."""
        trees = section["trees"]
        size = max(len(tree["leaf"]) for tree in trees)
        cols: dict[str, list] = {k: [] for k in ("feature", "threshold", "missing_left", "left", "right", "value")}
        depth = 0
        for tree in trees:
            n, leaf = len(tree["leaf"]), tree["leaf"]
            pad = range(n, size)
            cols["feature"].append([0 if leaf[i] else tree["feature"][i] for i in range(n)] + [0] * len(pad))
            cols["threshold"].append([float("inf") if tree["threshold"][i] is None or leaf[i] else tree["threshold"][i]
                                      for i in range(n)] + [0.0] * len(pad))
            cols["missing_left"].append(list(tree["missing_left"]) + [False] * len(pad))
            for side in ("left", "right"):
                cols[side].append([i if leaf[i] else tree[side][i] for i in range(n)] + list(pad))
            cols["value"].append([float(tree["value"][i]) if leaf[i] else 0.0 for i in range(n)] + [0.0] * len(pad))
            level = [0] * n
            for i in range(n):
                if not leaf[i]:
                    level[tree["left"][i]] = level[tree["right"][i]] = level[i] + 1
            depth = max(depth, *level)
        long, f64 = torch.long, torch.float64
        return cls(float(section["baseline"]), torch.tensor(cols["feature"], dtype=long),
                   torch.tensor(cols["threshold"], dtype=f64), torch.tensor(cols["missing_left"], dtype=torch.bool),
                   torch.tensor(cols["left"], dtype=long), torch.tensor(cols["right"], dtype=long),
                   torch.tensor(cols["value"], dtype=f64), depth)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[N] the logit of the features ``x [F, N]`` (float64): the trees walked in chunks of at most
        :data:`MAX_GATHER` (tree, entry) pairs."""
        n_trees, n = self.feature.shape[0], x.shape[1]
        step = max(1, MAX_GATHER // max(n, 1))
        total = torch.full((n,), self.baseline, dtype=torch.float64, device=x.device)
        for start in range(0, n_trees, step):
            part = slice(start, start + step)
            feature, threshold, missing_left, left, right, value = (
                w[part].to(x.device) for w in (self.feature, self.threshold, self.missing_left, self.left, self.right,
                                               self.value))
            node = torch.zeros(feature.shape[0], n, dtype=torch.long, device=x.device)  # [T, N] the root
            for _ in range(self.depth):
                xs = x.gather(0, feature.gather(1, node))  # [T, N] each entry's value of its node's feature
                go_left = torch.where(xs.isnan(), missing_left.gather(1, node), xs <= threshold.gather(1, node))
                node = torch.where(go_left, left.gather(1, node), right.gather(1, node))
            total += value.gather(1, node).sum(0)
        return total


@register_scorer("fitted")
@dataclass
class Fitted(Scorer):
    """The logit ``P(harmful)`` of the model ``kvdiag fit`` saved at ``path`` (``model.json``), the one its ``rule``
    names (``logistic`` or ``boosted``): keep what would hurt to evict (higher = keep).

    Each (layer, KV head) cell's entries are scored on their own features, in float64, exactly as scikit-learn's
    ``decision_function`` scores that feature matrix. A model fitted on cell rows (``kvdiag fit --per-cell``, model.json
    ``aggregation: cells``) scores each cell as it was fitted. One fitted on token rows saw the features averaged over
    layers and KV heads: the logistic regression is linear, so the mean of its cells' logits
    (``--aggregation mean_raw``) is exactly its logit of those means; the trees are not, so the boosted rule's token
    score is the mean of its cells' scores, not the trees' score of the mean features. No protected entries.

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
    def _rule(self) -> Logistic | Boosted:
        rule = self._model["rule"]
        return (Logistic if rule == "logistic" else Boosted).from_json(self._model[rule])

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        x = entry_features(ctx, self._model["features"]).double()  # [F, Hkv, t]
        return self._rule(x.flatten(1)).view(ctx.num_kv_heads, ctx.t)


def register_fitted(name: str) -> type[Scorer]:
    """Register ``fitted:PATH``: the ``fitted`` scorer with ``path`` = PATH (checked now: one UserError line)."""
    path = name.split(":", 1)[1]
    Fitted(path=path)  # a missing or foreign model is refused before anything runs
    cls = dataclasses.make_dataclass("FittedAt", [("path", str, field(default=path))], bases=(Fitted,),
                                     namespace={"__module__": __name__, "__doc__": f"the fitted rule of {path}"})
    return register_scorer(cls, name)


SCORERS.add_resolver("fitted:", register_fitted)

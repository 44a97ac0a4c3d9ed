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

MAX_GATHER = 1 << 24  # elements of one [trees, leaves, entries] product of the boosted trees (chunks beyond it)


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

    Evaluated as matrices, not walked node by node: every internal node's test is computed for every entry at once
    (in float64, on the raw features), and a leaf is reached when every test on its path goes its way: the count of
    tests that agree with the path, ``path @ go_left + rights`` (one batched product; small integers, exact in
    float32), equals the path's length. Trees are padded to ``M`` internal nodes and ``L`` leaves: ``feature``
    [T, M] long, ``threshold`` [T, M] float64, ``missing_left`` [T, M] bool; ``path`` [T, L, M] float32, +1 where
    the leaf's path leaves the node to the left, -1 to the right; ``rights`` [T, L] its right turns; ``length``
    [T, L] its tests (-1 for padding: never reached); ``value`` [T, L] float64.
    """

    baseline: float
    feature: torch.Tensor
    threshold: torch.Tensor
    missing_left: torch.Tensor
    path: torch.Tensor
    rights: torch.Tensor
    length: torch.Tensor
    value: torch.Tensor

    @classmethod
    def from_json(cls, section: dict) -> Boosted:
        """From a checked ``boosted`` section (``fitted_file``: children follow their parent, so one pass in node
        order finds each node's path)."""
        trees = []
        for tree in section["trees"]:
            leaf = tree["leaf"]
            internal = [i for i in range(len(leaf)) if not leaf[i]]
            slot = {node: j for j, node in enumerate(internal)}
            path: dict[int, list[tuple[int, int]]] = {0: []}  # node -> [(internal slot, 1 left / -1 right)]
            for i in internal:
                path[tree["left"][i]] = [*path[i], (slot[i], 1)]
                path[tree["right"][i]] = [*path[i], (slot[i], -1)]
            leaves = [i for i in range(len(leaf)) if leaf[i]]
            trees.append((tree, internal, [(path[i], float(tree["value"][i])) for i in leaves]))
        n_trees = len(trees)
        m = max(1, *(len(internal) for _, internal, _ in trees))
        n_leaves = max(len(leaves) for _, _, leaves in trees)
        f64 = torch.float64
        feature = torch.zeros(n_trees, m, dtype=torch.long)
        threshold = torch.full((n_trees, m), float("inf"), dtype=f64)
        missing_left = torch.zeros(n_trees, m, dtype=torch.bool)
        path = torch.zeros(n_trees, n_leaves, m)
        length = torch.full((n_trees, n_leaves), -1.0)
        value = torch.zeros(n_trees, n_leaves, dtype=f64)
        for t, (tree, internal, leaves) in enumerate(trees):
            for j, i in enumerate(internal):
                feature[t, j] = tree["feature"][i]
                threshold[t, j] = float("inf") if tree["threshold"][i] is None else tree["threshold"][i]
                missing_left[t, j] = tree["missing_left"][i]
            for k, (steps, v) in enumerate(leaves):
                for j, side in steps:
                    path[t, k, j] = side
                length[t, k], value[t, k] = len(steps), v
        rights = (path < 0).sum(-1).float()
        return cls(float(section["baseline"]), feature, threshold, missing_left, path, rights, length, value)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[N] the logit of the features ``x [F, N]`` (float64), in chunks of trees of at most :data:`MAX_GATHER`
        (tree, leaf, entry) triples."""
        n_trees, n_leaves, m = self.path.shape
        n = x.shape[1]
        step = max(1, MAX_GATHER // max(n * max(n_leaves, m), 1))
        nan = bool(x.isnan().any())
        leaf_values = []
        for start in range(0, n_trees, step):
            part = slice(start, start + step)
            feature, threshold, missing_left, path, rights, length, value = (
                w[part].to(x.device) for w in (self.feature, self.threshold, self.missing_left, self.path,
                                               self.rights, self.length, self.value))
            xs = x[feature.flatten()].view(*feature.shape, n)  # [T, M, N] each node's feature of each entry
            go_left = xs <= threshold[..., None]
            if nan:
                go_left = torch.where(xs.isnan(), missing_left[..., None], go_left)
            agree = path @ go_left.float() + rights[..., None]  # [T, L, N] tests on the leaf's path that go its way
            leaf = (agree == length[..., None]).float().argmax(1)  # [T, N] the one leaf each entry reaches
            leaf_values.append(value.gather(1, leaf))
        return self.baseline + torch.cat(leaf_values).sum(0)


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

"""The fitted rule's file (``model.json``, written by ``kvdiag fit``), read and checked without torch, and the one
check of a fitted rule against what a command runs it on (:func:`check_fitted`): the CLI refuses a malformed file, a
rule trained on some of the evaluated prompts or on another model family before anything heavy loads.

The file (``kind`` :data:`KIND`) holds both models ``kvdiag fit`` fitted on every entry and which of them the rule
runs (``rule``: ``logistic`` or ``boosted``); docs/rank-eval.md describes its fields.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvdiag.core.errors import UserError
from kvdiag.scorers.names import ENTRY_FEATURES

KIND = "kvdiag_fitted_rule"
RULES = ("logistic", "boosted")  # the models a fitted file holds, by the key of their section
NODE_FIELDS = ("feature", "threshold", "missing_left", "left", "right", "leaf", "value")  # one list per tree each


def text_digest(text: str) -> str:
    """sha256 of a prompt's text (UTF-8): the identity the training prompts are recorded and compared by."""
    return hashlib.sha256(text.encode()).hexdigest()


def read_fitted_model(path: str) -> dict:
    """The model.json (written by ``kvdiag fit``) of the ``fitted`` scorer at ``path``, read and checked without
    torch: every feature known, each model's arrays of the features' length, every tree a tree (each node's children
    inside it, after it, each node but the root the child of one), finite numbers, the training prompts recorded.
    Anything else is one ``UserError`` line naming the file."""
    if not path:
        raise UserError("scorer fitted needs its model: name it fitted:DIR/model.json or pass --param "
                        "fitted.path=DIR/model.json (written by kvdiag fit)")
    try:
        model = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"fitted model {path}: not a readable model.json ({err}); run kvdiag fit") from err
    where = f"fitted model {path}"
    if not isinstance(model, dict) or model.get("kind") != KIND:
        old = isinstance(model, dict) and model.get("kind") == "kvdiag_fitted_logreg"
        raise UserError(f"{where}: " + ("written by an older kvdiag fit, which recorded no training prompts (a rule "
                                        "evaluated on its own training prompts could not be refused); re-run kvdiag "
                                        "fit" if old else "not a model.json written by kvdiag fit"))
    features = model.get("features")
    if not isinstance(features, list) or not features:
        raise UserError(f"{where}: lists no features; re-run kvdiag fit")
    if unknown := [f for f in features if f not in ENTRY_FEATURES]:
        raise UserError(f"{where}: unknown feature {', '.join(map(str, unknown))}; kvdiag's are "
                        f"{', '.join(ENTRY_FEATURES)}")
    if model.get("rule") not in RULES or not isinstance(model.get(model["rule"]), dict):
        raise UserError(f"{where}: rule {model.get('rule')!r} is not one of {', '.join(RULES)} with its section")
    if isinstance(model.get("logistic"), dict):
        _check_logistic(model["logistic"], len(features), where)
    if isinstance(model.get("boosted"), dict):
        _check_boosted(model["boosted"], len(features), where)
    _check_trained_on(model.get("trained_on"), where)
    return model


def _numbers(value, n: int, what: str, where: str) -> None:
    """``value`` is a list of ``n`` finite numbers, one per feature."""
    if not isinstance(value, list) or len(value) != n or not all(_finite(x) for x in value):
        got = f"{len(value)} values" if isinstance(value, list) else f"a {type(value).__name__}"
        raise UserError(f"{where}: {what} must hold {n} finite numbers, one per feature; it has {got}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_logistic(section: dict, n: int, where: str) -> None:
    for key in ("mean", "scale", "coef"):
        _numbers(section.get(key), n, f"logistic.{key}", where)
    if not all(s > 0 for s in section["scale"]):
        raise UserError(f"{where}: logistic.scale must be positive (the features' standard deviations)")
    if not _finite(section.get("intercept")):
        raise UserError(f"{where}: logistic.intercept must be a finite number")


def _check_boosted(section: dict, n: int, where: str) -> None:
    if not _finite(section.get("baseline")):
        raise UserError(f"{where}: boosted.baseline must be a finite number")
    trees = section.get("trees")
    if not isinstance(trees, list) or not trees:
        raise UserError(f"{where}: boosted.trees must be a non-empty list of trees")
    for i, tree in enumerate(trees):
        _check_tree(tree, n, f"{where}: boosted tree {i}")


def _check_tree(tree: dict, n_features: int, where: str) -> None:
    """One tree of :data:`NODE_FIELDS` lists (sklearn's ``TreePredictor.nodes``, in its order): an internal node sends
    ``x[feature] <= threshold`` (``None``: +inf) to ``left``, NaN to ``left`` when ``missing_left``, the rest to
    ``right``; a leaf's ``value`` is what the tree adds. Children follow their parent and each node but the root is
    the child of exactly one node, so every walk from the root ends at a leaf."""
    if not isinstance(tree, dict) or any(not isinstance(tree.get(k), list) for k in NODE_FIELDS):
        raise UserError(f"{where}: needs the lists {', '.join(NODE_FIELDS)}")
    size = len(tree["leaf"])
    if size == 0 or any(len(tree[k]) != size for k in NODE_FIELDS):
        raise UserError(f"{where}: its lists {', '.join(NODE_FIELDS)} must have one entry per node, the same number")
    if not all(isinstance(x, bool) for x in tree["leaf"] + tree["missing_left"]):
        raise UserError(f"{where}: leaf and missing_left must be true or false")
    children = []
    for i in range(size):
        if tree["leaf"][i]:
            if not _finite(tree["value"][i]):
                raise UserError(f"{where}: leaf {i} has no finite value")
            continue
        feature, threshold = tree["feature"][i], tree["threshold"][i]
        if not isinstance(feature, int) or isinstance(feature, bool) or not 0 <= feature < n_features:
            raise UserError(f"{where}: node {i} splits on feature {feature!r}, not one of the {n_features} features")
        if threshold is not None and not _finite(threshold):
            raise UserError(f"{where}: node {i} has threshold {threshold!r}, not a finite number (or null: +inf)")
        for child in (tree["left"][i], tree["right"][i]):
            if not isinstance(child, int) or isinstance(child, bool) or not i < child < size:
                raise UserError(f"{where}: node {i} points to node {child!r}, outside the tree (its children are "
                                f"among nodes {i + 1}..{size - 1})")
            children.append(child)
    if sorted(children) != list(range(1, size)):
        raise UserError(f"{where}: not a tree (a node is the child of two nodes, or of none)")


def _check_trained_on(trained_on, where: str) -> None:
    prompts = trained_on.get("prompts") if isinstance(trained_on, dict) else None
    if not isinstance(prompts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("id"), str) and isinstance(p.get("text_sha256"), (str, type(None)))
            for p in prompts):
        raise UserError(f"{where}: trained_on.prompts must list the training prompts ({{id, text_sha256}}); re-run "
                        "kvdiag fit")
    if not isinstance(trained_on.get("model"), (dict, type(None))):
        raise UserError(f"{where}: trained_on.model must be the labels' model ({{spec, family, ...}}) or null")


@dataclass(frozen=True)
class Evaluation:
    """What a command runs a fitted rule on: ``prompts`` (id -> the prompt's text, None where not recorded), the
    ``model`` (its spec) and its ``family`` (its ``model_type``; None where it cannot be told before the model
    loads); ``what``: the input that names the prompts, for the refusal (``--trace DIR``, ``--prompts SOURCE``,
    ``--bench NAME``)."""

    what: str
    prompts: dict[str, str | None]
    model: str
    family: str | None


def trace_evaluation(manifest: dict, what: str, prompt_ids: list[str] | None = None) -> Evaluation:
    """The :class:`Evaluation` of a Trace's ``manifest`` (its prompts, or the ``prompt_ids`` of them a command runs)."""
    prompts, model = manifest["prompts"], manifest["model"]
    ids = list(prompts) if prompt_ids is None else prompt_ids
    return Evaluation(what, {pid: (prompts[pid] or {}).get("text") for pid in ids}, str(model.get("spec")),
                      (model.get("attention") or {}).get("family"))


def training_overlap(model: dict, prompts: dict[str, str | None]) -> list[str]:
    """The ids among ``prompts`` (id -> text or None) that ``model`` was trained on: the same text (sha256), or the
    same id where either side has no text recorded."""
    trained = model["trained_on"]["prompts"]
    digests = {p["text_sha256"] for p in trained if p["text_sha256"]}
    ids = {p["id"] for p in trained}
    ids_without_text = {p["id"] for p in trained if not p["text_sha256"]}
    hits = []
    for pid, text in prompts.items():
        digest = None if text is None else text_digest(text)
        if (digest is not None and digest in digests) or pid in (ids if digest is None else ids_without_text):
            hits.append(pid)
    return hits


def fitted_paths(names: list[str], params: dict[str, dict]) -> list[str]:
    """The model path of every ``fitted`` scorer among ``names`` (``fitted:PATH``, or ``fitted`` with ``--param
    fitted.path=PATH``; ``""`` when it has none)."""
    return [name.split(":", 1)[1] if name.startswith("fitted:") else (params.get("fitted") or {}).get("path", "")
            for name in names if name.startswith("fitted:") or name == "fitted"]


def check_fitted(names: list[str], params: dict[str, dict], evaluation: Evaluation | None = None) -> None:
    """Read the model of every ``fitted`` scorer among ``names`` (:func:`read_fitted_model`) and, given the
    ``evaluation`` the command runs it on, refuse a rule trained on another model family or on any of its prompts:
    its scores there would be in-sample. One ``UserError`` line, before torch."""
    for path in fitted_paths(names, params):
        model = read_fitted_model(path)
        if evaluation is None:
            continue
        trained = model["trained_on"]["model"] or {}
        if trained.get("family") and evaluation.family and trained["family"] != evaluation.family:
            raise UserError(f"fitted model {path} was trained on {trained.get('spec')} (family {trained['family']}); "
                            f"{evaluation.what} runs {evaluation.model} (family {evaluation.family}): fit the rule on "
                            "labels of that model")
        if hits := training_overlap(model, evaluation.prompts):
            shown = ", ".join(hits[:3]) + (", ..." if len(hits) > 3 else "")
            raise UserError(f"fitted model {path} was trained on {len(hits)} of the {len(evaluation.prompts)} prompts "
                            f"of {evaluation.what} ({shown}): evaluate a fitted rule on prompts disjoint from its "
                            "training prompts")


__all__ = ["KIND", "NODE_FIELDS", "RULES", "Evaluation", "check_fitted", "fitted_paths",
           "read_fitted_model", "text_digest", "trace_evaluation", "training_overlap"]

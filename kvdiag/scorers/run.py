"""``score_trace``: every selected scorer on the labeled (or chosen) candidates of a Trace; ``score_files``:
the same from files to a scores.parquet (what ``kvdiag score`` runs).

Loop order: prompt → layer → checkpoint (increasing) → scorer. A layer's q/k/v are read once, the features
shared across checkpoints (cumulative attention, recurrence state, sparsity) stream forward once per layer,
and the features shared by scorers (window attention, payload, redundancy) are computed once per checkpoint.
Each scorer sees the whole cache ``[0, t)``, so candidate-normalized features never depend on which
candidates were sampled for labeling.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import polars as pl
import torch

from kvdiag.errors import UserError
from kvdiag.features import AttentionHistory, o_proj_weights
from kvdiag.io import check_writable, read_table, write_table
from kvdiag.progress import progress_bar
from kvdiag.provenance import provenance
from kvdiag.schema import GRANULARITIES, KEY_SCHEMA, KEYS, check_checkpoint, check_keys, default_checkpoints
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.normalization import AGGREGATIONS, aggregation_values
from kvdiag.scorers.registry import SCORERS, Scorer, ensure_registered, get_scorer, needs_o_proj, register_scorer, scorer_names
from kvdiag.token_features import PromptSums, TokenFeatures, features_path

ENTRY_POINT_GROUP = "kvdiag.scorers"
KEY_COLUMNS = KEYS  # the key columns under their name in kvdiag.scorers
KEEP_SCORE = "protected entries score max + 1 + |max| of their row's other scores"


def load_plugins(modules: Iterable[str] = ()) -> list[str]:
    """Register plugin scorers: every installed entry point of group ``kvdiag.scorers`` (a Scorer class, or a
    module that registers on import), then each of ``modules`` (a module name importable from the current
    directory or ``PYTHONPATH``, or a ``.py`` file). Returns what was loaded."""
    loaded = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as err:  # a broken third-party plugin: name it
            raise UserError(f"scorer plugin {ep.name} = {ep.value} failed to load ({err.__class__.__name__}: {err}); fix or uninstall it") from err
        if isinstance(obj, type) and issubclass(obj, Scorer):
            register_scorer(obj, ep.name)
        loaded.append(f"{ep.name} = {ep.value}")
    for module in modules:
        _import_plugin(module)
        loaded.append(module)
    return loaded


def _import_plugin(module: str) -> None:
    path = Path(module)
    try:
        if module.endswith(".py"):
            if not path.is_file():
                raise UserError(f"--plugin {module}: file not found; pass a .py file or an importable module name")
            spec = importlib.util.spec_from_file_location(f"kvdiag_plugin_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
        else:
            if os.getcwd() not in sys.path:  # console scripts do not put the working directory on sys.path
                sys.path.append(os.getcwd())
            importlib.import_module(module)
    except ImportError as err:
        raise UserError(f"--plugin {module}: cannot import it ({err}); pass a module on PYTHONPATH or a .py file") from err


def resolve_scorers(names: str | Iterable[str] = "all", params: dict[str, dict] | None = None, plugins: Iterable[str] = ()) -> dict[str, Scorer]:
    """Instances of the named scorers (``"all"``, ``"a,b"`` or a list) with ``params[name]`` applied."""
    load_plugins(plugins)
    if isinstance(names, str):  # "all": built-ins and plugins; kvpress presses are named (or kvpress:all)
        names = ([n for n in scorer_names() if not n.startswith("kvpress:") and SCORERS[n].in_all] if names.strip() == "all"
                 else [n.strip() for n in names.split(",") if n.strip()])
    if "kvpress:all" in names:
        from kvdiag.scorers.kvpress_press import expand

        names = expand(list(names))
    names = list(dict.fromkeys(names))
    if not names:
        raise UserError(f"--scorers is empty: use all or some of {', '.join(SCORERS)}")
    params = params or {}
    for name in list(names) + list(params):
        ensure_registered(name)
        if name not in SCORERS:
            raise UserError(f"unknown scorer {name!r}: use one of {', '.join(SCORERS)} (or load yours with --plugin)")
    stray = [n for n in params if n not in names]
    if stray:
        raise UserError(f"--param {stray[0]}.…: scorer {stray[0]} is not in --scorers; add it or drop the parameter")
    return {name: get_scorer(name, **params.get(name, {})) for name in names}


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise UserError(f"--aggregation {aggregation!r} is unknown: use one of {', '.join(AGGREGATIONS)}")


def checkpoint_keys(trace, checkpoints: str | Iterable[int] | dict[str, Iterable[int]] = "default",
                    granularity: Iterable[str] = ("token",)) -> pl.DataFrame:
    """Key rows for every cached entry ``i < t`` at the chosen checkpoints of every prompt.

    ``checkpoints``: ``"default"`` (:func:`default_checkpoints`), positions applied to every prompt, or a dict
    prompt_id -> positions. ``granularity``: any of token, layer (one row per layer), head (per layer and KV head).
    """
    granularity = list(granularity)
    for g in granularity:
        if g not in GRANULARITIES:
            raise UserError(f"--granularity {g!r} is unknown: use token, layer and/or head")
    frames = []
    for pid in trace.prompt_ids:
        if checkpoints == "default":
            cps = default_checkpoints(trace.prompt_len(pid), trace.length(pid))
        elif isinstance(checkpoints, dict):
            cps = list(checkpoints.get(pid, []))
        else:
            cps = list(checkpoints)
        for t in sorted(set(cps)):
            check_checkpoint(trace, pid, t)
            pos = np.arange(t)
            units = []
            if "token" in granularity:
                units.append(("token", -1, -1))
            if "layer" in granularity:
                units += [("layer", layer, -1) for layer in range(trace.num_layers)]
            if "head" in granularity:
                units += [("head", layer, h) for layer in range(trace.num_layers) for h in range(trace.num_kv_heads)]
            for gran, layer, head in units:
                frames.append(pl.DataFrame({
                    "prompt_id": [pid] * t, "checkpoint": np.full(t, t), "position": pos,
                    "granularity": [gran] * t, "layer": np.full(t, layer), "kv_head": np.full(t, head),
                }, schema=KEY_SCHEMA))
    if not frames:
        raise UserError("no checkpoints to score: the Trace's prompts are too short for the default schedule; pass --checkpoints")
    return pl.concat(frames)


def score_trace(
    trace,
    keys: pl.DataFrame | None = None,
    checkpoints: str | Iterable[int] | dict[str, Iterable[int]] | None = None,
    scorers: str | Iterable[str] = "all",
    params: dict[str, dict] | None = None,
    plugins: Iterable[str] = (),
    aggregation: str = "mean_rank",
    granularity: Iterable[str] = ("token",),
    o_proj: dict[int, torch.Tensor] | None = None,
    progress: bool = False,
    timings: dict[str, float] | None = None,
    token_features: TokenFeatures | None = None,
) -> tuple[pl.DataFrame, dict]:
    """Score candidates of a Trace with every selected scorer.

    Parameters
    ----------
    trace : a :class:`kvdiag.trace.Trace` (or an object with the same reader API).
    keys : rows with the key columns (prompt_id, checkpoint, position, granularity, layer, kv_head), e.g. a
        labels table; or None with ``checkpoints`` (:func:`checkpoint_keys`, every entry ``< t``).
    scorers, params, plugins : see :func:`resolve_scorers`; params maps scorer -> {field: value}.
    aggregation : how token/layer rows combine per-(layer, KV head) scores (``AGGREGATIONS``).
    o_proj : layer -> the model's o_proj weight [hidden, H*d], for the ``wo_l2`` payload.
    timings : if given, seconds spent per scorer are added to it (shared features are charged to the first
        scorer that needs them at each checkpoint).
    token_features : if given, the read pressure and value payload of every token row are added to it
        (``kvdiag.token_features``: what the figures read), from the same layer tensors.

    Returns the keys with one Float64 column per scorer (rows in the keys' order) and the metadata dict.
    """
    check_aggregation(aggregation)
    # a dict of instances is taken as is (kvdiag fit scores unregistered feature extractors this way)
    selected = scorers if isinstance(scorers, dict) else resolve_scorers(scorers, params, plugins)
    if keys is None:
        keys = checkpoint_keys(trace, checkpoints or "default", granularity)
    keys = check_keys(trace, keys)
    keys = keys.with_row_index("_row")
    out = {name: np.full(keys.height, np.nan) for name in selected}
    prompts = keys["prompt_id"].unique(maintain_order=True).to_list()
    with progress_bar(progress) as bar:
        task = bar.add_task("score: prompt × layer", total=len(prompts) * trace.num_layers)
        for pid in prompts:
            _score_prompt(trace, pid, keys.filter(pl.col("prompt_id") == pid), selected, aggregation, o_proj, out,
                          timings, token_features, lambda: bar.advance(task))
    df = keys.drop("_row").with_columns(pl.Series(name, values, dtype=pl.Float64) for name, values in out.items())
    meta = {
        "kind": "scores",
        "trace": trace.provenance if hasattr(trace, "provenance") else {"fingerprint": trace.fingerprint},
        "scorers": {name: s.params for name, s in selected.items()},
        "scorer_classes": {name: f"{type(s).__module__}.{type(s).__qualname__}" for name, s in selected.items()},
        "aggregation": aggregation,
        "aggregation_doc": AGGREGATIONS[aggregation],
        "keep_score": KEEP_SCORE,
        **provenance(),
    }
    return df, meta


def parse_checkpoints(text: str) -> str | list[int]:
    """``default`` or comma-separated positive integers."""
    if text.strip() == "default":
        return "default"
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"--checkpoints {text!r}: use 'default' or comma-separated positions, e.g. 256,384") from None
    if not values:
        raise UserError("--checkpoints is empty: use 'default' or comma-separated positions, e.g. 256,384")
    return values


def load_o_proj(spec: str, trace) -> dict[int, torch.Tensor]:
    """layer -> o_proj weight of the model ``spec``, refused unless it is the Trace's model (same weights hash)."""
    from kvdiag.models import load_model

    lm = load_model(spec, dtype=trace.manifest["model"].get("dtype", "float32"))
    lm.check_model_of(trace.manifest["model"], "--model", f"pass {trace.manifest['model']['spec']}")
    return o_proj_weights(lm.model)


def score_files(trace: str | os.PathLike, out: str | os.PathLike, labels: str | os.PathLike | None = None,
                checkpoints: str | None = None, granularity: str | None = None, scorers: str = "all",
                params: dict[str, dict] | None = None, plugins: Iterable[str] = (), aggregation: str = "mean_rank",
                model: str | None = None, progress: bool = True) -> tuple[pl.DataFrame, dict]:
    """What ``kvdiag score`` runs: score the candidates of ``labels`` (a labels file), or every cached entry at
    ``checkpoints`` (``default`` or ``t1,t2,...``) in ``granularity`` (``token,layer,head``; default token), of the
    Trace directory ``trace``, and write ``out`` (and beside it the token rows' read pressure and value payload,
    ``kvdiag.token_features.features_path(out)``, which the figures read). ``model``: the Trace's model, read only for the ``wo_l2``
    payload. Every input is checked before the work (and the model load) starts. Returns the table and its metadata."""
    from kvdiag.trace import Trace

    if (labels is None) == (checkpoints is None):
        raise UserError("pass exactly one of --labels labels.parquet or --checkpoints default|t1,t2,...")
    if labels is not None and granularity is not None:
        raise UserError("--granularity does not apply with --labels (its rows are scored at their own granularity); drop it")
    check_writable(out, "--out")
    check_aggregation(aggregation)
    selected = resolve_scorers(scorers, params, plugins)
    if model and not any(needs_o_proj(s) for s in selected.values()):
        raise UserError(f"--model {model} does not apply: no selected scorer reads the wo_l2 payload (‖W_O v‖₂); drop it")
    tr = Trace(trace)
    if labels is not None:
        keys, labels_meta = read_table(labels, what=f"--labels {labels}")
        tr.check_belongs(labels_meta, f"--labels {labels}")
        keys = check_keys(tr, keys, f"--labels {labels}")
    else:
        keys = checkpoint_keys(tr, parse_checkpoints(checkpoints), (granularity or "token").split(","))
    token_features = TokenFeatures()
    df, meta = score_trace(tr, keys=keys, scorers=scorers, params=params, aggregation=aggregation,  # plugins: loaded above
                           o_proj=load_o_proj(model, tr) if model else None, progress=progress, token_features=token_features)
    meta["source"] = {"labels": str(labels)} if labels is not None else {"checkpoints": checkpoints, "granularity": granularity or "token"}
    write_table(token_features.table(), features_path(out), token_features.meta(meta["trace"]))  # before the scores they serve
    write_table(df, out, meta)
    return df, meta


def _score_prompt(trace, pid, keys, selected, aggregation, o_proj, out, timings, token_features, advance) -> None:
    """Fill ``out[name][rows]`` for the key rows of one prompt."""
    groups: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for (t, gran, layer, head), grp in keys.group_by(["checkpoint", "granularity", "layer", "kv_head"]):
        groups[(t, gran, layer, head)] = (grp["position"].to_numpy(), grp["_row"].to_numpy())
    token_t = sorted(t for (t, gran, _, _) in groups if gran == "token")
    token_sum = {name: {t: np.zeros(len(groups[(t, "token", -1, -1)][0])) for t in token_t} for name in selected}
    by_layer = defaultdict(list)  # layer -> [(t, head or -1 for the layer row, positions, rows)]
    for (t, gran, layer, head), (pos, rows) in groups.items():
        if gran != "token":
            by_layer[layer].append((t, head, pos, rows))
    P, ids = trace.prompt_len(pid), trace.token_ids(pid)
    L = trace.num_layers
    sums = (PromptSums(token_features.params, pid, {t: torch.tensor(groups[(t, "token", -1, -1)][0]) for t in token_t}, L)
            if token_features is not None and token_t else None)
    for layer in range(L):
        scale = trace.layer_attention(layer)  # the layer's attention semantics (window, softcap, sinks)
        cps = sorted(set(token_t) | {t for t, *_ in by_layer[layer]})
        if not cps:
            advance()
            continue
        qkv = trace.layer(pid, layer)
        q, k, v = qkv.q.float(), qkv.k.float(), qkv.v.float()
        del qkv
        history = AttentionHistory(q, k, scale)
        if sums is not None:
            sums.add_layer(q, k, v, scale)
        for t in cps:
            ctx = ScoreContext(q[:, :t], k[:, :t], v[:, :t], scale, P, layer, pid, ids[:t],
                               o_proj=o_proj.get(layer) if o_proj else None, history=history, trace=trace)
            for name, scorer in selected.items():
                start = time.perf_counter()
                scores = scorer.scores(ctx)
                _check_scores(name, scores, ctx)
                values = aggregation_values(scores, aggregation).numpy()
                if t in token_sum[name]:
                    token_sum[name][t] += values[:, groups[(t, "token", -1, -1)][0]].sum(axis=0)
                for tt, head, pos, rows in by_layer[layer]:
                    if tt == t:
                        out[name][rows] = values[:, pos].mean(axis=0) if head < 0 else values[head, pos]
                if timings is not None:
                    timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
        del q, k, v, history
        advance()
    for name in selected:
        for t in token_t:
            out[name][groups[(t, "token", -1, -1)][1]] = token_sum[name][t] / (L * trace.num_kv_heads)
    if sums is not None:
        token_features.add(sums)


def _check_scores(name: str, scores: torch.Tensor, ctx: ScoreContext) -> None:
    expected = (ctx.num_kv_heads, ctx.t)
    if tuple(scores.shape) != expected:
        raise UserError(f"scorer {name} returned shape {tuple(scores.shape)}, expected [Hkv, t] = {list(expected)}; fix its scores()")
    if not bool(torch.isfinite(scores).all()):
        raise UserError(f"scorer {name} returned non-finite scores at layer {ctx.layer}, checkpoint {ctx.t}; fix its scores()")

"""``score_trace``: every selected scorer on the labeled (or chosen) candidates of a Trace; ``score_files``:
the same from files to a scores.parquet (what ``kvdiag score`` runs).

Loop order: prompt → layer → checkpoint (increasing) → scorer. A layer's q/k/v are read once, the features
shared across checkpoints (cumulative attention, recurrence state, sparsity) stream forward once per layer,
and the features shared by scorers (window attention, payload, redundancy) are computed once per checkpoint.
Each scorer sees the whole cache ``[0, t)``, so candidate-normalized features never depend on which
candidates were sampled for labeling.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterable

import numpy as np
import polars as pl
import torch

from kvdiag.core.contracts import read_keys
from kvdiag.core.errors import UserError
from kvdiag.core.guard import check_outputs
from kvdiag.core.io import write_table
from kvdiag.core.parsing import parse_checkpoints, parse_list
from kvdiag.core.progress import progress_bar
from kvdiag.core.provenance import provenance
from kvdiag.core.schema import (
    GRANULARITIES,
    KEY_SCHEMA,
    KEYS,
    check_checkpoint,
    check_keys,
    default_checkpoints,
)
from kvdiag.scorers.base import needs_o_proj
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.features import AttentionHistory, o_proj_weights
from kvdiag.scorers.fields import MODEL_UNUSED
from kvdiag.scorers.normalization import AGGREGATIONS, aggregation_values
from kvdiag.scorers.registry import resolve_scorers
from kvdiag.scorers.token_features import PromptSums, TokenFeatures, features_path

KEY_COLUMNS = KEYS  # the key columns under their name in kvdiag.scorers
KEEP_SCORE = "protected entries score max + 1 + |max| of their row's other scores"


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise UserError(f"--aggregation {aggregation!r} is unknown: use one of {', '.join(AGGREGATIONS)}")


def checkpoint_keys(trace, checkpoints: str | int | Iterable[int] | dict[str, Iterable[int]] = "default",
                    granularity: Iterable[str] = ("token",)) -> pl.DataFrame:
    """Key rows for every cached entry ``i < t`` at the chosen checkpoints of every prompt.

    ``checkpoints``: a spec of the checkpoint grammar (``kvdiag.core.parsing.parse_checkpoints``: ``every:K``,
    ``default``, ``t1,t2,...``), an interval K (:func:`default_checkpoints` every K generated tokens), positions
    applied to every prompt, or a dict prompt_id -> positions. ``granularity``: any of token, layer (one row per
    layer), head (per layer and KV head).
    """
    if isinstance(checkpoints, str):
        checkpoints = parse_checkpoints(checkpoints)
    granularity = list(granularity)
    for g in granularity:
        if g not in GRANULARITIES:
            raise UserError(f"--granularity {g!r} is unknown: use token, layer and/or head")
    frames = []
    for pid in trace.prompt_ids:
        if isinstance(checkpoints, int):
            cps = default_checkpoints(trace.prompt_len(pid), trace.length(pid), checkpoints)
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
        raise UserError("no checkpoints to score: the Trace's prompts are too short for the default schedule; pass "
                        "--checkpoints")
    return pl.concat(frames)


def score_trace(
    trace, keys: pl.DataFrame | None = None,
    checkpoints: str | int | Iterable[int] | dict[str, Iterable[int]] | None = None,
    scorers: str | Iterable[str] = "all", params: dict[str, dict] | None = None, plugins: Iterable[str] = (),
    aggregation: str = "mean_rank", granularity: Iterable[str] = ("token",),
    o_proj: dict[int, torch.Tensor] | None = None, progress: bool = False, timings: dict[str, float] | None = None,
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
        (``kvdiag.scorers.token_features``: what the figures read), from the same layer tensors.

    Returns the keys with one Float64 column per scorer (rows in the keys' order) and the metadata dict.
    """
    check_aggregation(aggregation)
    # a dict of instances is taken as is (kvdiag fit scores unregistered feature extractors this way)
    selected = scorers if isinstance(scorers, dict) else resolve_scorers(scorers, params, plugins)
    if keys is None:
        keys = checkpoint_keys(trace, checkpoints or "default", granularity)
    keys = check_keys(trace, keys)
    keys = keys.with_row_index("_row")
    for scorer in selected.values():
        scorer.check_trace(trace)
    out = {name: np.full(keys.height, np.nan) for name in selected}
    shared: dict = {}  # what the scorers of this run share across contexts (kvpress: the Trace's model run)
    prompts = keys["prompt_id"].unique(maintain_order=True).to_list()
    with progress_bar(progress) as bar:
        task = bar.add_task("score: prompt × layer", total=len(prompts) * trace.num_layers)
        for pid in prompts:
            _score_prompt(trace, pid, keys.filter(pl.col("prompt_id") == pid), selected, aggregation, o_proj, out,
                          timings, token_features, shared, lambda: bar.advance(task))
    df = keys.drop("_row").with_columns(pl.Series(name, values, dtype=pl.Float64) for name, values in out.items())
    meta = {
        "kind": "scores",
        "trace": trace.provenance if hasattr(trace, "provenance") else {"fingerprint": trace.fingerprint},
        "scorers": {name: s.params for name, s in selected.items()},
        "scorer_classes": {name: f"{type(s).__module__}.{type(s).__qualname__}" for name, s in selected.items()},
        "aggregation": aggregation, "aggregation_doc": AGGREGATIONS[aggregation], "keep_score": KEEP_SCORE,
        **provenance(),
    }
    return df, meta


def load_o_proj(spec: str, trace) -> dict[int, torch.Tensor]:
    """layer -> o_proj weight of the model ``spec``, refused unless it is the Trace's model (same weights hash)."""
    from kvdiag.model.load import load_model

    lm = load_model(spec, dtype=trace.manifest["model"].get("dtype", "float32"))
    lm.check_model_of(trace.manifest["model"], "--model", f"pass {trace.manifest['model']['spec']}")
    return o_proj_weights(lm.model)


def score_files(trace: str | os.PathLike, out: str | os.PathLike, labels: str | os.PathLike | None = None,
                checkpoints: str | None = None, granularity: str | None = None, scorers: str = "all",
                params: dict[str, dict] | None = None, plugins: Iterable[str] = (), aggregation: str = "mean_rank",
                model: str | None = None, progress: bool = True, overwrite: bool = False
                ) -> tuple[pl.DataFrame, dict]:
    """What ``kvdiag score`` runs: score the candidates of ``labels`` (a labels file), or every cached entry at
    ``checkpoints`` (``every:K``, ``default`` or ``t1,t2,...``) in ``granularity`` (``token,layer,head``; default
    token), of the Trace directory ``trace``, and write ``out`` (and beside it the token rows' read pressure and value
    payload, ``kvdiag.scorers.token_features.features_path(out)``, which the figures read). ``model``: the Trace's
    model, read
    only for the ``wo_l2`` payload. Every input is checked before the work (and the model load) starts. Returns the
    table and its metadata."""
    from kvdiag.trace import Trace

    if (labels is None) == (checkpoints is None):
        raise UserError("pass exactly one of --labels labels.parquet or --checkpoints every:K|default|t1,t2,...")
    if labels is not None and granularity is not None:
        raise UserError("--granularity does not apply with --labels (its rows are scored at their own granularity); "
                        "drop it")
    check_outputs({"--out": (out, "file", "scores"),
                   "--out (its features)": (features_path(out), "file", "token_features")},
                  {"--trace": trace, "--labels": labels, "--plugin": [p for p in plugins if str(p).endswith(".py")]},
                  overwrite=overwrite)
    check_aggregation(aggregation)
    selected = resolve_scorers(scorers, params, plugins)
    if model and not any(needs_o_proj(s) for s in selected.values()):
        raise UserError(MODEL_UNUSED.format(model=model))
    tr = Trace(trace)
    if labels is not None:
        keys = read_keys(tr, labels)  # its contract, its Trace, its keys
    else:
        grans = parse_list(granularity or "token", "--granularity", str, choices=GRANULARITIES)
        keys = checkpoint_keys(tr, parse_checkpoints(checkpoints), grans)
    token_features = TokenFeatures()
    df, meta = score_trace(
        tr,
        keys=keys,
        scorers=scorers,
        params=params,
        aggregation=aggregation,  # plugins: loaded above
        o_proj=load_o_proj(model, tr) if model else None,
        progress=progress,
        token_features=token_features,
    )
    meta["source"] = (
        {"labels": str(labels)}
        if labels is not None
        else {"checkpoints": checkpoints, "granularity": granularity or "token"}
    )
    write_table(
        token_features.table(), features_path(out), token_features.meta(meta["trace"])
    )  # before the scores they serve
    write_table(df, out, meta)
    return df, meta


def _score_prompt(trace, pid, keys, selected, aggregation, o_proj, out, timings, token_features, shared,
                  advance) -> None:
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
    sums = (
        PromptSums(token_features.params, pid, {t: torch.tensor(groups[(t, "token", -1, -1)][0]) for t in token_t}, L)
        if token_features is not None and token_t
        else None
    )
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
                               o_proj=o_proj.get(layer) if o_proj else None, history=history, trace=trace,
                               shared=shared)
            for name, scorer in selected.items():
                start = time.perf_counter()
                scores = scorer.scores(ctx)  # checked and protected by the Scorer base
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

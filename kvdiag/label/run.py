"""``label_trace``: work items (prompt, checkpoint) -> atomic Parquet parts -> one labels table.

Each item is written as ``<out>.parts/<prompt_id>__<checkpoint>.parquet`` atomically (``kvdiag.core.parts``); a rerun
skips items whose part exists, so an interrupted run loses no finished work; the merge makes the
output table. Items can be split over processes (``shard=(i, n)``, or torchrun ranks).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import polars as pl

from kvdiag.core.contracts import (
    LABEL_SCHEMA,
    read_labels,  # noqa: F401  (run's API)
)
from kvdiag.core.distributed import Group, parse_shard
from kvdiag.core.errors import UserError
from kvdiag.core.io import check_writable, write_table
from kvdiag.core.parts import PartStore, check_stamp, part_name
from kvdiag.core.progress import plain_console, progress_bar
from kvdiag.core.provenance import provenance
from kvdiag.label.config import (  # noqa: F401  (run's API)
    HYBRID,
    LabelConfig,
    candidate_positions,
    check_horizon_fits,
    work_items,
)
from kvdiag.label.engine import OracleEngine, Row, candidate_rows
from kvdiag.label.fast import APPROXIMATE
from kvdiag.label.hybrid import HybridLabeler, HybridParams, miss_rate
from kvdiag.model.load import LoadedModel, check_device, load_model, parse_dtype
from kvdiag.trace import Trace


def checkpoint_part(pid: str, t: int) -> str:
    """The part of the work item (``pid``, checkpoint ``t``): ``<pid>__<t, 7 digits>.parquet``."""
    return part_name(pid, f"{t:07d}")


def part_path(parts: Path, pid: str, t: int) -> Path:
    """Where the part of the work item (``pid``, ``t``) lies in the parts directory ``parts``."""
    return parts / checkpoint_part(pid, t)


def make_engine(lm: LoadedModel, token_ids, cfg: LabelConfig):
    """The labeler of one prompt: the oracle engine (exact), the hybrid labeler, or the approximate method's."""
    if cfg.method == "exact":
        return OracleEngine(lm, token_ids, cfg.horizon, cfg.batch_size, cfg.backend, chunk=cfg.chunk)
    if cfg.method == HYBRID:
        return HybridLabeler(lm, token_ids, cfg.horizon, HybridParams(**cfg.params), cfg.seed, cfg.batch_size,
                             cfg.backend, cfg.chunk)
    labeler, params = APPROXIMATE[cfg.method]
    return labeler(lm, token_ids, cfg.horizon, params(**cfg.params), cfg.seed, chunk=cfg.chunk)


def label_item(engine, trace: Trace, pid: str, t: int, cfg: LabelConfig, token_ids, progress=None,
               audit: int | None = None) -> pl.DataFrame:
    """Label one checkpoint; returns its rows in ``LABEL_SCHEMA`` (hybrid: ``audit`` rows audited, default its
    setting's)."""
    positions = candidate_positions(pid, t, cfg)
    rows = candidate_rows(positions, cfg.granularity, engine.num_layers, engine.num_kv_heads, cfg.layers)
    if isinstance(engine, HybridLabeler):
        return _hybrid_item(engine, pid, t, cfg, rows, token_ids, progress, audit)
    if not isinstance(engine, OracleEngine):
        return _approximate_item(engine, pid, t, cfg, rows, token_ids, progress)
    res, noise = engine.label(t, rows, progress=progress)
    kl = res["kl"].double()
    return pl.DataFrame({
        "prompt_id": [pid] * len(rows), "checkpoint": [t] * len(rows), "position": [r.position for r in rows],
        "granularity": [cfg.granularity] * len(rows), "layer": [r.layer for r in rows],
        "kv_head": [r.kv_head for r in rows], "horizon": [engine.steps(t)] * len(rows), "kl_mean": kl.mean(1).tolist(),
        "kl_max": kl.amax(1).tolist(), "kl_steps": kl.tolist(), "js_mean": res["js"].double().mean(1).tolist(),
        "nll_delta": res["nll_delta"].double().mean(1).tolist(), "top1_flips": res["flips"].tolist(),
        "noise_floor": [noise] * len(rows), "age": [t - r.position for r in rows],
        "token_id": [int(token_ids[r.position]) for r in rows],
    }, schema=LABEL_SCHEMA)


def _approximate_item(labeler, pid: str, t: int, cfg: LabelConfig, rows, token_ids, progress=None) -> pl.DataFrame:
    """An approximate method's rows: kl_mean and nll_delta estimated; what it cannot give is null
    (kl_max, kl_steps, js_mean, top1_flips); noise_floor 0 (docs/labels.md)."""
    res = labeler.label(t, rows)
    if progress is not None:
        progress(len(rows))
    n = len(rows)
    return pl.DataFrame({
        "prompt_id": [pid] * n, "checkpoint": [t] * n, "position": [r.position for r in rows],
        "granularity": [cfg.granularity] * n, "layer": [r.layer for r in rows], "kv_head": [r.kv_head for r in rows],
        "horizon": [labeler.steps(t)] * n, "kl_mean": res["kl"].tolist(), "kl_max": None, "kl_steps": None,
        "js_mean": None, "nll_delta": res["nll_delta"].tolist(), "top1_flips": None, "noise_floor": [0.0] * n,
        "age": [t - r.position for r in rows], "token_id": [int(token_ids[r.position]) for r in rows],
    }, schema=LABEL_SCHEMA)


def _hybrid_item(labeler, pid: str, t: int, cfg: LabelConfig, rows, token_ids, progress=None,
                 audit: int | None = None) -> pl.DataFrame:
    """Hybrid rows: the exact label where ``method`` is exact-top or exact-audit, the Fisher estimate (kl_mean,
    nll_delta; the rest null) where it is fast; every row the checkpoint's measured noise floor and its Fisher
    estimate (``fast_kl_mean``)."""
    res = labeler.label(t, rows, progress, audit)
    n = len(rows)
    return pl.DataFrame({
        "prompt_id": [pid] * n, "checkpoint": [t] * n, "position": [r.position for r in rows],
        "granularity": [cfg.granularity] * n, "layer": [r.layer for r in rows], "kv_head": [r.kv_head for r in rows],
        "horizon": [labeler.steps(t)] * n, "kl_mean": res["kl"], "kl_max": res["kl_max"], "kl_steps": res["kl_steps"],
        "js_mean": res["js_mean"], "nll_delta": res["nll_delta"], "top1_flips": res["top1_flips"],
        "noise_floor": [res["noise"]] * n, "age": [t - r.position for r in rows],
        "token_id": [int(token_ids[r.position]) for r in rows], "method": res["method"], "fast_kl_mean": res["fast_kl"],
    }, schema={**LABEL_SCHEMA, "method": pl.String, "fast_kl_mean": pl.Float64})


def labels_meta(trace: Trace, lm: LoadedModel, cfg: LabelConfig) -> dict:
    label = ("KL(P_full || P_evict) per step (kl_steps), fp32, full vocabulary; kl_mean = mean over the row's horizon "
             "(the column horizon: N, or to the end of the prompt with --horizon rest)")
    if cfg.method == HYBRID:
        label = (f"hybrid ({cfg.params}, seed {cfg.seed}): the column method says which rows are exact (exact-top: "
                 "the M largest Fisher labels; exact-audit: a seeded uniform sample of the rest) and which are the "
                 "Fisher estimate (fast: kl_mean and nll_delta, the rest null); every row the checkpoint's noise floor "
                 "(docs/labels.md)")
    elif cfg.method != "exact":
        label = (f"approximate ({cfg.method}, settings {cfg.params}, seed {cfg.seed}): kl_mean and nll_delta estimate "
                 "the exact label's; kl_max, kl_steps, js_mean, top1_flips are null; noise_floor 0 (docs/labels.md)")
    return {"kind": "labels", **provenance(), "trace": trace.provenance, "model": lm.info,
            "config": asdict(cfg), "label": label}


def check_model(trace: Trace, lm: LoadedModel, force: bool) -> None:
    had = trace.manifest["model"]
    if not (force or lm.is_model_of(had, config=True)):
        if lm.spec == had["spec"]:  # the Trace's own model (no --model): its weights changed, or the manifest did
            raise UserError(f"--trace {trace.path}: its model {lm.spec} loads with weights {lm.weights_hash}, the "
                            f"Trace records {had['weights_hash']}: the model's files changed since it was traced, or "
                            "manifest.json was edited; trace again, or pass --model with the traced weights")
        raise UserError(f"--model {lm.spec} is not the model of the Trace ({had['spec']}, weights "
                        f"{had['weights_hash']}); drop --model or pass --force")
    trace.check_vocabulary(lm)


def label_trace(
    trace: Trace, lm: LoadedModel, out: str | os.PathLike, cfg: LabelConfig, *, shard: tuple[int, int] = (0, 1),
    merge: bool = True, show_progress: bool = True, force_model: bool = False,
) -> Path:
    """Label every work item of ``shard`` (items i with i % n == shard index), writing parts; merge at the end."""
    check_model(trace, lm, force_model)
    out = Path(out)
    parts = PartStore(out.with_name(out.name + ".parts"), out)
    meta = labels_meta(trace, lm, cfg)
    items = work_items(trace, cfg)
    _stamp_parts(parts, trace, lm, cfg)
    hybrid = HybridParams(**cfg.params) if cfg.method == HYBRID else None
    target = None if hybrid is None else hybrid.miss_target
    if target is not None and shard[1] > 1:
        raise UserError("--miss-rate bounds the miss rate over the whole run: label it in one process, not sharded")
    audits = {} if target is None else dict(zip(items, hybrid.check_audit(
        [len(candidate_positions(pid, t, cfg)) for pid, t in items]), strict=True))
    mine = [it for i, it in enumerate(items) if i % shard[1] == shard[0]]
    todo = [it for it in mine if not parts.done(checkpoint_part(*it))]
    n_rows = len(candidate_rows([0], cfg.granularity, trace.num_layers, trace.num_kv_heads, cfg.layers))
    with progress_bar(show_progress, remaining=True) as progress:
        item_task = progress.add_task("label: checkpoints", total=len(mine), completed=len(mine) - len(todo))
        cand_task = progress.add_task("  candidate rows", total=None)
        schedule: dict[str, list[int]] = {}  # every checkpoint of each prompt, ascending
        for pid, t in items:
            schedule.setdefault(pid, []).append(t)
        by_prompt: dict[str, set[int]] = {}
        for pid, t in todo:
            by_prompt.setdefault(pid, set()).add(t)
        for pid, ts in by_prompt.items():
            ids = trace.token_ids(pid)
            engine = make_engine(lm, ids, cfg)
            for t in (c for c in schedule[pid] if c <= max(ts)):  # ascending: the engine extends one prefix cache
                if t not in ts:
                    # extend the cache in the same steps as a run that labels every checkpoint: the prefix's
                    # float rounding, hence every label, is then the same whatever the split or the resume
                    engine.golden(t)
                    continue
                progress.reset(cand_task, total=len(candidate_positions(pid, t, cfg)) * n_rows,
                               description=f"  {pid} @ {t}")
                df = label_item(engine, trace, pid, t, cfg, ids, progress=lambda k: progress.advance(cand_task, k),
                                audit=audits.get((pid, t)))
                parts.write(checkpoint_part(pid, t), df, meta)
                progress.advance(item_task)
    control = None if target is None or not merge else miss_rate_rounds(trace, lm, parts, items, cfg, meta)
    if merge:
        if control is not None:
            meta = {**meta, "miss_rate_control": control.as_dict()}
        merged = parts.merge(
            [checkpoint_part(*it) for it in items], out, meta,
            sort=["prompt_id", "checkpoint", "position", "layer", "kv_head"], schema=LABEL_SCHEMA,
        )
        if cfg.method == HYBRID and cfg.miss_rate:  # the audit's estimate, into the metadata
            write_table(merged, out, {**meta, "miss_rate": miss_rate(merged, seed=cfg.seed)})
        warning = noise_floor_warning(pl.read_parquet(out, columns=["kl_mean", "noise_floor"], glob=False), lm.dtype)
        if warning:
            plain_console(stderr=True, soft_wrap=True).print(f"warning: {warning}")
    return out


def miss_rate_rounds(trace: Trace, lm: LoadedModel, parts: PartStore, items: list[tuple[str, int]], cfg: LabelConfig,
                     meta: dict):
    """``--miss-rate R`` (``kvdiag.label.adaptive``): the rounds after every checkpoint has its round 0 (its part),
    each labeling the next rows down the Fisher ranking exactly (one oracle engine per prompt, its checkpoints in
    order) and rewriting the parts, until the bound is below R. A rerun recomputes the rounds from the parts (the
    rows already exact are not labeled again). Returns the ``adaptive.Control``."""
    import numpy as np

    from kvdiag.label import adaptive

    hybrid = HybridParams(**cfg.params)
    frames = [pl.read_parquet(parts.path(checkpoint_part(*it)), glob=False).sort("position") for it in items]
    ckpts = [adaptive.Checkpoint(
        fast=df["fast_kl_mean"].to_numpy().astype(float),
        exact=np.where(df["method"].to_numpy() != "fast", df["kl_mean"].to_numpy(), np.nan),
        top=(df["method"] == "exact-top").to_numpy().copy(), audit=(df["method"] == "exact-audit").to_numpy().copy(),
    ) for df in frames]

    def label(asks: list[tuple[int, np.ndarray]]) -> list[np.ndarray]:
        by_prompt: dict[str, list[tuple[int, np.ndarray]]] = {}
        for i, rows in asks:
            by_prompt.setdefault(items[i][0], []).append((i, rows))
        values: dict[int, np.ndarray] = {}
        for pid, group in by_prompt.items():
            ids = trace.token_ids(pid)
            engine = OracleEngine(lm, ids, cfg.horizon, cfg.batch_size, cfg.backend, chunk=cfg.chunk)
            for i, rows in sorted(group, key=lambda g: items[g[0]][1]):  # ascending: the engine extends its cache
                t, df = items[i][1], frames[i]
                res, _ = engine.label(t, [Row(int(p)) for p in df["position"].to_numpy()[rows]])
                kl = res["kl"].double()
                values[i] = kl.mean(1).numpy()
                update = pl.DataFrame({
                    "position": df["position"].to_numpy()[rows], "kl_mean": values[i],
                    "kl_max": kl.amax(1).numpy(), "kl_steps": kl.tolist(),
                    "js_mean": res["js"].double().mean(1).numpy(),
                    "nll_delta": res["nll_delta"].double().mean(1).numpy(),
                    "top1_flips": res["flips"].numpy().astype(np.int64), "method": ["exact-top"] * len(rows),
                })
                frames[i] = df = df.update(update.cast({k: df.schema[k] for k in update.columns}), on="position")
                parts.write(checkpoint_part(*items[i]), df, meta)
        return [values[i] for i, _ in asks]

    def mark_top(i: int, rows: np.ndarray) -> None:  # audited rows the exact top reaches are exact already
        df = frames[i]
        top = np.zeros(df.height, bool)
        top[rows] = True
        frames[i] = df.with_columns(method=pl.when(pl.Series(top)).then(pl.lit("exact-top")).otherwise("method"))

    ctl = adaptive.control(ckpts, hybrid.miss_target, hybrid.exact_frac, label)
    for i, c in enumerate(ckpts):  # the parts say which rows ended in the exact top
        if (frames[i]["method"] == "exact-top").sum() != c.top.sum():
            mark_top(i, np.flatnonzero(c.top))
            parts.write(checkpoint_part(*items[i]), frames[i], meta)
    return ctl


# warn when the median label is within this factor of the median noise floor: measured on SmolLM2 (docs/labels.md,
# "bf16"), bf16 noise adds about one floor to every label, so a floor above the fp32 median label shows up as bf16
# labels of ~1.5 floors
NOISE_WARN_RATIO = 2.0


def noise_floor_warning(df: pl.DataFrame, dtype: str) -> str | None:
    """One line when the median label is at most ``NOISE_WARN_RATIO`` x the median noise floor (the null row's KL):
    most labels are then numerical noise of the model's ``dtype`` (rank-eval treats labels at or below the floor as
    unresolved)."""
    floor, label = df["noise_floor"].median(), df["kl_mean"].median()
    if floor is None or label is None or not floor > 0 or label > NOISE_WARN_RATIO * floor:
        return None
    near = float((df["kl_mean"] <= NOISE_WARN_RATIO * df["noise_floor"]).mean())
    fix = ("label in float32 (--dtype float32) to resolve them" if dtype in ("float16", "bfloat16") else
           "these entries' single evictions are below what float32 resolves (rank-eval treats labels at or below "
           "their floor as unresolved)")
    return (f"the median label {label:.2e} nats is within {NOISE_WARN_RATIO:g}x the median noise floor {floor:.2e} "
            f"({near:.0%} of labels are): in {dtype} most labels are numerical noise; {fix}")


def label_stamp(fingerprint: str, weights_hash: str, cfg: LabelConfig) -> dict:
    """The parts' settings stamp: only what changes a part's content (the schedule, batch size and backend may
    differ between runs)."""
    config = asdict(cfg)
    return {"trace": fingerprint, "model": weights_hash,
            **{k: config[k] for k in ("horizon", "candidates", "include", "granularity", "layers", "seed", "method",
                                     "params")}}


def same_stamp(have: dict, want: dict) -> bool:
    """Whether the stamp on disk ``have`` is ``want`` (one written before approximate methods or include existed:
    exact, none)."""
    return {"method": "exact", "params": {}, "include": None, **have} == want


def _stamp_parts(parts: PartStore, trace: Trace, lm: LoadedModel, cfg: LabelConfig) -> None:
    """A parts directory made with other settings or another Trace must not be mixed in."""
    want = label_stamp(trace.fingerprint, lm.info["weights_hash"], cfg)
    parts.stamp("config.json", want, lambda have: None if same_stamp(have, want) else parts.refuse_mixing())


def label_files(
    trace_dir: Path, out: Path, cfg: LabelConfig, *, model: str | None, force: bool, dtype: str | None, device: str,
    shard: str | None, quiet: bool,
) -> Path | None:
    """``kvdiag label``: load the model and label a Trace in this process's share of the work (``shard``, or torchrun's
    rank); returns the merged output where this process merged. Bad input is refused before the model loads."""
    # every input is checked before the (slow) model load and before anything is written
    part = parse_shard(shard)
    tr = Trace(trace_dir)
    work_items(tr, cfg)
    check_writable(out, "--out")
    check_writable(out.with_name(out.name + ".parts"), "--out", "dir")
    parse_dtype(dtype or tr.manifest["model"]["dtype"])
    check_device(device)
    if not force:  # parts made with other settings: refused now, not after the load (the model is the Trace's)
        want = label_stamp(tr.fingerprint, tr.manifest["model"]["weights_hash"], cfg)
        check_stamp(out.with_name(out.name + ".parts"), "config.json", lambda have: same_stamp(have, want))
    with Group(device, part) as group:
        spec = model or tr.manifest["model"]["spec"]
        lm = load_model(spec, dtype=dtype or tr.manifest["model"]["dtype"], device=group.device)
        return group.split(lambda part, merge, show: label_trace(
            tr, lm, out, cfg, shard=part, merge=merge, force_model=force, show_progress=show and not quiet))

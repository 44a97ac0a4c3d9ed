"""``kvdiag label``: oracle labels (single-entry eviction KL) for a Trace's checkpoints."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli import common
from kvdiag.core import parsing
from kvdiag.core.errors import UserError
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console
from kvdiag.core.schema import CHECKPOINTS, CHUNK, HORIZON, W_OBS


def label(
    ctx: typer.Context,
    trace: Path = common.flag("--trace", ..., "Trace directory from `kvdiag trace`"),
    out: Path = common.flag("--out", ..., "labels.parquet (parts are kept beside it in OUT.parts/)"),
    checkpoints: list[str] = common.flag("--checkpoints", [CHECKPOINTS], "every:K (generated tokens) or "
        "absolute positions t1,t2,... (repeatable)"),
    horizon: str = common.flag("--horizon", HORIZON, "teacher-forced steps H, or rest: each label to the "
                                "end of its prompt (rows record their H; shorter horizons derive from kl_steps)"),
    chunk: int = common.flag("--chunk", CHUNK, "horizon steps per forward: memory is one chunk's logits"),
    candidates: str = common.flag("--candidates", "64", "N (seeded sample per checkpoint) or all"),
    include: Path = typer.Option(None, "--include", help="JSON {prompt_id: [positions]}: label these too at every "
                                 "checkpoint they precede, besides the sample (e.g. the tokens an answer needs)"),
    granularity: str = common.flag("--granularity", "token", "token | layer | head"),
    layers: list[str] | None = typer.Option(None, "--layers", help="layer/head granularity: comma-separated layers, "
                                                                   "repeatable (default all)"),
    w_obs: int = common.flag("--w-obs", W_OBS, "every:K starts once W_obs tokens are generated"),
    batch_size: int = common.flag("--batch-size", 64, "candidate rows per forward (at H <= --chunk; fewer at "
                                   "longer horizons, holding the memory of a batch)"),
    method: str = common.flag("--method", "exact", "exact (the oracle) | fast (the recommended approximate "
        "method, labels every entry in one pass) | fisher | hybrid (fast for every entry, exact for the top M and an "
        "audit sample; docs/labels.md)"),
    fisher_samples: int = common.flag("--fisher-samples", None, "fisher, hybrid: sampled "
                                       "continuations per horizon step (default 8; --samples is the deprecated name)"),
    exact_top: int = common.flag("--exact-top", None, "hybrid: the M entries per checkpoint with the largest "
                                  "fast labels get exact labels"),
    exact_frac: float = common.flag("--exact-frac", None, "hybrid: M as a share of the checkpoint's candidates"),
    audit: int = common.flag("--audit", None, "hybrid: a seeded uniform sample of N other entries labeled "
                              "exactly, to estimate the miss rate (default 32)"),
    miss_rate: float = common.flag("--miss-rate", None, "hybrid: label exactly down the fast ranking in rounds "
                                    "(from --exact-frac) until the audit's 95% upper bound on the top-decile miss "
                                    "rate is below R, e.g. 0.05 (docs/labels.md)"),
    no_miss_rate: bool = typer.Option(False, "--no-miss-rate", help="hybrid: no miss-rate estimate from the audit"),
    seed: int = common.Seed,
    model: str = common.flag("--model", None, "override the Trace's model (refused if different unless --force)"),
    force: bool = typer.Option(False, "--force", help="label with a model other than the Trace's"),
    dtype: str = common.flag("--dtype", None, "default: the Trace's model dtype"),
    device: str = common.Device,
    backend: str = common.flag("--backend", "auto", "kernel backend: auto | torch | triton"),
    shard: str = common.flag("--shard", None, "i/n: label only work items i, i+n, ... (Slurm arrays); merge "
                                                    "with a final run without --shard"),
    quiet: bool = common.Quiet,
    overwrite: bool = common.flag("--overwrite", False, "replace an existing --out that is not labels of this Trace"),
) -> None:
    """Evict single cache entries at checkpoints and measure the KL damage to the next H predictions."""
    from kvdiag.trace.manifest import TraceFiles

    ours = TraceFiles(trace).fingerprint if Path(out).is_file() and not overwrite else None  # what --out may hold
    check_outputs({"--out": (out, "file", "labels"), "--out (its parts)": (out.with_name(out.name + ".parts"), "dir")},
                  {"--trace": trace, "--include": include}, overwrite=overwrite, trace_fingerprint=ours)
    from kvdiag.label.config import LabelConfig, work_items  # light: the config, not the engine
    from kvdiag.model.specs import check_model_spec, check_trace_model

    if model is None:
        common.refuse_given(ctx, ["force"], "without --model (the Trace's own model is used)")
    if method != "hybrid":
        common.refuse_given(ctx, ["exact_top", "exact_frac", "audit", "miss_rate", "no_miss_rate"],
                            "without --method hybrid")
    given = {"samples": fisher_samples, "exact_top": exact_top, "exact_frac": exact_frac, "audit": audit,
             "miss_target": miss_rate}
    params = {k: v for k, v in given.items() if v is not None}
    if method == "hybrid" and no_miss_rate:  # the audit only estimates the miss rate: none without it
        if miss_rate is not None:
            raise UserError(f"--miss-rate {miss_rate} with --no-miss-rate: the target is bounded from the audit; "
                            "drop one of them")
        if audit:
            raise UserError(f"--audit {audit} with --no-miss-rate: the audit sample only estimates the miss rate; "
                            "drop --audit or --no-miss-rate")
        params["audit"] = 0
    if miss_rate is not None and shard is not None:
        raise UserError("--shard with --miss-rate: the rounds bound the miss rate over the whole run; label it in one "
                        "process")

    cfg = LabelConfig(
        checkpoints=parsing.joined(checkpoints), horizon=horizon, candidates=candidates,
        include=None if include is None else parsing.read_positions(include), granularity=granularity,
        layers=parsing.parse_ints(layers, "--layers"), w_obs=w_obs, batch_size=batch_size, seed=seed, backend=backend,
        chunk=chunk, method=method, params=params, miss_rate=not no_miss_rate,
    )
    parsing.parse_shard(shard)
    parsing.check_device_name(device)
    parsing.check_backend(backend, device)
    if dtype is not None:
        parsing.check_dtype(dtype)
    if model is not None:
        check_model_spec(model)
    trace_files = TraceFiles(trace)
    work_items(trace_files, cfg)  # the settings against the Trace's prompts and model shape
    if model is not None and not force:  # another model than the Trace's, told from names and configs before it loads
        check_trace_model(model, trace_files.manifest["model"], "drop --model or pass --force")
    if model is not None:  # --force too: the tokens must fit the model they are fed to
        trace_files.check_vocabulary_of(model)
    from kvdiag.label.run import label_files  # the engine: torch and the model, once the arguments are checked

    common.quiet_transformers()
    path = label_files(trace, out, cfg, model=model, force=force, dtype=dtype, device=device, shard=shard, quiet=quiet)
    if path is not None:
        plain_console().print(f"labels written to {path}")

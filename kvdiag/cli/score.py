"""``kvdiag score``: one column per scorer for the labeled (or chosen) candidates of a Trace."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli import common
from kvdiag.core.errors import UserError
from kvdiag.core.progress import plain_console
from kvdiag.core.run_layout import features_path


def score(
    trace: Path | None = common.flag("--trace", None, "Trace directory written by `kvdiag trace` (required "
                                                            "unless --list)."),
    out: Path | None = common.flag("--out", None, "Output scores.parquet (required unless --list)."),
    labels: Path | None = common.flag("--labels", None, "labels.parquet: score exactly its candidates (same "
                                                              "keys)."),
    checkpoints: list[str] | None = common.flag("--checkpoints", None, "Without --labels: every:K (every K generated "
                                                "tokens), 'default' (every:128) or positions t, e.g. 256,384 "
                                                "(repeatable); every entry < t is scored."),
    granularity: list[str] | None = common.flag("--granularity", None, "With --checkpoints: token (default), "
        "layer and/or head, comma-separated, repeatable."),
    scorers: list[str] = common.flag("--scorers", ["all"], "'all' or comma-separated scorer names, repeatable."),
    param: list[str] | None = common.flag("--param", None, "scorer.key=value, repeatable (e.g. "
                                                                 "rkv.mix_lambda=0.07)."),
    plugin: list[str] | None = common.flag("--plugin", None, "Module (or .py file) whose import registers "
                                                                   "scorers, repeatable."),
    aggregation: str = typer.Option("mean_rank", "--aggregation", help="How token/layer rows combine per-(layer, "
                                                                       "head) scores: mean_rank or mean_raw."),
    model: str | None = common.flag("--model", None, "The Trace's model, only for payload wo_l2 (‖W_O v‖₂): its "
                                                           "o_proj weights are read."),
    list_: bool = typer.Option(False, "--list", help="List every scorer (built-in, plugin, kvpress:<Press>) and "
                                                     "whether it can be graded, then exit."),
    quiet: bool = common.Quiet,
    overwrite: bool = common.flag("--overwrite", False, "replace an existing --out that is not a scores table"),
) -> None:
    """Score candidates of a Trace with the scorer zoo (higher = keep) and write scores.parquet."""
    from kvdiag.core import parsing
    from kvdiag.core.guard import check_outputs
    from kvdiag.core.parsing import GRANULARITIES, joined, parse_checkpoints, parse_list
    from kvdiag.core.schema import check_checkpoint
    from kvdiag.scorers.fields import MODEL_UNUSED, check_params, wo_l2_unused
    from kvdiag.scorers.fitted_file import check_fitted, trace_evaluation
    from kvdiag.scorers.names import AGGREGATIONS, check_scorer_names
    from kvdiag.scorers.plugin_check import check_plugin_files
    from kvdiag.trace.manifest import TraceFiles

    if list_:
        list_scorers(plugin or ())
        return
    if trace is None or out is None:
        raise UserError("pass --trace DIR and --out scores.parquet (or --list to see the scorers)")
    # the checks that need no scorer, model or tensor, before torch is imported
    if (labels is None) == (checkpoints is None):
        raise UserError("pass exactly one of --labels labels.parquet or --checkpoints every:K|default|t1,t2,...")
    if labels is not None and granularity is not None:
        raise UserError("--granularity does not apply with --labels (its rows are scored at their own granularity); "
                        "drop it")
    if checkpoints is not None:
        cps = parse_checkpoints(joined(checkpoints))
        parse_list(joined(granularity) or "token", "--granularity", str, choices=GRANULARITIES)
    if aggregation not in AGGREGATIONS:
        raise UserError(f"--aggregation {aggregation}: use one of {', '.join(AGGREGATIONS)}")
    if not plugin:
        check_scorer_names(parse_list(scorers, "--scorers", str))
    check_outputs({"--out": (out, "file", "scores"),
                   "--out (its features)": (features_path(out), "file", "token_features")},
                  {"--trace": trace, "--labels": labels, "--plugin": plugin}, overwrite=overwrite)
    check_plugin_files(plugin)
    trace_files = TraceFiles(trace)
    trace_files.check_layer_files()
    if labels is not None:  # their contract, their Trace and their keys against its manifest, before torch (the
        from kvdiag.core.contracts import read_keys  # stage reads them again, with the tensors)

        read_keys(trace_files, labels)
    elif not isinstance(cps, int):  # positions: each a checkpoint of every prompt (every:K fits itself to each)
        for pid in trace_files.prompt_ids:
            for t in cps:
                check_checkpoint(trace_files, pid, t)
    if model is not None:  # another model than the Trace's, told from names and configs before anything loads
        from kvdiag.model.specs import check_model_spec, check_trace_model

        check_trace_model(check_model_spec(model), trace_files.manifest["model"],
                          f"pass {trace_files.manifest['model']['spec']}")
        trace_files.check_vocabulary_of(model)
    params = parsing.parse_params(param)
    names = parse_list(scorers, "--scorers", str)
    check_params(params)  # the built-ins' parameter names and types, from kvdiag.scorers.fields
    check_fitted(names, params, trace_evaluation(trace_files.manifest, f"--trace {trace}"))
    if model is not None and wo_l2_unused(names, params, plugin):
        raise UserError(MODEL_UNUSED.format(model=model))
    from kvdiag.scorers.run import score_files  # the scorers: torch, once the arguments are checked
    df, meta = score_files(trace, out, labels, joined(checkpoints), joined(granularity),
                           parse_list(scorers, "--scorers", str), params, plugin or (), aggregation, model,
                           progress=not quiet, overwrite=overwrite)
    plain_console(stderr=True).print(f"wrote {df.height} rows × {len(meta['scorers'])} scorers to {out}")


def list_scorers(plugins) -> None:
    """One line per scorer: name, kind (built-in, plugin, kvpress), status (gradable or refused) and a note."""
    from kvdiag.scorers import SCORERS, load_plugins
    from kvdiag.scorers.kvpress_press import PREFIX, listing

    load_plugins(plugins)
    rows = [(name, "built-in" if cls.__module__.startswith("kvdiag.scorers.") else "plugin", "gradable",
             (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "")
            for name, cls in SCORERS.items() if not name.startswith(PREFIX)]
    rows += [(name, "kvpress", status, note) for name, status, note in listing()]
    width = max(len(r[0]) for r in rows)
    for name, kind, status, note in rows:
        typer.echo(f"{name:<{width}}  {kind:<8}  {status:<13}  {note}")

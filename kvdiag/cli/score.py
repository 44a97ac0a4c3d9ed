"""``kvdiag score``: one column per scorer for the labeled (or chosen) candidates of a Trace."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from kvdiag.errors import UserError


def score(
    ctx: typer.Context,
    trace: Path | None = typer.Option(None, "--trace", help="Trace directory written by `kvdiag trace` (required unless --list)."),
    out: Path | None = typer.Option(None, "--out", help="Output scores.parquet (required unless --list)."),
    labels: Path | None = typer.Option(None, "--labels", help="labels.parquet: score exactly its candidates (same keys)."),
    checkpoints: list[str] | None = typer.Option(
        None, "--checkpoints", help="Without --labels: 'default' (every 128 generated tokens) or positions t, e.g. 256,384 (repeatable); every entry < t is scored."),
    granularity: list[str] | None = typer.Option(None, "--granularity", help="With --checkpoints: token (default), layer and/or head, comma-separated, repeatable."),
    scorers: list[str] = typer.Option(["all"], "--scorers", help="'all' or comma-separated scorer names, repeatable."),
    param: list[str] | None = typer.Option(None, "--param", help="scorer.key=value, repeatable (e.g. rkv.mix_lambda=0.07)."),
    plugin: list[str] | None = typer.Option(None, "--plugin", help="Module (or .py file) whose import registers scorers, repeatable."),
    aggregation: str = typer.Option("mean_rank", "--aggregation", help="How token/layer rows combine per-(layer, head) scores: mean_rank or mean_raw."),
    model: str | None = typer.Option(None, "--model", help="The Trace's model, only for payload wo_l2 (‖W_O v‖₂): its o_proj weights are read."),
    list_: bool = typer.Option(False, "--list", help="List every scorer (built-in, plugin, kvpress:<Press>) and whether it can be graded, then exit."),
) -> None:
    """Score candidates of a Trace with the scorer zoo (higher = keep) and write scores.parquet."""
    from kvdiag.cli.common import joined, listed, refuse_given
    from kvdiag.io import check_writable, read_table, write_table
    from kvdiag.replay.live import needs_o_proj
    from kvdiag.scorers import checkpoint_keys, parse_params, resolve_scorers, score_trace
    from kvdiag.scorers.run import check_aggregation, check_keys
    from kvdiag.trace import Trace

    if list_:
        list_scorers(plugin or ())
        return
    if trace is None or out is None:
        raise UserError("pass --trace DIR and --out scores.parquet (or --list to see the scorers)")
    # every input is checked before the work (and the --model load) starts
    if (labels is None) == (checkpoints is None):
        raise UserError("pass exactly one of --labels labels.parquet or --checkpoints default|t1,t2,...")
    if labels is not None:
        refuse_given(ctx, ["granularity"], "with --labels (its rows are scored at their own granularity)")
    check_writable(out, "--out")
    check_aggregation(aggregation)
    scorer_names, params = ",".join(listed(scorers)), parse_params(param)
    selected = resolve_scorers(scorer_names, params, plugin or ())
    if model and not any(needs_o_proj(s) for s in selected.values()):
        raise UserError(f"--model {model} does not apply: no selected scorer reads the wo_l2 payload (‖W_O v‖₂); drop it")
    tr = Trace(trace)
    if labels is not None:
        keys, labels_meta = read_table(labels, what=f"--labels {labels}")
        tr.check_belongs(labels_meta, f"--labels {labels}")
        keys = check_keys(tr, keys, f"--labels {labels}")
    else:
        keys = checkpoint_keys(tr, parse_checkpoints(joined(checkpoints)), listed(granularity) or ["token"])
    df, meta = score_trace(
        tr, keys=keys, scorers=scorer_names, params=params, aggregation=aggregation,  # plugins: loaded above
        o_proj=load_o_proj(model, tr) if model else None, progress=True,
    )
    meta["source"] = ({"labels": str(labels)} if labels is not None
                      else {"checkpoints": joined(checkpoints), "granularity": joined(granularity) or "token"})
    write_table(df, out, meta)
    Console(stderr=True).print(f"wrote {df.height} rows × {len(meta['scorers'])} scorers to {out}")


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


def load_o_proj(spec: str, trace) -> dict:
    """layer -> o_proj weight of ``spec``, refused unless it is the Trace's model (same weights hash)."""
    from kvdiag.features import o_proj_weights
    from kvdiag.models import load_model

    lm = load_model(spec, dtype=trace.manifest["model"].get("dtype", "float32"))
    lm.check_model_of(trace.manifest["model"], "--model", f"pass {trace.manifest['model']['spec']}")
    return o_proj_weights(lm.model)

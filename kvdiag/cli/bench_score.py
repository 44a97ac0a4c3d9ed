"""``kvdiag bench score``: seconds per checkpoint of every scorer on a Trace, and peak memory."""

from __future__ import annotations

import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table


def bench_score(
    trace: Path = typer.Option(..., "--trace", help="Trace directory written by `kvdiag trace`."),
    scorers: list[str] = typer.Option(["all"], "--scorers", help="'all' or comma-separated scorer names, repeatable."),
    checkpoints: list[str] = typer.Option(["default"], "--checkpoints", help="'default' (every 128 generated tokens) or positions t, repeatable."),
    param: list[str] | None = typer.Option(None, "--param", help="scorer.key=value, repeatable."),
    plugin: list[str] | None = typer.Option(None, "--plugin", help="Module (or .py file) registering scorers, repeatable."),
    out: Path | None = typer.Option(None, "--out", help="Also write the numbers as JSON here."),
) -> None:
    """Time `kvdiag score` over every checkpoint (token granularity, all cached entries) and report s/checkpoint."""
    from kvdiag.cli.common import joined
    from kvdiag.cli.score import parse_checkpoints
    from kvdiag.io import write_json
    from kvdiag.kernels.bench import rss_kb
    from kvdiag.scorers import checkpoint_keys, parse_params, score_trace
    from kvdiag.trace import Trace

    tr = Trace(trace)
    keys = checkpoint_keys(tr, parse_checkpoints(joined(checkpoints)))
    n_cp = keys.select("prompt_id", "checkpoint").n_unique()
    timings: dict[str, float] = {}
    start = time.perf_counter()
    score_trace(tr, keys=keys, scorers=joined(scorers), params=parse_params(param), plugins=plugin or (), timings=timings, progress=True)
    total = time.perf_counter() - start
    peak_mib = rss_kb("VmHWM") / 1024
    table = Table(title=f"kvdiag score on {trace}: {n_cp} checkpoints, {tr.num_layers} layers, {keys.height} entries")
    table.add_column("scorer")
    table.add_column("s / checkpoint", justify="right")
    table.add_column("share", justify="right")
    for name, sec in timings.items():
        table.add_row(name, f"{sec / n_cp:.4f}", f"{sec / total:.0%}")
    table.add_row("[bold]total (incl. reading)", f"[bold]{total / n_cp:.4f}", "100%")
    console = Console()
    console.print(table)
    console.print(f"peak RSS {peak_mib:.0f} MiB; shared features are charged to the first scorer that needs them")
    if out is not None:
        write_json(out, {
            "trace": str(trace), "checkpoints": n_cp, "layers": tr.num_layers, "entries": keys.height,
            "seconds_total": total, "seconds_per_checkpoint": total / n_cp,
            "scorer_seconds_per_checkpoint": {k: v / n_cp for k, v in timings.items()}, "peak_rss_mib": peak_mib,
        })

"""``kvdiag bench score``: seconds per checkpoint of every scorer on a Trace, and peak memory."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from kvdiag.cli import common
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console


def bench_score(
    trace: Path = common.flag("--trace", ..., "Trace directory written by `kvdiag trace`."),
    scorers: list[str] = common.flag("--scorers", ["all"], "'all' or comma-separated scorer names, repeatable."),
    checkpoints: list[str] = common.flag("--checkpoints", ["default"], "'default' (every 128 generated tokens) "
                                                                             "or positions t, repeatable."),
    param: list[str] | None = common.flag("--param", None, "scorer.key=value, repeatable."),
    plugin: list[str] | None = common.flag("--plugin", None, "Module (or .py file) registering scorers, "
                                                                   "repeatable."),
    out: Path | None = common.flag("--out", None, "Also write the numbers as JSON here."),
) -> None:
    """Time `kvdiag score` over every checkpoint (token granularity, all cached entries) and report s/checkpoint."""
    check_outputs({"--out": out}, {"--trace": trace, "--plugin": plugin})
    from kvdiag.core.io import write_json
    from kvdiag.core.parsing import joined, parse_checkpoints, parse_list, parse_params
    from kvdiag.trace.manifest import read_trace_files

    read_trace_files(trace)  # before torch
    from kvdiag.scorers.bench import run_score_bench
    from kvdiag.trace import Trace

    tr = Trace(trace)
    r = run_score_bench(tr, parse_list(scorers, "--scorers", str), parse_checkpoints(joined(checkpoints)),
                        parse_params(param), plugin or ())
    n_cp = r.checkpoints
    table = Table(title=f"kvdiag score on {trace}: {n_cp} checkpoints, {r.layers} layers, {r.entries} entries")
    table.add_column("scorer")
    table.add_column("s / checkpoint", justify="right")
    table.add_column("share", justify="right")
    for name, sec in r.scorer_seconds.items():
        table.add_row(name, f"{sec / n_cp:.4f}", f"{sec / r.seconds:.0%}")
    table.add_row("total (incl. reading)", f"{r.seconds / n_cp:.4f}", "100%")
    console = plain_console()
    console.print(table)
    console.print(f"peak RSS {r.peak_rss_mib:.0f} MiB; shared features are charged to the first scorer that needs them")
    if out is not None:
        write_json(out, r.to_json(str(trace)))

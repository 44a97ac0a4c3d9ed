"""``kvdiag demo``: the whole pipeline on the embedded model and builtin prompts, ending with a report.

Each stage is the same command a user would type; the demo runs them in this process, records the
exact command lines in the run directory (the report quotes them), and skips stages whose output
exists, so an interrupted demo continues where it stopped.
"""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import typer

from kvdiag.cli import common
from kvdiag.core.progress import plain_console
from kvdiag.core.schema import HORIZON


def demo_commands(out: Path, model: str, prompts: str, limit: int, max_new_tokens: int, candidates: int,
                  horizon: int, interval: int, bootstrap: int) -> list[tuple[str, Path, list[str]]]:
    """(stage, output that marks it done, argv) for every stage of the pipeline."""
    trace, labels, scores = out / "trace", out / "labels.parquet", out / "scores.parquet"
    return [
        (
            "trace",
            trace / "manifest.json",
            [
                "trace", "--model", model, "--prompts", prompts, "--limit", str(limit), "--max-new-tokens",
                str(max_new_tokens), "--out", str(trace),
            ],
        ),
        (
            "label",
            labels,
            [
                "label", "--trace", str(trace), "--out", str(labels), "--checkpoints", f"every:{interval}",
                "--candidates", str(candidates), "--horizon", str(horizon),
            ],
        ),
        (
            "score", scores,
            ["score", "--trace", str(trace), "--labels", str(labels), "--scorers", "all", "--out", str(scores)],
        ),
        (
            "rank-eval",
            out / "rank-eval" / "metrics.csv",
            [
                "rank-eval", "--labels", str(labels), "--scores", str(scores), "--out", str(out / "rank-eval"),
                "--bootstrap", str(bootstrap),
            ],
        ),
        (
            "figures",
            out / "figures" / "figures.json",
            [
                "figures", "--trace", str(trace), "--labels", str(labels), "--scores", str(scores), "--out",
                str(out / "figures"), "--rank-eval", str(out / "rank-eval"), "--bootstrap", str(bootstrap),
            ],
        ),
        ("report", out / "report.md", ["report", "--run", str(out)]),
    ]


def demo(
    ctx: typer.Context, out: Path = common.flag("--out", Path("runs/demo"), "run directory"),
    model: str = common.Model, prompts: str = common.Prompts,
    limit: int = common.flag("--limit", 6, "prompts to trace"),
    max_new_tokens: int = common.flag("--max-new-tokens", 384),
    candidates: int = common.flag("--candidates", 64, "labeled candidates per checkpoint"),
    horizon: int = common.flag("--horizon", HORIZON, **common.HORIZON_STEPS),
    interval: int = common.flag("--interval", 64, "checkpoint every K generated tokens"),
    bootstrap: int = common.Bootstrap,
) -> None:
    """Run trace -> label -> score -> rank-eval -> figures -> report and print the report's path."""
    from kvdiag.core.io import check_writable
    from kvdiag.model.specs import check_model_spec

    check_writable(out, "--out", "dir")
    check_model_spec(model)
    from kvdiag.report.run import record_command  # matplotlib and torch, once the arguments are checked

    console = plain_console()
    out.mkdir(parents=True, exist_ok=True)
    stages = demo_commands(out, model, prompts, limit, max_new_tokens, candidates, horizon, interval, bootstrap)
    start = time.perf_counter()
    for i, (stage, done, argv) in enumerate(stages, 1):
        line = "kvdiag " + shlex.join(argv)
        if done.exists():
            console.rule(f"[{i}/{len(stages)}] {stage}: done before, skipped")
            continue
        console.rule(f"[{i}/{len(stages)}] {stage}")
        console.print(f"$ {line}", highlight=False)
        common.invoke(ctx.find_root().command, argv)  # as typed: repeated options refused
        record_command(out, ["kvdiag", *argv])
    minutes = (time.perf_counter() - start) / 60
    console.rule()
    console.print(f"demo finished in {minutes:.1f} min; report: {out / 'report.md'} (and "
                  f"{out / 'report.html'})")

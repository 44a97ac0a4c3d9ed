"""``kvdiag bench label``: engine vs naive loop vs plain batched forward, as ratios in one run."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from kvdiag.cli import common


def bench_label(
    model: str = common.Model,
    prefix: int = typer.Option(512, "--prefix", help="prefix length P (the checkpoint)"),
    n: int = typer.Option(64, "--n", help="candidates N"),
    horizon: int = typer.Option(16, "--horizon", help="teacher-forced tokens H"),
    repeats: int = typer.Option(3, "--repeats", help="timed runs per method, round-robin (best reported)"),
    dtype: str = common.Dtype,
    device: str = common.Device,
    backend: str = typer.Option("auto", "--backend", help="kernel backend of the engine"),
) -> None:
    """Oracle engine throughput vs the naive per-candidate loop and the plain batched forward."""
    from kvdiag.label.bench import run_label_bench
    from kvdiag.models import load_model

    common.quiet_transformers()
    lm = load_model(model, dtype=dtype, device=device)
    rows = run_label_bench(lm, prefix, n, horizon, repeats, backend=backend)
    engine, naive, plain = rows
    table = Table(title=f"bench label: {model} {dtype} on {device}, P={prefix}, N={n}, H={horizon}")
    for col in ("method", "s", "tok/s", "peak extra MB", "engine speed-up"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for r in rows:
        peak = "n/a" if r.peak_mb is None else f"{r.peak_mb:.0f}"
        table.add_row(r.method, f"{r.seconds:.2f}", f"{r.tokens_per_s:.0f}", peak, f"{r.seconds / engine.seconds:.2f}x")
    console = Console()
    console.print(table)
    console.print(f"engine / naive speed: {naive.seconds / engine.seconds:.2f}x; "
                  f"engine throughput / plain batched forward: {plain.seconds / engine.seconds:.2f}")

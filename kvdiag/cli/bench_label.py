"""``kvdiag bench label``: engine vs naive loop vs plain batched forward (token), layer start vs full depth
(``--granularity layer|head``), or cost per labeled entry of an approximate method vs exact (``--method``).

Exact methods also print their achieved matmul FLOP/s (``kvdiag.cost``) and MFU against the matmul peak measured
at the model's dtype in the same run, before the timed runs (``kvdiag.peak``)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from kvdiag.cli import common


def bench_label(
    model: str = common.Model,
    prefix: int = typer.Option(512, "--prefix", help="prefix length P (the checkpoint)"),
    n: int = typer.Option(64, "--n", help="candidate positions N"),
    horizon: int = typer.Option(16, "--horizon", help="teacher-forced tokens H"),
    granularity: str = typer.Option("token", "--granularity", help="token: engine vs naive vs plain; layer | head: "
                                                                   "layer start vs full depth"),
    method: str = typer.Option("exact", "--method", help="exact, or an approximate method (fast, fisher): its cost "
                                                         "per labeled entry vs exact"),
    samples: int = typer.Option(8, "--samples", help="fisher: sampled continuations per horizon step"),
    repeats: int = typer.Option(3, "--repeats", help="timed runs per method, round-robin (best reported)"),
    dtype: str = common.Dtype,
    device: str = common.Device,
    backend: str = typer.Option("auto", "--backend", help="kernel backend of the engine"),
) -> None:
    """Oracle engine throughput: vs the naive loop and the plain forward, layer start, or an approximate method."""
    from kvdiag.cost import ModelShape
    from kvdiag.errors import UserError
    from kvdiag.label.bench import run_fast_bench, run_label_bench, run_layer_start_bench
    from kvdiag.label.engine import GRANULARITIES
    from kvdiag.label.fast import resolve_method
    from kvdiag.models import load_model
    from kvdiag.peak import model_peak

    if granularity not in GRANULARITIES:
        raise UserError(f"--granularity {granularity}: use one of {', '.join(GRANULARITIES)}")
    method = resolve_method(method)
    if method != "exact" and granularity != "token":
        raise UserError("--method with --granularity layer|head: bench one of them at a time (the approximate method "
                        "is benched on token rows)")
    common.quiet_transformers()
    lm = load_model(model, dtype=dtype, device=device)
    weights = " (random weights)" if lm.random else ""
    title = f"bench label: {model}{weights} {dtype} on {device}, P={prefix}, N={n}, H={horizon}"
    console = Console(width=max(120, Console().width))  # piped output defaults to 80 columns
    if method != "exact":
        res = run_fast_bench(lm, method, prefix, n, horizon, repeats, backend=backend, samples=samples)
        table = _table(f"{title}, {method} samples={samples}", ("method", "entries", "s", "ms / entry", "peak extra "
                                                                                                        "MB"))
        for r, k in zip(res.rows, res.labeled, strict=True):
            table.add_row(r.method, str(k), f"{r.seconds:.2f}", f"{1000 * r.seconds / k:.1f}", _mb(r.peak_mb))
        (ex, ap), (kx, ka) = res.rows, res.labeled
        console.print(table)
        console.print(f"cost per labeled entry, exact / {method}: {(ex.seconds / kx) / (ap.seconds / ka):.1f}x; "
                      f"Spearman({method}, exact kl_mean) on the N candidates: {res.spearman:.3f}")
        return
    peak = model_peak(lm)  # the ratio's denominator, measured in this run
    if granularity != "token":
        res = run_layer_start_bench(lm, granularity, prefix, n, horizon, repeats, backend=backend)
        table = _table(f"{title}, {granularity} granularity ({res.labeled} rows)",
                       ("method", "s", "tok/s", *THROUGHPUT, "peak extra MB"))
        for r in res.rows:
            table.add_row(r.method, f"{r.seconds:.2f}", f"{r.tokens_per_s:.0f}", *_throughput(r, peak), _mb(r.peak_mb))
        start, full = res.rows
        console.print(table)
        console.print(_peak_line(peak))
        ceiling = ModelShape.from_config(lm.model.config, model).layer_start_ceiling(prefix)
        per_repeat = ", ".join(f"{r:.2f}x" for r in res.ratios)
        console.print(f"layer start speed-up over full depth: {full.seconds / start.seconds:.2f}x (per repeat: "
                      f"{per_repeat}; batches timed in alternation; FLOP ceiling for this model "
                      f"at P={prefix}: {ceiling:.2f}x, kvdiag.cost); labels differ by at most "
                      f"{res.max_abs_diff:.2e} nats ({res.max_rel_diff:.1e} relative)")
        return
    rows = run_label_bench(lm, prefix, n, horizon, repeats, backend=backend)
    engine, naive, plain = rows
    table = _table(title, ("method", "s", "tok/s", *THROUGHPUT, "peak extra MB", "engine speed-up"))
    for r in rows:
        table.add_row(r.method, f"{r.seconds:.2f}", f"{r.tokens_per_s:.0f}", *_throughput(r, peak), _mb(r.peak_mb),
                      f"{r.seconds / engine.seconds:.2f}x")
    console.print(table)
    console.print(_peak_line(peak))
    console.print(f"engine / naive speed: {naive.seconds / engine.seconds:.2f}x; "
                  f"engine throughput / plain batched forward: {plain.seconds / engine.seconds:.2f}")


THROUGHPUT = ("GFLOP/s", "MFU")


def _throughput(row, peak) -> tuple[str, str]:
    """A row's achieved matmul GFLOP/s and its fraction of the measured ``peak`` (``kvdiag.peak.Peak``)."""
    if row.flops is None:
        return "n/a", "n/a"
    return _gflops(row.flops / row.seconds), f"{peak.mfu(row.flops, row.seconds):.0%}"


def _gflops(flops_per_s: float) -> str:
    g = flops_per_s / 1e9
    return f"{g:,.1f}" if g >= 10 else f"{g:.3g}"


def _peak_line(peak) -> str:
    return (f"matmul peak, measured in this run: {peak.gflops:,.1f} GFLOP/s (F.linear {peak.size}^3, {peak.dtype}, "
            f"{peak.device}, best of {peak.calls}); MFU = achieved matmul FLOP/s (kvdiag.cost) / that peak")


def _table(title: str, columns: tuple[str, ...]) -> Table:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col == "method" else "right")
    return table


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"

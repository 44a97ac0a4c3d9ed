"""``kvdiag bench label``: engine vs naive loop vs plain batched forward (token), layer start vs full depth
(``--granularity layer|head``), cost per labeled entry of an approximate method or of hybrid vs exact (``--method``),
or what a set row of ``kvdiag decisions`` costs against a single row and the physical-deletion reference (``--sets``).

Exact methods also print their achieved matmul FLOP/s (``kvdiag.trace.cost``) and MFU against the matmul peak measured
at the model's dtype in the same run, before the timed runs (``kvdiag.kernels.peak``)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kvdiag.cli import common
from kvdiag.core import parsing
from kvdiag.core.errors import UserError, check_number
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console
from kvdiag.core.schema import CHUNK, HORIZON

MAX_REPEATS = 1000  # timed runs; more would only hang


def bench_label(
    model: str = common.Model,
    prefix: int = common.flag("--prefix", 512, "prefix length P (the checkpoint)"),
    n: int = common.flag("--n", 64, "candidate positions N"),
    horizon: int = common.flag("--horizon", 16, "teacher-forced tokens H; exact token rows at H > 16: the engine "
                                "at H (chunked) against H = 16, time and peak memory per labeled entry",
                               **common.HORIZON_STEPS),
    chunk: int = common.flag("--chunk", CHUNK, "horizon steps per forward (H > 16)"),
    granularity: str = common.flag("--granularity", "token", "token: engine vs naive vs plain; layer | head: "
                                                                   "layer start vs full depth"),
    method: str = common.flag("--method", "exact", "exact, or fast | fisher | hybrid: its cost per labeled "
                                                         "entry vs exact"),
    samples: int = common.flag("--fisher-samples", 8, "fisher, hybrid: sampled continuations per "
                                "horizon step (--samples is the deprecated name)"),
    exact_top: int = common.flag("--exact-top", None, "hybrid: M entries labeled exactly"),
    exact_frac: float = common.flag("--exact-frac", None, "hybrid: M as a share of the P entries"),
    audit: int = common.flag("--audit", 32, "hybrid: audit sample labeled exactly"),
    miss_rate: float = common.flag("--miss-rate", None, "hybrid: the rounds of label --miss-rate R (from "
                                    "--exact-frac, with the minimum audit) on --checkpoints windows, against exact "
                                    "labels of every entry, and the Fisher ranking's cost / miss-rate frontier"),
    checkpoints: int = common.flag("--checkpoints", 3, "--miss-rate: windows of P + H + 1 tokens (one "
                                    "checkpoint each), pooled"),
    sets: bool = typer.Option(False, "--sets", help="set rows (decisions) vs single rows vs physical deletion"),
    keep: float = common.flag("--keep", 0.5, "--sets: the share of the P entries a set keeps "
                                                     + common.BUDGET_TERMS),
    out: str = common.flag("--out", None, "also write the result as JSON here (--method, --sets)"),
    repeats: int = common.flag("--repeats", 3, "timed runs per method, round-robin (best reported)"),
    dtype: str = common.Dtype,
    device: str = common.Device,
    backend: str = common.flag("--backend", "auto", "kernel backend of the engine"),
) -> None:
    """Oracle engine throughput: vs the naive loop and the plain forward, layer start, or an approximate method."""
    check_outputs({"--out": out})
    for flag, value, example in (("--prefix", prefix, 512), ("--n", n, 64),
                                 ("--repeats", repeats, 3), ("--chunk", chunk, 16)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be a positive integer, e.g. {flag} {example}")
    check_number("--repeats", repeats, 1, MAX_REPEATS)
    if n > prefix:
        raise UserError(f"--n {n} candidates exceed the --prefix {prefix} cached entries: use --n {prefix} or less")
    from kvdiag.core.schema import GRANULARITIES
    from kvdiag.label.config import HybridParams, resolve_method

    if granularity not in GRANULARITIES:
        raise UserError(f"--granularity {granularity}: use one of {', '.join(GRANULARITIES)}")
    if miss_rate is not None and method != "hybrid":
        raise UserError("--miss-rate applies to --method hybrid only; add it or drop --miss-rate")
    if checkpoints < 1:
        raise UserError(f"--checkpoints {checkpoints}: must be a positive number of windows, e.g. 3")
    hybrid = HybridParams(exact_top, exact_frac, audit, samples, miss_rate) if method == "hybrid" else None
    if hybrid is not None:
        hybrid.validate()
        if miss_rate is None:
            hybrid.check_fits(prefix, f"of the --prefix {prefix} entries")
    elif exact_top is not None or exact_frac is not None:
        raise UserError("--exact-top / --exact-frac: hybrid settings; pass --method hybrid")
    else:
        method = resolve_method(method)
    if (method != "exact" or sets) and granularity != "token":
        raise UserError("--method / --sets with --granularity layer|head: bench one of them at a time (they are "
                        "benched on token rows)")
    if sets and method != "exact":
        raise UserError("--sets with --method: bench one of them at a time")
    if sets and not 0 < keep < 1:
        raise UserError(f"--keep {keep}: a share of the P entries in (0, 1), e.g. 0.5")
    scaling = method == "exact" and not sets and granularity == "token" and horizon > HORIZON
    if out is not None and method == "exact" and not sets and not scaling:
        raise UserError(f"--out: written for --method, --sets and --horizon above {HORIZON} only; drop it")
    parsing.check_dtype(dtype)
    parsing.check_device_name(device)
    parsing.check_backend(backend, device)
    from kvdiag.model.specs import check_model_spec, context_of

    _check_context(prefix, horizon, model, context_of(check_model_spec(model)))  # from its config, before the load
    from kvdiag.kernels.peak import model_peak
    from kvdiag.label.bench import run_fast_bench, run_label_bench, run_layer_start_bench
    from kvdiag.model.load import load_model
    from kvdiag.trace.cost import ModelShape

    common.quiet_transformers()
    lm = load_model(model, dtype=dtype, device=device)
    # a model whose config only its load reads (random:, .gguf, a hub id not in the local cache)
    _check_context(prefix, horizon, model, getattr(lm.model.config, "max_position_embeddings", None))
    weights = " (random weights)" if lm.random else ""
    title = f"bench label: {model}{weights} {dtype} on {device}, P={prefix}, N={n}, H={horizon}"
    console = plain_console(width=max(120, Console().width))  # piped output defaults to 80 columns
    if sets:
        _bench_sets(console, title, lm, prefix, n, horizon, keep, repeats, backend, out)
        return
    if miss_rate is not None:
        _bench_miss_rate(console, title, lm, prefix, checkpoints, horizon, miss_rate, exact_frac, samples, backend,
                         out)
        return
    if scaling:
        _bench_horizon(console, title, lm, prefix, n, horizon, repeats, backend, chunk, out)
        return
    if method != "exact":
        params = asdict(hybrid) if hybrid is not None else {"samples": samples}
        res = run_fast_bench(lm, method, prefix, n, horizon, repeats, backend=backend, **params)
        shown = " ".join(f"{k}={v}" for k, v in params.items() if v is not None)
        table = _table(f"{title}, {method} {shown}", ("method", "entries", "s", "ms / entry", "peak extra MB"))
        for r, k in zip(res.rows, res.labeled, strict=True):
            table.add_row(r.method, str(k), f"{r.seconds:.2f}", f"{1000 * r.seconds / k:.1f}", _mb(r.peak_mb))
        (ex, ap), (kx, ka) = res.rows, res.labeled
        ratio = (ex.seconds / kx) / (ap.seconds / ka)
        console.print(table)
        console.print(f"cost per labeled entry, exact / {method}: {ratio:.1f}x (cost of {method} / exact labels of "
                      f"every entry: {1 / ratio:.3f}); Spearman({method}, exact kl_mean) on the N candidates: "
                      f"{res.spearman:.3f}")
        _write(out, {"model": model, "dtype": dtype, "device": device, "prefix": prefix, "n": n, "horizon": horizon,
                     "method": method, "params": params, "exact_over_method_per_entry": ratio, "ratio": 1 / ratio,
                     "spearman": res.spearman, "rows": [asdict(r) for r in res.rows], "entries": res.labeled})
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
                      f"at P={prefix}: {ceiling:.2f}x, kvdiag.trace.cost); labels differ by at most "
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


def _check_context(prefix: int, horizon: int, model: str, limit: int | None) -> None:
    """Refuse a --prefix whose horizon runs past the model's context of ``limit`` positions (None: not known)."""
    if limit and prefix + horizon > limit:
        raise UserError(f"--prefix {prefix} + --horizon {horizon} exceeds {model}'s context of {limit} positions: use "
                        f"--prefix {max(1, limit - horizon)} or less")


def _bench_sets(console, title, lm, prefix, n, horizon, keep, repeats, backend, out) -> None:
    from kvdiag.decisions.bench import run_set_bench

    res = run_set_bench(lm, prefix, n, horizon, keep, repeats, backend=backend)
    table = _table(f"{title}, set rows (keep {keep:g}: {res['evicted']} entries evicted)",
                   ("rows", "evicted", "s / batch", "/ single", "max |kl - physical|"))
    for r in res["rows"]:
        diff = "n/a" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}"
        table.add_row(r.rows, str(r.evicted), f"{r.seconds_per_batch:.3f}", f"{r.ratio_to_single:.2f}x", diff)
    console.print(table)
    console.print(f"physical deletion per set {res['physical_seconds_per_set']:.3f} s, batched set row "
                  f"{res['batched_seconds_per_set']:.3f} s: batched speed-up {res['physical_over_batched']:.2f}x")
    _write(out, {**res, "rows": [asdict(r) for r in res["rows"]]})


def _bench_miss_rate(console, title, lm, prefix, checkpoints, horizon, target, exact_frac, samples, backend,
                     out) -> None:
    from kvdiag.label.bench import run_miss_rate_bench

    res = run_miss_rate_bench(lm, prefix, checkpoints, horizon, target, exact_frac, samples, backend=backend)
    n = checkpoints * prefix
    table = _table(f"{title}: the Fisher ranking's frontier over {checkpoints} windows ({n} entries, harmful: the "
                   "pooled top decile)", ("exact share", "cost / exact", "missed / harmful", "miss rate",
                                          "per window"))
    for r in res.frontier:
        table.add_row(f"{r['share']:.3f}", f"{r['cost']:.3f}", f"{r['missed']} / {r['harmful']}",
                      f"{r['miss_rate']:.3f}", ", ".join(f"{m:.2f}" for m in r["per_checkpoint"]))
    console.print(table)
    console.print(f"exact labels of every entry {res.exact_seconds:.1f} s, fisher {res.fast_seconds:.1f} s "
                  f"({res.fast_seconds / res.exact_seconds:.3f} of exact); Spearman(fisher, exact) {res.spearman:.3f}")
    c = res.control
    if "refused" in c:
        console.print(f"--miss-rate {target} from --exact-frac {exact_frac}: refused: {c['refused']}")
    else:
        console.print(f"--miss-rate {target} from --exact-frac {exact_frac}, audit {c['min_audit']} (the minimum): "
                      f"{len(c['rounds'])} rounds, stopped at bound {c['bound']:.3f}; exact share "
                      f"{c['exact_share']:.3f}, cost {c['cost']:.3f} of exact labels of every entry; measured miss "
                      f"rate {c['miss_rate']:.3f} "
                      f"({c['missed']} of {c['harmful']} harmful)")
    best = min((r for r in res.frontier if r["miss_rate"] <= target), key=lambda r: r["cost"], default=None)
    console.print("the Fisher ranking alone (no audit, measured against exact labels): " + (
        f"miss rate <= {target} first at exact share {best['share']:.3f}, cost {best['cost']:.3f}" if best else
        f"no share below 1 reaches a miss rate <= {target}"))
    _write(out, {"model": lm.spec, "dtype": lm.dtype, "device": str(lm.device), **asdict(res)})


def _bench_horizon(console, title, lm, prefix, n, horizon, repeats, backend, chunk, out) -> None:
    from kvdiag.label.bench import run_horizon_bench

    res = run_horizon_bench(lm, prefix, n, horizon, HORIZON, repeats, backend=backend, chunk=chunk)
    table = _table(f"{title}: exact labels at H={horizon} against H={HORIZON}",
                   ("method", "s", "ms / entry", "tok/s", "peak extra MB"))
    for r in res.rows:
        table.add_row(r.method, f"{r.seconds:.2f}", f"{1000 * r.seconds / n:.1f}", f"{r.tokens_per_s:.0f}",
                      _mb(r.peak_mb))
    console.print(table)
    linear = horizon / HORIZON
    peak = "n/a" if res.peak_ratio is None else f"{res.peak_ratio:.2f}x"
    console.print(f"cost per labeled entry, H={horizon} / H={HORIZON}: {res.cost_ratio:.2f}x (linear in H: "
                  f"{linear:g}x; {res.cost_ratio / linear:.2f} of linear); peak extra memory: {peak} (memory budget: "
                  f"{n} rows x {chunk} steps); the first {HORIZON} steps at H={horizon} differ from H={HORIZON} by at "
                  f"most {res.max_abs_diff:.1e} nats")
    _write(out, {"model": lm.spec, "dtype": lm.dtype, "device": str(lm.device), "prefix": prefix, "n": n,
                 "horizons": res.horizons, "chunk": chunk, "plans": res.plans, "cost_ratio_per_entry": res.cost_ratio,
                 "linear_ratio": linear, "peak_ratio": res.peak_ratio, "max_abs_diff_first_steps": res.max_abs_diff,
                 "rows": [asdict(r) for r in res.rows]})


def _write(out: str | None, payload: dict) -> None:
    if out is not None:
        from kvdiag.core.io import write_json

        write_json(Path(out), payload)


def _throughput(row, peak) -> tuple[str, str]:
    """A row's achieved matmul GFLOP/s and its fraction of the measured ``peak`` (``kvdiag.kernels.peak.Peak``)."""
    if row.flops is None:
        return "n/a", "n/a"
    return _gflops(row.flops / row.seconds), f"{peak.mfu(row.flops, row.seconds):.0%}"


def _gflops(flops_per_s: float) -> str:
    g = flops_per_s / 1e9
    return f"{g:,.1f}" if g >= 10 else f"{g:.3g}"


def _peak_line(peak) -> str:
    return (f"matmul peak, measured in this run: {peak.gflops:,.1f} GFLOP/s (F.linear {peak.size}^3, {peak.dtype}, "
            f"{peak.device}, best of {peak.calls}); MFU = achieved matmul FLOP/s (kvdiag.trace.cost) / that peak")


def _table(title: str, columns: tuple[str, ...]) -> Table:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col == "method" else "right")
    return table


def _mb(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"

"""``kvdiag figures``: Appendix D diagnostics (blind spot, delayed reads) and the AvoKV-E component figure."""

from __future__ import annotations

from pathlib import Path

import typer

from kvdiag.cli import common
from kvdiag.core.guard import check_outputs
from kvdiag.core.progress import plain_console
from kvdiag.figures.config import FigureParams

_D = FigureParams()


def figures(
    ctx: typer.Context,
    trace: Path = common.flag("--trace", ..., "Trace directory written by kvdiag trace"),
    labels: Path = common.flag("--labels", ..., "labels.parquet written by kvdiag label (token granularity is "
                                                      "used)"),
    scores: Path = common.flag("--scores", ..., "scores.parquet written by kvdiag score (for the component "
                                                      "figure)"),
    out: Path = common.flag("--out", ..., "output directory (PNG, PDF, CSV, figures.json)"),
    rank_eval: Path | None = typer.Option(None, "--rank-eval", help="a kvdiag rank-eval directory: reuse its "
                                                                    "metrics.csv"),
    w_obs: int = typer.Option(_D.w_obs, help="observation window: p's window [t-W, t); (b)'s first window [i+1, "
                                             "i+1+W)"),
    w_delay: int = typer.Option(_D.w_delay, help="p is normalized over entries of age > w_delay (AvoKV-E's C_t); 0: "
                                                 "whole cache"),
    payload: str = typer.Option(_D.payload, help="value payload b: l2 | l1 | range | var"),
    harm: str = common.Harm,
    include_unresolved: bool = common.IncludeUnresolved,
    noise_mult: float = common.NoiseMult,
    low_attention_quantile: float = typer.Option(_D.low_attention_quantile, help="low attention: p below this "
                                                                                 "quantile of its checkpoint"),
    large_payload_quantile: float = typer.Option(_D.large_payload_quantile, help="large payload: b above this "
                                                                                 "quantile of its checkpoint"),
    read_reduce: str = typer.Option(_D.read_reduce, help="read strength: mean or max over layers and query heads"),
    strong_read_mult: float = typer.Option(_D.strong_read_mult, help="strong read: strength >= this many times "
                                                                     "uniform attention 1/(tau+1)"),
    interval: int = typer.Option(_D.interval, help="a window-only rule compresses every INTERVAL generated tokens"),
    min_group: int = typer.Option(_D.min_group, help="fewest candidates per compared group for a test (else n/a + "
                                                     "note)"),
    bootstrap: int = common.Bootstrap,
    seed: int = typer.Option(_D.seed, help="bootstrap seed"),
    rho: float = typer.Option(_D.rho, help="eviction fraction of the false-safe rate"),
    scope: str = typer.Option(_D.scope, help="component metrics: pooled or macro"),
    min_age: int | None = common.MinAge,
    max_age: int | None = common.MaxAge,
    eligible: str | None = common.Eligible,
) -> None:
    """Draw the attention-only blind spot, the delayed-read effect and the AvoKV-E component figure."""
    check_outputs({"--out": (out, "dir")},
                  {"--trace": trace, "--labels": labels, "--scores": scores, "--rank-eval": rank_eval})
    from kvdiag.trace.manifest import TraceFiles

    # the settings, the inputs (their contracts: polars only) and the Trace they were made from, before torch and
    # matplotlib are imported (what needs the Trace's tensors: figures_files)
    params = FigureParams(
        w_obs=w_obs, w_delay=w_delay, payload=payload, harm=harm, include_unresolved=include_unresolved,
        noise_mult=noise_mult, low_attention_quantile=low_attention_quantile,
        large_payload_quantile=large_payload_quantile, read_reduce=read_reduce, strong_read_mult=strong_read_mult,
        interval=interval, min_group=min_group, n_boot=bootstrap, seed=seed, rho=rho, scope=scope, min_age=min_age,
        max_age=max_age, eligible=eligible,
    )
    trace_files = TraceFiles(trace)
    from kvdiag.core.contracts import belongs, read_labels, read_scores  # polars: only now

    belongs(trace_files, read_labels(labels)[1], f"--labels {labels}")
    belongs(trace_files, read_scores(scores)[1], f"--scores {scores}")
    if rank_eval is not None:
        from kvdiag.rankeval.run import load_metrics  # polars: only now

        load_metrics(rank_eval)
    from kvdiag.figures.run import figures_files
    result = figures_files(trace, labels, scores, out, params, rank_eval, command=invocation(ctx))
    console = plain_console()
    a, b = result["blind_spot"], result["delayed_reads"]
    console.print(f"blind spot: {a['n_blind_spot']:.0f} of {a['n_low_attention']:.0f} low-attention "
                  "candidates have large "
                  f"payloads, {a['n_blind_spot_high_damage']:.0f} high-damage; Fisher p = {a['fisher_p']:.3g}, "
                  f"rank-biserial r = {a['rank_biserial']:.3g}", highlight=False)
    console.print(f"delayed reads: {b['n_delayed']:.0f} delayed, {b['n_never']:.0f} never read, "
                  f"{b['n_early']:.0f} early; "
                  f"share evicted before the read {b['share_evicted_before_read']:.3g}; KL delayed vs never r = "
                  f"{b['rank_biserial']:.3g}",
                  highlight=False)
    for note in result["notes"]:
        console.print(f"note: {note}", highlight=False)
    console.print(f"wrote {len(result['files'])} files to {out}", highlight=False)


def invocation(ctx: typer.Context) -> list[str]:
    """The running command as argv: ``kvdiag NAME`` and every option the user set (defaults left out)."""
    argv = ["kvdiag", ctx.info_name]
    for param in ctx.command.params:
        if ctx.get_parameter_source(param.name).name == "DEFAULT":
            continue
        value, flag = ctx.params[param.name], max(param.opts, key=len)
        if getattr(param, "is_flag", False):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv

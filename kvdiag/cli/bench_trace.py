"""``kvdiag bench trace``: tracing time vs plain SDPA generation, as a ratio in one run, with each method's
achieved matmul FLOP/s and MFU against the matmul peak measured at the model's dtype in the same run."""

from __future__ import annotations

from rich.console import Console

from kvdiag.cli import common
from kvdiag.core.progress import plain_console


def bench_trace(
    model: str = common.Model, prompts: str = common.Prompts, limit: int = common.flag("--limit", 2),
    max_new_tokens: int = common.flag("--max-new-tokens", 128),
    repeats: int = common.flag("--repeats", 2, "alternating runs per method (best reported)"),
    dtype: str = common.Dtype, device: str = common.Device,
) -> None:
    """Time `kvdiag trace` (record + write) against plain `generate` on the same prompts."""
    from kvdiag.core import parsing
    from kvdiag.core.errors import UserError
    from kvdiag.model.specs import check_model_spec
    from kvdiag.tasks.prompts import load_prompts

    # the arguments, before torch is imported
    for flag, value in (("--max-new-tokens", max_new_tokens), ("--repeats", repeats)):
        if value < 1:
            raise UserError(f"{flag} {value}: use a positive number")
    check_model_spec(model)
    parsing.check_dtype(dtype)
    parsing.check_device_name(device)
    items = load_prompts(prompts, limit=limit)
    from kvdiag.kernels.peak import model_peak
    from kvdiag.model.load import load_model
    from kvdiag.trace.bench import run_trace_bench

    common.quiet_transformers()
    lm = load_model(model, dtype=dtype, device=device)
    peak = model_peak(lm)
    r = run_trace_bench(lm, items, max_new_tokens, repeats)

    def rate(s: float) -> str:
        return f"{r.flops / s / 1e9:,.2f} GFLOP/s, MFU {peak.mfu(r.flops, s):.1%}"

    weights = " (random weights)" if lm.random else ""
    plain_console(width=max(120, Console().width)).print(
        f"bench trace: {model}{weights} {dtype} on {device}, {len(items)} prompts, {r.tokens} tokens, "
        f"{r.flops / 1e9:,.1f} GFLOP of matmuls per run (kvdiag.trace.cost)\n"
        f"  plain generate (sdpa): {r.plain_s:.2f} s ({rate(r.plain_s)})\n"
        f"  kvdiag trace:          {r.trace_s:.2f} s ({rate(r.trace_s)})\n"
        f"  ratio trace / plain:   {r.ratio:.3f}\n"
        f"  matmul peak, measured in this run: {peak.gflops:,.1f} GFLOP/s (F.linear {peak.size}^3, {peak.dtype}); "
        "batch-1 decoding is bound by memory bandwidth (every weight read once per token), hence the low MFU"
    )

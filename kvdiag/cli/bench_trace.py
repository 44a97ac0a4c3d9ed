"""``kvdiag bench trace``: tracing time vs plain SDPA generation, as a ratio in one run."""

from __future__ import annotations

import typer
from rich.console import Console

from kvdiag.cli import common


def bench_trace(
    model: str = common.Model, prompts: str = common.Prompts, limit: int = typer.Option(2, "--limit"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    repeats: int = typer.Option(2, "--repeats", help="alternating runs per method (best reported)"),
    dtype: str = common.Dtype, device: str = common.Device,
) -> None:
    """Time `kvdiag trace` (record + write) against plain `generate` on the same prompts."""
    from kvdiag.models import load_model
    from kvdiag.prompts import load_prompts
    from kvdiag.trace.bench import run_trace_bench

    common.quiet_transformers()
    items = load_prompts(prompts, limit=limit)
    lm = load_model(model, dtype=dtype, device=device)
    r = run_trace_bench(lm, items, max_new_tokens, repeats)
    Console().print(
        f"bench trace: {model} {dtype} on {device}, {len(items)} prompts, {r.tokens} tokens\n"
        f"  plain generate (sdpa): {r.plain_s:.2f} s\n  kvdiag trace:          {r.trace_s:.2f} s\n"
        f"  ratio trace / plain:   {r.ratio:.3f}"
    )

"""``kvdiag bench kernels``: eviction kernels vs their torch reference and the obvious composition, with the
attention's FLOP/s and MFU against the matmul peak measured at the same dtype in the same run, and the
compaction's GB/s."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from kvdiag.cli import common
from kvdiag.core.errors import UserError
from kvdiag.core.progress import plain_console


def bench_kernels(
    device: str = typer.Option("cpu", help="cpu, cuda or cuda:N"),
    n: int = common.flag("--n", 64, "candidate rows N of shared_prefix_attention"),
    prefix: int = typer.Option(512, help="shared prefix length P"),
    window: int = typer.Option(16, help="teacher-forced window W (suffix length)"),
    heads: int = typer.Option(9, help="query heads H"), kv_heads: int = typer.Option(3, help="KV heads Hkv"),
    head_dim: int = typer.Option(64, help="head dim d"),
    exclude: int = typer.Option(1, help="excluded prefix entries per row E"),
    trace_len: int = typer.Option(16384, help="cache length T for compact_kv"),
    keep_fraction: float = typer.Option(0.5, help="fraction of the T entries compact_kv keeps"),
    dtype: str = typer.Option("float32", help="float32, float16 or bfloat16"),
    repeats: int = typer.Option(5, help="timed calls per implementation (best reported)"),
    seed: int = typer.Option(0, help="seed of the random inputs"),
) -> None:
    """Time and peak memory of each eviction kernel: Triton (CUDA), torch reference, obvious composition."""
    from kvdiag.core.parsing import check_device_name, check_dtype

    check_dtype(dtype)
    check_device_name(device)
    if heads % kv_heads:
        raise UserError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")
    if not 0 < keep_fraction <= 1:
        raise UserError(f"--keep-fraction {keep_fraction} must be in (0, 1]")
    import torch  # once the arguments are checked

    from kvdiag.kernels import triton_available
    from kvdiag.kernels.bench import run_kernel_bench
    from kvdiag.kernels.peak import matmul_peak
    from kvdiag.model.load import check_device, parse_dtype

    torch_dtype = parse_dtype(dtype)
    check_device(device)
    peak = matmul_peak(device, torch_dtype)
    rows = run_kernel_bench(
        device, n, prefix, window, heads, kv_heads, head_dim, exclude, trace_len,
        keep_fraction, torch_dtype, repeats, seed,
    )
    obvious = {r.op: r for r in rows if r.impl == "obvious"}
    triton = ("yes" if triton_available() else "not installed") if device.startswith("cuda") else "CUDA only"
    table = Table(title=f"eviction kernels on {device} ({dtype}, threads={torch.get_num_threads()}, triton: {triton})")
    table.add_column("op", no_wrap=True)
    table.add_column("impl", no_wrap=True)
    for col in ("ms", "speed-up vs obvious", "GFLOP/s", "MFU", "GB/s", "peak MB", "memory vs obvious",
                "max |err| vs torch"):
        table.add_column(col, justify="right")
    for r in rows:
        base = obvious[r.op]
        mem_ratio = f"{r.peak_mb / base.peak_mb:.2f}x" if r.peak_mb and base.peak_mb else "n/a"
        s = r.ms / 1e3
        table.add_row(
            r.op, r.impl, f"{r.ms:.2f}", f"{base.ms / r.ms:.2f}x",
            "-" if r.flops is None else f"{r.flops / s / 1e9:,.1f}",
            "-" if r.flops is None else f"{peak.mfu(r.flops, s):.0%}",
            "-" if r.bytes is None else f"{r.bytes / s / 1e9:,.1f}",
            "n/a" if r.peak_mb is None else f"{r.peak_mb:.1f}", mem_ratio, f"{r.max_err:.1e}",
        )
    console = plain_console(width=max(140, Console().width))  # piped output defaults to 80 columns
    console.print(table)
    console.print(f"matmul peak, measured in this run: {peak.gflops:,.1f} GFLOP/s (F.linear {peak.size}^3, {dtype}); "
                  "MFU: the attention's QK + PV FLOPs / that peak; GB/s: the kept entries read and written")

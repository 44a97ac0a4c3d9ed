"""``kvdiag bench peak``: the machine's matmul peak per dtype, measured in one run (the denominator of MFU)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from kvdiag.cli import common
from kvdiag.core import parsing
from kvdiag.core.progress import plain_console

MAX_SECONDS = 3600.0  # per dtype; a longer timing only hangs the command


def bench_peak(
    device: str = common.Device,
    dtypes: list[str] = common.flag("--dtype", ["float32,bfloat16"], "dtypes to time, comma-separated or "
                                                                            "repeated (float32, float16, bfloat16)"),
    size: int = typer.Option(0, "--size", help="matrix size n of the n x n x n product (0: 2048 on CPU, 8192 on "
                                               "CUDA)"),
    seconds: float = typer.Option(1.0, "--seconds", help="time each dtype for about this long (best call kept)"),
) -> None:
    """Time a large square matmul (F.linear, the product of a linear layer) per dtype: GFLOP/s, one run."""
    from kvdiag.core.errors import UserError, check_number

    # the arguments, before torch is imported
    parsing.check_device_name(device)
    names = [parsing.check_dtype(d) for d in parsing.parse_list(dtypes, "--dtype", str, example="float32,bfloat16")]
    if size < 0:
        raise UserError(f"--size {size}: use a size >= 0 (0: the default)")
    check_number("--seconds", seconds, 0, MAX_SECONDS, open_low=True)
    import torch

    from kvdiag.kernels.peak import matmul_peak
    from kvdiag.model.load import check_device, parse_dtype

    device = check_device(device)
    torch_dtypes = [parse_dtype(d) for d in names]
    peaks = [matmul_peak(device, dt, size or None, seconds, min_calls=2) for dt in torch_dtypes]
    table = Table(title=f"matmul peak on {device} (F.linear n x n x n, best call; threads={torch.get_num_threads()})")
    for col in ("dtype", "n", "calls", "GFLOP/s", "vs first dtype"):
        table.add_column(col, justify="left" if col == "dtype" else "right")
    for p in peaks:
        table.add_row(p.dtype, str(p.size), str(p.calls), f"{p.gflops:,.1f}", f"{p.gflops / peaks[0].gflops:.2f}x")
    plain_console(width=max(100, Console().width)).print(table)

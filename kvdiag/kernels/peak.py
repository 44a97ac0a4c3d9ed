"""The machine's matmul peak, measured, and model FLOP utilization (MFU) against it.

MFU here = achieved matmul FLOP/s of a run (its FLOPs counted by ``kvdiag.trace.cost``, divided by its wall time) /
the FLOP/s of one large square matmul ``F.linear(a, b) = a @ b^T`` (the product ``nn.Linear`` computes) in the
same dtype on the same device, timed in the same process a few seconds apart. Both are measured on the same
machine in the same run, so the ratio holds on a shared or throttled machine where a datasheet peak would not;
it is the fraction of what this machine's GEMM reaches, not of the vendor's number. ``kvdiag bench peak`` prints
the peak per dtype; ``kvdiag bench label``, ``bench trace`` and ``bench kernels`` measure it at their own dtype
and print MFU beside their FLOP/s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvdiag.kernels.bench import sync

# default matmul sizes: large enough to reach the GEMM's plateau, short enough for a bench's preamble
# (CPU: 2,048^3 = 17 GFLOP per call, ~0.2 s at 100 GFLOP/s; CUDA: 8,192^3 = 1.1 TFLOP, ~1.5 ms in bf16)
CPU_SIZE, CUDA_SIZE = 2048, 8192


@dataclass(frozen=True)
class Peak:
    """The best FLOP/s of a ``size``^3 matmul in ``dtype`` on ``device`` over ``calls`` timed calls."""

    device: str
    dtype: str
    size: int
    calls: int
    flops_per_s: float

    @property
    def gflops(self) -> float:
        return self.flops_per_s / 1e9

    def mfu(self, flops: float, seconds: float) -> float:
        """``flops`` done in ``seconds`` as a fraction of this peak."""
        return flops / seconds / self.flops_per_s

    def to_dict(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "size": self.size, "calls": self.calls,
                "gflops": self.gflops}


@torch.no_grad()
def matmul_peak(device: str = "cpu", dtype: torch.dtype = torch.float32, size: int | None = None,
                seconds: float = 1.0, min_calls: int = 3) -> Peak:
    """Time ``F.linear(a, b)`` (``size`` x ``size``, ``dtype``, on ``device``) for about ``seconds`` after a
    warm-up call; the best call's FLOP/s (2·size³ FLOPs) is the peak: the least disturbed by other processes.
    ``F.linear`` (b transposed), not ``a @ b``: on a CPU without bf16 instructions torch's bf16 ``a @ b`` takes a
    path 3x slower than the one linear layers take. fp32 on CUDA is the plain fp32 GEMM (TF32 as torch's current
    setting: off by default)."""
    dev = torch.device(device)
    n = size or (CUDA_SIZE if dev.type == "cuda" else CPU_SIZE)
    gen = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, generator=gen).to(dtype)
    b = torch.randn(n, n, device=dev, generator=gen).to(dtype)
    F.linear(a, b)  # warm-up: kernel choice, the allocator
    sync(dev)
    best, calls, start = float("inf"), 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        F.linear(a, b)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
        calls += 1
    return Peak(str(dev), str(dtype).removeprefix("torch."), n, calls, 2 * n**3 / best)


def model_peak(lm) -> Peak:
    """The matmul peak at ``lm``'s dtype and device (``kvdiag.model.load.LoadedModel``)."""
    return matmul_peak(lm.device, next(lm.model.parameters()).dtype)

"""Benchmark of the eviction kernels: each backend vs the obvious torch composition, time and peak memory.

``run_kernel_bench`` returns one row per (op, implementation); ``kvdiag bench kernels`` prints them.
The "obvious" implementations are what one writes without these kernels (and what transformers' sdpa
path does with a 4D mask): copy the prefix per row, repeat KV heads, mask, SDPA; ``torch.gather``;
materialize the window's attention rows.

Each row also carries the op's useful work: ``shared_prefix_attention``'s matmul FLOPs (QK and PV over the keys
each query sees: 4·d per key, exclusions not subtracted; the same for every implementation) and ``compact_kv``'s
bytes (the kept entries read and written), so the CLI prints FLOP/s, MFU against a measured matmul peak, and GB/s.
"""

from __future__ import annotations

import ctypes
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kvdiag import kernels
from kvdiag.kernels import torch_ref


@dataclass
class KernelBenchRow:
    op: str
    impl: str
    ms: float  # best wall time per call over the repeats (least disturbed by other processes)
    peak_mb: float | None  # peak extra memory of one call, output included (None: not measurable here)
    max_err: float  # max |out - torch reference| (fp32)
    flops: float | None = None  # useful matmul FLOPs of one call (attention)
    bytes: float | None = None  # bytes read + written by one call (compaction)


def attention_flops(n: int, heads: int, window: int, suffix: int, prefix: int, head_dim: int) -> float:
    """QK and PV FLOPs of ``shared_prefix_attention``: N rows x H heads x W queries, query w (the suffix's
    ``S - W + w``-th) reading the P prefix keys and ``S - W + w + 1`` suffix keys, 4·d FLOPs per key."""
    keys = window * (prefix + suffix - window) + window * (window + 1) / 2
    return 4.0 * n * heads * head_dim * keys


def obvious_shared_prefix_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, exclude, scale):
    """The composition without the kernel: q [N, H, W, d], prefix [Hkv, P, d], suffix [N, Hkv, S, d],
    exclude [N, E] -> [N, H, W, d]. Copies the prefix per row (expand + cat), repeats KV heads,
    builds a bool mask [N, 1, W, P + S] and calls SDPA."""
    N, H, W, _ = q.shape
    Hkv, P, _ = prefix_k.shape
    S = suffix_k.shape[2]
    g = H // Hkv
    k = torch.cat([prefix_k.expand(N, -1, -1, -1), suffix_k], 2).repeat_interleave(g, 1)
    v = torch.cat([prefix_v.expand(N, -1, -1, -1), suffix_v], 2).repeat_interleave(g, 1)
    seen = torch.ones(N, P + 1, dtype=torch.bool, device=q.device)  # column P absorbs -1
    seen.scatter_(1, torch.where(exclude < 0, P, exclude), False)
    causal = torch.arange(S, device=q.device)[None, :] <= (S - W + torch.arange(W, device=q.device))[:, None]
    mask = torch.cat([seen[:, None, None, :P].expand(N, 1, W, P), causal.expand(N, 1, W, S)], -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def obvious_compact_kv(keys, values, keep):
    """``torch.gather`` with the index expanded over d: keys, values [Hkv, T, d], keep [Hkv, B]."""
    idx = keep[..., None].expand(-1, -1, keys.shape[-1])
    return keys.gather(1, idx), values.gather(1, idx)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a timer reads finished work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fns: dict[str, Callable[[], object]], device: torch.device, repeats: int) -> dict[str, float]:
    """Best wall time of each function over ``repeats`` calls, after one warm-up call each (Triton
    compilation, allocator). The calls go round-robin, so a noisy spell of the machine does not hit one
    function only."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            best[name] = min(best[name], seconds(fn, device))
    return best


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call of ``fn``, with the device's queued work finished before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def rss_kb(field: str) -> int:
    """A memory field of /proc/self/status in KiB: ``VmRSS`` now, ``VmHWM`` the peak of this process image
    (unlike ``getrusage``'s ru_maxrss, which keeps the peak of the process that forked us across exec)."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def cpu_peak_probe() -> Callable[[], None] | None:
    """A reset of the peak-RSS counter, or None where unsupported. Linux resets a process's VmHWM when
    it writes 5 to /proc/self/clear_refs; glibc's malloc_trim first returns freed heap pages, which
    would otherwise be reused without showing up in RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None

    def reset() -> None:
        trim(0)
        Path("/proc/self/clear_refs").write_text("5")

    return reset


def peak_mb(fn: Callable[[], object], device: torch.device, cpu_reset: Callable[[], None] | None) -> float | None:
    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    if cpu_reset is None:
        return None
    cpu_reset()
    base = rss_kb("VmRSS")
    fn()
    return (rss_kb("VmHWM") - base) / 1024


def run_kernel_bench(
    device: str = "cpu", n: int = 64, prefix: int = 512, window: int = 16, heads: int = 9, kv_heads: int = 3,
    head_dim: int = 64, exclude: int = 1, trace_len: int = 16384, keep_fraction: float = 0.5,
    dtype: torch.dtype = torch.float32, repeats: int = 5, seed: int = 0,
) -> list[KernelBenchRow]:
    """Time and peak memory of every implementation of the two ops on ``device``.

    shared_prefix_attention: N rows, prefix P, window W (= suffix length), E exclusions per row
    ([N, E], every KV head); compact_kv: T = ``trace_len`` entries, ``keep_fraction`` of them kept.
    Implementations: "triton" (CUDA with triton only), "torch" (reference), "obvious".
    """
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)

    scale = head_dim**-0.5
    spa = (
        rand(n, heads, window, head_dim), rand(kv_heads, prefix, head_dim), rand(kv_heads, prefix, head_dim),
        rand(n, kv_heads, window, head_dim), rand(n, kv_heads, window, head_dim),
        torch.randint(0, prefix, (n, exclude), generator=gen).to(dev), scale,
    )
    keys, values = rand(kv_heads, trace_len, head_dim), rand(kv_heads, trace_len, head_dim)
    budget = max(1, int(keep_fraction * trace_len))
    keep = torch.stack([torch.randperm(trace_len, generator=gen)[:budget].sort().values for _ in range(kv_heads)]).to(
        dev
    )

    triton_ok = dev.type == "cuda" and kernels.triton_available()
    cases: list[tuple[str, Callable, dict[str, Callable[[], object]]]] = [
        (
            "shared_prefix_attention",
            lambda: torch_ref.shared_prefix_attention(
                *spa[:5], kernels.normalize_exclude(spa[5], n, kv_heads, dev), scale
            ),
            {
                "triton": lambda: kernels.shared_prefix_attention(*spa, backend="triton"),
                "torch": lambda: kernels.shared_prefix_attention(*spa, backend="torch"),
                "obvious": lambda: obvious_shared_prefix_attention(*spa),
            },
        ),
        (
            "compact_kv",
            lambda: torch_ref.compact_kv(keys, values, keep)[0],
            {
                "triton": lambda: kernels.compact_kv(keys, values, keep, backend="triton"),
                "torch": lambda: kernels.compact_kv(keys, values, keep, backend="torch"),
                "obvious": lambda: obvious_compact_kv(keys, values, keep),
            },
        ),
    ]
    work = {"shared_prefix_attention": (attention_flops(n, heads, window, window, prefix, head_dim), None),
            "compact_kv": (None, 2.0 * 2 * kv_heads * budget * head_dim * keys.element_size())}
    timed = []
    for op, reference, impls in cases:
        ref = reference().float()
        for impl, fn in impls.items():
            if impl == "triton" and not triton_ok:
                continue
            out = fn()
            err = (torch.as_tensor(out[0] if isinstance(out, tuple) else out).float() - ref).abs().max().item()
            del out
            timed.append((op, impl, fn, best_seconds({impl: fn}, dev, repeats)[impl] * 1e3, err))
    cpu_reset = cpu_peak_probe() if dev.type == "cpu" else None
    return [KernelBenchRow(op, impl, ms, peak_mb(fn, dev, cpu_reset), err, *work[op])
            for op, impl, fn, ms, err in timed]

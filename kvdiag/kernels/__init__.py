"""Eviction kernels: physical compaction and shared-prefix attention with per-row exclusions.

Each op takes ``backend="auto" | "torch" | "triton"``. ``auto`` picks Triton when the tensors are on
CUDA and triton imports (``pip install 'kvdiag[cuda]'``), the torch reference otherwise (and for fp32 attention:
``attention_backend``). Both backends
compute in fp32 (Triton: fp32 accumulation, inputs in their own dtype) and agree within the tolerances
stated in ``tests/test_kernels.py``. Shapes: see ``kvdiag.kernels.torch_ref``.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import BACKENDS
from kvdiag.kernels import torch_ref
from kvdiag.model.attention import group_size

Backend = Literal["auto", "torch", "triton"]

__all__ = [
    "BACKENDS", "attention_backend", "compact_kv", "normalize_exclude", "resolve_backend", "shared_prefix_attention",
    "triton_available",
]


@functools.cache
def triton_available() -> bool:
    """Whether the optional ``triton`` package (the ``kvdiag[cuda]`` extra) imports."""
    try:
        import triton  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"torch"`` or ``"triton"`` for tensors on ``device`` (see the module docstring for ``auto``)."""
    if backend not in BACKENDS:
        raise UserError(f"unknown kernel backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise UserError("kernel backend 'triton' needs triton: pip install 'kvdiag[cuda]'")
    return backend


def attention_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend of ``shared_prefix_attention``: as ``resolve_backend``, except that ``auto`` keeps fp32 inputs on
    the torch reference. On an H200 (reports/gpu-check) the Triton kernel's IEEE fp32 dot ran at 0.58 TFLOP/s,
    4.5-9.4x slower than the torch reference's fp32 matmuls, and 56-88x faster in bf16."""
    resolved = resolve_backend(backend, device)
    return "torch" if backend == "auto" and dtype == torch.float32 else resolved


def _triton():
    from kvdiag.kernels import triton_kernels

    return triton_kernels


def normalize_exclude(exclude: torch.Tensor | None, n: int, num_kv_heads: int, device: torch.device) -> torch.Tensor:
    """Exclusions as int64 [N, Hkv, E]: ``None`` -> E = 0; [N, E] applies to every KV head (a stride-0
    view, no copy); [N, Hkv, E] is per KV head. ``-1`` = no exclusion; repeated indices are allowed."""
    if exclude is None:
        return torch.empty(n, num_kv_heads, 0, dtype=torch.int64, device=device)
    exclude = exclude.to(device=device, dtype=torch.int64)
    if exclude.dim() == 2 and exclude.shape[0] == n:
        return exclude[:, None, :].expand(n, num_kv_heads, exclude.shape[1])
    if exclude.dim() == 3 and exclude.shape[:2] == (n, num_kv_heads):
        return exclude
    raise ValueError(f"exclude must be [N, E] or [N, Hkv, E] with N={n}, Hkv={num_kv_heads}; got {list(exclude.shape)}")


def compact_kv(
    keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, backend: Backend = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical eviction (per-head gather of kept entries).

    keys, values [Hkv, T, d]; keep [Hkv, B] kept positions per head, ascending to keep temporal
    order. Returns ``(keys [Hkv, B, d], values [Hkv, B, d])`` in the input dtype.
    """
    if keys.dim() != 3 or values.shape != keys.shape or keep.dim() != 2 or keep.shape[0] != keys.shape[0]:
        raise ValueError(
            f"compact_kv needs keys/values [Hkv, T, d] and keep [Hkv, B]; got {list(keys.shape)}, "
            f"{list(values.shape)}, {list(keep.shape)}"
        )
    if resolve_backend(backend, keys.device) == "triton":
        return _triton().compact_kv(keys, values, keep)
    return torch_ref.compact_kv(keys, values, keep)


def shared_prefix_attention(
    q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor,
    exclude: torch.Tensor | None, scale: float | None = None, backend: Backend = "auto", chunk: int | None = None,
    window: int | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of N candidate rows over one shared prefix plus each row's own causal suffix.

    q [N, H, W, d] (the last W suffix positions of each row); prefix_k, prefix_v [Hkv, P, d] (shared,
    never copied per row); suffix_k, suffix_v [N, Hkv, S, d] with S >= W; exclude [N, E] (all KV heads)
    or [N, Hkv, E] (per KV head) prefix positions each row does not see, ``-1`` = none, or ``None``.
    Query head h reads KV head h // g; ``scale`` defaults to d ** -0.5. ``chunk``: rows per chunk on
    the torch backend (default: ``torch_ref.LOGITS_CHUNK_BYTES`` of prefix logits).
    ``window`` / ``softcap`` / ``sinks [H]``: the layer's attention semantics
    (``kvdiag.model.adapters.LayerAttention``),
    with prefix entry j at absolute position j and the suffix right after it (see ``torch_ref``).
    Returns [N, H, W, d] in q's dtype; equals deleting the excluded entries from each row's cache.
    """
    N, H, W, d = q.shape
    Hkv, P, _ = prefix_k.shape
    group_size(H, Hkv)
    S = suffix_k.shape[2]
    if (
        prefix_v.shape != prefix_k.shape
        or prefix_k.shape[2] != d
        or suffix_k.shape != (N, Hkv, S, d)
        or suffix_v.shape != suffix_k.shape
        or S < W
    ):
        raise ValueError(
            f"shared_prefix_attention needs q [N, H, W, d], prefix [Hkv, P, d], suffix [N, Hkv, S>=W, d]; got "
            f"{list(q.shape)}, {list(prefix_k.shape)}/{list(prefix_v.shape)}, "
            f"{list(suffix_k.shape)}/{list(suffix_v.shape)}"
        )
    if len({t.dtype for t in (q, prefix_k, prefix_v, suffix_k, suffix_v)}) != 1:
        raise ValueError("shared_prefix_attention needs q, prefix and suffix tensors of one dtype")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of keys, got {window}")
    if sinks is not None and tuple(sinks.shape) != (H,):
        raise ValueError(f"sinks must be [H={H}], got {list(sinks.shape)}")
    ex = normalize_exclude(exclude, N, Hkv, q.device)
    scale = d**-0.5 if scale is None else scale
    semantics = dict(window=window, softcap=softcap, sinks=sinks)
    if attention_backend(backend, q.device, q.dtype) == "triton":
        return _triton().shared_prefix_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, ex, scale, **semantics)
    return torch_ref.shared_prefix_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, ex, scale, chunk, **semantics)


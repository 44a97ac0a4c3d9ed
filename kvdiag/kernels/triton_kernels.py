"""Triton implementations of the eviction kernels (CUDA; CPU tensors only under ``TRITON_INTERPRET=1``).

Same contracts as ``kvdiag.kernels.torch_ref`` (shapes documented there). Imported lazily by
``kvdiag.kernels`` so the package works without triton. ``triton.jit`` reads ``TRITON_INTERPRET`` at
decoration time, and triton's own library functions are decorated when triton is imported, so the
interpreter is chosen per process: set ``TRITON_INTERPRET=1`` before triton is first imported.

Layout trick shared by the attention kernels: the ``g`` query heads of one KV head are processed as
one block of ``g * W`` query rows (row ``r`` = head ``kv * g + r // W``, query ``r % W``), so each
key block is loaded once per KV head, also when ``W = 1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# Key-block width of the attention loops; tests pass smaller blocks to cross block boundaries.
BLOCK_N = 64
# Most query rows per program (``g * W`` rows are split into blocks of at most this many).
MAX_BLOCK_M = 64


def _block(n: int, cap: int | None = None) -> int:
    """Power of two >= n and >= 16 (``tl.dot`` needs dims >= 16), at most ``cap``."""
    b = max(16, triton.next_power_of_2(n))
    return min(b, cap) if cap else b


def _interpreted() -> bool:
    """Whether this module's kernels were built for the interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(_gather_rows_kernel, JITFunction)


def _check_launchable(t: torch.Tensor) -> None:
    if not t.is_cuda and not _interpreted():
        raise ValueError(
            "Triton kernels need CUDA tensors; on CPU start the process with TRITON_INTERPRET=1 "
            "(before triton is imported) or use backend='torch'"
        )


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products ("tf32" would cost ~1e-3 relative error and blur small KLs)
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _gather_rows_kernel(
    SRC, IDX, DST, s_h, s_t, s_d, i_h, i_b, o_h, o_b, o_d, B, D, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
):
    kv = tl.program_id(1)
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    dd = tl.arange(0, BLOCK_D)
    ok = (b < B)[:, None] & (dd < D)[None, :]
    t = tl.load(IDX + kv * i_h + b * i_b, mask=b < B, other=0)
    x = tl.load(SRC + kv * s_h + t[:, None] * s_t + dd[None, :] * s_d, mask=ok)
    tl.store(DST + kv * o_h + b[:, None] * o_b + dd[None, :] * o_d, x, mask=ok)


def compact_kv(
    keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, block_b: int = 64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``compact_kv``: keys, values [Hkv, T, d]; keep [Hkv, B] -> ([Hkv, B, d], [Hkv, B, d])."""
    _check_launchable(keys)
    Hkv, _, d = keys.shape
    B = keep.shape[1]
    outs = []
    for src in (keys, values):
        dst = torch.empty(Hkv, B, d, dtype=src.dtype, device=src.device)
        if B:
            _gather_rows_kernel[(triton.cdiv(B, block_b), Hkv)](
                src, keep, dst, *src.stride(), *keep.stride(), *dst.stride(), B, d,
                BLOCK_B=block_b, BLOCK_D=triton.next_power_of_2(d),
            )
        outs.append(dst)
    return outs[0], outs[1]


@triton.jit
def _softcap(s, cap):
    # cap * tanh(s / cap), with tanh(x) = 2 sigmoid(2x) - 1 (portable to the interpreter)
    return cap * (2.0 * tl.sigmoid(2.0 * s / cap) - 1.0)


@triton.jit
def _shared_prefix_kernel(
    Q, PK, PV, SK, SV, EX, SINK, O, q_n, q_h, q_w, q_d, pk_h, pk_p, pk_d, pv_h, pv_p, pv_d, sk_n, sk_h, sk_s, sk_d,
    sv_n, sv_h, sv_s, sv_d, ex_n, ex_h, ex_e, o_n, o_h, o_w, o_d, P, S, W, E, D, scale, window, cap,
    HKV: tl.constexpr, G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
    PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # one program: candidate row n, KV head kv, a block of its g*W query rows
    n = tl.program_id(1) // HKV
    kv = tl.program_id(1) % HKV
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < G * W
    head = kv * G + r // W
    w = r % W
    last_key = S - W + w  # the query's own suffix position: it sees suffix keys <= last_key
    dd = tl.arange(0, BLOCK_D)
    d_ok = dd < D
    q = tl.load(Q + n * q_n + head[:, None] * q_h + w[:, None] * q_w + dd[None, :] * q_d,
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    ee = tl.arange(0, BLOCK_E)
    ex = tl.load(EX + n * ex_n + kv * ex_h + ee * ex_e, mask=ee < E, other=-1)

    if HAS_SINKS:  # the sink logit starts the online softmax: max = sink, normalizer = exp(0)
        m_i = tl.load(SINK + head, mask=r_ok, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # absolute query position P + last_key; with a window it sees keys > that - window
    lo = P + last_key - window + 1
    # shared prefix: all queries see every entry that is not excluded for this row (and in its window)
    for start in range(0, P, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < P
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(PK + kv * pk_h + j[:, None] * pk_p + dd[None, :] * pk_d, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if HAS_SOFTCAP:
            s = _softcap(s, cap)
        hit = tl.sum((j[:, None] == ex[None, :]).to(tl.int32), axis=1)
        s = tl.where((j_ok & (hit == 0))[None, :], s, float("-inf"))
        if HAS_WINDOW:
            s = tl.where(j[None, :] >= lo[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully hidden block adds nothing
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(PV + kv * pv_h + j[:, None] * pv_p + dd[None, :] * pv_d, mask=kv_ok, other=0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # the row's own suffix, causal
    for start in range(0, S, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < S
        kv_ok = j_ok[:, None] & d_ok[None, :]
        k = tl.load(SK + n * sk_n + kv * sk_h + j[:, None] * sk_s + dd[None, :] * sk_d, mask=kv_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if HAS_SOFTCAP:
            s = _softcap(s, cap)
        s = tl.where(j_ok[None, :] & (j[None, :] <= last_key[:, None]), s, float("-inf"))
        if HAS_WINDOW:
            s = tl.where(P + j[None, :] >= lo[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(SV + n * sv_n + kv * sv_h + j[:, None] * sv_s + dd[None, :] * sv_d, mask=kv_ok, other=0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]  # l_i > 0: every query sees its own suffix key
    tl.store(O + n * o_n + head[:, None] * o_h + w[:, None] * o_w + dd[None, :] * o_d,
             out.to(O.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


def shared_prefix_attention(
    q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, suffix_k: torch.Tensor, suffix_v: torch.Tensor,
    exclude: torch.Tensor, scale: float, block_n: int = BLOCK_N, window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton ``shared_prefix_attention`` (flash-style online softmax over prefix blocks, then the suffix).

    q [N, H, W, d]; prefix_k/v [Hkv, P, d]; suffix_k/v [N, Hkv, S, d]; exclude [N, Hkv, E] (-1 = none)
    -> [N, H, W, d] in q's dtype. ``block_n``: keys per block (power of two >= 16). ``window``,
    ``softcap``, ``sinks [H]``: the layer's semantics, positions as in ``torch_ref.shared_prefix_attention``.
    """
    _check_launchable(q)
    N, H, W, d = q.shape
    Hkv, P, _ = prefix_k.shape
    S = suffix_k.shape[2]
    g = H // Hkv
    E = exclude.shape[2]
    out = torch.empty_like(q)
    block_m = _block(g * W, MAX_BLOCK_M)
    sink = (sinks if sinks is not None else torch.zeros(H)).to(device=q.device, dtype=torch.float32).contiguous()
    _shared_prefix_kernel[(triton.cdiv(g * W, block_m), N * Hkv)](
        q, prefix_k, prefix_v, suffix_k, suffix_v, exclude, sink, out,
        *q.stride(), *prefix_k.stride(), *prefix_v.stride(), *suffix_k.stride(), *suffix_v.stride(),
        *exclude.stride(), *out.stride(), P, S, W, E, d, scale, window or 0, float(softcap or 1.0),
        HKV=Hkv, G=g, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block(d),
        BLOCK_E=triton.next_power_of_2(max(E, 2)), PRECISION=_precision(q.dtype),
        HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
    )
    return out


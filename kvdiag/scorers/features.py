"""Per-checkpoint features of cached entries, computed from a Trace's recorded q/k/v alone (no model).

Every function works on the tensors of one (prompt, layer) and a checkpoint ``t``: the cache holds
positions ``[0, t)`` and only queries at positions ``< t`` may be read (a feature never sees the future).
Shapes: ``q [H, t, d]``, ``k [Hkv, t, d]``, ``v [Hkv, t, d]`` (fp32); query head ``h`` reads KV head
``h // g`` (``g = H // Hkv``). Features that depend on every past query (cumulative attention, LazyEviction's
recurrence state, ThinKV's per-step sparsity) are streamed by :class:`AttentionHistory`, chunked over queries
so that memory stays ``O(H · T)`` plus one bounded chunk, whatever the trace length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvdiag.core.errors import UserError
from kvdiag.model.adapters import LayerAttention, as_layer_attention, attention_modules, output_projection
from kvdiag.model.attention import attention_rows, group_size

# Upper bound on the elements of one chunk of attention probabilities [H, queries, keys] (64 MiB in fp32);
# attention_rows needs about three buffers of this size at once.
CHUNK_ELEMENTS = 2**24
PAYLOADS = ("l2", "l1", "range", "var", "wo_l2")


def group_reduce(x: torch.Tensor, num_kv_heads: int, how: str = "mean") -> torch.Tensor:
    """Reduce per-query-head values ``x [H, ...]`` over each GQA group -> ``[Hkv, ...]`` (``mean`` or ``max``)."""
    g = group_size(x.shape[0], num_kv_heads)
    grouped = x.reshape(num_kv_heads, g, *x.shape[1:])
    return grouped.mean(dim=1) if how == "mean" else grouped.amax(dim=1)


def window_attention(q: torch.Tensor, k: torch.Tensor, attn: LayerAttention | float, window: int) -> torch.Tensor:
    """Exact attention of the observation window over the cache.

    q [H, t, d], k [Hkv, t, d]. Queries at positions ``[t - window, t)`` (clipped at 0), each softmaxed over
    every key it can see (``j <= tau``, within the layer's sliding window; ``attn``: the layer's
    ``LayerAttention`` or a bare scale), fp32. Returns ``[H, w, t]`` with ``w = min(window, t)``.
    """
    t = k.shape[1]
    start = max(0, t - window)
    return attention_rows(q[:, start:t], k, torch.arange(start, t), attn)


def read_pressure(attn: torch.Tensor, candidates: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Candidate-normalized read pressure ``p_i``.

    attn [H, W, t]: window attention rows; candidates [t] bool. For each query head, the mass the window puts on
    ``i`` divided by the mass it puts on the whole candidate set, then the mean over the group -> ``[Hkv, t]``.
    Non-candidates get the same ratio (mass on ``i`` over candidate mass), for completeness.
    """
    mass = attn.sum(dim=1)  # [H, t]
    total = mass[:, candidates].sum(dim=1, keepdim=True).clamp_min(torch.finfo(mass.dtype).tiny)
    return group_reduce(mass / total, num_kv_heads)


def mean_cosine_redundancy(k: torch.Tensor, candidates: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Key redundancy ``r_i``: mean cosine similarity of ``k_i`` to the *other* candidate keys of its head.

    k [Hkv, t, d], candidates [t] bool -> ``[Hkv, t]``. Uses ``mean_{j != i} k̂_i·k̂_j = (k̂_i·Σ_j k̂_j - k̂_i·k̂_i)
    / (|C| - 1)``, which is exact and linear in ``t`` (no ``t × t`` matrix). Non-candidates are compared with
    all candidates (nothing to exclude). A single candidate has no other key: its redundancy is 0.
    """
    kn = k / (k.norm(dim=-1, keepdim=True) + eps)
    total = kn[:, candidates].sum(dim=1)  # [Hkv, d]
    dots = kn @ total.unsqueeze(-1)  # [Hkv, t, 1]
    self_dot = (kn * kn).sum(dim=-1)
    n = int(candidates.sum())
    others = torch.where(candidates, torch.full_like(self_dot, n - 1.0), torch.full_like(self_dot, float(n)))
    own = torch.where(candidates, self_dot, torch.zeros_like(self_dot))
    return (dots.squeeze(-1) - own) / others.clamp_min(1.0)


def rkv_redundancy(k: torch.Tensor, threshold: float = 0.5, eps: float = 1e-8, block: int = 256) -> torch.Tensor:
    """R-KV's redundancy ``R`` over all ``n`` keys of each head (``cal_similarity``, retain_direction "last").

    k [Hkv, n, d] -> ``[Hkv, n]``, summing to 1 per head. Cosine matrix ``S`` with a zero diagonal; in each row
    ``i`` the entry of the largest ``j`` with ``S_ij > threshold`` (or column 0 when there is none, R-KV's quirk)
    is zeroed; ``R = softmax_j(mean_i S_ij)``. fp32 (R-KV runs in bf16, which creates ties).

    Same result without R-KV's ``n × n`` matrix: the column sums of ``S`` are ``k̂_j·Σ_i k̂_i − k̂_j·k̂_j``
    (linear in n); the retain rule then removes one entry per row, ``S[i, j*(i)]``, and ``j*`` is found by
    scanning ``block`` keys at a time from the newest, so most rows stop after the first block. Memory
    ``O(block · n)``; the worst case (rows without a near-duplicate) scans every block, ``O(n² d)`` as R-KV.
    """
    Hkv, n, _ = k.shape
    kn = k / (k.norm(dim=-1, keepdim=True) + eps)
    col_sum = (kn @ kn.sum(dim=1).unsqueeze(-1)).squeeze(-1) - (kn * kn).sum(dim=-1)
    last = torch.zeros(Hkv, n, dtype=torch.long)
    for h in range(Hkv):
        pending = torch.arange(n)
        for end in range(n, 0, -block):
            start = max(0, end - block)
            hit = kn[h, pending] @ kn[h, start:end].T > threshold  # [p, b]
            hit &= pending[:, None] != torch.arange(start, end)  # the diagonal is zero
            found = hit.any(dim=1)
            last[h, pending[found]] = end - 1 - hit[found].flip(1).int().argmax(dim=1)
            pending = pending[~found]
            if not len(pending):
                break
    removed = (kn * kn.gather(1, last.unsqueeze(-1).expand_as(kn))).sum(dim=-1)  # S[i, j*(i)]
    removed[:, 0] = torch.where(last[:, 0] == 0, 0.0, removed[:, 0])  # row 0 without a match hits the zero diagonal
    return torch.softmax(col_sum.scatter_add(1, last, -removed) / n, dim=-1)


def o_proj_weights(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The output projection ``W_O [hidden, H*d]`` of every decoder layer of a transformers causal LM (fp32)."""
    return {i: output_projection(m).weight.detach().float().cpu() for i, m in attention_modules(model).items()}


def value_payload(
    v: torch.Tensor, kind: str = "l2", o_proj: torch.Tensor | None = None, num_heads: int | None = None
) -> torch.Tensor:
    """Value payload ``b_i`` per KV head -> ``[Hkv, t]``.

    v [Hkv, t, d]. ``kind``: ``l2`` ‖v‖₂; ``l1`` ‖v‖₁ (VATP); ``range`` max_d v − min_d v (VaSE's default);
    ``var`` the variance over d (a VaSE variant); ``wo_l2`` ‖W_O^h v‖₂ per query head ``h`` of the group
    (W_O^h: the columns of o_proj [hidden, H*d] that read head ``h``), mean over the group — needs the model.
    """
    if kind == "l2":
        return v.norm(dim=-1)
    if kind == "l1":
        return v.abs().sum(dim=-1)
    if kind == "range":
        return v.amax(dim=-1) - v.amin(dim=-1)
    if kind == "var":
        return v.var(dim=-1, unbiased=False)
    if kind == "wo_l2":
        if o_proj is None or num_heads is None:
            raise UserError("payload wo_l2 (‖W_O v‖₂) needs the model's o_proj weights: pass --model (the Trace's "
                            "model) or use payload l2/range")
        Hkv, t, d = v.shape
        g = group_size(num_heads, Hkv)
        w = o_proj.float().reshape(o_proj.shape[0], num_heads, d).transpose(0, 1)  # [H, hidden, d]
        gram = w.transpose(1, 2) @ w  # [H, d, d]: ‖W v‖² = vᵀ(WᵀW)v without a [H, t, hidden] product
        v_h = v.repeat_interleave(g, dim=0)  # [H, t, d], head h reads KV head h // g
        sq = ((v_h @ gram) * v_h).sum(dim=-1).clamp_min(0.0)
        return group_reduce(sq.sqrt(), Hkv)
    raise UserError(f"payload {kind!r} is unknown: use one of {', '.join(PAYLOADS)}")


def max_pool(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """Same-size 1-D max pooling over the last axis of ``x [..., n]`` (stride 1, padding ``kernel // 2``)."""
    if kernel <= 1:
        return x
    return F.max_pool1d(x.unsqueeze(-2), kernel, stride=1, padding=kernel // 2).squeeze(-2)


def avg_pool(x: torch.Tensor, kernel: int) -> torch.Tensor:
    """Same-size 1-D average pooling (zero padding counted, as ``F.avg_pool1d`` in SnapKV) of ``x [..., n]``."""
    if kernel <= 1:
        return x
    return F.avg_pool1d(x.unsqueeze(-2), kernel, stride=1, padding=kernel // 2).squeeze(-2)


# --------------------------------------------------------------------------- streamed history of past queries


class ColumnSum:
    """Cumulative attention: ``Σ_{tau < t} a_{h,tau,j}`` over every past query (H2O) -> snapshot ``[H, t]``."""

    def __init__(self, num_heads: int, length: int):
        self.total = torch.zeros(num_heads, length)

    def update(self, probs: torch.Tensor, start: int) -> None:
        """probs [H, c, e]: attention of queries ``[start, start + c)`` over keys ``[0, e)``."""
        self.total[:, : probs.shape[2]] += probs.sum(dim=1)

    def snapshot(self, t: int) -> torch.Tensor:
        return self.total[:, :t].clone()


class Recurrence:
    """LazyEviction's per-(query head, token) recurrence state, replayed over the decode steps.

    Decode step ``s = tau - prompt_len + 1`` is the step whose (single) query sits at position ``tau``. A token at
    position ``j`` enters with ``TS = max(j - prompt_len, 0)`` (prompt tokens: 0; a generated token: its step − 1)
    and ``MRI = 0``. When ``a_{tau,j} >= alpha``: ``MRI = max(MRI, s - TS)``, ``TS = s``. Thresholding is in
    fp32 (the official code thresholds an fp16 copy). Snapshot: ``(TS, MRI)`` each ``[H, t]``, in steps.
    """

    def __init__(self, num_heads: int, length: int, prompt_len: int, alpha: float):
        self.prompt_len, self.alpha = prompt_len, alpha
        self.ts = (torch.arange(length) - prompt_len).clamp_min(0).float().expand(num_heads, length).clone()
        self.mri = torch.zeros(num_heads, length)

    def update(self, probs: torch.Tensor, start: int) -> None:
        skip = max(0, self.prompt_len - start)  # prompt queries are not decode steps
        if skip >= probs.shape[1]:
            return
        probs = probs[:, skip:]
        e = probs.shape[2]
        steps = torch.arange(start + skip, start + skip + probs.shape[1]).float() - self.prompt_len + 1
        hit_step = torch.where(probs >= self.alpha, steps[None, :, None], -1.0)  # [H, c, e]
        ts0 = self.ts[:, None, :e]
        # last hit strictly before each step (or the entry TS): exclusive running max along the steps
        seen = torch.cummax(hit_step, dim=1).values
        before = torch.maximum(torch.cat([ts0, seen[:, :-1]], dim=1), ts0)
        gaps = torch.where(hit_step >= 0, hit_step - before, 0.0).amax(dim=1)
        self.mri[:, :e] = torch.maximum(self.mri[:, :e], gaps)
        self.ts[:, :e] = torch.maximum(self.ts[:, :e], seen[:, -1])

    def snapshot(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ts[:, :t].clone(), self.mri[:, :t].clone()


class Sparsity:
    """ThinKV's attention sparsity of each query: the share of its softmax row (keys ``j <= tau``) below
    ``rel_threshold`` × the row maximum. Snapshot ``[H, t]`` (one value per query position and head)."""

    def __init__(self, num_heads: int, length: int, rel_threshold: float, window: int | None = None):
        self.rel, self.window = rel_threshold, window
        self.values = torch.zeros(num_heads, length)

    def update(self, probs: torch.Tensor, start: int) -> None:
        c, e = probs.shape[1], probs.shape[2]
        pos = torch.arange(start, start + c)
        below = (probs < self.rel * probs.amax(dim=-1, keepdim=True)).sum(dim=-1).float()
        # keys the query does not see (j > tau, or outside a sliding window) have probability 0 and were
        # counted as "below": remove them
        seen = pos + 1 if self.window is None else (pos + 1).clamp(max=self.window)
        self.values[:, start : start + c] = (below - (e - seen)) / seen

    def snapshot(self, t: int) -> torch.Tensor:
        return self.values[:, :t].clone()


class AttentionHistory:
    """Streams exact causal attention rows of queries ``0, 1, 2, …`` in chunks and feeds registered trackers.

    q [H, T, d], k [Hkv, T, d] (fp32; T may exceed the checkpoint: only queries ``< t`` are read when a
    snapshot at ``t`` is requested). Checkpoints requested in increasing order cost one pass over the queries
    per layer, shared by every tracker; an earlier checkpoint restarts the pass. A tracker registered late
    replays the queries already streamed on its own. Memory: the trackers' ``[H, T]`` state plus one chunk of
    at most ``chunk_elements`` probabilities.
    """

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, attn: LayerAttention | float, chunk_elements: int = CHUNK_ELEMENTS
    ):
        # attn: the layer's semantics (window, softcap, sinks) or a bare scale (plain causal)
        self.q, self.k, self.attn, self.chunk_elements = q, k, as_layer_attention(attn), chunk_elements
        self.pos = 0
        self.trackers: dict[tuple, object] = {}
        self.factories: dict[tuple, Callable[[], object]] = {}

    def get(self, key: tuple, factory: Callable[[], object], t: int):
        """The tracker named ``key`` (created by ``factory()``), advanced over exactly the queries ``< t``."""
        if t > self.q.shape[1]:
            raise ValueError(f"checkpoint {t} is beyond the {self.q.shape[1]} recorded queries")
        if t < self.pos:  # an earlier checkpoint: start over
            self.pos = 0
            self.trackers = {name: self.factories[name]() for name in self.trackers}
        if key not in self.trackers:
            self.factories[key] = factory
            tracker = factory()
            self._stream([tracker], 0, self.pos)
            self.trackers[key] = tracker
        self._stream(list(self.trackers.values()), self.pos, t)
        self.pos = t
        return self.trackers[key]

    def _stream(self, trackers: list, start: int, stop: int) -> None:
        H = self.q.shape[0]
        s = start
        while s < stop:
            c = max(1, min(stop - s, self.chunk_elements // (H * stop)))
            e = s + c
            probs = attention_rows(self.q[:, s:e], self.k[:, :e], torch.arange(s, e), self.attn, chunk=c)
            for tracker in trackers:
                tracker.update(probs, s)
            s = e


# --------------------------------------------------------------------------- ThinKV thought segments

TRANSITION, REASONING, EXECUTION = 0, 1, 2
THOUGHT_CLASSES = {"T": TRANSITION, "R": REASONING, "E": EXECUTION}


def thought_segments(
    step_sparsity: torch.Tensor, prompt_len: int, segment_len: int = 128, thresholds: tuple[float, float] | None = None,
    quantiles: tuple[float, float] = (1 / 3, 2 / 3), prompt_class: str = "R",
) -> tuple[torch.Tensor, torch.Tensor]:
    """ThinKV-style thought segmentation of the cache ``[0, t)``.

    step_sparsity [t]: attention sparsity of the query at each position (mean over heads). Generated tokens are
    cut into segments of ``segment_len`` steps from ``prompt_len``; a segment's class comes from its mean
    sparsity: above the upper threshold Transition, below the lower one Execution, else Reasoning (ThinKV: T > R
    > E in sparsity). ThinKV calibrates the thresholds offline (KDE over s1K); without calibration the defaults
    are the ``quantiles`` of this checkpoint's segment sparsities, or fixed ``thresholds`` when given. The
    prompt is one segment of class ``prompt_class`` (ThinKV does not classify it).

    Returns ``segment [t]`` (0 = the prompt, 1.. generated segments) and ``classes [S + 1]``.
    """
    t = step_sparsity.shape[0]
    pos = torch.arange(t)
    segment = torch.where(pos < prompt_len, 0, (pos - prompt_len) // segment_len + 1)
    n_seg = int(segment.max()) + 1 if t else 1
    gen = pos >= prompt_len
    sums = torch.zeros(n_seg).index_add_(0, segment[gen], step_sparsity[gen])
    counts = torch.zeros(n_seg).index_add_(0, segment[gen], torch.ones(int(gen.sum())))
    means = sums[1:] / counts[1:].clamp_min(1)
    if thresholds is not None:
        lo, hi = thresholds
    elif len(means):
        lo, hi = torch.quantile(means, torch.tensor(quantiles)).tolist()
    else:
        lo = hi = 0.0
    classes = torch.full((n_seg,), REASONING, dtype=torch.long)
    classes[1:][means > hi] = TRANSITION
    classes[1:][means < lo] = EXECUTION
    classes[0] = THOUGHT_CLASSES[prompt_class]
    return segment, classes

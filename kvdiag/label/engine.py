"""The counterfactual oracle: single-entry eviction KL at a checkpoint, batched over candidates.

For checkpoint ``t`` (the cache holds positions ``[0, t)``) and a candidate entry ``i < t``:
the recorded continuation ``x_t .. x_{t+H-1}`` is teacher-forced at its original absolute positions
with entry ``i`` evicted (from every layer and KV head, one layer, or one layer and KV head), and
``KL(P_full(.|tau) || P_evict(.|tau))`` is measured in fp32 on the full vocabulary at each of the
H query positions ``tau = t .. t+H-1``. H is fixed, or ``rest``: T - t, to the end of the prompt's trace.

Long horizons run in chunks of C steps (``chunk``): each chunk's C tokens attend to the shared prefix and to the
row's own keys and values of the earlier chunks (the continuation cache, which grows by C per chunk), and only one
chunk's logits [N, C, V] are alive at a time; the divergences are taken per chunk and concatenated per step. At H <= C
a row is one forward, as before chunking. The runs of one sequence (the full-cache run, the null row) take chunks as
long as that memory allows (``solo_chunk``), and a batch of rows takes ``plan``'s shape within it.

The prefix cache is computed once per checkpoint (and extended, not recomputed, from one checkpoint
to the next). A row that evicts from one layer ``l`` (layer/head granularity) is identical to the null row
below ``l``: it starts at layer ``l`` from the null row's hidden states (``kvdiag.model.adapters.starting_at_layer``),
so a layer sweep skips (L - 1) / 2 of the L layers per row on average (lm_head and the divergences remain).
Candidate rows are batched: each row runs the same H tokens and reads the shared prefix through
``kvdiag.kernels.shared_prefix_attention`` with its own exclusions, so a batch of N rows costs about one
forward of N x H tokens and no per-row copy of the prefix. ``P_full`` comes from the plain model path
(the model's own attention over a standard cache); a null row (nothing evicted) through the
batched path measures the numerical noise floor of each checkpoint.

Attention semantics (per-layer sliding windows, softcap, sinks) come from ``kvdiag.model.adapters``. An entry
outside a layer's window for every horizon query (``i <= t - window``) is invisible to that layer: a row
that evicts only such entries changes nothing, and its label is exactly zero without running it.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvdiag.core.errors import UserError
from kvdiag.core.parsing import REST, parse_horizon
from kvdiag.core.schema import CHUNK, GRANULARITIES
from kvdiag.label.hooks import EvictionBatch, evicting
from kvdiag.model.adapters import capturing_layer_inputs, starting_at_layer
from kvdiag.model.load import LoadedModel

SOLO_CHUNKS = 4  # the full-cache run and the null row take chunks of up to this many --chunk (solo_chunk)


@dataclass(frozen=True)
class Row:
    """One counterfactual: evict ``position`` at (``layer``, ``kv_head``); -1 = all. position -1 = null row."""

    position: int
    layer: int = -1
    kv_head: int = -1


def candidate_rows(positions: list[int], granularity: str, num_layers: int, num_kv_heads: int,
                   layers: list[int] | None = None) -> list[Row]:
    """Rows for ``positions`` at ``granularity``: token -> one row each; layer -> one per layer;
    head -> one per (layer, KV head). ``layers`` restricts the layers (default: all)."""
    if granularity not in GRANULARITIES:
        raise UserError(f"--granularity {granularity}: use one of {', '.join(GRANULARITIES)}")
    layers = list(range(num_layers)) if layers is None else layers
    if granularity == "token":
        return [Row(p) for p in positions]
    if granularity == "layer":
        return [Row(p, l) for p in positions for l in layers]
    return [Row(p, l, h) for p in positions for l in layers for h in range(num_kv_heads)]


def full_cache(num_layers: int) -> DynamicCache:
    """A ``DynamicCache`` of full layers: sliding-window layers keep every entry too (transformers' sliding
    cache layers drop old entries; the mask, not the cache, applies the window)."""
    cache = DynamicCache()
    cache.layers[:] = [DynamicLayer() for _ in range(num_layers)]
    return cache


def cache_from_prefix(config, prefix: list[tuple[torch.Tensor, torch.Tensor]], rows: int = 1) -> DynamicCache:
    """A full-layer ``DynamicCache`` over prefix[l] = (k, v) [Hkv, P, d], viewed as ``rows`` batch rows without
    a copy (``update()`` rebinds the layer tensors and never writes into them)."""
    cache = full_cache(len(prefix))
    for layer, (k, v) in zip(cache.layers, prefix, strict=True):
        k, v = k[None].expand(rows, -1, -1, -1), v[None].expand(rows, -1, -1, -1)
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v
    return cache


# divergences() normalizes rows in chunks of about this many bytes of fp32 log-probs: one row of SmolLM2
# (16 steps x 49,152 tokens) is 3 MiB; chunks this small keep the ~15 elementwise passes in cache
DIVERGENCE_CHUNK_BYTES = 4 << 20


def divergences(logp_full: torch.Tensor, logits_ev: torch.Tensor, targets: torch.Tensor,
                chunk: int | None = None) -> dict[str, torch.Tensor]:
    """logp_full [W, V] fp32 log-probs, logits_ev [N, W, V] logits (or log-probs: both are normalized here, one
    chunk of rows at a time, so the full [N, W, V] log-probs never exist), targets [W'] realized next tokens.

    Returns kl [N, W] = KL(full || evicted), js [N, W], nll_delta [N, W'] = NLL_evicted - NLL_full of the
    realized tokens, flips [N] = steps where the full model's top-1 token is no longer a top-1 token of
    the evicted one. Rows are processed in chunks of ``chunk`` rows (default: ``DIVERGENCE_CHUNK_BYTES``);
    the cross terms are batched dot products.
    """
    p = logp_full.exp()
    top_full = logp_full.argmax(-1)
    Wt = targets.shape[0]
    nll_full = logp_full[:Wt].gather(-1, targets[:, None]).squeeze(-1)
    log2 = math.log(2.0)
    chunk = chunk or max(1, DIVERGENCE_CHUNK_BYTES // (4 * logp_full.numel()))
    out: dict[str, list[torch.Tensor]] = {"kl": [], "js": [], "nll_delta": [], "flips": []}
    for s in range(0, logits_ev.shape[0], chunk):
        le = torch.log_softmax(logits_ev[s : s + chunk].float(), dim=-1)
        # differences are taken elementwise first: near-zero labels must not cancel out of two large sums
        d = logp_full - le  # log p - log q
        out["kl"].append(torch.einsum("wv,nwv->nw", p, d))
        # with m = (p + q)/2: log p - log m = log 2 + log sigmoid(d), log q - log m = that - d
        # (one fused op; torch's softplus is several times slower on CPU)
        u = F.logsigmoid(d).add_(log2)
        q = le.exp()
        out["js"].append(0.5 * torch.einsum("wv,nwv->nw", p, u) + 0.5 * torch.linalg.vecdot(q, u.sub_(d)))
        out["nll_delta"].append(
            nll_full - le[:, :Wt].gather(-1, targets[None, :, None].expand(le.shape[0], Wt, 1)).squeeze(-1)
        )
        # a max and a gather instead of an argmax (several times slower on CPU)
        top_ev = le.gather(-1, top_full[None, :, None].expand(le.shape[0], -1, 1)).squeeze(-1)
        out["flips"].append((top_ev < le.amax(-1)).sum(-1))
    res = {key: torch.cat(val) for key, val in out.items()}
    res["kl"] = res["kl"].clamp_min(0.0)  # rounding can make a zero divergence slightly negative
    res["js"] = res["js"].clamp_min(0.0)
    return res


def set_exclusions(sets: list[torch.Tensor], num_layers: int, num_kv_heads: int, t: int,
                   device: torch.device | str = "cpu") -> list[torch.Tensor | None]:
    """Per layer: int64 [N, Hkv, E] exclusions of set rows (``-1`` = none; E the largest set of the batch), or None
    where no row evicts anything. ``sets[r]`` is [E_r] (the same positions from every layer and KV head: a token
    set) or [L, Hkv, E_r] (its own positions per layer and KV head: a per-head set); every position in ``[0, t)``."""
    full = []
    for r, evict in enumerate(sets):
        evict = torch.as_tensor(evict, dtype=torch.long)
        if evict.dim() == 1:
            evict = evict.expand(num_layers, num_kv_heads, -1)
        if evict.dim() != 3 or tuple(evict.shape[:2]) != (num_layers, num_kv_heads):
            raise ValueError(f"set row {r}: need [E] or [L={num_layers}, Hkv={num_kv_heads}, E], "
                             f"got {list(evict.shape)}")
        if evict.numel() and (evict.max() >= t or evict.min() < -1):
            raise UserError(f"set row {r} evicts positions outside [0, {t}) at checkpoint {t}")
        full.append(evict)
    width = max([e.shape[-1] for e in full] + [0])
    ex = torch.full((len(full), num_layers, num_kv_heads, width), -1, dtype=torch.long)
    for r, evict in enumerate(full):
        ex[r, :, :, : evict.shape[-1]] = evict
    return [ex[:, l].to(device) if (ex[:, l] >= 0).any() else None for l in range(num_layers)]


@dataclass(frozen=True)
class Checkpoint:
    """What the batches of one checkpoint share: prefix[l] (k, v) [Hkv, t, d], logp_full [H, V], targets [H'] (the
    realized next tokens), the null row's divergences null (``divergences``' dict, one row) and its layer inputs
    hidden[l] [1, H, D] (empty where no row starts above layer 0)."""

    t: int
    prefix: list[tuple[torch.Tensor, torch.Tensor]]
    logp_full: torch.Tensor
    targets: torch.Tensor
    null: dict[str, torch.Tensor]
    hidden: list[torch.Tensor]


class OracleEngine:
    """Labels candidates of one prompt's checkpoints; build it once per (model, token sequence).

    ``horizon``: H steps, or ``rest`` (T - t at checkpoint t). ``chunk``: horizon steps per forward (C).
    ``layer_start``: rows that evict from one layer start at that layer (False: every row runs the full depth,
    the method before layer start, kept for ``kvdiag bench label`` and the exactness tests)."""

    def __init__(self, lm: LoadedModel, token_ids: torch.Tensor, horizon: int | str, batch_size: int = 64,
                 backend: str = "auto", layer_start: bool = True, chunk: int = CHUNK):
        horizon = parse_horizon(horizon)
        if chunk < 1:
            raise UserError(f"--chunk {chunk}: must be a positive number of horizon steps per forward")
        self.lm, self.model = lm, lm.model
        self.ids = token_ids.to(self.model.device)
        self.T, self.horizon, self.batch_size, self.backend = len(token_ids), horizon, batch_size, backend
        self.chunk = chunk
        self.layer_start = layer_start
        self.attention = lm.attention
        self.num_layers, self.num_kv_heads = self.attention.num_layers, self.attention.num_kv_heads
        # cache elements per step and sequence, and the vocabulary: what one step of a forward holds (plan's budget)
        self.kv_step = self.num_layers * self.num_kv_heads * (self.attention.qk_head_dim + self.attention.v_head_dim)
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        self._cache = full_cache(self.num_layers)  # the golden prefix, extended checkpoint by checkpoint
        self._cached = 0
        self._golden: tuple[int, list, torch.Tensor] | None = None  # the last checkpoint's (t, prefix, logp_full)

    def steps(self, t: int) -> int:
        """H at checkpoint ``t``: the fixed horizon, or T - t (``rest``)."""
        return self.T - t if self.horizon == REST else self.horizon

    def check_checkpoint(self, t: int) -> None:
        last = self.T - (1 if self.horizon == REST else self.horizon)
        if not 1 <= t <= last:
            raise UserError(f"checkpoint {t} is outside [1, {last}] (trace length {self.T}, horizon "
                            f"{self.horizon}); choose earlier checkpoints or a shorter --horizon")

    def spans(self, t: int, chunk: int | None = None) -> list[tuple[int, int]]:
        """The chunks of checkpoint ``t``'s horizon: [(c0, c1)] step ranges of at most ``chunk`` steps (default
        ``self.chunk``)."""
        H, chunk = self.steps(t), chunk or self.chunk
        return [(c0, min(H, c0 + chunk)) for c0 in range(0, H, chunk)]

    @torch.no_grad()
    def golden(self, t: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """The full-cache run at checkpoint ``t``: (prefix, logp_full) with prefix[l] = post-RoPE (k, v) of
        positions [0, t), each [Hkv, t, d] (views of one cache; never copied per row), and log P_full
        [H, V] (fp32) at positions t .. t+H-1 from the plain model path (SDPA over a standard cache).

        Checkpoints are visited in order: when the cache ends at or before ``t``, forwards over
        [end, t+H) extend it and their logits at t .. t+H-1 are P_full, so the horizon is not run twice; for a
        checkpoint inside the cache (closer than H to the last one, or earlier) the H tokens run over a
        cache of the first ``t`` entries. Either way the horizon runs in chunks (``spans`` of ``solo_chunk``): one
        chunk's logits at a time (the first chunk also carries [end, t) when the cache is extended).
        """
        self.check_checkpoint(t)
        if self._golden is not None and self._golden[0] == t:
            return self._golden[1], self._golden[2]
        end = t + self.steps(t)
        extend = self._cached <= t  # extend the run through the horizon
        if extend:
            cache, first = self._cache, self._cached
            self._cached = end
        else:  # a checkpoint inside the run's cache: the horizon over a cache of its first t entries
            prefix = [(layer.keys[0, :, :t], layer.values[0, :, :t]) for layer in self._cache.layers]
            cache, first = cache_from_prefix(self.model.config, prefix), t
        logp = []
        for c0, c1 in self.spans(t, self.solo_chunk(t)):
            pos = torch.arange(first, t + c1, device=self.ids.device)[None]
            logits = self.model(self.ids[None, first : t + c1], cache=cache, position_ids=pos, use_cache=True,
                                logits_to_keep=c1 - c0).logits[0]
            self._check_finite(logits, t)
            logp.append(torch.log_softmax(logits.float(), dim=-1))
            first = t + c1
        if extend:
            prefix = [(layer.keys[0, :, :t], layer.values[0, :, :t]) for layer in self._cache.layers]
        self._golden = (t, prefix, torch.cat(logp) if len(logp) > 1 else logp[0])
        return prefix, self._golden[2]

    def stored_golden(self, t: int):
        """The full-cache run of checkpoint ``t`` as :meth:`golden` last returned it (None if it was another one):
        what ``kvdiag.label.golden_store`` keeps."""
        return (self._golden[1], self._golden[2]) if self._golden is not None and self._golden[0] == t else None

    def use_golden(self, t: int, prefix: list[tuple[torch.Tensor, torch.Tensor]], logp_full: torch.Tensor) -> None:
        """Make ``golden(t)`` return a stored run of this engine's computation (``kvdiag.label.golden_store``: all
        of a prompt's checkpoints or none, so no checkpoint is computed apart from its neighbours)."""
        self._golden = (t, prefix, logp_full)

    def _check_finite(self, values: torch.Tensor, t: int) -> None:
        if not torch.isfinite(values.sum()):  # one reduction: any inf/nan makes the sum non-finite
            raise UserError(f"non-finite logits at checkpoint {t}: the model overflows in {self.lm.dtype}; rerun with "
                            "--dtype float32")

    def _exclusions(self, rows: list[Row]) -> list[torch.Tensor | None]:
        """Per layer: int64 [N, Hkv, 1] with the row's position where it applies, -1 elsewhere."""
        pos = torch.tensor([r.position for r in rows], dtype=torch.long)
        layer = torch.tensor([r.layer for r in rows], dtype=torch.long)
        head = torch.tensor([r.kv_head for r in rows], dtype=torch.long)
        heads = torch.arange(self.num_kv_heads)
        out = []
        for l in range(self.num_layers):
            applies = ((layer == -1) | (layer == l))[:, None] & ((head[:, None] == -1) | (head[:, None] == heads[None]))
            ex = torch.where(applies, pos[:, None], -1)[:, :, None]  # [N, Hkv, 1]
            out.append(ex.to(self.ids.device) if (ex >= 0).any() else None)
        return out

    @torch.no_grad()
    def evicted_logits(self, t: int, prefix, rows: list[Row], start: int = 0,
                       hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [N, H, V] for ``rows`` through the batched shared-prefix path, chunk by chunk (the labels take the
        divergences per chunk instead: ``label``); with ``start`` > 0 the rows run decoder layers ``start..L-1``
        only, from ``hidden [1, H, D]`` (the null row's input to layer ``start``)."""
        return torch.cat([logits for _, logits in self._chunks(t, prefix, self._exclusions(rows), len(rows), start,
                                                               hidden)], 1)

    @torch.no_grad()
    def set_logits(self, t: int, prefix, sets: list[torch.Tensor]) -> torch.Tensor:
        """Logits [N, H, V] of set rows: row r evicts ``sets[r]`` (:func:`set_exclusions`) through the same batched
        shared-prefix path, from layer 0."""
        exclude = set_exclusions(sets, self.num_layers, self.num_kv_heads, t, self.ids.device)
        return torch.cat([logits for _, logits in self._chunks(t, prefix, exclude, len(sets))], 1)

    def _chunks(self, t: int, prefix, exclude: list[torch.Tensor | None], n: int, start: int = 0,
                hidden: torch.Tensor | None = None, chunk: int | None = None):
        """Yield ((c0, c1), logits [N, c1 - c0, V]) chunk by chunk over the horizon (``spans``): each chunk reads the
        shared prefix with the rows' exclusions and the rows' own keys and values of the earlier chunks."""
        spans = self.spans(t, chunk)
        batch = EvictionBatch(prefix=prefix, exclude=exclude, attention=self.attention.layers, backend=self.backend,
                              suffix=[None] * self.num_layers if len(spans) > 1 else None, steps=spans[-1][1])
        for c0, c1 in spans:
            batch.offset = c0
            ids = self.ids[None, t + c0 : t + c1].expand(n, -1)
            pos = torch.arange(t + c0, t + c1, device=self.ids.device)[None].expand(n, -1)
            below = None if hidden is None else hidden[:, c0:c1].expand(n, -1, -1)
            with torch.no_grad(), evicting(self.model, batch), starting_at_layer(self.model, start, below):
                logits = self.model(ids, position_ids=pos, use_cache=False).logits
            yield (c0, c1), logits  # outside the contexts: the model is its own again while the caller works

    @torch.no_grad()
    def null_run(self, t: int, prefix, logp_full: torch.Tensor, targets: torch.Tensor,
                 layer_inputs: bool = True) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """The null row (nothing evicted) through the batched path: its divergences from ``logp_full`` [H, V] and,
        with ``layer_inputs``, the hidden states entering each decoder layer, inputs[l] [1, H, D]."""
        parts, inputs = [], [[] for _ in range(self.num_layers)]
        chunks = self._chunks(t, prefix, self._exclusions([Row(-1)]), 1, chunk=self.solo_chunk(t))
        while True:
            with capturing_layer_inputs(self.model) as captured:
                step = next(chunks, None)
            if step is None:
                break
            (c0, c1), logits = step
            parts.append(self._chunk_divergences(t, logp_full, targets, c0, c1, logits))
            if layer_inputs:
                for l, x in enumerate(captured):
                    inputs[l].append(x)
        return _joined(parts), [torch.cat(x, 1) for x in inputs] if layer_inputs else []

    def start_layer(self, row: Row) -> int:
        """The first decoder layer ``row`` must run: the one it evicts from (0 for every-layer rows)."""
        return max(row.layer, 0) if self.layer_start else 0

    def invisible(self, t: int, row: Row) -> bool:
        """Whether every layer ``row`` evicts from hides its entry from all horizon queries (sliding window:
        the query at ``t`` sees keys ``> t - window``, later queries even fewer)."""
        layers = range(self.num_layers) if row.layer < 0 else [row.layer]
        return row.position >= 0 and all(
            self.attention.layers[l].window is not None and row.position <= t - self.attention.layers[l].window
            for l in layers)

    def label(self, t: int, rows: list[Row], progress=None) -> tuple[dict[str, torch.Tensor], float]:
        """Label ``rows`` at checkpoint ``t``. Returns (per-row tensors: kl [N, H], js [N, H],
        nll_delta [N, H'], flips [N]) and the checkpoint's noise floor (mean KL of the null row).
        Rows whose entry no horizon query can see (``invisible``) are exactly 0 and are not run."""
        self.check_checkpoint(t)
        rows = list(rows)
        for r in rows:
            if not 0 <= r.position < t:
                raise UserError(f"candidate position {r.position} at checkpoint {t}: candidates must lie in [0, {t})")
        run = [i for i, r in enumerate(rows) if not self.invisible(t, r)]
        if len(run) < len(rows):
            out, noise = self._label(t, [rows[i] for i in run], progress)
            full = {key: torch.zeros((len(rows), *val.shape[1:]), dtype=val.dtype) for key, val in out.items()}
            for key, val in out.items():
                full[key][run] = val
            if progress is not None:
                progress(len(rows) - len(run))
            return full, noise
        return self._label(t, rows, progress)

    def batches(self, rows: list[Row], size: int | None = None) -> list[tuple[int, list[int]]]:
        """The engine's batches of ``rows``: (start layer, row indices), grouped by start layer (stable: within a
        group in the given order) and at most ``size`` rows each (default ``batch_size``; ``plan``)."""
        size = size or self.batch_size
        order = sorted(range(len(rows)), key=lambda j: self.start_layer(rows[j]))
        out = []
        for start, group in itertools.groupby(order, key=lambda j: self.start_layer(rows[j])):
            group = list(group)
            out += [(start, group[s : s + size]) for s in range(0, len(group), size)]
        return out

    def budget(self) -> int:
        """Elements one forward may hold: ``batch_size`` rows' logits and continuation caches over ``chunk`` steps."""
        return self.batch_size * self.chunk * (self.vocab + self.kv_step)

    def solo_chunk(self, t: int) -> int:
        """Horizon steps per forward of one sequence (the full-cache run, the null row) at checkpoint ``t``: up to
        ``SOLO_CHUNKS`` x ``chunk`` where its logits [1, C, V] and whole continuation cache fit ``budget``, at least
        ``chunk``. Many ``chunk``-step forwards made H = 128 cost 8.5x H = 16 (issue #42); one forward of the whole
        horizon added more peak memory than it saved time (``kvdiag bench label``: docs/labels.md, "Cost")."""
        H = self.steps(t)
        fits = (self.budget() - H * self.kv_step) // self.vocab
        return min(H, max(self.chunk, min(SOLO_CHUNKS * self.chunk, fits)))

    def plan(self, ckpt: Checkpoint) -> tuple[int, int]:
        """(rows per forward, horizon steps per chunk) at ``ckpt``: (``batch_size``, ``chunk``) at H <= chunk. At
        longer horizons a batch holds one chunk's logits [rows, C, V] and the rows' continuation caches (2 Hkv d
        values per layer, step and row, for all H steps); the plan keeps that within what ``batch_size`` rows hold
        over ``chunk`` steps and, within it, runs the most tokens per forward (rows x C: fewer rows, longer chunks;
        ties: more rows). Where one row's cache alone exceeds it: one row in chunks of ``chunk``."""
        H = len(ckpt.logp_full)
        if H <= self.chunk:
            return self.batch_size, self.chunk
        V, kv, budget = self.vocab, self.kv_step, self.budget()
        best = (1, self.chunk)
        for rows in range(self.batch_size, 0, -1):
            steps = min(H, (budget // rows - H * kv) // V)
            if steps >= 1 and rows * steps > best[0] * min(best[1], H):
                best = (rows, steps)
        return best

    @torch.no_grad()
    def checkpoint(self, t: int, layer_inputs: bool = True) -> Checkpoint:
        """What every batch at checkpoint ``t`` shares: the full-cache run (``golden``), the realized next tokens and
        the null row (``null_run``; its layer inputs where ``layer_inputs``: rows that start above layer 0)."""
        prefix, logp_full = self.golden(t)
        targets = self.ids[t + 1 : t + self.steps(t) + 1]  # the realized next tokens (the last step may have none)
        null, hidden = self.null_run(t, prefix, logp_full, targets, layer_inputs)
        return Checkpoint(t, prefix, logp_full, targets, null, hidden)

    def label_batch(self, ckpt: Checkpoint, rows: list[Row], start: int) -> dict[str, torch.Tensor]:
        """One batch of ``batches``: its rows' divergences (on the CPU), run from layer ``start`` on the null row's
        layer inputs."""
        return self._rows(ckpt, self._exclusions(rows), len(rows), start)

    def _rows(self, ckpt: Checkpoint, exclude: list[torch.Tensor | None], n: int, start: int = 0,
              chunk: int | None = None) -> dict[str, torch.Tensor]:
        """The divergences (on the CPU) of ``n`` rows with ``exclude``, chunk by chunk: one chunk's logits alive."""
        hidden = ckpt.hidden[start] if start else None
        chunks = self._chunks(ckpt.t, ckpt.prefix, exclude, n, start, hidden, chunk)
        return _joined([{key: val.cpu() for key, val in
                         self._chunk_divergences(ckpt.t, ckpt.logp_full, ckpt.targets, c0, c1, logits).items()}
                        for (c0, c1), logits in chunks])

    def _label(self, t: int, rows: list[Row], progress=None) -> tuple[dict[str, torch.Tensor], float]:
        ckpt = self.checkpoint(t, layer_inputs=any(self.start_layer(r) for r in rows))
        div_null = ckpt.null
        noise = float(div_null["kl"].mean())
        parts = {key: [val[:0].cpu()] for key, val in div_null.items()}
        order = []
        size, chunk = self.plan(ckpt)
        for start, batch in self.batches(rows, size):
            for key, val in self._rows(ckpt, self._exclusions([rows[j] for j in batch]), len(batch), start,
                                       chunk).items():
                parts[key].append(val)
            order += batch
            if progress is not None:
                progress(len(batch))
        out = {key: torch.cat(val) for key, val in parts.items()}
        back = torch.empty(len(order), dtype=torch.long)
        back[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        return {key: val[back] for key, val in out.items()}, noise

    def label_sets(self, t: int, sets: list[torch.Tensor], progress=None) -> tuple[dict[str, torch.Tensor], float]:
        """Joint labels of set rows at checkpoint ``t``: row r evicts every entry of ``sets[r]`` at once (positions
        [E] from every layer and KV head, or [L, Hkv, E] per layer and KV head, ``-1`` = none; see
        :func:`set_exclusions`). Returns the per-row tensors of :meth:`label` (kl [N, H], js [N, H], nll_delta
        [N, H'], flips [N]) and the checkpoint's noise floor. Rows are batched as ``plan`` says; a set is
        exact as a physical deletion of its entries (``kvdiag.label.reference.reference_set_logprobs``)."""
        self.check_checkpoint(t)
        ckpt = self.checkpoint(t, layer_inputs=False)
        div_null = ckpt.null
        parts = {key: [val[:0].cpu()] for key, val in div_null.items()}
        size, chunk = self.plan(ckpt)
        for s in range(0, len(sets), size):
            batch = sets[s : s + size]
            exclude = set_exclusions(batch, self.num_layers, self.num_kv_heads, t, self.ids.device)
            for key, val in self._rows(ckpt, exclude, len(batch), chunk=chunk).items():
                parts[key].append(val)
            if progress is not None:
                progress(len(batch))
        return {key: torch.cat(val) for key, val in parts.items()}, float(div_null["kl"].mean())

    def _divergences(self, ckpt: Checkpoint, logits) -> dict[str, torch.Tensor]:
        """The divergences of logits [N, H, V] over the whole horizon (one tensor: ``set_logits``)."""
        return self._chunk_divergences(ckpt.t, ckpt.logp_full, ckpt.targets, 0, len(ckpt.logp_full), logits)

    def _chunk_divergences(self, t: int, logp_full, targets, c0: int, c1: int, logits) -> dict[str, torch.Tensor]:
        """``divergences`` of horizon steps [c0, c1): logits [N, c1 - c0, V] against logp_full[c0:c1], a few steps at
        a time (``DIVERGENCE_CHUNK_BYTES`` of fp32 log-probs per row): its temporaries, several [rows, steps, V]
        tensors, must not grow with a long chunk."""
        step = max(1, DIVERGENCE_CHUNK_BYTES // (4 * logp_full.shape[-1]))
        div = _joined([divergences(logp_full[a : min(c1, a + step)], logits[:, a - c0 : min(c1, a + step) - c0],
                                   targets[a : min(c1, a + step)]) for a in range(c0, c1, step)])
        self._check_finite(div["kl"], t)  # a non-finite logit makes its row's KL inf or nan
        return div


def _joined(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-chunk divergences joined over the horizon: kl, js, nll_delta concatenated per step, flips summed."""
    if len(parts) == 1:
        return parts[0]
    return {key: sum(p[key] for p in parts) if key == "flips" else torch.cat([p[key] for p in parts], 1)
            for key in parts[0]}

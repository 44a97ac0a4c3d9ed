"""The positioned cache: a transformers ``Cache`` whose layers keep every entry's absolute position beside its key
and value, full and sliding attention alike, compacted in place per (layer, KV head).

Compaction is physical (``kvdiag.kernels.compact_kv``, a per-head gather, Triton on CUDA); kept entries keep the
RoPE rotation of their original positions. The cache reports its *logical* length (tokens fed, ``get_seq_length``),
so a forward without ``position_ids`` (and ``model.generate``) numbers new tokens by absolute position, and its
*physical* length to the mask builder (``get_query_offset``, ``get_mask_sizes``), so transformers' causal mask over
slots stays exact after a compaction. A sliding layer drops the entries no future query can see (as transformers'
``DynamicSlidingWindowLayer`` does) and its mask comes from positions (``kvdiag.cache.attend``).

Every row of a batch holds the same number of entries per layer (each keeps its own entries). Rows share their
prompt length, unless the batch is left-padded: a layer's ``offsets`` then says how many padding slots open each row,
its slot ``s`` holds position ``s - offsets[r]``, and padding has negative positions, which no real query sees
(``kvdiag.cache.attend`` masks by position on every layer then). Positions live on the CPU (a few integers per
entry).

Storage: by default each step concatenates (``torch.cat``: a compacted cache stays small). With ``capacity`` (the
Trace recorder: the trace's longest possible length, never compacted) a layer writes each step's rows into blocks
allocated once (``kvdiag.cache.blocks``) and hands attention views of the held part: O(new rows) bytes copied per
step instead of O(cache). A sliding layer's block holds about two windows: its entries move to the front when the
block fills (one copy of W entries per ~W steps).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvdiag.cache.attend import HANDOFF, QueryWindow
from kvdiag.cache.blocks import append_rows
from kvdiag.core.errors import UserError
from kvdiag.kernels import compact_kv


class PositionedLayer(DynamicLayer):
    """One layer: keys, values [b, Hkv, n, d] and their absolute positions [b, Hkv, n] (ascending per row and head).

    sliding_window : W of a sliding layer (query ``q`` sees ``q - W < k <= q``), None for full attention.
    queries : the cache's query window, filled by the attention call this layer hands itself to.
    capacity : entries per (row, KV head) to allocate blocks for (None: concatenate each step; see the module).
    offsets : [b] the left padding of each row (``EvictingCache`` sets it from the attention mask), or None: none.
        Row ``r``'s slot ``s`` (tokens fed) is position ``s - offsets[r]``; padding has negative positions.
    """

    is_croppable = False  # a compacted cache cannot be rolled back

    def __init__(self, sliding_window: int | None = None, queries: QueryWindow | None = None,
                 capacity: int | None = None):
        super().__init__()
        self.sliding_window, self.is_sliding, self.queries = sliding_window, sliding_window is not None, queries
        if capacity is not None and sliding_window is not None:
            capacity = min(capacity, 2 * sliding_window)
        self.capacity = capacity
        self.blocks: list[torch.Tensor | None] = [None, None, None]  # keys, values [b, Hkv, size, d], positions [.., 1]
        self.start = self.end = 0  # the held entries are slots [start, end) of the blocks
        self.positions = torch.empty(0, 0, 0, dtype=torch.long)
        self.visible_positions = self.positions  # of the keys the current attention call reads
        self.seen = 0  # tokens fed: the next token's position (its slot in a left-padded batch)
        self.offsets: torch.Tensor | None = None

    def __len__(self) -> int:
        """n: entries held per (row, KV head)."""
        return self.positions.shape[-1]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key/value_states [b, Hkv, c, d] at positions ``[seen, seen + c)`` -> every entry the new queries may read,
        [b, Hkv, n + c, d] (a sliding layer then forgets those no later query sees)."""
        if HANDOFF.get() is not None:
            HANDOFF.set(None)
            raise RuntimeError("the model ran an attention function other than kvdiag's over a positioned cache; "
                               "switch it with kvdiag.generate.use_kvdiag_attention(model)")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, Hkv, c, _ = key_states.shape
        if self.positions.numel() == 0:
            self.positions = torch.empty(b, Hkv, 0, dtype=torch.long)
        query_pos = torch.arange(self.seen, self.seen + c).expand(b, c)
        if self.offsets is not None:  # left padding: each row's positions start after its own padding
            query_pos = query_pos - self.offsets[:, None]
        new_pos = query_pos[:, None, :].expand(b, Hkv, c)
        if self.capacity is None:
            keys = torch.cat([self.keys, key_states], dim=-2)
            values = torch.cat([self.values, value_states], dim=-2)
            positions = torch.cat([self.positions, new_pos], dim=-1)
        else:
            keys, values, positions = self._write(key_states, value_states, new_pos)
        self.seen += c
        self.visible_positions = positions
        HANDOFF.set((self, query_pos, self.queries))
        drop = 0
        if self.sliding_window is not None:  # entries at or before seen - W are out of every later query's window
            limit = self.seen - self.sliding_window
            if self.offsets is not None:  # each row's next position is its own
                limit = (limit - self.offsets)[:, None, None]
            drop = int((positions <= limit).sum(-1).min())
        self.start += drop if self.capacity is not None else 0
        self.keys, self.values, self.positions = keys[:, :, drop:], values[:, :, drop:], positions[..., drop:]
        return keys, values

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor, new_pos: torch.Tensor):
        """Append the rows to the blocks -> views [b, Hkv, n + c, (d)] of every held entry (preallocated storage)."""
        c = key_states.shape[-2]
        if self.start and self.end + c > self.blocks[0].shape[-2]:  # a sliding layer's block is full: move to front
            n = self.end - self.start
            for block in self.blocks:
                block[:, :, :n] = block[:, :, self.start : self.end].clone()
            self.start, self.end = 0, n
        rows = (key_states, value_states, new_pos[..., None])
        devices = (key_states.device, key_states.device, torch.device("cpu"))
        self.blocks = [append_rows(block, self.end, r, self.capacity, r.dtype, device)
                       for block, r, device in zip(self.blocks, rows, devices, strict=True)]
        self.end += c
        keys, values, positions = (block[:, :, self.start : self.end] for block in self.blocks)
        return keys, values, positions[..., 0]

    def get_seq_length(self) -> int:
        """Tokens fed (the logical length: the next position)."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys the next attention reads: the entries held plus the new ones."""
        return len(self) + query_length, 0

    def compact(self, keep: torch.Tensor, backend: str = "auto") -> None:
        """Keep, in row ``r``, the slots ``keep[r] [Hkv, B]`` (ascending per head)."""
        idx = keep.to(self.keys.device)
        pairs = [compact_kv(self.keys[r], self.values[r], idx[r], backend=backend) for r in range(idx.shape[0])]
        keys, values = torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])
        positions = self.positions.gather(-1, keep.cpu())
        if self.capacity is None:
            self.keys, self.values, self.positions = keys, values, positions
            return
        B = keys.shape[-2]  # the gathers are copies: the blocks' first B slots can take them
        for block, rows in zip(self.blocks, (keys, values, positions[..., None]), strict=True):
            block[:, :, :B] = rows
        self.start, self.end = 0, B
        self.keys, self.values, self.positions = (block[:, :, :B] for block in self.blocks)
        self.positions = self.positions[..., 0]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Make batch row ``i`` the current row ``indices[i]``."""
        if self.offsets is not None:
            self.offsets = self.offsets[indices.cpu()]
        if not self.is_initialized:
            return
        if self.capacity is not None:
            self.blocks = [block[indices.to(block.device)] for block in self.blocks]
            self.keys, self.values, positions = (block[:, :, self.start : self.end] for block in self.blocks)
            self.positions = positions[..., 0]
            return
        self.keys, self.values = self.keys[indices.to(self.keys.device)], self.values[indices.to(self.keys.device)]
        self.positions = self.positions[indices.cpu()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self.positions.shape[0]).repeat_interleave(repeats))

    def reset(self) -> None:
        super().reset()
        self.blocks, self.start, self.end = [None, None, None], 0, 0
        self.positions = self.visible_positions = torch.empty(0, 0, 0, dtype=torch.long)
        self.seen = 0
        self.offsets = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a positioned cache cannot be cropped (its entries may have been compacted)")


class PositionedCache(Cache):
    """A cache of :class:`PositionedLayer` (one per model layer, ``windows[l]``: its sliding window or None) and
    the query window of the last ``query_window`` post-RoPE queries per layer (0: none kept).

    active : per fed position, the entries its query attended (the most any layer held, its own included; every row
        alike): replay's ``peak_kv`` and ``mean_kv``."""

    def __init__(self, windows: list[int | None], query_window: int = 0, capacity: int | None = None):
        self.queries = QueryWindow(len(windows), query_window) if query_window else None
        self.active: list[int] = []
        super().__init__(layers=[PositionedLayer(w, self.queries, capacity) for w in windows])

    @classmethod
    def for_model(cls, model, query_window: int = 0, capacity: int | None = None) -> PositionedCache:
        """The cache of ``model``'s layers (their windows from ``kvdiag.model.adapters``); ``capacity``:
        preallocated."""
        from kvdiag.model.adapters import model_attention

        return cls([layer.window for layer in model_attention(model).layers], query_window, capacity)

    def __len__(self) -> int:
        """n: the most entries any layer holds per (row, KV head) (every full-attention layer holds this many)."""
        return max(len(layer) for layer in self.layers)

    @property
    def positions(self) -> list[torch.Tensor]:
        """Per layer, [b, Hkv, n_l] absolute positions."""
        return [layer.positions for layer in self.layers]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            c = key_states.shape[2]
            self.check_positions(key_states.shape[0], c, kwargs.get("kwargs") or {})
            n0 = len(self)  # before this forward: no layer has taken its rows yet
            self.active.extend(range(n0 + 1, n0 + c + 1))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def check_positions(self, b: int, c: int, kwargs: dict) -> None:
        """The forward's ``position_ids`` must be the next ``c`` positions of every row (no reuse): the next slots,
        less each row's left padding when the layers have ``offsets`` (padding slots may say anything)."""
        given = kwargs.get("position_ids")
        if given is None:
            return
        start, offsets = self.layers[0].seen, self.layers[0].offsets
        want = torch.arange(start, start + c).expand(b, c)
        if offsets is not None:
            want = want - offsets[:, None]
        ok = given.dim() == 2 and given.shape[-1] == c and given.shape[0] in (1, b)
        if ok:
            ok = bool(((given.cpu().expand(b, c) == want) | (want < 0)).all())
        if not ok:
            raise UserError(f"positions {given.flatten()[:4].tolist()}… fed to a positioned cache that holds {start} "
                            "tokens: every row must continue at its next position (prompts of one length, or "
                            "left-padded with their attention_mask given to an EvictingCache)")

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Physical entries of ``layer_idx``: where the new queries' slots start (the causal mask is over slots)."""
        return len(self.layers[layer_idx])

    def layer(self, layer: int, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [Hkv, n, d] of ``layer`` in batch row ``row`` (views)."""
        entry = self.layers[layer]
        return entry.keys[row], entry.values[row]

    def compact(self, keep: list[torch.Tensor | None], backend: str = "auto") -> None:
        """Keep, per layer, the slots ``keep[l] [b, Hkv, B]`` (None: the layer is kept whole)."""
        for layer, kl in zip(self.layers, keep, strict=True):
            if kl is not None:
                layer.compact(kl, backend)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Make batch row ``i`` the current row ``indices[i]`` (finished generations leave the batch; a shared
        prefill is copied to its rows): every layer's entries and positions, and the query window's rows."""
        super().batch_select_indices(indices)
        if self.queries is not None:
            self.queries.select(indices)

    def select(self, rows: torch.Tensor) -> None:
        """kvdiag's name for :meth:`batch_select_indices`."""
        self.batch_select_indices(rows)


def distinct_rows(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [b, c] -> (its distinct rows [u, c] in first-seen order, copy [b]: row ``r`` is distinct row ``copy[r]``;
    None when every row differs). Rows fed to an empty cache with the same tokens are one computation: run each once,
    then ``select(copy)`` (the first prefill chunk of one prompt under several rules or samples)."""
    rows = [tuple(r) for r in ids.tolist()]
    first = {row: u for u, row in enumerate(dict.fromkeys(rows))}
    if len(first) == len(rows):
        return ids, None
    unique = torch.tensor([rows.index(row) for row in first], device=ids.device)
    return ids[unique], torch.tensor([first[row] for row in rows])

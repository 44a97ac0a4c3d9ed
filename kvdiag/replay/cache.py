"""The bounded cache: a transformers ``DynamicCache`` whose entries carry absolute positions, compacted in place.

Compaction is physical (``kvdiag.kernels.compact_kv``: a per-head gather of the kept entries, Triton on CUDA),
and the kept entries keep the RoPE rotation of their original positions: new tokens are fed with explicit
absolute ``position_ids`` (transformers' default, ``cache length + i``, would renumber them after an eviction).
The causal mask works on slots, which is consistent with a compacted cache (new keys are appended last).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvdiag.adapters import ModelAttention
from kvdiag.errors import UserError
from kvdiag.kernels import compact_kv
from kvdiag.parsing import Selection
from kvdiag.schema import CHECKPOINT_INTERVAL
from kvdiag.scorers import Scorer


@dataclass
class Policy:
    """How a sequence is decoded under a bounded cache.

    At every checkpoint (the end of each prompt chunk, then every ``interval`` generated tokens, R-KV's schedule)
    a cache holding more than ``budget`` entries is compacted to ``budget``: ``scorer`` scores the live cache from
    its query window and each (layer, KV head) keeps its ``budget`` highest-scored entries (``per-head``) or all
    keep the same entries (``per-token``). The cache therefore never holds more than ``budget + interval`` entries.

    Parameters
    ----------
    scorer : the scoring rule (must run on a live cache, see ``live.check_live_scorer``).
    budget : B, entries kept per (layer, KV head) after a compaction.
    interval : generated tokens between checkpoints (R-KV's ``divide_length``, 128).
    selection : ``per-head`` (R-KV), ``per-token`` or ``stochastic[:TAU]`` (a ``kvdiag.selection.Selection``; a
        spec string is parsed here).
    backend : kernel backend of the compaction (``auto``, ``torch``, ``triton``).
    seed : seed of stochastic selection (each compaction draws from ``crc32(seed:prompt:t)``).
    """

    scorer: Scorer
    budget: int
    interval: int = CHECKPOINT_INTERVAL
    selection: Selection | str = "per-head"
    backend: str = "auto"
    seed: int = 0

    def __post_init__(self):
        if self.budget < 1:
            raise UserError(f"--budget {self.budget}: must be a positive number of cache entries")
        if self.interval < 1:
            raise UserError(f"--interval {self.interval}: must be a positive number of tokens between compressions")
        self.selection = Selection.parse(self.selection)

    @property
    def query_window(self) -> int:
        """W_q: post-RoPE queries the compressor keeps per layer (the scorer's largest observation window)."""
        return max(self.scorer.query_window, 1)


class ReplayCache:
    """A ``DynamicCache`` of ``b`` batch rows plus the absolute position of every entry, ``positions [b, L, Hkv, n]``.

    Every row holds the same number of entries: the rows of one batch share their prompt length, budget and
    schedule, so they are fed and compacted at the same steps (each keeps its own entries).
    """

    def __init__(self, config, attention: ModelAttention, batch: int = 1):
        # transformers masks a window by cache slot; after a compaction slots are no longer positions
        windows = sorted({l.window for l in attention.layers if l.window is not None})
        if windows:
            raise UserError(f"--model: sliding-window attention (window {', '.join(map(str, windows))}) is not "
                            "supported by "
                            "replay (a compacted cache breaks the slot-based window mask); use a model with full "
                            "attention")
        self.cache = DynamicCache(config=config)
        self.positions = torch.empty(batch, attention.num_layers, attention.num_kv_heads, 0, dtype=torch.long)

    def __len__(self) -> int:
        """n: entries per (row, layer, KV head); every head holds the same number."""
        return self.positions.shape[-1]

    def extend(self, start: int, count: int) -> None:
        """Record that the model appended the tokens at positions ``[start, start + count)`` to every row."""
        new = torch.arange(start, start + count).expand(*self.positions.shape[:3], count)
        self.positions = torch.cat([self.positions, new], dim=-1)

    def layer(self, layer: int, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [Hkv, n, d] of ``layer`` in batch row ``row`` (views)."""
        entry = self.cache.layers[layer]
        return entry.keys[row], entry.values[row]

    def compact(self, keep: list[torch.Tensor], backend: str = "auto") -> None:
        """Keep, in batch row ``r``, the slots ``keep[r] [L, Hkv, B]`` (ascending per head) of every layer."""
        for layer, entry in enumerate(self.cache.layers):
            pairs = [compact_kv(entry.keys[r], entry.values[r], kr[layer].to(entry.keys.device), backend=backend)
                     for r, kr in enumerate(keep)]
            entry.keys, entry.values = torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])
        self.positions = self.positions.gather(-1, torch.stack(keep))

    def select(self, rows: torch.Tensor, positions: bool = True) -> None:
        """Make batch row ``i`` the current row ``rows[i]`` (finished generations leave the batch; a shared prefill
        is copied to its rows). ``positions``: also select the positions (False when they already have the new
        batch's rows)."""
        for entry in self.cache.layers:
            idx = rows.to(entry.keys.device)
            entry.keys, entry.values = entry.keys[idx], entry.values[idx]
        if positions:
            self.positions = self.positions[rows]

"""The generation cache of ``kvdiag trace``: transformers' ``DynamicCache`` whose full-attention layers hold their
keys and values in one block each, allocated once at the trace's longest possible length.

transformers' ``DynamicLayer`` concatenates every step (``torch.cat`` of the whole cache: O(T) bytes copied per
step and layer, and a heap of ever larger freed blocks). Here each step writes its rows into the block and the
layer hands attention a view of the filled part ``[:, :, :n]``; the block's pages are touched only as rows arrive,
so resident memory grows by the KV cache itself. Sliding-window layers keep transformers' own class (they
roll). Same values as ``DynamicLayer``: only where they live differs.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvdiag.trace.hooks import append_rows


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` over blocks ``[B, Hkv, capacity, d]`` (``hooks.append_rows``, as the recorder's rows)."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0
        self._keys = self._values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.length, self.is_initialized = key_states.device, 0, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value_states [B, Hkv, n, d] -> the whole cache so far, views [B, Hkv, length, d]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._keys = append_rows(self._keys, self.length, key_states, self.capacity, key_states.dtype, self.device)
        self._values = append_rows(
            self._values, self.length, value_states, self.capacity, value_states.dtype, self.device
        )
        self.length += key_states.shape[-2]
        self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]
        return self.keys, self.values

    def reset(self) -> None:
        self._keys = self._values = None
        self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.is_initialized and self.keys is not None:
            self.length = self.keys.shape[-2]

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("kvdiag trace generates one sequence at a time (no beam search)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("kvdiag trace generates one sequence at a time (no beam search)")


def preallocated_cache(config, capacity: int) -> DynamicCache:
    """``DynamicCache(config=config)`` with each full-attention layer a :class:`PreallocatedLayer` of ``capacity``."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache

"""Rows written into blocks allocated once: the storage of the Trace recorder's rows and of a positioned cache
layer given a capacity (no ``torch.cat`` of the whole cache per step: O(rows written) bytes copied, and one block
instead of a heap of ever larger freed ones)."""

from __future__ import annotations

import torch


def append_rows(block: torch.Tensor | None, filled: int, rows: torch.Tensor, capacity: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """Copy ``rows [..., n, d]`` into positions ``[filled, filled + n)`` of ``block [..., size, d]`` and return the
    block. The block is allocated on first use with ``capacity`` positions (``torch.empty``: its pages are touched
    only as rows arrive) and doubled, keeping its first ``filled`` rows, when a write would pass its end."""
    end = filled + rows.shape[-2]
    if block is None or block.shape[-2] < end:
        grown = torch.empty(*rows.shape[:-2], max(2 * end, capacity), rows.shape[-1], dtype=dtype, device=device)
        if block is not None:
            grown[..., :filled, :] = block[..., :filled, :]
        block = grown
    block[..., filled:end, :] = rows
    return block

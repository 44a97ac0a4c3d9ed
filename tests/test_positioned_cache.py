"""The positioned cache's two storages: blocks allocated once (``capacity``, the Trace recorder's) hold the same
keys, values and positions as concatenation, through appends, sliding-window forgetting, block moves and growth,
compaction and batch-row selection (copies of the same numbers: compared bitwise)."""

from __future__ import annotations

import pytest
import torch

from kvdiag.cache import PositionedLayer, take_handoff


def _same(a: PositionedLayer, b: PositionedLayer) -> None:
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.positions, b.positions)
    assert len(a) == len(b) and a.seen == b.seen


@pytest.mark.parametrize("window, capacity", [(None, 64), (None, 3), (5, 64), (5, 3)])
def test_blocks_hold_what_concatenation_holds(window, capacity):
    """Chunks of 7, 1, ... tokens over 2 rows x 2 KV heads; a compaction at 20 tokens and a row selection at 25.
    capacity 3 grows the blocks; a window of 5 keeps a block of 10 whose entries move to its front when it fills."""
    gen = torch.Generator().manual_seed(0)
    cat, blocks = PositionedLayer(window), PositionedLayer(window, capacity=capacity)
    assert blocks.capacity == (min(capacity, 2 * window) if window else capacity)
    fed, moved, b = 0, 0, 2
    for c in [7] + [1] * 30:
        k, v = torch.randn(b, 2, c, 4, generator=gen), torch.randn(b, 2, c, 4, generator=gen)
        out_cat = cat.update(k, v)
        take_handoff()  # the attention call's read (each update hands its layer on)
        start = blocks.start
        out_blocks = blocks.update(k, v)
        take_handoff()
        assert all(torch.equal(x, y) for x, y in zip(out_cat, out_blocks, strict=True))
        assert torch.equal(cat.visible_positions, blocks.visible_positions)
        _same(cat, blocks)
        fed += c
        moved += blocks.start < start
        if fed == 20:  # keep 4 entries per head, different ones per row and head
            n = len(cat)
            keep = torch.stack([torch.randperm(n, generator=gen)[:4].sort().values for _ in range(4)]).view(2, 2, 4)
            cat.compact(keep, "torch")
            blocks.compact(keep, "torch")
            _same(cat, blocks)
        if fed == 25:
            rows = torch.tensor([1, 1, 0])
            cat.batch_select_indices(rows)
            blocks.batch_select_indices(rows)
            _same(cat, blocks)
            b = 3
    assert (moved > 0) == (window is not None)  # the entries moved to the front of a full block (sliding only)
    if window:
        assert len(blocks) == window - 1 and blocks.positions[0, 0, -1] == fed - 1
        assert blocks.blocks[0].shape[-2] <= 2 * max(window, 7)  # about two windows, not the whole sequence
    else:
        assert len(blocks) == 4 + fed - 20  # the compaction kept 4, then every later token

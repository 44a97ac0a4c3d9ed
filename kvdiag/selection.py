"""Which entries a rule keeps under a budget: one selection function for replay (every compaction) and decisions
(every checkpoint), so budget, selection, protection and tie-breaking mean the same in both.

Scores are the rule's ``[Hkv, n]`` per layer (higher = keep; protected entries carry the kept score, so they are
kept first). Ties keep the newer entry (the higher slot): recency is the safer guess between equals.
"""

from __future__ import annotations

import torch
from scipy.stats import rankdata

from kvdiag.errors import check_choice

SELECTIONS = ("per-head", "per-token")


def top_slots(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """The ``budget`` highest-scored slots of each row of ``scores [..., n]``, ascending; ties keep the newer slot."""
    n = scores.shape[-1]
    # a stable descending sort of the reversed row puts the newer of tied entries first
    order = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices[..., :budget]
    return (n - 1 - order).sort(dim=-1).values


def token_ranks(stacked: torch.Tensor) -> torch.Tensor:
    """[n] fp64: the sum over layers and KV heads of each entry's average rank in its row of ``stacked [L, Hkv, n]``.
    Every row ranks the same n entries, so this orders entries as the mean percentile rank (``mean_rank``, the token
    aggregation of ``kvdiag score``) does, exactly in fp64 (half-integers): float noise never breaks a tie."""
    L, Hkv, n = stacked.shape
    return torch.from_numpy(rankdata(stacked.reshape(L * Hkv, n).double().numpy(), method="average", axis=-1).sum(0))


def select_keep(scores: list[torch.Tensor], budget: int, selection: str) -> torch.Tensor:
    """Slots to keep [L, Hkv, budget] (ascending) from per-layer scores ``[Hkv, n]``; ties keep the newer entry.

    ``per-head``: each (layer, KV head) keeps its own top ``budget`` (R-KV). ``per-token``: one keep set for every
    layer and head, ranked by :func:`token_ranks`.
    """
    check_choice(selection, SELECTIONS, "--selection")
    stacked = torch.stack(scores)  # [L, Hkv, n]
    if selection == "per-head":
        return top_slots(stacked, budget)
    L, Hkv, _ = stacked.shape
    return top_slots(token_ranks(stacked), budget).expand(L, Hkv, budget)


def evicted_slots(keep: torch.Tensor, n: int) -> torch.Tensor:
    """The complement of ``keep [L, Hkv, B]`` (ascending kept slots of ``n``): evicted slots [L, Hkv, n - B],
    ascending."""
    kept = torch.zeros(*keep.shape[:-1], n, dtype=torch.bool)
    kept.scatter_(-1, keep.long(), True)
    return torch.nonzero(~kept)[:, -1].view(*keep.shape[:-1], n - keep.shape[-1])

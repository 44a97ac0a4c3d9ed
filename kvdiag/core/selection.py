"""Which entries a rule keeps under a budget: one selection function for replay (every compaction) and decisions
(every checkpoint), so budget, selection, protection and tie-breaking mean the same in both.

Scores are the rule's ``[Hkv, n]`` per layer (higher = keep; protected entries carry the kept score, so they are
kept first). Ties keep the newer entry (the higher slot): recency is the safer guess between equals.

Selections: ``per-head`` (each layer and KV head keeps its own top B, R-KV), ``per-token`` (one keep set for every layer
and head), ``stochastic[:TAU]`` (each layer and KV head *samples* the entries it evicts, without replacement, with
probabilities ``softmax(-r / TAU)`` over the percentile ranks ``r`` of its scores (0: the lowest-scored), so a low score
makes eviction likely, not certain; protected entries are never drawn; VaSE's stochastic eviction, TAU our parameter).
A selection is parsed once from its spec string into a :class:`Selection` and passed around as that object.
"""

from __future__ import annotations

import torch
from scipy.stats import rankdata

from kvdiag.core.parsing import PER_HEAD, SELECTIONS, STOCHASTIC_TAU, Selection, parse_selection  # noqa: F401  (its API)


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


def select_keep(scores: list[torch.Tensor], budget: int, selection: Selection | str,
                protected: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Slots to keep [L, Hkv, budget] (ascending) from per-layer scores ``[Hkv, n]``; ties keep the newer entry.

    ``per-head``: each (layer, KV head) keeps its own top ``budget`` (R-KV). ``per-token``: one keep set for every
    layer and head, ranked by :func:`token_ranks`. ``stochastic[:TAU]``: each (layer, KV head) samples the ``n -
    budget`` entries it evicts (module docstring; Gumbel top-k, drawn from ``generator``), never the ``protected``
    [L, Hkv, n] (or [n]) ones.
    """
    selection = Selection.parse(selection)
    stacked = torch.stack(scores)  # [L, Hkv, n]
    if selection.stochastic:
        return _sample_keep(stacked, budget, selection.tau, protected, generator)
    if not selection.per_token:
        return top_slots(stacked, budget)
    L, Hkv, _ = stacked.shape
    return top_slots(token_ranks(stacked), budget).expand(L, Hkv, budget)


def _sample_keep(stacked: torch.Tensor, budget: int, tau: float, protected: torch.Tensor | None,
                 generator: torch.Generator | None) -> torch.Tensor:
    L, Hkv, n = stacked.shape
    ranks = torch.from_numpy(rankdata(stacked.reshape(L * Hkv, n).double().numpy(), method="average", axis=-1))
    ranks = (ranks - 1) / max(n - 1, 1)  # percentile ranks in [0, 1]: the temperature means the same for every rule
    logits = (-ranks / tau).view(L, Hkv, n)
    if protected is not None:
        logits = logits.masked_fill(protected.bool().expand(L, Hkv, n), float("-inf"))
    u = torch.rand(L, Hkv, n, generator=generator, dtype=torch.float64).clamp(1e-300, 1.0 - 1e-16)
    keys = logits - torch.log(-torch.log(u))  # Gumbel top-k: the n - budget largest keys are a weighted draw
    return top_slots(-keys, budget)  # keep the smallest keys (never a protected one's -inf unless they overflow B)


def evicted_slots(keep: torch.Tensor, n: int) -> torch.Tensor:
    """The complement of ``keep [L, Hkv, B]`` (ascending kept slots of ``n``): evicted slots [L, Hkv, n - B],
    ascending."""
    kept = torch.zeros(*keep.shape[:-1], n, dtype=torch.bool)
    kept.scatter_(-1, keep.long(), True)
    return torch.nonzero(~kept)[:, -1].view(*keep.shape[:-1], n - keep.shape[-1])

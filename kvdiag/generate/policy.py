"""A bounded cache's policy (:class:`Policy`: rule, budget, schedule, selection) and the choice it makes at a
checkpoint (:func:`live_scores`, :func:`choose`): one implementation for ``kvdiag replay`` and for
:class:`~kvdiag.generate.EvictingCache` under ``model.generate``."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from kvdiag.cache import PositionedCache
from kvdiag.core.errors import UserError
from kvdiag.core.parsing import Selection
from kvdiag.core.schema import CHECKPOINT_INTERVAL
from kvdiag.core.selection import select_keep
from kvdiag.generate.live import score_layer
from kvdiag.model.adapters import ModelAttention
from kvdiag.model.families import check_windows
from kvdiag.scorers import Scorer

# how a prompt is compacted (Policy.prefill): replay's chunks, or kvpress's one compaction after a one-forward prefill
PREFILLS = ("chunked", "once")


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
    selection : ``per-head`` (R-KV), ``per-token`` or ``stochastic[:TAU]`` (a ``kvdiag.core.selection.Selection``; a
        spec string is parsed here).
    backend : kernel backend of the compaction (``auto``, ``torch``, ``triton``).
    seed : seed of stochastic selection (each compaction draws from ``crc32(seed:prompt:t)``).
    prefill : how the prompt is fed and compacted. ``chunked`` (replay's, R-KV's): ``budget + interval`` tokens, then
        ``interval`` at a time, a checkpoint after each chunk, so no forward holds more than ``budget + interval``
        entries. ``once`` (kvpress's): the whole prompt in one forward, one checkpoint at its end (the cache holds the
        whole prompt until then). Both then compact every ``interval`` generated tokens.
    """

    scorer: Scorer
    budget: int
    interval: int = CHECKPOINT_INTERVAL
    selection: Selection | str = "per-head"
    backend: str = "auto"
    seed: int = 0
    prefill: str = "chunked"

    def __post_init__(self):
        if self.budget < 1:
            raise UserError(f"--budget {self.budget}: must be a positive number of cache entries")
        if self.interval < 1:
            raise UserError(f"--interval {self.interval}: must be a positive number of tokens between compressions")
        if self.prefill not in PREFILLS:
            raise UserError(f"prefill={self.prefill!r} is not valid: use one of {', '.join(PREFILLS)}")
        self.selection = Selection.parse(self.selection)

    @property
    def query_window(self) -> int:
        """W_q: post-RoPE queries the compressor keeps per layer (the scorer's largest observation window)."""
        return max(self.scorer.query_window, 1)

    def check_model(self, attention: ModelAttention) -> None:
        """Refuse what this policy cannot mean on a model with sliding-window layers (bad input: UserError)."""
        check_windows([layer.window for layer in attention.layers], self.selection, self.budget)


def prompt_chunks(prompt_len: int, policy: Policy | None) -> list[tuple[int, int]]:
    """``(start, end)`` of each prefill forward: the whole prompt when it fits ``budget + interval`` entries or the
    policy prefills ``once``, else ``budget + interval`` tokens and then ``interval`` at a time (a checkpoint follows
    each chunk)."""
    if policy is None or policy.prefill == "once":
        return [(0, prompt_len)]
    first = min(prompt_len, policy.budget + policy.interval)
    return [(0, first)] + [(s, min(s + policy.interval, prompt_len)) for s in range(first, prompt_len, policy.interval)]


def live_scores(policy: Policy, cache: PositionedCache, row: int, t: int, attention: ModelAttention, prompt_len: int,
                prompt_id: str, token_ids: torch.Tensor | None = None,
                o_proj: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Per layer, the live scores [Hkv, n_l] of row ``row`` at checkpoint ``t`` (``kvdiag.generate.live``)."""
    o_proj = o_proj or {}
    return [
        score_layer(policy.scorer, *cache.layer(layer, row), cache.layers[layer].positions[row],
                    cache.queries.get(layer, row)[:, -policy.query_window :], t, attention.layers[layer],
                    prompt_len, layer, prompt_id, token_ids, policy.selection, o_proj.get(layer))
        for layer in range(len(cache.layers))
    ]


def choose(policy: Policy, scores: list[torch.Tensor], positions: list[torch.Tensor], t: int, prompt_id: str,
           windows: list[int | None]) -> list[torch.Tensor | None]:
    """Per layer, the slots [Hkv, B] row ``prompt_id`` keeps at checkpoint ``t`` (None: the layer holds no more than
    the budget) from its scores and positions [Hkv, n_l] (``kvdiag.core.selection.select_keep``; stochastic draws from
    ``crc32(seed:prompt:t)``). Layers of one size are chosen together (per-token ranks across layers); a sliding
    layer evicts the entries its window already hides first."""
    generator = None
    if policy.selection.stochastic:  # a seeded draw per compaction; never a protected one
        generator = torch.Generator().manual_seed(zlib.crc32(f"{policy.seed}:{prompt_id}:{t}".encode()))
    if len({s.shape[-1] for s in scores}) == 1 and all(w is None for w in windows):
        stacked = torch.stack(positions)
        protected = policy.scorer.protected(t - stacked, stacked) if generator is not None else None
        return list(select_keep(scores, policy.budget, policy.selection, protected, generator))
    keep = []
    for s, pos, window in zip(scores, positions, windows, strict=True):
        if s.shape[-1] <= policy.budget:
            keep.append(None)
            continue
        if window is not None:
            s = s.masked_fill(pos <= t - window, float("-inf"))  # no query from t on sees them
        protected = policy.scorer.protected(t - pos, pos) if generator is not None else None
        keep.append(select_keep([s], policy.budget, policy.selection, protected, generator)[0])
    return keep

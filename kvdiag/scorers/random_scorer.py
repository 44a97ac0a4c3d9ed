"""Random: the chance baseline, seeded."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from kvdiag.scorers.base import Scorer
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.registry import register_scorer


@register_scorer("random")
@dataclass
class RandomScorer(Scorer):
    """Uniform random scores in [0, 1), one per KV head and entry.

    Seeded by ``(seed, prompt_id, checkpoint, layer)`` (CRC32), so a score does not depend on which other
    candidates are scored or in which order: rerunning gives the same file.

    Parameters
    ----------
    seed : base seed (default 0).
    """

    seed: int = 0

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        key = f"{self.seed}:{ctx.prompt_id}:{ctx.checkpoint}:{ctx.layer}".encode()
        gen = torch.Generator().manual_seed(zlib.crc32(key))
        return torch.rand(ctx.num_kv_heads, ctx.t, generator=gen)

"""Seeded, coupled sampling for free-running replay.

Every generation ``(prompt, sample s)`` draws its uniforms from its own generator, seeded by
``crc32(f"{seed}:{prompt_id}:{s}")``, one per generated token, and turns each into a token by the inverse CDF of
the (temperature, top-p) distribution in token-id order. FullKV and every policy therefore share their random
numbers (common random numbers): where their distributions agree they write the same token, so answer fidelity
compares what the cache changed, not two independent draws.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvdiag.core.errors import UserError

if TYPE_CHECKING:  # torch loads where tokens are drawn: the CLI checks the sampling settings before it
    import torch


@dataclass(frozen=True)
class Sampling:
    """temperature > 0 (None: greedy, argmax); top_p in (0, 1] (the nucleus); seed of every generation's draws."""

    temperature: float | None = None
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature is not None and not 0 < self.temperature < float("inf"):
            raise UserError(f"--temperature {self.temperature}: must be positive and finite (omit it for greedy "
                            "decoding)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.temperature is None and self.top_p != 1.0:
            raise UserError(f"--top-p {self.top_p} needs --temperature (greedy decoding has no nucleus)")

    @property
    def greedy(self) -> bool:
        return self.temperature is None

    def generator(self, prompt_id: str, sample: int) -> torch.Generator | None:
        """The draws of generation ``(prompt_id, sample)`` (None when greedy)."""
        if self.greedy:
            return None
        import torch

        return torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{prompt_id}:{sample}".encode()))

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """The next token from logits [V]: argmax when greedy, else one inverse-CDF draw from ``generator`` over the
        nucleus in token-id order."""
        if self.greedy:
            return int(logits.argmax())
        import torch

        probs = torch.softmax(logits.double() / self.temperature, dim=-1)
        ids = nucleus(probs, self.top_p) if self.top_p < 1 else torch.arange(probs.numel())
        cdf = probs[ids].cumsum(0)  # the full vocabulary's CDF at these tokens: the others add exact zeros
        u = torch.rand((), generator=generator, dtype=torch.float64)
        # right=True: the first token whose CDF exceeds u * total
        return int(ids[torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=cdf.numel() - 1)])


def nucleus(probs: torch.Tensor, top_p: float, k: int = 256) -> torch.Tensor:
    """Token ids (ascending) of the nucleus of ``probs [V]``: ranked by probability, ties by token id, every token
    whose preceding mass is below ``top_p``. Ranks only the top ``k`` (doubled until the nucleus ends on a
    probability above the k-th largest, so no tie straddles the cut) instead of sorting the vocabulary."""
    import torch

    V = probs.numel()
    while True:
        k = min(k, V)
        top = torch.topk(probs, k).indices.sort().values  # id order, then a stable sort by probability
        ranked, order = probs[top].sort(descending=True, stable=True)
        inside = ranked.cumsum(0) - ranked < top_p
        n = int(inside.sum())
        if k == V or (n < k and ranked[n - 1] > ranked[-1]):
            return top[order[:n]].sort().values
        k *= 2

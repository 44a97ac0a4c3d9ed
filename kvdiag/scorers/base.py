"""The scorer template: a rule writes its raw score and declares what it protects and what it reads.

- :meth:`Scorer.score` returns the raw score ``[Hkv, t]`` (higher = keep);
- :meth:`Scorer.protected` declares the entries the rule never evicts (sinks, recent windows, a delay buffer);
- :attr:`Scorer.needs_history` / :attr:`Scorer.needs_model` declare what a live (compacted) cache lacks, and
  :attr:`Scorer.window_field` names the field that holds its observation window.

The base class applies the declaration: :meth:`Scorer.scores` checks the raw score's shape and finiteness and gives
the protected entries :func:`~kvdiag.scorers.normalization.protect`'s kept score. Scoring (``score_trace``),
rank-eval's ``--eligible``, replay and decisions read the same declaration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiag.errors import UserError, check_positive
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.normalization import protect


@dataclass
class Scorer:
    """Base of every scoring rule: a dataclass whose fields are its parameters (with official defaults).

    Subclasses implement :meth:`score` and, where the rule always keeps some entries, :meth:`protected`. The
    registry name is set by :func:`kvdiag.scorers.register_scorer`.
    """

    name: ClassVar[str] = ""
    in_all: ClassVar[bool] = True  # part of `--scorers all` (False: needs a setting, e.g. fitted's model path)
    window_field: ClassVar[str | None] = None  # the field holding the observation window (replay's --w-obs sets it)
    needs_history: ClassVar[bool] = False  # reads the attention of every past query (a live cache keeps W_q)
    needs_model: ClassVar[bool] = False  # reruns the Trace's model (kvpress presses): not in a live cache
    continuous: ClassVar[bool] = True  # its score is a graded preference (False: a fixed order; no stochastic draws)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[Hkv, t] raw score of every cached entry, higher = keep; the protected entries' values are replaced."""
        raise NotImplementedError

    def protected(self, age: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """[n] bool: the entries of ``age [n]`` (checkpoint − position) and ``position [n]`` that this rule never
        evicts (sinks, recent windows, a delay buffer); they get :func:`protect`'s kept score. Default: none."""
        return torch.zeros_like(age, dtype=torch.bool)

    def check_trace(self, trace) -> None:
        """Refuse a Trace this rule cannot score, in one ``UserError`` line, before any work (default: none)."""

    @property
    def query_window(self) -> int:
        """W_q: the newest queries the rule reads (its observation window; 0 when it reads none)."""
        return int(getattr(self, self.window_field)) if self.window_field else 0

    def scores(self, ctx: ScoreContext) -> torch.Tensor:
        """[Hkv, t]: :meth:`score`, checked, with the :meth:`protected` entries given the kept score."""
        raw = self.score(ctx)
        check_scores(self.name, raw, ctx)
        return protect(raw.float(), self.protected(ctx.age, ctx.positions))

    def __call__(self, ctx: ScoreContext) -> torch.Tensor:
        """[Hkv, C]: the scores of ``ctx.candidates``."""
        return self.scores(ctx)[:, ctx.candidates]

    @property
    def params(self) -> dict:
        """The parameters as a JSON-serializable dict (written into scores.parquet's metadata)."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass
class QueryWindowScorer(Scorer):
    """A rule that scores from its last ``window`` queries and keeps the last ``window`` entries (SnapKV, R-KV)."""

    window_field: ClassVar[str | None] = "window"
    window: int = 32

    def __post_init__(self):
        check_positive(f"{self.name}.window", self.window)

    def protected(self, age: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Never evicted: the last ``window`` entries (the query window)."""
        return age <= self.window


def check_scores(name: str, scores: torch.Tensor, ctx: ScoreContext) -> None:
    """A scorer's raw scores must be ``[Hkv, t]`` and finite (one ``UserError`` line naming where they were not)."""
    expected = (ctx.num_kv_heads, ctx.t)
    if tuple(scores.shape) != expected:
        raise UserError(f"scorer {name} returned shape {tuple(scores.shape)}, expected [Hkv, t] = {list(expected)} at "
                        f"layer {ctx.layer}, checkpoint {ctx.checkpoint}; fix its score()")
    if not bool(torch.isfinite(scores).all()):
        raise UserError(f"scorer {name} returned non-finite scores at layer {ctx.layer}, checkpoint {ctx.checkpoint}; "
                        "fix its score()")


def needs_o_proj(scorer: Scorer) -> bool:
    """Whether ``scorer`` reads ‖W_O v‖₂ (the ``wo_l2`` payload), which needs the model's o_proj weights."""
    return "wo_l2" in (str(value) for value in scorer.params.values())


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value

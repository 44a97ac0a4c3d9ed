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
import inspect
import os
import traceback
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiag.core.errors import UserError, check_positive
from kvdiag.scorers.context import ScoreContext
from kvdiag.scorers.fields import protected_span
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
    # (the field W: entries of age <= W, the newest; the field S: entries at position < S, the first) never evicted
    protects: ClassVar[tuple[str | None, str | None]] = (None, None)
    needs_history: ClassVar[bool] = False  # reads the attention of every past query (a live cache keeps W_q)
    needs_model: ClassVar[bool] = False  # reruns the Trace's model (kvpress presses): not in a live cache
    continuous: ClassVar[bool] = True  # its score is a graded preference (False: a fixed order; no stochastic draws)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """[Hkv, t] raw score of every cached entry, higher = keep; the protected entries' values are replaced."""
        raise NotImplementedError

    def protected(self, age: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """[n] bool: the entries of ``age [n]`` (checkpoint − position) and ``position [n]`` that this rule never
        evicts; they get :func:`protect`'s kept score. The built-ins declare them in ``protects`` (the newest entries
        up to one field's age, the first ones below another's position: :class:`kvdiag.scorers.fields.Protected`, the
        one definition the CLI's budget check reads before torch loads); a plugin may override this."""
        return protected_span(self.protects, self).mask(age, position)

    def check_trace(self, trace) -> None:
        """Refuse a Trace this rule cannot score, in one ``UserError`` line, before any work (default: none)."""

    @property
    def query_window(self) -> int:
        """W_q: the newest queries the rule reads (its observation window; 0 when it reads none)."""
        return int(getattr(self, self.window_field)) if self.window_field else 0

    def scores(self, ctx: ScoreContext) -> torch.Tensor:
        """[Hkv, t]: :meth:`score`, checked, with the :meth:`protected` entries given the kept score."""
        try:
            raw = self.score(ctx)
            if not isinstance(raw, torch.Tensor):
                raise UserError(f"scorer {self.name} ({where(type(self))}) returned a {type(raw).__name__}, not a "
                                "torch.Tensor [Hkv, t]; fix its score()")
            check_scores(self.name, raw, ctx)
        except UserError:
            raise
        except Exception as err:  # a plugin's own exception is its author's fault; a built-in's is a kvdiag bug
            if type(self).__module__.startswith("kvdiag."):
                raise
            raise UserError(f"scorer {self.name} ({where(type(self))}) raised {type(err).__name__}: "
                            f"{' '.join(str(err).split())} at {blame(err)}; fix its score()") from err
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
    protects: ClassVar = ("window", None)  # never evicted: the last ``window`` entries (the query window)
    window: int = 32

    def __post_init__(self):
        check_positive(f"{self.name}.window", self.window)


def check_scores(name: str, scores: torch.Tensor, ctx: ScoreContext) -> None:
    """A scorer's raw scores must be ``[Hkv, t]`` and finite (one ``UserError`` line naming where they were not)."""
    expected = (ctx.num_kv_heads, ctx.t)
    if tuple(scores.shape) != expected:
        raise UserError(f"scorer {name} returned shape {tuple(scores.shape)}, expected [Hkv, t] = {list(expected)} at "
                        f"layer {ctx.layer}, checkpoint {ctx.checkpoint}; fix its score()")
    if not bool(torch.isfinite(scores).all()):
        raise UserError(f"scorer {name} returned non-finite scores at layer {ctx.layer}, checkpoint {ctx.checkpoint}; "
                        "fix its score()")


def where(obj) -> str:
    """``file:line`` of a (plugin's) class or function, for the one line that blames it."""
    try:
        return f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (OSError, TypeError):
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def blame(err: BaseException, default: str = "?") -> str:
    """``file:line`` of the innermost frame of ``err``'s traceback outside kvdiag, torch and the import machinery:
    the plugin's own line."""
    skip = (f"{os.sep}kvdiag{os.sep}", f"{os.sep}torch{os.sep}", "importlib")
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not any(s in f.filename for s in skip)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else default


def needs_o_proj(scorer: Scorer) -> bool:
    """Whether ``scorer`` reads ‖W_O v‖₂ (the ``wo_l2`` payload), which needs the model's o_proj weights."""
    return "wo_l2" in (str(value) for value in scorer.params.values())


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value

"""Exact labels of a live cache during teacher-forced replay: the oracle policy and each compression's joint damage.

At a checkpoint ``t`` the bounded cache holds, per (layer, KV head), the survivors ``positions [L, Hkv, n]`` of
``[0, t)``; everything else in ``[0, t)`` has been evicted, the set ``E_t``. The label engine
(``kvdiag.label.engine``) masks entries of the full-cache prefix exactly as a physical deletion, so:

- the **joint damage** of a compression is the exact label of the set ``E_t`` (the policy's whole evicted set, per
  layer and KV head, evicted from the full-cache prefix at once): ``KL(P_full || P_evicted)`` over the next
  ``horizon`` teacher-forced steps, mean over them. At the first compaction it is the KL the replay then measures
  (tests/test_replay_oracle.py); after it, the replay's own surviving entries were written under a compacted cache,
  and that drift is what the replayed KL adds to the label;
- the **oracle policy** ranks each live entry ``i`` by the label of ``E_t ∪ {i}`` (what evicting ``i`` too would
  cost, given what is already gone) and keeps the ``budget`` costliest: a greedy one-step policy on exact labels.
  It evicts token sets (the same positions from every layer and KV head: ``--selection per-token``) and costs one
  set row per live entry per compression (``n`` rows of ``horizon`` tokens; its seconds are recorded per run).

The **future-attention oracle** (``oracle_future``, :class:`FutureRule`) reads no label: at each compression, per
(layer, KV head), it keeps the ``budget`` live entries that the full-cache run's queries at ``t .. t + W - 1`` attend
most (``kvdiag.model.attention.future_attention`` on the Trace, as ``kvdiag decisions``' ``future_attention``
reference),
W reaching past the next compression plus the label horizon (``kvdiag.replay.config.future_window``). It chooses
in the rules' own per-head action space (or per token under ``--selection per-token``) and costs one attention
recomputation per compression (no set row).

Near the end of the sequence the horizon and the window shrink to the steps left (``min(horizon, T - t)``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvdiag.core.parsing import REST
from kvdiag.core.schema import HORIZON
from kvdiag.label.engine import OracleEngine
from kvdiag.model.load import LoadedModel
from kvdiag.scorers.names import ORACLE, ORACLE_FUTURE  # noqa: F401  (the oracles' API)


@dataclass
class OracleRule:
    """The oracle policy as a replay rule: no query window, nothing protected, labels instead of scores."""

    horizon: int = HORIZON
    name: str = ORACLE
    query_window: int = 0
    needs_history: bool = False
    needs_model: bool = False

    @property
    def params(self) -> dict:
        return {"horizon": self.horizon}

    def protected(self, age: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(position, dtype=torch.bool)


@dataclass
class FutureRule:
    """The future-attention oracle as a replay rule: ``window`` future queries (a number, or ``rest``: to the end of
    the Trace) read from the full-cache run instead of scores; no query window, nothing protected."""

    window: int | str
    name: str = ORACLE_FUTURE
    query_window: int = 0
    needs_history: bool = False
    needs_model: bool = False

    @property
    def params(self) -> dict:
        return {"window": self.window}

    def protected(self, age: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(position, dtype=torch.bool)

    def steps(self, t: int, length: int) -> int:
        """Future queries at checkpoint ``t`` of a sequence of ``length`` tokens: the window, cut at the end."""
        return length - t if self.window == REST else min(int(self.window), length - t)


@dataclass
class LiveLabels:
    """Exact labels of one sequence's live caches (``token_ids`` [T], the Trace's tokens).

    seconds : time spent labeling, per call kind (``joint``, ``oracle``, ``future``); rows : set rows labeled, per
    kind (``future`` labels no row). future : ``(t, W) -> [L, Hkv, t]``, the full-cache attention of the queries
    ``t .. t + W - 1`` on each entry of ``[0, t)`` (``kvdiag.model.attention.future_attention`` of the Trace and prompt;
    None: ``oracle_future`` cannot run).
    """

    lm: LoadedModel
    token_ids: torch.Tensor
    horizon: int = HORIZON
    batch_size: int = 64
    backend: str = "auto"
    future: Callable[[int, int], torch.Tensor] | None = None
    seconds: dict[str, float] = field(default_factory=lambda: {"joint": 0.0, "oracle": 0.0, "future": 0.0})
    rows: dict[str, int] = field(default_factory=lambda: {"joint": 0, "oracle": 0, "future": 0})
    _engines: dict[int, OracleEngine] = field(default_factory=dict)

    def engine(self, t: int) -> OracleEngine:
        """The label engine whose horizon fits checkpoint ``t`` (``min(horizon, T - t)``)."""
        h = min(self.horizon, len(self.token_ids) - t)
        if h not in self._engines:
            self._engines[h] = OracleEngine(self.lm, self.token_ids, h, self.batch_size, self.backend)
        return self._engines[h]

    def joint(self, positions: torch.Tensor, t: int) -> float:
        """Mean KL over the horizon of evicting everything in ``[0, t)`` that ``positions [L, Hkv, n]`` lacks."""
        return float(self._label(t, [evicted_set(positions, t)], "joint").mean())

    def token_labels(self, positions: torch.Tensor, t: int) -> torch.Tensor:
        """[n] the label of evicting each live entry on top of the evicted set (per-token caches only)."""
        live = positions[0, 0]
        if not bool((positions == live).all()):
            raise ValueError("the oracle policy needs a token-set cache (the same positions in every layer and head)")
        gone = evicted_set(positions[:1, :1], t)[0, 0]
        sets = [torch.cat([gone, live[i : i + 1]]) for i in range(live.numel())]
        return self._label(t, sets, "oracle")

    def future_scores(self, positions: list[torch.Tensor], t: int, rule: FutureRule) -> list[torch.Tensor]:
        """Per layer, [Hkv, n_l] fp64: the future attention (``rule``'s window) on each live entry ``positions[l]
        [Hkv, n_l]`` at checkpoint ``t``: ``oracle_future``'s scores (higher = keep)."""
        if self.future is None:
            raise ValueError(f"{ORACLE_FUTURE} needs the full-cache run's queries (a Trace): teacher-forced replay")
        start = time.perf_counter()
        attention = self.future(t, rule.steps(t, len(self.token_ids)))  # [L, Hkv, t]
        scores = [attention[layer].gather(-1, pos) for layer, pos in enumerate(positions)]
        self.seconds["future"] += time.perf_counter() - start
        return scores

    def _label(self, t: int, sets: list[torch.Tensor], kind: str) -> torch.Tensor:
        """[N] mean-over-horizon KL of each set row at checkpoint ``t``."""
        start = time.perf_counter()
        labels, _ = self.engine(t).label_sets(t, sets)
        self.seconds[kind] += time.perf_counter() - start
        self.rows[kind] += len(sets)
        return labels["kl"].mean(-1)


def evicted_set(positions: torch.Tensor, t: int) -> torch.Tensor:
    """[L, Hkv, t - n] the positions of ``[0, t)`` missing from ``positions [L, Hkv, n]`` (every head has n)."""
    L, Hkv, n = positions.shape
    present = torch.zeros(L, Hkv, t, dtype=torch.bool)
    present.scatter_(-1, positions, True)
    return torch.arange(t).expand(L, Hkv, t)[~present].view(L, Hkv, t - n)

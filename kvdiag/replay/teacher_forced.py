"""Teacher-forced replay: a Trace's tokens fed under every policy, one sequence at a time, with exact labels
(each compression's joint damage, the oracle policy's scores); KL against a full-cache forward of the same tokens."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

from kvdiag.attention import future_attention
from kvdiag.errors import UserError
from kvdiag.models import LoadedModel
from kvdiag.replay.decoding import Decoded, full_logprobs, kl_steps, teacher_force
from kvdiag.replay.oracle import LiveLabels
from kvdiag.replay.settings import ReplaySettings
from kvdiag.replay.units import Item, Unit, common_key, make_unit
from kvdiag.scorer_names import ORACLE_FUTURE, REPLAY_ONLY


@dataclass
class TeacherForced:
    """Teacher-forced replay of the Trace ``trace`` (its ``prompt_ids``, default all; ``source``: its path, for
    config.json)."""

    trace: object  # a kvdiag.trace.Trace
    prompt_ids: list[str] | None = None
    source: str | None = None
    name: ClassVar[str] = "teacher_forced"  # the ``mode`` column and fingerprint field

    @property
    def provenance(self) -> dict:
        """config.json's ``trace``."""
        return self.trace.provenance

    def adjust(self, settings: ReplaySettings) -> ReplaySettings:
        """No FullKV row: the KL reference is the full cache itself."""
        return dataclasses.replace(settings, full_kv=False)

    def items(self, lm: LoadedModel, settings: ReplaySettings) -> list[Item]:
        items = []
        for pid in self.prompt_ids or self.trace.prompt_ids:
            entry = self.trace.manifest["prompts"].get(pid)
            if entry is None:
                raise UserError(f"prompt {pid!r} is not in the Trace {self.trace.path}")
            items.append(Item(pid, self.trace.token_ids(pid).tolist(), self.trace.prompt_len(pid), entry.get("answer")))
        return items

    def units(self, model_info: dict, settings: ReplaySettings, items: list[Item], policies: dict) -> list[Unit]:
        """Every (sequence, scorer, budget) with its part and fingerprint (keyed by the Trace's fingerprint and the
        label settings)."""
        common = common_key(self.name, model_info, settings, (), self.trace.fingerprint)
        return [make_unit(common, it, name, budget, policy) for it in items
                for (name, budget), policy in policies.items()]

    def run(self, lm: LoadedModel, settings: ReplaySettings, policies: dict, pending: list[Unit], o_proj,
            commit, progress, task) -> None:
        """Feed each pending unit's Trace tokens under its policy, one at a time; with exact labels (joint damage of
        every compression unless ``--no-joint``, the oracle's scores) and ``oracle_future``'s future attention (the
        Trace's q and k: stored, or rebuilt with ``lm``) from one :class:`LiveLabels` per sequence."""
        if any(u.scorer == ORACLE_FUTURE for u in pending):
            self.trace.use_model(lm)  # a Trace without stored q/k rebuilds them with the loaded model, not a copy
        reference: dict[str, torch.Tensor] = {}  # P_full of the current sequence
        labels: dict[str, LiveLabels] = {}
        for u in pending:
            it, policy = u.item, policies[(u.scorer, u.budget)]
            progress.update(task, description=f"replay {it.prompt_id} {u.scorer} B={u.budget or 'full'}")
            start = time.perf_counter()
            if it.prompt_id not in reference:
                reference = {it.prompt_id: full_logprobs(lm.model, it.token_ids, it.prompt_len)}
                labels = {it.prompt_id: LiveLabels(lm, torch.tensor(it.token_ids), settings.horizon,
                                                   backend=settings.backend,
                                                   future=partial(future_attention, self.trace, it.prompt_id))}
            live = labels[it.prompt_id]
            use = live if settings.joint or u.scorer in REPLAY_ONLY else None
            before = (sum(live.seconds.values()), sum(live.rows.values()))
            run = teacher_force(lm, it.token_ids, it.prompt_len, policy, it.prompt_id, o_proj=o_proj, labels=use,
                                joint=settings.joint)
            if not settings.joint:  # --no-joint: no joint_kl column values (and none computed, oracle or not)
                run.joint = None
            spent = {"seconds": sum(live.seconds.values()) - before[0], "rows": sum(live.rows.values()) - before[1]}
            commit(u, run, kl_steps(reference[it.prompt_id], run.logprobs), time.perf_counter() - start, spent)
            progress.advance(task)

    @staticmethod
    def outcome(run: Decoded, item: Item, text: str) -> dict:
        """The row fields of a replayed Trace: no max-length hit or verdict (its tokens are not the policy's), the
        joint damage of each compression."""
        return {"max_length_hit": None, "correct": None, "joint_kl": run.joint}

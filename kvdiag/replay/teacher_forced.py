"""Teacher-forced replay: a Trace's tokens fed under every policy, one sequence at a time, with exact labels
(each compression's joint damage, the oracle policy's scores); KL against a full-cache forward of the same tokens."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

from kvdiag.core.errors import UserError
from kvdiag.model.attention import future_attention
from kvdiag.model.load import LoadedModel
from kvdiag.replay.config import ReplaySettings
from kvdiag.replay.decoding import Decoded, full_logprobs, kl_steps, teacher_force
from kvdiag.replay.free_running import needed_columns
from kvdiag.replay.oracle import LiveLabels
from kvdiag.replay.units import Item, Unit, common_key, make_unit
from kvdiag.scorers.names import ORACLE_FUTURE, REPLAY_ONLY
from kvdiag.tasks.needed import decoded_ends, final_line_positions, needed_texts, prompt_positions
from kvdiag.tasks.prompts import load_prompts
from kvdiag.tasks.suites import suite_of


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
        """The Trace's sequences; a Trace of a builtin suite with needed tokens (``kvdiag.tasks.needed``) gives each its
        prompt's needed positions and texts, found as the Trace rendered its prompts."""
        source, generation = self.trace.manifest.get("prompts_source"), self.trace.manifest.get("generation", {})
        suite = {p.prompt_id: p for p in load_prompts(source)} if suite_of(source) is not None else {}
        items = []
        for pid in self.prompt_ids or self.trace.prompt_ids:
            entry = self.trace.manifest["prompts"].get(pid)
            if entry is None:
                raise UserError(f"prompt {pid!r} is not in the Trace {self.trace.path}")
            needs, needed = (), ()
            if pid in suite:
                p = suite[pid]
                needs = tuple(prompt_positions(lm.tokenizer, p, generation.get("chat", True),
                                               generation.get("instruction")))
                needed = tuple(needed_texts(p))
            items.append(Item(pid, self.trace.token_ids(pid).tolist(), self.trace.prompt_len(pid), entry.get("answer"),
                              needs=needs, needed=needed))
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
            suite = bool(it.needs or it.needed)
            run = teacher_force(lm, it.token_ids, it.prompt_len, policy, it.prompt_id, o_proj=o_proj, labels=use,
                                joint=settings.joint, keep_history=suite)
            if not settings.joint:  # --no-joint: no joint_kl column values (and none computed, oracle or not)
                run.joint = None
            top1 = run.logprobs.argmax(-1) == reference[it.prompt_id].argmax(-1)
            run.agree = top1.tolist()
            if suite:
                suite_columns(lm.tokenizer, it, run, top1)
            spent = {"seconds": sum(live.seconds.values()) - before[0], "rows": sum(live.rows.values()) - before[1]}
            commit(u, run, kl_steps(reference[it.prompt_id], run.logprobs), time.perf_counter() - start, spent)
            progress.advance(task)

    @staticmethod
    def outcome(run: Decoded, item: Item, text: str) -> dict:
        """The row fields of a replayed Trace: no max-length hit or verdict (its tokens are not the policy's), the
        joint damage of each compression, the top-1 agreement with the full cache; on a builtin suite its needed
        columns and ``tf_task``."""
        return {"max_length_hit": None, "correct": None, "joint_kl": run.joint, "top1_agree": run.agree,
                **run.needed}


def suite_columns(tokenizer, item: Item, run: Decoded, top1) -> None:
    """``run.needed``: the needed columns of the Trace's sequence under the policy (what each compaction kept of the
    needed tokens, from the policy's kept positions) and ``tf_task``: the policy's top-1 token is the full cache's at
    every token where the Trace's final line writes the needed texts (the teacher-forced task success; None when
    that line lacks them) and ``tf_needed_agree``, the share of those tokens where it is. ``top1`` [T - P] bool, row j
    for position P + j."""
    P = run.prompt_len
    run.kept_counts = [(t, torch.bincount(pos.reshape(-1), minlength=t)[:t]) for t, pos in run.kept]
    run.slots = run.kept[0][1].shape[0] * run.kept[0][1].shape[1] if run.kept else 0
    ends = decoded_ends(tokenizer, run.token_ids[P:])
    run.needed = needed_columns(tokenizer, item, run, ends)
    at = final_line_positions(tokenizer, run.token_ids, P, list(item.needed), ends)
    agree = [bool(top1[q - P]) for q in at] if at else []
    run.needed["tf_task"] = bool(all(agree)) if agree else None
    run.needed["tf_needed_agree"] = sum(agree) / len(agree) if agree else None

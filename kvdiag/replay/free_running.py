"""Free-running replay: each prompt generates under every policy (and the full-cache FullKV reference), in
batches of ``model.generate`` calls (``kvdiag.replay.generating``); graded against its answer, KL against a
full-cache forward of its own generation."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import kvdiag.replay.generating as generating  # by module: tests/test_faults kills a run inside generate_batch
from kvdiag.model.adapters import text_config
from kvdiag.model.load import LoadedModel
from kvdiag.model.token_count import check_room
from kvdiag.replay.config import ReplaySettings
from kvdiag.replay.decoding import Decoded, batches, full_logprobs, kl_steps
from kvdiag.replay.units import Item, Unit, common_key, make_unit
from kvdiag.tasks.needed import (
    decoded_ends,
    final_line_start,
    generated_positions,
    needed_texts,
    prompt_positions,
    slot_shares,
)
from kvdiag.tasks.prompts import Prompt, encode_prompt


def check_answer(text: str, answer: str | None, check: str = "math") -> bool | None:
    """The verdict on ``text`` against ``answer`` (None without an answer): ``math``: math-verify's; ``exact``: the
    whole generation, stripped, is the answer (the builtin suites)."""
    if answer is None:
        return None
    if check == "exact":
        return text.strip() == answer.strip()
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    return bool(verify(gold, parse(text)))


@dataclass
class FreeRunning:
    """Free-running replay of ``prompts`` (``source``: where they came from, for messages and config.json)."""

    prompts: list[Prompt]
    source: str | None = None
    name: ClassVar[str] = "free"  # the ``mode`` column and fingerprint field

    @property
    def provenance(self) -> None:
        """config.json's ``trace``: none (prompts are the input)."""
        return None

    def adjust(self, settings: ReplaySettings) -> ReplaySettings:
        return settings

    def items(self, lm: LoadedModel, settings: ReplaySettings) -> list[Item]:
        """The encoded prompts, each checked to fit the model's context with its whole generation, and the
        generation limit against the builtin suites' answers counted by the model's tokenizer (bad input:
        ``kvdiag.model.token_count.check_room``, the check the CLI runs before torch where it can count without it)."""
        ids = [encode_prompt(lm.tokenizer, p, chat=settings.chat, instruction=settings.instruction)
               for p in self.prompts]
        check_room(self.prompts, [len(i) for i in ids], settings.max_new_tokens,
                   getattr(text_config(lm.model.config), "max_position_embeddings", None), self.source,
                   lambda text: len(lm.tokenizer(text, add_special_tokens=False).input_ids))
        return [Item(p.prompt_id, i, len(i), p.answer, p.check,
                     tuple(prompt_positions(lm.tokenizer, p, settings.chat, settings.instruction)),
                     tuple(needed_texts(p)))
                for p, i in zip(self.prompts, ids, strict=True)]

    def units(self, model_info: dict, settings: ReplaySettings, items: list[Item], policies: dict) -> list[Unit]:
        """Every (prompt, scorer, budget, sample) with its part and fingerprint; a sampled sweep names and keys each
        sample, a greedy one has one generation per policy and no sample field."""
        common = common_key(self.name, model_info, settings, ("horizon", "joint"), None)
        samples = None if settings.sampling.greedy else range(settings.samples)
        return [make_unit(common, it, name, budget, policy, s) for it in items
                for (name, budget), policy in policies.items() for s in (samples or [None])]

    def run(self, lm: LoadedModel, settings: ReplaySettings, policies: dict, pending: list[Unit], o_proj,
            commit, progress, task) -> None:
        """Decode the pending units in batches of rows that share their prompt length and budget (any scorers, any
        samples), ``batch_size`` at a time, each batch one ``model.generate`` under an EvictingCache with a rule per
        row (``generating``); each row's part is committed when its batch ends."""
        for batch in batches(pending, settings.batch_size, lambda u: (len(u.item.token_ids), u.budget)):
            budget = batch[0].budget
            pols = [policies[(u.scorer, u.budget)] for u in batch]
            progress.update(task, description=f"replay B={budget or 'full'} ×{len(batch)} ({batch[0].item.prompt_id}…)")
            start = time.perf_counter()
            want_kl = settings.kl and budget is not None
            record = any(u.item.needs or u.item.needed for u in batch)
            runs = generating.generate_batch(lm, [u.item.token_ids for u in batch], pols, settings.max_new_tokens,
                                             [u.item.prompt_id for u in batch], keep_logprobs=want_kl, o_proj=o_proj,
                                             sampling=settings.sampling, samples=[u.sample for u in batch],
                                             record_kept=record and budget is not None)
            seconds = (time.perf_counter() - start) / len(batch)  # the batch's time, shared by its rows
            for u, run in zip(batch, runs, strict=True):
                if record:
                    run.needed = needed_columns(lm.tokenizer, u.item, run)
                kl = kl_steps(full_logprobs(lm.model, run.token_ids, run.prompt_len), run.logprobs) if want_kl else None
                commit(u, run, kl, seconds)
                progress.advance(task)

    @staticmethod
    def outcome(run: Decoded, item: Item, text: str) -> dict:
        """The row fields only a generation has: its max-length hit and its verdict."""
        return {"max_length_hit": run.stop == "max_new_tokens", "correct": check_answer(text, item.answer, item.check),
                "joint_kl": None, **run.needed}


def needed_columns(tokenizer, item: Item, run: Decoded, ends: list[int] | None = None) -> dict:
    """The needed-token columns of a generation (``needed_*``, ``kept_steps`` and ``final_line_at`` of
    ``kvdiag.replay.run.ROW_SCHEMA``): each needed token (in the prompt, and where the generation wrote the needed
    text), per compaction the share of (layer, KV head) slots that held it (None before it was written), and where the
    generation's final line starts. FullKV: the positions, no compactions. ``ends``: ``decoded_ends`` of the
    generation, when the caller has it."""
    if ends is None:  # decoded once for both lookups below
        ends = decoded_ends(tokenizer, run.token_ids[run.prompt_len:])
    written = [p for text in item.needed for p in generated_positions(tokenizer, run.token_ids, run.prompt_len, text,
                                                                        ends)]
    positions = [*item.needs, *written]
    kept = [(t, counts.tolist()) for t, counts in run.kept_counts]
    return {"needed_where": ["prompt"] * len(item.needs) + ["answer"] * len(written), "needed_positions": positions,
            "kept_steps": [t for t, _ in kept],
            "needed_kept": slot_shares(kept, run.slots, positions) if kept else [[] for _ in positions],
            "final_line_at": final_line_start(tokenizer, run.token_ids, run.prompt_len, ends)}

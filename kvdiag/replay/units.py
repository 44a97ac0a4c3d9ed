"""The work of a replay sweep: the sequences (:class:`Item`), one generation of a sequence per (scorer, budget,
sample) (:class:`Unit`), and the resume key of each unit's part (its fingerprint).

A part's fingerprint hashes what made it: the mode, the model, the settings that change its tokens, the sequence,
the policy and (sampled) its sample. It must stay byte-identical across refactors, or finished ``parts/``
directories stop resuming (tests/test_replay_modes.py pins it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kvdiag.core.parts import part_name
from kvdiag.generate.policy import Policy
from kvdiag.replay.config import ReplaySettings

# settings that change no unit's tokens (the sweep's axes are in each unit's own key; the batch changes no token:
# tests/test_replay_batch), never in a fingerprint
UNKEYED = ("scorers", "budgets", "params", "backend", "full_kv", "samples", "batch_size")


@dataclass
class Item:
    """One sequence to replay: its id, token ids (prompt, or the Trace's whole sequence) and answer."""

    prompt_id: str
    token_ids: list[int]
    prompt_len: int
    answer: str | None
    check: str = "math"
    needs: tuple[int, ...] = ()  # positions of the prompt tokens its answer needs (kvdiag.tasks.needed)
    needed: tuple[str, ...] = ()  # the texts its answer needs, as the expected generation writes them


@dataclass
class Unit:
    """One generation of the sweep: a sequence under (scorer, budget), sample ``sample``; its part and fingerprint."""

    item: Item
    scorer: str
    budget: int | None
    sample: int = 0
    part: str = ""
    fingerprint: str = ""


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def common_key(mode: str, model_info: dict, settings: ReplaySettings, unused: tuple[str, ...],
               trace: str | None) -> dict:
    """What every part of a sweep shares in its fingerprint: the mode, the model, the settings but the UNKEYED ones
    and the mode's ``unused`` ones (the seed only where it draws: stochastic selection or sampling) and the Trace's
    fingerprint (teacher-forced)."""
    draws = settings.selection.stochastic or not settings.sampling.greedy
    keyed = {k: v for k, v in settings.to_json().items()
             if k not in UNKEYED + unused and (k != "seed" or draws)}
    return {"mode": mode, "model": {k: model_info[k] for k in ("config_hash", "weights_hash", "dtype")},
            "settings": keyed, "trace": trace}


def make_unit(common: dict, item: Item, scorer: str, budget: int | None, policy: Policy | None,
              sample: int | None = None) -> Unit:
    """The unit of ``item`` under (``scorer``, ``budget``), its part named and fingerprinted; ``sample``: the sample
    of a sampled sweep (None: unsampled, no sample in the name or the key)."""
    tail = [] if sample is None else [f"s{sample}"]
    key = {**common, "tokens": item.token_ids, "scorer": scorer, "budget": budget,
           "params": policy.scorer.params if policy else None, **({} if sample is None else {"sample": sample})}
    part = part_name(item.prompt_id, scorer, "full" if budget is None else budget, *tail)
    return Unit(item, scorer, budget, sample or 0, part, fingerprint(key))

"""``replay``: the sweep of ``kvdiag replay``. Every (prompt, scorer, budget) is decoded under its policy
(``kvdiag.replay.decoding``), graded, and committed as its own part; the parts make generations.parquet,
the Table-2-shaped summary and the budget figure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import polars as pl
import torch

from kvdiag.errors import UserError
from kvdiag.features import o_proj_weights
from kvdiag.io import check_writable, write_json
from kvdiag.models import LoadedModel, load_model
from kvdiag.parts import PartStore, part_name
from kvdiag.progress import progress_bar
from kvdiag.prompts import DEFAULT_INSTRUCTION, Prompt, encode_prompt, load_prompts
from kvdiag.provenance import command_line, provenance
from kvdiag.replay.cache import Policy
from kvdiag.replay.decoding import Decoded, decode, full_logprobs, kl_steps, teacher_force
from kvdiag.replay.live import check_live_scorer, make_scorer
from kvdiag.schema import CHECKPOINT_INTERVAL
from kvdiag.scorers.base import needs_o_proj
from kvdiag.selection import check_stochastic_rule, parse_selection
from kvdiag.trace import Trace

FULL_KV = "full_kv"  # the scorer name of the uncompressed reference rows (the paper's FullKV)


def check_answer(text: str, answer: str | None) -> bool | None:
    """math-verify's verdict on ``text`` against ``answer`` (None without an answer)."""
    if answer is None:
        return None
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    return bool(verify(gold, parse(text)))


@dataclass
class ReplaySettings:
    """Everything that decides a replay's results (written into config.json and every part).

    scorers, budgets : the sweep (scorer names; entries kept per layer and KV head).
    interval : generated tokens between compressions (R-KV 128).
    w_obs : observation window given to every scorer's ``window``/``w_obs`` field (None: each scorer's own).
    selection : ``per-head``, ``per-token`` or ``stochastic[:TAU]`` (``kvdiag.selection``).
    max_new_tokens : free-running generation cap (a stop there is a max-length hit).
    full_kv : also decode with the full cache (the FullKV reference row; free-running only).
    kl : free-running: also measure KL against a full-cache forward of each generation.
    chat, instruction : how prompts are encoded (``kvdiag.prompts.encode_prompt``).
    params : scorer -> {field: value} overrides.
    backend : compaction kernel backend.
    """

    scorers: list[str]
    budgets: list[int]
    interval: int = CHECKPOINT_INTERVAL
    w_obs: int | None = None
    selection: str = "per-head"
    max_new_tokens: int = 512
    full_kv: bool = True
    kl: bool = True
    chat: bool = True
    instruction: str | None = DEFAULT_INSTRUCTION
    params: dict[str, dict] = field(default_factory=dict)
    backend: str = "auto"
    seed: int = 0  # of stochastic selection


@dataclass
class Item:
    """One sequence to replay: its id, token ids (prompt, or the Trace's whole sequence) and answer."""

    prompt_id: str
    token_ids: list[int]
    prompt_len: int
    answer: str | None


def check_settings(settings: ReplaySettings) -> None:
    """The checks that need no model (bad input: UserError): sizes, selection, scorers that run on a live cache."""
    if not settings.scorers:
        raise UserError("--scorers is empty: name at least one scorer, e.g. rkv")
    if not settings.budgets or min(settings.budgets) < 1:
        raise UserError(f"--budget {settings.budgets}: give positive budgets (cache entries), e.g. 128,256")
    if settings.interval < 1:
        raise UserError(f"--interval {settings.interval}: must be a positive number of tokens between compressions")
    if settings.w_obs is not None and settings.w_obs < 1:
        raise UserError(f"--w-obs {settings.w_obs}: must be a positive number of queries")
    if settings.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {settings.max_new_tokens}: must be a positive number of tokens")
    mode, _ = parse_selection(settings.selection)
    stray = [name for name in settings.params if name not in settings.scorers]
    if stray:
        raise UserError(f"--param {stray[0]}.…: scorer {stray[0]} is not in --scorer; add it or drop the parameter")
    for name in settings.scorers:
        scorer = make_scorer(name, settings.params.get(name), settings.w_obs)
        check_live_scorer(scorer)
        if mode == "stochastic":
            check_stochastic_rule(scorer)


def build_policies(lm: LoadedModel, settings: ReplaySettings) -> dict[tuple[str, int | None], Policy | None]:
    """(scorer, budget) -> Policy for the sweep (None: FullKV), each budget checked against the scorer's
    protected windows on a live cache of the model's head shape (bad input: UserError)."""
    check_settings(settings)
    group, head_dim = lm.attention.num_heads // lm.attention.num_kv_heads, lm.attention.qk_head_dim
    policies: dict[tuple[str, int | None], Policy | None] = {(FULL_KV, None): None} if settings.full_kv else {}
    for name in settings.scorers:
        scorer = make_scorer(name, settings.params.get(name), settings.w_obs)
        for budget in settings.budgets:
            policy = Policy(scorer, budget, settings.interval, settings.selection, settings.backend, settings.seed)
            check_live_scorer(scorer, budget, settings.interval, group, head_dim)
            policies[(name, budget)] = policy
    return policies


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def replay_sweep(
    settings: ReplaySettings, out: str | os.PathLike, teacher_forced: str | os.PathLike | None = None,
    prompts: str | None = None, limit: int | None = None, model: str | None = None, seed: int = 0,
    dtype: str | None = None, device: str = "cpu", revision: str | None = None, trust_remote_code: bool = False,
    show_progress: bool = True,
) -> Path:
    """What ``kvdiag replay`` runs: load the model and :func:`replay` the first ``limit`` prompts of ``prompts``
    (free-running; default ``builtin:arith`` on ``smollm2``) or of the Trace directory ``teacher_forced`` (its model
    unless ``model``, which must be the Trace's). Settings and ``out`` are checked before the model loads."""
    check_settings(settings)
    check_writable(out, "--out", "dir")
    if teacher_forced is not None:
        tr = Trace(teacher_forced)
        had = tr.manifest["model"]
        lm = load_model(
            model or had["spec"], dtype=dtype or had.get("dtype", "float32"), device=device, revision=revision,
            trust_remote_code=trust_remote_code, seed=seed,
        )
        lm.check_model_of(had, "--model", "drop --model")
        ids = tr.prompt_ids[:limit] if limit else tr.prompt_ids
        return replay(
            lm, out, settings, trace=tr, prompt_ids=ids, source=str(teacher_forced), show_progress=show_progress
        )
    source = prompts or "builtin:arith"
    items = load_prompts(source, limit=limit, seed=seed)
    lm = load_model(model or "smollm2", dtype=dtype or "float32", device=device, revision=revision,
                    trust_remote_code=trust_remote_code, seed=seed)
    return replay(lm, out, settings, prompts=items, source=source, show_progress=show_progress)


def replay(
    lm: LoadedModel, out: str | os.PathLike, settings: ReplaySettings, prompts: list[Prompt] | None = None, trace=None,
    prompt_ids: list[str] | None = None, source: str | None = None, command: str | None = None,
    show_progress: bool = True,
) -> Path:
    """Replay ``prompts`` (free-running) or the Trace ``trace`` (teacher-forced) under every (scorer, budget).

    Each (prompt, scorer, budget) is committed to ``out/parts/`` as it finishes; a rerun with the same settings
    reuses finished parts. Writes ``generations.parquet``, ``summary.md``/``summary.csv``, ``budget.png``/``.pdf``
    (+ ``budget.csv``) and ``config.json`` into ``out``; returns ``out``.
    """
    from kvdiag.replay.figure import write_summary

    teacher_forced = trace is not None
    if teacher_forced == (prompts is not None):
        raise ValueError("pass exactly one of prompts (free-running) or trace (teacher-forced)")
    if teacher_forced:
        settings = dataclasses.replace(settings, full_kv=False)  # the KL reference is the full cache itself
    policies = build_policies(lm, settings)
    items = _trace_items(trace, prompt_ids) if teacher_forced else _prompt_items(lm, prompts, settings)
    out = Path(out)
    parts = PartStore(out / "parts", out)  # each part's fingerprint says what made it: no settings stamp
    mode = "teacher_forced" if teacher_forced else "free"
    common = {
        "mode": mode,
        "model": {k: lm.info[k] for k in ("config_hash", "weights_hash", "dtype")},
        "settings": {  # the seed changes nothing but a stochastic selection's draws
            k: v for k, v in asdict(settings).items()
            if k not in ("scorers", "budgets", "params", "backend", "full_kv")
            and not (k == "seed" and parse_selection(settings.selection)[0] != "stochastic")
        },
        "trace": trace.fingerprint if teacher_forced else None,
    }
    config = {
        "kind": "replay_config",
        **provenance(created=True),
        "command": command or command_line(),
        "mode": mode,
        "settings": asdict(settings),
        "scorers": {name: p.scorer.params for (name, budget), p in policies.items() if p is not None},
        "query_window": {name: p.query_window for (name, budget), p in policies.items() if p is not None},
        "model": lm.info,
        "prompts_source": source,
        "trace": trace.provenance if teacher_forced else None,
        "prompt_ids": [it.prompt_id for it in items],
        "definitions": {
            "budget": "entries kept per (layer, KV head) after each compaction",
            "peak_kv": "most cache entries (per layer and KV head) any query attended, prompt included",
            "mean_kv": "mean cache entries attended by the queries that produced the generated tokens",
            "compression_steps": "absolute checkpoints t at which a compaction ran (cache held [0, t)'s survivors)",
            "kl": "KL(P_full || P_policy) per generated position, nats; P_full from a full-cache forward of the same "
                  "tokens",
            "prefill": "the prompt counts toward the budget and is compressed (chunked when longer than budget + "
                       "interval)",
        },
    }
    write_json(out / "config.json", config)
    o_proj = (
        o_proj_weights(lm.model) if any(p is not None and needs_o_proj(p.scorer) for p in policies.values()) else None
    )
    units = [(it, name, budget) for it in items for (name, budget) in policies]
    names = []
    with progress_bar(show_progress) as progress:
        task = progress.add_task("replay", total=len(units))
        reference: dict[str, torch.Tensor] = {}  # teacher-forced: P_full of the current prompt
        for it, name, budget in units:
            policy = policies[(name, budget)]
            part = part_name(it.prompt_id, name, "full" if budget is None else budget)
            names.append(part)
            fp = fingerprint({**common, "tokens": it.token_ids, "scorer": name, "budget": budget,
                              "params": policy.scorer.params if policy else None})
            if parts.done(part, fp):
                progress.advance(task)
                continue
            progress.update(task, description=f"replay {it.prompt_id} {name} B={budget or 'full'}")
            start = time.perf_counter()
            if teacher_forced:
                if it.prompt_id not in reference:
                    reference = {it.prompt_id: full_logprobs(lm.model, it.token_ids, it.prompt_len)}
                run = teacher_force(lm, it.token_ids, it.prompt_len, policy, it.prompt_id, o_proj=o_proj)
                kl = kl_steps(reference[it.prompt_id], run.logprobs)
            else:
                want_kl = settings.kl and policy is not None
                run = decode(
                    lm, it.token_ids, policy, settings.max_new_tokens, it.prompt_id, keep_logprobs=want_kl,
                    o_proj=o_proj,
                )
                kl = kl_steps(full_logprobs(lm.model, run.token_ids, run.prompt_len), run.logprobs) if want_kl else None
            row = _row(lm, it, name, budget, mode, run, kl, time.perf_counter() - start)
            parts.write(part, pl.DataFrame([row], schema=ROW_SCHEMA), {"kind": "replay_part", "fingerprint": fp})
            progress.advance(task)
    df = parts.merge(names, out / "generations.parquet", {**config, "kind": "replay"})
    write_summary(df, out, [name for name in dict.fromkeys(n for n, _ in policies)], settings.budgets)
    return out


ROW_SCHEMA = {
    "prompt_id": pl.String, "scorer": pl.String, "budget": pl.Int64, "mode": pl.String, "prompt_len": pl.Int64,
    "token_ids": pl.List(pl.Int64), "text": pl.String, "generated": pl.Int64, "stop": pl.String,
    "max_length_hit": pl.Boolean, "answer": pl.String, "correct": pl.Boolean, "peak_kv": pl.Int64,
    "mean_kv": pl.Float64, "compressions": pl.Int64, "compression_steps": pl.List(pl.Int64),
    "kl_mean": pl.Float64, "kl_max": pl.Float64, "kl_steps": pl.List(pl.Float64), "seconds": pl.Float64,
}


def _row(
    lm: LoadedModel, it: Item, scorer: str, budget: int | None, mode: str, run: Decoded, kl, seconds: float
) -> dict:
    text = lm.tokenizer.decode(run.token_ids[run.prompt_len :], skip_special_tokens=True)
    free = mode == "free"
    return {
        "prompt_id": it.prompt_id, "scorer": scorer, "budget": budget, "mode": mode, "prompt_len": run.prompt_len,
        "token_ids": run.token_ids, "text": text, "generated": run.generated, "stop": run.stop,
        "max_length_hit": run.stop == "max_new_tokens" if free else None, "answer": it.answer,
        "correct": check_answer(text, it.answer) if free else None,
        "peak_kv": run.peak_kv, "mean_kv": run.mean_kv, "compressions": len(run.compressions),
        "compression_steps": run.compressions,
        "kl_mean": None if kl is None else float(kl.mean()), "kl_max": None if kl is None else float(kl.max()),
        "kl_steps": None if kl is None else kl.tolist(), "seconds": seconds,
    }


def _prompt_items(lm: LoadedModel, prompts: list[Prompt], settings: ReplaySettings) -> list[Item]:
    items = []
    for p in prompts:
        ids = encode_prompt(lm.tokenizer, p, chat=settings.chat, instruction=settings.instruction)
        items.append(Item(p.prompt_id, ids, len(ids), p.answer))
    return items


def _trace_items(trace, prompt_ids: list[str] | None) -> list[Item]:
    items = []
    for pid in prompt_ids or trace.prompt_ids:
        entry = trace.manifest["prompts"].get(pid)
        if entry is None:
            raise UserError(f"prompt {pid!r} is not in the Trace {trace.path}")
        items.append(Item(pid, trace.token_ids(pid).tolist(), trace.prompt_len(pid), entry.get("answer")))
    return items

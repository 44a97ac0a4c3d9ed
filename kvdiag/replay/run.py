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
from kvdiag.replay.decoding import Decoded, decode_batch, full_logprobs, kl_steps, teacher_force
from kvdiag.replay.live import check_live_scorer, make_scorer
from kvdiag.replay.oracle import ORACLE, LiveLabels, OracleRule
from kvdiag.replay.predict import SingleLabelAUROC, single_label_auroc
from kvdiag.replay.sampling import Sampling
from kvdiag.schema import CHECKPOINT_INTERVAL, HORIZON
from kvdiag.scorers.base import needs_o_proj
from kvdiag.selection import check_stochastic_rule, parse_selection
from kvdiag.trace import Trace

FULL_KV = "full_kv"  # the scorer name of the uncompressed reference rows (the paper's FullKV)


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
    samples, temperature, top_p : free-running: generations per prompt and their sampling (temperature None:
        greedy, one sample); every policy's sample ``s`` shares FullKV's draws (``kvdiag.replay.sampling``).
    batch_size : free-running generations decoded together (rows of one prompt length and budget).
    horizon : teacher-forced: steps of the exact labels (each compression's joint damage; the oracle policy).
    joint : teacher-forced: label each compression's whole evicted set (``joint_kl``).
    seed : of stochastic selection and of sampling.
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
    seed: int = 0
    samples: int = 1
    temperature: float | None = None
    top_p: float = 1.0
    batch_size: int = 16
    horizon: int = HORIZON
    joint: bool = True

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.seed)


@dataclass
class Item:
    """One sequence to replay: its id, token ids (prompt, or the Trace's whole sequence) and answer."""

    prompt_id: str
    token_ids: list[int]
    prompt_len: int
    answer: str | None
    check: str = "math"


def check_settings(settings: ReplaySettings, teacher_forced: bool = False) -> None:
    """The checks that need no model (bad input: UserError): sizes, selection, sampling, scorers that run on a live
    cache, the oracle policy's mode."""
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
    if settings.batch_size < 1:
        raise UserError(f"--batch-size {settings.batch_size}: must be a positive number of generations")
    if settings.samples < 1:
        raise UserError(f"--samples {settings.samples}: must be a positive number of generations per prompt")
    sampling = settings.sampling  # checks temperature and top-p
    if settings.samples > 1 and sampling.greedy:
        raise UserError(f"--samples {settings.samples} needs --temperature (greedy decoding writes one generation per "
                        "prompt), e.g. --temperature 0.6")
    if teacher_forced and (settings.samples > 1 or not sampling.greedy):
        raise UserError("--samples/--temperature/--top-p apply to free-running replay; drop them with "
                        "--teacher-forced (the Trace's tokens are replayed)")
    if settings.horizon < 1:
        raise UserError(f"--horizon {settings.horizon}: must be a positive number of steps")
    mode, _ = parse_selection(settings.selection)
    stray = [name for name in settings.params if name not in settings.scorers]
    if stray:
        raise UserError(f"--param {stray[0]}.…: scorer {stray[0]} is not in --scorer; add it or drop the parameter")
    if ORACLE in settings.scorers:
        if not teacher_forced:
            raise UserError(f"--scorers {ORACLE} labels entries on the Trace's future tokens: it runs with "
                            "--teacher-forced only")
        if settings.selection != "per-token":
            raise UserError(f"--scorers {ORACLE} evicts token sets (one label per position): add --selection per-token")
        if ORACLE in settings.params:
            raise UserError(f"--param {ORACLE}.…: the oracle's only setting is its label horizon; use --horizon")
    for name in settings.scorers:
        if name == ORACLE:
            continue
        scorer = make_scorer(name, settings.params.get(name), settings.w_obs)
        check_live_scorer(scorer)
        if mode == "stochastic":
            check_stochastic_rule(scorer)


def build_policies(lm: LoadedModel, settings: ReplaySettings,
                   teacher_forced: bool = False) -> dict[tuple[str, int | None], Policy | None]:
    """(scorer, budget) -> Policy for the sweep (None: FullKV), each budget checked against the scorer's
    protected windows on a live cache of the model's head shape (bad input: UserError)."""
    check_settings(settings, teacher_forced)
    group, head_dim = lm.attention.num_heads // lm.attention.num_kv_heads, lm.attention.qk_head_dim
    policies: dict[tuple[str, int | None], Policy | None] = {(FULL_KV, None): None} if settings.full_kv else {}
    for name in settings.scorers:
        oracle = name == ORACLE
        scorer = OracleRule(settings.horizon) if oracle else make_scorer(name, settings.params.get(name),
                                                                         settings.w_obs)
        for budget in settings.budgets:
            policy = Policy(scorer, budget, settings.interval, settings.selection, settings.backend, settings.seed)
            if not oracle:
                check_live_scorer(scorer, budget, settings.interval, group, head_dim)
            policies[(name, budget)] = policy
    return policies


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def replay_sweep(
    settings: ReplaySettings, out: str | os.PathLike, teacher_forced: str | os.PathLike | None = None,
    prompts: str | None = None, limit: int | None = None, model: str | None = None, seed: int = 0,
    dtype: str | None = None, device: str = "cpu", revision: str | None = None, trust_remote_code: bool = False,
    show_progress: bool = True, outcomes: str | os.PathLike | None = None,
    auroc: tuple[str | os.PathLike, str | os.PathLike] | None = None,
) -> Path:
    """What ``kvdiag replay`` runs: load the model and :func:`replay` the first ``limit`` prompts of ``prompts``
    (free-running; default ``builtin:arith`` on ``smollm2``) or of the Trace directory ``teacher_forced`` (its model
    unless ``model``, which must be the Trace's). Settings and ``out`` are checked before the model loads.
    ``auroc``: (labels, scores) files of a Trace of the same task, whose rank-eval AUROC per rule is correlated with
    the teacher-forced in-loop KL (``kvdiag.replay.predict.single_label_auroc``)."""
    check_settings(settings, teacher_forced is not None)
    check_writable(out, "--out", "dir")
    if outcomes is not None and (teacher_forced is None or not (Path(outcomes) / "generations.parquet").is_file()):
        raise UserError(f"--outcomes {outcomes}: give, with --teacher-forced, a free-running replay directory (its "
                        "generations.parquet) of the same prompts")
    single = None
    if auroc is not None:
        if teacher_forced is None or not settings.joint:
            raise UserError("--auroc correlates single-label AUROC with teacher-forced joint labels: give it with "
                            "--teacher-forced and --joint")
        rules = [n for n in settings.scorers if n != ORACLE]
        params = {n: make_scorer(n, settings.params.get(n), settings.w_obs).params for n in rules}
        single = single_label_auroc(*auroc, rules, params, seed=seed)
    if teacher_forced is not None:
        tr = Trace(teacher_forced)
        if outcomes is not None:  # before the model loads
            check_outcome_prompts(outcomes, tr.prompt_ids[:limit] if limit else tr.prompt_ids)
        had = tr.manifest["model"]
        lm = load_model(
            model or had["spec"], dtype=dtype or had.get("dtype", "float32"), device=device, revision=revision,
            trust_remote_code=trust_remote_code, seed=seed,
        )
        lm.check_model_of(had, "--model", "drop --model")
        ids = tr.prompt_ids[:limit] if limit else tr.prompt_ids
        return replay(
            lm, out, settings, trace=tr, prompt_ids=ids, source=str(teacher_forced), show_progress=show_progress,
            outcomes=outcomes, auroc=single,
        )
    source = prompts or "builtin:arith"
    items = load_prompts(source, limit=limit, seed=seed)
    lm = load_model(model or "smollm2", dtype=dtype or "float32", device=device, revision=revision,
                    trust_remote_code=trust_remote_code, seed=seed)
    return replay(lm, out, settings, prompts=items, source=source, show_progress=show_progress)


def check_outcome_prompts(outcomes: str | os.PathLike, prompt_ids: list[str]) -> None:
    """``--outcomes``: a free-running replay of the prompts replayed (else its fidelity rows would be empty)."""
    from kvdiag.io import read_table

    free, _ = read_table(Path(outcomes) / "generations.parquet", f"--outcomes {outcomes} generations.parquet")
    if "prompt_id" not in free.columns:
        raise UserError(f"--outcomes {outcomes}: generations.parquet has no prompt_id column; pass a kvdiag replay "
                        "directory")
    missing = sorted(set(prompt_ids) - set(free["prompt_id"].unique().to_list()))
    if missing:
        raise UserError(f"--outcomes {outcomes} holds no generation of prompt {missing[0]!r} ({len(missing)} of the "
                        f"{len(prompt_ids)} replayed prompts are missing): pass a replay of the Trace's prompts")


def replay(
    lm: LoadedModel, out: str | os.PathLike, settings: ReplaySettings, prompts: list[Prompt] | None = None, trace=None,
    prompt_ids: list[str] | None = None, source: str | None = None, command: str | None = None,
    show_progress: bool = True, outcomes: str | os.PathLike | None = None, auroc: SingleLabelAUROC | None = None,
) -> Path:
    """Replay ``prompts`` (free-running) or the Trace ``trace`` (teacher-forced) under every (scorer, budget).

    Each (prompt, scorer, budget) is committed to ``out/parts/`` as it finishes; a rerun with the same settings
    reuses finished parts. Writes ``generations.parquet``, ``summary.md``/``summary.csv``, ``budget.png``/``.pdf``
    (+ ``budget.csv``) and ``config.json`` into ``out``; returns ``out``. ``outcomes``: a free-running replay
    directory of the same prompts whose outcomes the teacher-forced joint labels are correlated with; ``auroc``: the
    rules' single-label AUROC, correlated with their in-loop KL.
    """
    from kvdiag.replay.figure import write_summary

    teacher_forced = trace is not None
    if teacher_forced == (prompts is not None):
        raise ValueError("pass exactly one of prompts (free-running) or trace (teacher-forced)")
    if teacher_forced:
        settings = dataclasses.replace(settings, full_kv=False)  # the KL reference is the full cache itself
    policies = build_policies(lm, settings, teacher_forced)
    items = _trace_items(trace, prompt_ids) if teacher_forced else _prompt_items(lm, prompts, settings, source)
    out = Path(out)
    parts = PartStore(out / "parts", out)  # each part's fingerprint says what made it: no settings stamp
    mode = "teacher_forced" if teacher_forced else "free"
    sampled = not settings.sampling.greedy
    stochastic = parse_selection(settings.selection)[0] == "stochastic"
    common = {
        "mode": mode,
        "model": {k: lm.info[k] for k in ("config_hash", "weights_hash", "dtype")},
        "settings": {  # the seed changes only stochastic draws; the batch changes no token (tests/test_replay_batch)
            k: v for k, v in asdict(settings).items()
            if k not in ("scorers", "budgets", "params", "backend", "full_kv", "samples", "batch_size")
            and not (k == "seed" and not (stochastic or sampled))
            and not (k in ("horizon", "joint") and not teacher_forced)
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
        "definitions": DEFINITIONS,
    }
    write_json(out / "config.json", config)
    o_proj = (
        o_proj_weights(lm.model) if any(p is not None and needs_o_proj(p.scorer) for p in policies.values()) else None
    )
    samples = range(settings.samples if sampled else 1)
    units = [Unit(it, name, budget, s) for it in items for (name, budget) in policies for s in samples]
    pending = []
    for u in units:
        policy = policies[(u.scorer, u.budget)]
        u.part = part_name(u.item.prompt_id, u.scorer, "full" if u.budget is None else u.budget,
                           *([f"s{u.sample}"] if sampled else []))
        u.fingerprint = fingerprint({**common, "tokens": u.item.token_ids, "scorer": u.scorer, "budget": u.budget,
                                     "params": policy.scorer.params if policy else None,
                                     **({"sample": u.sample} if sampled else {})})
        if not parts.done(u.part, u.fingerprint):
            pending.append(u)

    def commit(u: Unit, run: Decoded, kl, seconds: float, labels: dict | None = None) -> None:
        row = _row(lm, u, mode, run, kl, seconds, labels)
        meta = {"kind": "replay_part", "fingerprint": u.fingerprint}
        parts.write(u.part, pl.DataFrame([row], schema=ROW_SCHEMA), meta)

    with progress_bar(show_progress) as progress:
        task = progress.add_task("replay", total=len(units), completed=len(units) - len(pending))
        if teacher_forced:
            _teacher_forced(lm, settings, policies, pending, o_proj, commit, progress, task)
        else:
            _free_running(lm, settings, policies, pending, o_proj, commit, progress, task)
    df = parts.merge([u.part for u in units], out / "generations.parquet", {**config, "kind": "replay"})
    free = None if outcomes is None else pl.read_parquet(Path(outcomes) / "generations.parquet")
    write_summary(df, out, [name for name in dict.fromkeys(n for n, _ in policies)], settings.budgets,
                  settings.horizon, free, auroc, exact={it.prompt_id for it in items if it.check == "exact"})
    return out


DEFINITIONS = {
    "budget": "entries kept per (layer, KV head) after each compaction",
    "peak_kv": "most cache entries (per layer and KV head) any query attended, prompt included",
    "mean_kv": "mean cache entries attended by the queries that produced the generated tokens",
    "compression_steps": "absolute checkpoints t at which a compaction ran (cache held [0, t)'s survivors)",
    "kl": "KL(P_full || P_policy) per generated position, nats; P_full from a full-cache forward of the same "
          "tokens",
    "prefill": "the prompt counts toward the budget and is compressed (chunked when longer than budget + "
               "interval)",
    "sample": "free-running: the generation's sample index; sample s of every policy shares FullKV's random draws",
    "joint_kl": "teacher-forced: per compression, the exact label of the whole evicted set (every entry of [0, t) "
                "the cache lacks, per layer and KV head): mean KL(P_full || P_evicted) over the next `horizon` "
                "tokens (fewer at the end)",
    "label_seconds": "teacher-forced: seconds spent on exact labels (joint labels, and the oracle's per-entry labels)",
}


@dataclass
class Unit:
    """One generation of the sweep: a sequence under (scorer, budget), sample ``sample``; its part and fingerprint."""

    item: Item
    scorer: str
    budget: int | None
    sample: int = 0
    part: str = ""
    fingerprint: str = ""


def _free_running(lm, settings, policies, pending, o_proj, commit, progress, task) -> None:
    """Decode the pending units in batches of rows that share their prompt length and budget (any scorers, any
    samples), ``batch_size`` at a time; each row's part is committed when its batch ends."""
    groups: dict[tuple[int, int | None], list[Unit]] = {}
    for u in pending:
        groups.setdefault((len(u.item.token_ids), u.budget), []).append(u)
    for (_, budget), group in groups.items():
        for s in range(0, len(group), settings.batch_size):
            batch = group[s : s + settings.batch_size]
            pols = [policies[(u.scorer, u.budget)] for u in batch]
            progress.update(task, description=f"replay B={budget or 'full'} ×{len(batch)} ({batch[0].item.prompt_id}…)")
            start = time.perf_counter()
            want_kl = settings.kl and budget is not None
            runs = decode_batch(lm, [u.item.token_ids for u in batch], pols, settings.max_new_tokens,
                                [u.item.prompt_id for u in batch], keep_logprobs=want_kl, o_proj=o_proj,
                                sampling=settings.sampling, samples=[u.sample for u in batch])
            seconds = (time.perf_counter() - start) / len(batch)  # the batch's time, shared by its rows
            for u, run in zip(batch, runs, strict=True):
                kl = kl_steps(full_logprobs(lm.model, run.token_ids, run.prompt_len), run.logprobs) if want_kl else None
                commit(u, run, kl, seconds)
                progress.advance(task)


def _teacher_forced(lm, settings, policies, pending, o_proj, commit, progress, task) -> None:
    """Feed each pending unit's Trace tokens under its policy, one at a time; with exact labels (joint damage of
    every compression, the oracle's scores) from one :class:`LiveLabels` per sequence."""
    reference: dict[str, torch.Tensor] = {}  # P_full of the current sequence
    labels: dict[str, LiveLabels] = {}
    for u in pending:
        it, policy = u.item, policies[(u.scorer, u.budget)]
        progress.update(task, description=f"replay {it.prompt_id} {u.scorer} B={u.budget or 'full'}")
        start = time.perf_counter()
        if it.prompt_id not in reference:
            reference = {it.prompt_id: full_logprobs(lm.model, it.token_ids, it.prompt_len)}
            labels = {it.prompt_id: LiveLabels(lm, torch.tensor(it.token_ids), settings.horizon,
                                               backend=settings.backend)}
        live = labels[it.prompt_id]
        use = live if settings.joint or u.scorer == ORACLE else None
        before = (sum(live.seconds.values()), sum(live.rows.values()))
        run = teacher_force(lm, it.token_ids, it.prompt_len, policy, it.prompt_id, o_proj=o_proj, labels=use)
        if not settings.joint:  # --no-joint: no joint_kl column values (the oracle's own labels still ran)
            run.joint = None
        spent = {"seconds": sum(live.seconds.values()) - before[0], "rows": sum(live.rows.values()) - before[1]}
        commit(u, run, kl_steps(reference[it.prompt_id], run.logprobs), time.perf_counter() - start, spent)
        progress.advance(task)


ROW_SCHEMA = {
    "prompt_id": pl.String, "scorer": pl.String, "budget": pl.Int64, "sample": pl.Int64, "mode": pl.String,
    "prompt_len": pl.Int64, "token_ids": pl.List(pl.Int64), "text": pl.String, "generated": pl.Int64,
    "stop": pl.String, "max_length_hit": pl.Boolean, "answer": pl.String, "correct": pl.Boolean, "peak_kv": pl.Int64,
    "mean_kv": pl.Float64, "compressions": pl.Int64, "compression_steps": pl.List(pl.Int64),
    "kl_mean": pl.Float64, "kl_max": pl.Float64, "kl_steps": pl.List(pl.Float64), "joint_kl": pl.List(pl.Float64),
    "label_seconds": pl.Float64, "label_rows": pl.Int64, "seconds": pl.Float64,
}


def _row(lm: LoadedModel, u: Unit, mode: str, run: Decoded, kl, seconds: float, labels: dict | None) -> dict:
    it = u.item
    text = lm.tokenizer.decode(run.token_ids[run.prompt_len :], skip_special_tokens=True)
    free = mode == "free"
    return {
        "prompt_id": it.prompt_id, "scorer": u.scorer, "budget": u.budget, "sample": u.sample, "mode": mode,
        "prompt_len": run.prompt_len, "token_ids": run.token_ids, "text": text, "generated": run.generated,
        "stop": run.stop, "max_length_hit": run.stop == "max_new_tokens" if free else None, "answer": it.answer,
        "correct": check_answer(text, it.answer, it.check) if free else None,
        "peak_kv": run.peak_kv, "mean_kv": run.mean_kv, "compressions": len(run.compressions),
        "compression_steps": run.compressions,
        "kl_mean": None if kl is None else float(kl.mean()), "kl_max": None if kl is None else float(kl.max()),
        "kl_steps": None if kl is None else kl.tolist(), "joint_kl": None if free else run.joint,
        "label_seconds": None if labels is None else labels["seconds"],
        "label_rows": None if labels is None else labels["rows"], "seconds": seconds,
    }


def _prompt_items(lm: LoadedModel, prompts: list[Prompt], settings: ReplaySettings, source: str | None) -> list[Item]:
    """The encoded prompts, each checked to fit the model's context with its whole generation (bad input)."""
    limit = getattr(lm.model.config, "max_position_embeddings", None)
    items = []
    for p in prompts:
        ids = encode_prompt(lm.tokenizer, p, chat=settings.chat, instruction=settings.instruction)
        if limit and len(ids) + settings.max_new_tokens > limit:
            raise UserError(f"--prompts {source}: prompt {p.prompt_id} has {len(ids)} tokens, so its generation could "
                            f"reach {len(ids) + settings.max_new_tokens} > the model's context of {limit}; use a "
                            f"shorter suite length or --max-new-tokens {max(1, limit - len(ids))} or less")
        items.append(Item(p.prompt_id, ids, len(ids), p.answer, p.check))
    return items


def _trace_items(trace, prompt_ids: list[str] | None) -> list[Item]:
    items = []
    for pid in prompt_ids or trace.prompt_ids:
        entry = trace.manifest["prompts"].get(pid)
        if entry is None:
            raise UserError(f"prompt {pid!r} is not in the Trace {trace.path}")
        items.append(Item(pid, trace.token_ids(pid).tolist(), trace.prompt_len(pid), entry.get("answer")))
    return items

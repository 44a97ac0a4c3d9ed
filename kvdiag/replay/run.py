"""Decoding under a bounded cache (free-running and teacher-forced), its damage, and the replay outputs.

Free-running: a greedy loop with explicit absolute ``position_ids`` (the same forward calls as
``model.generate``, so with a budget at least the sequence length it reproduces greedy generation token for
token). Teacher-forced: a Trace's tokens fed under the same policy, ``interval`` tokens per forward (the cache
is only compacted between checkpoints, so this equals feeding them one by one). Both record the
policy's next-token distributions; the damage is ``KL(P_full || P_policy)`` per step, with ``P_full`` from a plain
full-cache forward of the same tokens.

Prefill: the prompt counts toward the cache and is compressed like generated tokens (R-KV compresses it at
the first trigger). It is fed in one forward when it fits ``budget + interval``; a longer prompt is fed in
chunks (the first ``budget + interval`` tokens, then ``interval`` at a time) with a checkpoint after each chunk,
so the cache never holds more than ``budget + interval`` entries. The end of the prompt is a checkpoint.
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
from transformers import DynamicCache

from kvdiag.errors import UserError, check_choice
from kvdiag.features import o_proj_weights
from kvdiag.io import read_meta, write_json, write_table
from kvdiag.models import LoadedModel
from kvdiag.progress import progress_bar
from kvdiag.prompts import DEFAULT_INSTRUCTION, Prompt, encode_prompt, safe_id
from kvdiag.provenance import command_line, provenance
from kvdiag.replay.cache import Policy, ReplayCache
from kvdiag.replay.live import (
    SELECTIONS, QueryWindow, check_live_scorer, make_scorer, needs_o_proj, observing, score_layer, select_keep,
)
from kvdiag.schema import CHECKPOINT_INTERVAL

FULL_KV = "full_kv"  # the scorer name of the uncompressed reference rows (the paper's FullKV)
REFERENCE_CHUNK = 512  # tokens per forward of the full-cache reference (bounds its logits memory)


@dataclass
class Decoded:
    """One sequence run under a policy.

    token_ids : prompt + generated (free-running) or the Trace's tokens (teacher-forced).
    active : per fed token, the cache entries (per layer and KV head) its query attended, its own included.
    compressions : the checkpoints ``t`` (absolute: the cache held ``[0, t)``'s survivors) at which a compaction ran.
    logprobs : [G, V] fp32 log P_policy of each generated position (row j predicts position prompt_len + j),
        or None when not kept.
    kept : (checkpoint, positions [L, Hkv, B]) after each compaction, when asked for (tests, inspection).
    """

    token_ids: list[int]
    prompt_len: int
    stop: str
    active: list[int] = field(default_factory=list)
    compressions: list[int] = field(default_factory=list)
    logprobs: torch.Tensor | None = None
    kept: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def peak_kv(self) -> int:
        """The most entries any query attended (prompt included)."""
        return max(self.active)

    @property
    def mean_kv(self) -> float:
        """Mean entries attended by the queries that produced the generated tokens (positions P-1 .. T-2)."""
        producing = self.active[self.prompt_len - 1 : len(self.token_ids) - 1]
        return sum(producing) / len(producing)


class Session:
    """The model, its bounded cache and the compressor's query window for one sequence.

    o_proj : layer -> W_O [hidden, H*d] for the ``wo_l2`` payload (read from the model when needed and not given).
    """

    def __init__(self, lm: LoadedModel, policy: Policy | None, prompt_id: str, prompt_len: int,
                 o_proj: dict[int, torch.Tensor] | None = None, keep_history: bool = False):
        self.model, self.policy, self.prompt_id, self.prompt_len = lm.model, policy, prompt_id, prompt_len
        if o_proj is None and policy is not None and needs_o_proj(policy.scorer):
            o_proj = o_proj_weights(self.model)
        self.o_proj, self.keep_history = o_proj or {}, keep_history
        cfg = self.model.config
        self.attention = lm.attention  # per-layer semantics (softcap, sinks) for the scorers
        self.num_layers = self.attention.num_layers
        self.cache = ReplayCache(cfg, self.attention)
        self.window = QueryWindow(self.num_layers, policy.query_window) if policy else None
        self.token_ids: list[int] = []
        self.active: list[int] = []
        self.compressions: list[int] = []
        self.kept: list[tuple[int, torch.Tensor]] = []

    def feed(self, ids: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        """Run the tokens ``ids`` at positions ``[start, start + c)``; fp32 logits [c, V] (or [1, V])."""
        device = self.model.device
        n0, c = len(self.cache), len(ids)
        out = self.model(torch.tensor([ids], device=device), cache=self.cache.cache, use_cache=True,
                         position_ids=torch.arange(start, start + c, device=device)[None],
                         logits_to_keep=0 if all_logits else 1)
        self.cache.extend(start, c)
        self.token_ids.extend(ids)
        self.active.extend(range(n0 + 1, n0 + c + 1))
        logits = out.logits[0].float()
        if not bool(torch.isfinite(logits).all()):
            raise UserError(f"non-finite logits at position {start + c - 1} of {self.prompt_id}: the model overflows; rerun with --dtype float32")
        return logits

    def prefill(self, prompt: list[int], all_logits: bool = False) -> torch.Tensor:
        """Feed the prompt in the chunks of :func:`prompt_chunks`, a checkpoint after each; the last chunk's logits."""
        for start, end in prompt_chunks(len(prompt), self.policy):
            logits = self.feed(prompt[start:end], start, all_logits)
            self.checkpoint(end)
        return logits

    def checkpoint(self, t: int) -> None:
        """Compact the cache to the budget if it holds more (the cache holds the survivors of ``[0, t)``)."""
        policy = self.policy
        if policy is None or len(self.cache) <= policy.budget:
            return
        ids = torch.tensor(self.token_ids)
        scores = []
        for layer in range(self.num_layers):
            k, v = self.cache.layer(layer)
            scores.append(score_layer(
                policy.scorer, k, v, self.cache.positions[layer], self.window.get(layer), t, self.attention.layers[layer],
                self.prompt_len, layer, self.prompt_id, ids, policy.selection, self.o_proj.get(layer)))
        self.cache.compact(select_keep(scores, policy.budget, policy.selection), policy.backend)
        self.compressions.append(t)
        if self.keep_history:
            self.kept.append((t, self.cache.positions.clone()))

    def result(self, token_ids: list[int], stop: str, logprobs: torch.Tensor | None) -> Decoded:
        return Decoded(token_ids, self.prompt_len, stop, self.active, self.compressions, logprobs, self.kept)


def prompt_chunks(prompt_len: int, policy: Policy | None) -> list[tuple[int, int]]:
    """``(start, end)`` of each prefill forward: the whole prompt when it fits ``budget + interval`` entries,
    else ``budget + interval`` tokens and then ``interval`` at a time (a checkpoint follows each chunk)."""
    if policy is None:
        return [(0, prompt_len)]
    first = min(prompt_len, policy.budget + policy.interval)
    return [(0, first)] + [(s, min(s + policy.interval, prompt_len)) for s in range(first, prompt_len, policy.interval)]


def eos_ids(lm: LoadedModel) -> set[int]:
    """Token ids that end a generation: the tokenizer's and the generation config's EOS."""
    ids = {lm.tokenizer.eos_token_id}
    extra = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, (list, tuple)) else {extra}
    return {i for i in ids if i is not None}


@torch.no_grad()
def decode(lm: LoadedModel, prompt: list[int], policy: Policy | None = None, max_new_tokens: int = 512,
           prompt_id: str = "", keep_logprobs: bool = False, keep_history: bool = False,
           o_proj: dict[int, torch.Tensor] | None = None) -> Decoded:
    """Greedy generation of up to ``max_new_tokens`` after ``prompt`` under ``policy`` (None: the full cache).

    A checkpoint follows every ``interval`` generated tokens: after the query at position ``t - 1`` produced the
    token at ``t`` (from the cache as it was), the cache is compacted, and the token at ``t`` is fed to it.
    """
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be a positive number of tokens")
    session = Session(lm, policy, prompt_id, len(prompt), o_proj, keep_history)
    P, ids, rows, stop, eos = len(prompt), list(prompt), [], "max_new_tokens", eos_ids(lm)
    with observing(lm.model, session.window):
        logits = session.prefill(ids)
        for g in range(1, max_new_tokens + 1):
            token = int(logits[-1].argmax())
            ids.append(token)
            if keep_logprobs:
                rows.append(torch.log_softmax(logits[-1], dim=-1).cpu())
            if token in eos:
                stop = "eos"
                break
            if g == max_new_tokens:
                break
            logits = session.feed([token], P + g - 1)
            if policy is not None and g % policy.interval == 0:
                session.checkpoint(P + g)
    return session.result(ids, stop, torch.stack(rows) if keep_logprobs else None)


@torch.no_grad()
def teacher_force(lm: LoadedModel, token_ids: list[int], prompt_len: int, policy: Policy | None = None,
                  prompt_id: str = "", keep_history: bool = False, o_proj: dict[int, torch.Tensor] | None = None) -> Decoded:
    """Feed ``token_ids`` (prompt + continuation) under ``policy``; ``logprobs`` [T - P, V] of every
    continuation position, checkpoints at the end of each prompt chunk and every ``interval`` tokens after it."""
    T, P = len(token_ids), prompt_len
    if not 1 <= P < T:
        raise UserError(f"prompt {prompt_id!r}: needs at least one token after its {P} prompt tokens to teacher-force")
    session = Session(lm, policy, prompt_id, P, o_proj, keep_history)
    interval = policy.interval if policy else T
    with observing(lm.model, session.window):
        rows = [torch.log_softmax(session.prefill(token_ids[:P]), dim=-1).cpu()]
        for start in range(P, T - 1, interval):
            end = min(start + interval, T - 1)
            rows.append(torch.log_softmax(session.feed(token_ids[start:end], start, all_logits=True), dim=-1).cpu())
            if (end - P) % interval == 0:
                session.checkpoint(end)
    return session.result(list(token_ids), "teacher_forced", torch.cat(rows))


@torch.no_grad()
def full_logprobs(model, token_ids: list[int], prompt_len: int, chunk: int = REFERENCE_CHUNK) -> torch.Tensor:
    """[T - P, V] fp32 log P_full of every position after the prompt: a plain full-cache forward (the model's
    own attention), in chunks of ``chunk`` tokens so that only ``chunk`` rows of logits exist at once."""
    cache, rows, device = DynamicCache(config=model.config), [], model.device
    T, P = len(token_ids), prompt_len
    for start in range(0, T - 1, chunk):
        end = min(start + chunk, T - 1)
        logits = model(torch.tensor([token_ids[start:end]], device=device), cache=cache, use_cache=True,
                       position_ids=torch.arange(start, end, device=device)[None]).logits[0]
        keep = max(0, P - 1 - start)
        if keep < end - start:
            rows.append(torch.log_softmax(logits[keep:].float(), dim=-1).cpu())
    return torch.cat(rows)


def kl_steps(logp_full: torch.Tensor, logp_policy: torch.Tensor) -> torch.Tensor:
    """[G] ``KL(P_full || P_policy)`` per step (nats, fp64 sum over the vocabulary) from log-probs [G, V]."""
    full = logp_full.double()
    return (full.exp() * (full - logp_policy.double())).sum(dim=-1)


def check_answer(text: str, answer: str | None) -> bool | None:
    """math-verify's verdict on ``text`` against ``answer`` (None without an answer)."""
    if answer is None:
        return None
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$")
    return bool(verify(gold, parse(text)))


# --------------------------------------------------------------------------- the replay command


@dataclass
class ReplaySettings:
    """Everything that decides a replay's results (written into config.json and every part).

    scorers, budgets : the sweep (scorer names; entries kept per layer and KV head).
    interval : generated tokens between compressions (R-KV 128).
    w_obs : observation window given to every scorer's ``window``/``w_obs`` field (None: each scorer's own).
    selection : ``per-head`` or ``per-token``.
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
        raise UserError("--scorer is empty: name at least one scorer, e.g. rkv")
    if not settings.budgets or min(settings.budgets) < 1:
        raise UserError(f"--budget {settings.budgets}: give positive budgets (cache entries), e.g. 128,256")
    if settings.interval < 1:
        raise UserError(f"--interval {settings.interval}: must be a positive number of tokens between compressions")
    if settings.w_obs is not None and settings.w_obs < 1:
        raise UserError(f"--w-obs {settings.w_obs}: must be a positive number of queries")
    if settings.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {settings.max_new_tokens}: must be a positive number of tokens")
    check_choice(settings.selection, SELECTIONS, "--selection")
    stray = [name for name in settings.params if name not in settings.scorers]
    if stray:
        raise UserError(f"--param {stray[0]}.…: scorer {stray[0]} is not in --scorer; add it or drop the parameter")
    for name in settings.scorers:
        check_live_scorer(make_scorer(name, settings.params.get(name), settings.w_obs))


def build_policies(lm: LoadedModel, settings: ReplaySettings) -> dict[tuple[str, int | None], Policy | None]:
    """(scorer, budget) -> Policy for the sweep (None: FullKV), each budget checked against the scorer's
    protected windows on a live cache of the model's head shape (bad input: UserError)."""
    check_settings(settings)
    group, head_dim = lm.attention.num_heads // lm.attention.num_kv_heads, lm.attention.qk_head_dim
    policies: dict[tuple[str, int | None], Policy | None] = {(FULL_KV, None): None} if settings.full_kv else {}
    for name in settings.scorers:
        scorer = make_scorer(name, settings.params.get(name), settings.w_obs)
        for budget in settings.budgets:
            policy = Policy(scorer, budget, settings.interval, settings.selection, settings.backend)
            check_live_scorer(scorer, budget, settings.interval, group, head_dim)
            policies[(name, budget)] = policy
    return policies


def fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def part_path(out: Path, prompt_id: str, scorer: str, budget: int | None) -> Path:
    return out / "parts" / f"{prompt_id}__{safe_id(scorer)}__{'full' if budget is None else budget}.parquet"


def replay(
    lm: LoadedModel,
    out: str | os.PathLike,
    settings: ReplaySettings,
    prompts: list[Prompt] | None = None,
    trace=None,
    prompt_ids: list[str] | None = None,
    source: str | None = None,
    command: str | None = None,
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
    try:
        (out / "parts").mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {out}: cannot create the directory ({err.strerror}); choose a writable path") from err
    mode = "teacher_forced" if teacher_forced else "free"
    common = {"mode": mode, "model": {k: lm.info[k] for k in ("config_hash", "weights_hash", "dtype")},
              "settings": {k: v for k, v in asdict(settings).items() if k not in ("scorers", "budgets", "params", "backend", "full_kv")},
              "trace": trace.fingerprint if teacher_forced else None}
    config = {
        "kind": "replay_config", **provenance(created=True), "command": command or command_line(), "mode": mode, "settings": asdict(settings),
        "scorers": {name: p.scorer.params for (name, budget), p in policies.items() if p is not None},
        "query_window": {name: p.query_window for (name, budget), p in policies.items() if p is not None},
        "model": lm.info, "prompts_source": source, "trace": trace.provenance if teacher_forced else None,
        "prompt_ids": [it.prompt_id for it in items],
        "definitions": {
            "budget": "entries kept per (layer, KV head) after each compaction",
            "peak_kv": "most cache entries (per layer and KV head) any query attended, prompt included",
            "mean_kv": "mean cache entries attended by the queries that produced the generated tokens",
            "compression_steps": "absolute checkpoints t at which a compaction ran (cache held [0, t)'s survivors)",
            "kl": "KL(P_full || P_policy) per generated position, nats; P_full from a full-cache forward of the same tokens",
            "prefill": "the prompt counts toward the budget and is compressed (chunked when longer than budget + interval)",
        },
    }
    write_json(out / "config.json", config)
    o_proj = o_proj_weights(lm.model) if any(p is not None and needs_o_proj(p.scorer) for p in policies.values()) else None
    units = [(it, name, budget) for it in items for (name, budget) in policies]
    paths = []
    with progress_bar(show_progress) as progress:
        task = progress.add_task("replay", total=len(units))
        reference: dict[str, torch.Tensor] = {}  # teacher-forced: P_full of the current prompt
        for it, name, budget in units:
            policy = policies[(name, budget)]
            path = part_path(out, it.prompt_id, name, budget)
            paths.append(path)
            fp = fingerprint({**common, "tokens": it.token_ids, "scorer": name, "budget": budget,
                              "params": policy.scorer.params if policy else None})
            if path.exists() and read_meta(path).get("fingerprint") == fp:
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
                run = decode(lm, it.token_ids, policy, settings.max_new_tokens, it.prompt_id, keep_logprobs=want_kl, o_proj=o_proj)
                kl = kl_steps(full_logprobs(lm.model, run.token_ids, run.prompt_len), run.logprobs) if want_kl else None
            row = _row(lm, it, name, budget, mode, run, kl, time.perf_counter() - start)
            write_table(pl.DataFrame([row], schema=ROW_SCHEMA), path, {"kind": "replay_part", "fingerprint": fp})
            progress.advance(task)
    df = pl.concat([pl.read_parquet(p) for p in paths])
    write_table(df, out / "generations.parquet", {**config, "kind": "replay"})
    write_summary(df, out, [name for name in dict.fromkeys(n for n, _ in policies)], settings.budgets)
    return out


ROW_SCHEMA = {
    "prompt_id": pl.String, "scorer": pl.String, "budget": pl.Int64, "mode": pl.String, "prompt_len": pl.Int64,
    "token_ids": pl.List(pl.Int64), "text": pl.String, "generated": pl.Int64, "stop": pl.String,
    "max_length_hit": pl.Boolean, "answer": pl.String, "correct": pl.Boolean, "peak_kv": pl.Int64,
    "mean_kv": pl.Float64, "compressions": pl.Int64, "compression_steps": pl.List(pl.Int64),
    "kl_mean": pl.Float64, "kl_max": pl.Float64, "kl_steps": pl.List(pl.Float64), "seconds": pl.Float64,
}


def _row(lm: LoadedModel, it: Item, scorer: str, budget: int | None, mode: str, run: Decoded, kl, seconds: float) -> dict:
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

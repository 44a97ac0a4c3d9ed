"""Decoding under a bounded cache (free-running and teacher-forced) and its damage.

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

import zlib
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvdiag.errors import UserError
from kvdiag.features import o_proj_weights
from kvdiag.models import LoadedModel
from kvdiag.replay.cache import Policy, ReplayCache
from kvdiag.replay.live import QueryWindow, observing, score_layer
from kvdiag.scorers.base import needs_o_proj
from kvdiag.selection import parse_selection, select_keep

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
            raise UserError(f"non-finite logits at position {start + c - 1} of {self.prompt_id}: the model overflows; "
                            "rerun with --dtype float32")
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
            scores.append(
                score_layer(
                    policy.scorer, k, v, self.cache.positions[layer], self.window.get(layer), t,
                    self.attention.layers[layer], self.prompt_len, layer, self.prompt_id, ids, policy.selection,
                    self.o_proj.get(layer),
                )
            )
        generator = protected = None
        if parse_selection(policy.selection)[0] == "stochastic":  # a seeded draw per compaction; never a protected one
            generator = torch.Generator().manual_seed(zlib.crc32(f"{policy.seed}:{self.prompt_id}:{t}".encode()))
            positions = self.cache.positions
            protected = policy.scorer.protected(t - positions, positions)
        self.cache.compact(select_keep(scores, policy.budget, policy.selection, protected, generator), policy.backend)
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
def teacher_force(
    lm: LoadedModel, token_ids: list[int], prompt_len: int, policy: Policy | None = None, prompt_id: str = "",
    keep_history: bool = False, o_proj: dict[int, torch.Tensor] | None = None,
) -> Decoded:
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

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

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from transformers import DynamicCache

from kvdiag.cache import distinct_rows
from kvdiag.core.errors import UserError
from kvdiag.generate import Policy, PositionedCache, choose, live_scores, observing, prompt_chunks
from kvdiag.model.load import LoadedModel
from kvdiag.replay.oracle import FutureRule, LiveLabels, OracleRule
from kvdiag.replay.sampling import Sampling
from kvdiag.scorers.base import needs_o_proj
from kvdiag.scorers.features import o_proj_weights

REFERENCE_CHUNK = 512  # tokens per forward of the full-cache reference (bounds its logits memory)
Row = TypeVar("Row")


@dataclass
class Decoded:
    """One sequence run under a policy.

    token_ids : prompt + generated (free-running) or the Trace's tokens (teacher-forced).
    active : per fed token, the cache entries (per layer and KV head) its query attended, its own included.
    compressions : the checkpoints ``t`` (absolute: the cache held ``[0, t)``'s survivors) at which a compaction ran.
    logprobs : [G, V] fp32 log P_policy of each generated position (row j predicts position prompt_len + j),
        or None when not kept.
    kept : (checkpoint, positions [L, Hkv, B]) after each compaction, when asked for (tests, inspection).
    kept_counts : (checkpoint t, [t] how many of the ``slots`` (layer, KV head) slots hold each position of [0, t))
        after each compaction, when asked for (``generate_batch(record_kept=True)``).
    needed : the needed-token columns of a builtin suite's generation (``kvdiag.replay.free_running``).
    agree : teacher-forced: per continuation position, whether the policy's most likely token is the full-cache
        run's (``top1_agree``).
    joint : teacher-forced with exact labels: the joint damage (mean KL over the label horizon) of the whole evicted
        set after each compaction, aligned with ``compressions``.
    """

    token_ids: list[int]
    prompt_len: int
    stop: str
    active: list[int] = field(default_factory=list)
    compressions: list[int] = field(default_factory=list)
    logprobs: torch.Tensor | None = None
    kept: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    joint: list[float] | None = field(default_factory=list)
    kept_counts: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    slots: int = 0
    needed: dict = field(default_factory=dict)
    agree: list[bool] | None = None

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
    """The model, its bounded cache and the compressor's query window for a batch of sequences.

    The rows share their prompt length and schedule (budget and interval, or all the full cache), so every row is
    fed and compacted at the same steps; each row has its own policy (scorer), tokens and kept entries. A finished
    row leaves the batch (:meth:`select`).

    o_proj : layer -> W_O [hidden, H*d] for the ``wo_l2`` payload (read from the model when needed and not given).
    labels : the exact labels of a teacher-forced sequence (batch of one): the oracle policy's scores, and (with
        ``joint``) the joint damage of the evicted set after each compaction.
    """

    def __init__(self, lm: LoadedModel, policies: list[Policy | None], prompt_ids: list[str], prompt_len: int,
                 o_proj: dict[int, torch.Tensor] | None = None, keep_history: bool = False,
                 labels: LiveLabels | None = None, joint: bool = True):
        schedules = {None if p is None else (p.budget, p.interval) for p in policies}
        if len(schedules) != 1 or len(prompt_ids) != len(policies):
            raise ValueError("one batch needs one prompt id per policy and one (budget, interval) for all rows")
        if labels is not None and len(policies) != 1:
            raise ValueError("exact labels run on a batch of one sequence")
        self.model, self.prompt_len = lm.model, prompt_len
        self.policy = policies[0]  # its budget and interval are every row's
        self.policies, self.prompt_ids = list(policies), list(prompt_ids)
        if o_proj is None and any(p is not None and needs_o_proj(p.scorer) for p in policies):
            o_proj = o_proj_weights(self.model)
        self.o_proj, self.keep_history, self.labels = o_proj or {}, keep_history, labels
        self.label_joint = labels is not None and joint
        self.attention = lm.attention  # per-layer semantics (softcap, sinks) for the scorers
        self.num_layers = self.attention.num_layers
        self.windows = [layer.window for layer in self.attention.layers]
        for policy in policies:
            if policy is not None:
                policy.check_model(self.attention)
        size = 0 if self.policy is None else max(p.query_window for p in policies)
        self.cache = PositionedCache(self.windows, size)
        self.token_ids: list[list[int]] = [[] for _ in policies]
        self.compressions: list[int] = []
        self.kept: list[list[tuple[int, torch.Tensor]]] = [[] for _ in policies]
        self.joint: list[float] = []

    def feed(self, ids: list[list[int]], start: int, all_logits: bool = False) -> torch.Tensor:
        """Feed row r its tokens ``ids[r]`` at positions ``[start, start + c)``; fp32 logits [b, c, V] or [b, 1, V]."""
        device = self.model.device
        c = len(ids[0])
        fed, copy = torch.tensor(ids, device=device), None
        if len(self.cache) == 0:  # rows of one prompt start as one computation: run each once, then copy it
            fed, copy = distinct_rows(fed)
        out = self.model(fed, cache=self.cache, use_cache=True,
                         position_ids=torch.arange(start, start + c, device=device).expand(len(fed), c),
                         logits_to_keep=0 if all_logits else 1)
        logits = out.logits.float()
        if copy is not None:
            self.cache.select(copy)
            logits = logits[copy.to(logits.device)]
        for row, new in zip(self.token_ids, ids, strict=True):
            row.extend(new)
        finite = torch.isfinite(logits).flatten(1).all(dim=1)
        if not bool(finite.all()):
            bad = self.prompt_ids[int((~finite).nonzero()[0])]
            raise UserError(f"non-finite logits at position {start + c - 1} of {bad}: the model overflows; "
                            "rerun with --dtype float32")
        return logits

    def prefill(self, prompts: list[list[int]], all_logits: bool = False) -> torch.Tensor:
        """Feed the prompts (one per row, of equal length) in the chunks of :func:`prompt_chunks`, a checkpoint after
        each; the last chunk's logits [b, c, V]."""
        for start, end in prompt_chunks(len(prompts[0]), self.policy):
            logits = self.feed([p[start:end] for p in prompts], start, all_logits)
            self.checkpoint(end)
        return logits

    def checkpoint(self, t: int) -> None:
        """Compact every row's cache to the budget if it holds more (the cache holds the survivors of ``[0, t)``)."""
        if self.policy is None or len(self.cache) <= self.policy.budget:
            return
        keep = [self._keep(row, policy, t) for row, policy in enumerate(self.policies)]
        self.cache.compact([None if keep[0][layer] is None else torch.stack([k[layer] for k in keep])
                            for layer in range(self.num_layers)], self.policy.backend)
        self.compressions.append(t)
        if self.keep_history:
            for row, kept in enumerate(self.kept):
                kept.append((t, self._positions(row)))
        if self.label_joint:
            self.joint.append(self.labels.joint(self._positions(0), t))

    def _positions(self, row: int) -> torch.Tensor:
        """[L, Hkv, n] positions of row ``row`` (a model whose layers hold as many entries each)."""
        return torch.stack([p[row] for p in self.cache.positions])

    def _keep(self, row: int, policy: Policy, t: int) -> list[torch.Tensor | None]:
        """Per layer, the slots [Hkv, B] row ``row`` keeps at checkpoint ``t`` (None: the layer is kept whole)."""
        positions = [p[row] for p in self.cache.positions]
        if isinstance(policy.scorer, OracleRule):
            if self.labels is None:
                raise ValueError("the oracle policy needs exact labels (teacher-forced replay)")
            label = self.labels.token_labels(self._positions(row), t)  # [n]
            scores = [label.expand(positions[0].shape[0], -1)] * self.num_layers
        elif isinstance(policy.scorer, FutureRule):
            if self.labels is None:
                raise ValueError("the future-attention oracle reads the full-cache run (teacher-forced replay)")
            scores = self.labels.future_scores(positions, t, policy.scorer)
        else:
            scores = live_scores(policy, self.cache, row, t, self.attention, self.prompt_len, self.prompt_ids[row],
                                 torch.tensor(self.token_ids[row]), self.o_proj)
        return choose(policy, scores, positions, t, self.prompt_ids[row], self.windows)

    def select(self, rows: list[int]) -> None:
        """Keep only the batch rows ``rows`` (in this order)."""
        self.cache.select(torch.tensor(rows, dtype=torch.long))
        for name in ("policies", "prompt_ids", "token_ids", "kept"):
            setattr(self, name, [getattr(self, name)[r] for r in rows])

    def result(self, row: int, token_ids: list[int], stop: str, logprobs: torch.Tensor | None) -> Decoded:
        return Decoded(list(token_ids), self.prompt_len, stop, list(self.cache.active), list(self.compressions),
                       logprobs, self.kept[row], list(self.joint))


def eos_ids(lm: LoadedModel) -> set[int]:
    """Token ids that end a generation: the tokenizer's and the generation config's EOS."""
    ids = {lm.tokenizer.eos_token_id}
    extra = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
    ids |= set(extra) if isinstance(extra, (list, tuple)) else {extra}
    return {i for i in ids if i is not None}


@torch.no_grad()
def decode(lm: LoadedModel, prompt: list[int], policy: Policy | None = None, max_new_tokens: int = 512,
           prompt_id: str = "", keep_logprobs: bool = False, keep_history: bool = False,
           o_proj: dict[int, torch.Tensor] | None = None, sampling: Sampling | None = None, sample: int = 0) -> Decoded:
    """One generation of up to ``max_new_tokens`` after ``prompt`` under ``policy`` (None: the full cache): a batch
    of one of :func:`decode_batch`."""
    return decode_batch(lm, [prompt], [policy], max_new_tokens, [prompt_id], keep_logprobs, keep_history, o_proj,
                        sampling, [sample])[0]


def batch_args(prompts: list[list[int]], max_new_tokens: int, prompt_ids: list[str] | None,
               sampling: Sampling | None, samples: list[int] | None) -> tuple:
    """The checks and defaults a decoded batch shares (loop or ``generate``): (b, P, prompt_ids, sampling, samples)."""
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: must be a positive number of tokens")
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("one batch needs prompts of one length")
    b = len(prompts)
    return b, len(prompts[0]), prompt_ids or [""] * b, sampling or Sampling(), samples or [0] * b


@torch.no_grad()
def decode_batch(
    lm: LoadedModel, prompts: list[list[int]], policies: list[Policy | None], max_new_tokens: int = 512,
    prompt_ids: list[str] | None = None, keep_logprobs: bool = False, keep_history: bool = False,
    o_proj: dict[int, torch.Tensor] | None = None, sampling: Sampling | None = None, samples: list[int] | None = None,
) -> list[Decoded]:
    """Generations of up to ``max_new_tokens`` after each of ``prompts`` (equal lengths) under ``policies[r]``
    (all with one budget and interval, or all None: the full cache), decoded together; a row that writes EOS leaves
    the batch. Greedy unless ``sampling`` has a temperature; row ``r`` then draws as generation
    ``(prompt_ids[r], samples[r])`` (:class:`~kvdiag.replay.sampling.Sampling`), whatever the batch.

    A checkpoint follows every ``interval`` generated tokens: after the query at position ``t - 1`` produced the
    token at ``t`` (from the cache as it was), the cache is compacted, and the token at ``t`` is fed to it.
    """
    b, P, prompt_ids, sampling, samples = batch_args(prompts, max_new_tokens, prompt_ids, sampling, samples)
    draws = [sampling.generator(pid, s) for pid, s in zip(prompt_ids, samples, strict=True)]
    session = Session(lm, policies, prompt_ids, P, o_proj, keep_history)
    ids, rows, eos = [list(p) for p in prompts], [[] for _ in prompts], eos_ids(lm)
    live, results = list(range(b)), [None] * b  # live: the original row of each batch row
    with observing(lm.model):
        logits = session.prefill(prompts)[:, -1]
        for g in range(1, max_new_tokens + 1):
            staying = []
            for j, r in enumerate(live):
                token = sampling.pick(logits[j], draws[r])
                ids[r].append(token)
                if keep_logprobs:
                    rows[r].append(torch.log_softmax(logits[j], dim=-1).cpu())
                if token in eos or g == max_new_tokens:
                    logprobs = torch.stack(rows[r]) if keep_logprobs else None
                    results[r] = session.result(j, ids[r], "eos" if token in eos else "max_new_tokens", logprobs)
                else:
                    staying.append(j)
            if not staying:
                break
            if len(staying) < len(live):
                session.select(staying)
                live = [live[j] for j in staying]
            logits = session.feed([[ids[r][-1]] for r in live], P + g - 1)[:, -1]
            if session.policy is not None and g % session.policy.interval == 0:
                session.checkpoint(P + g)
    return results


def batches(rows: Sequence[Row], size: int, key: Callable[[Row], Hashable]) -> list[list[Row]]:
    """``rows`` cut into batches :func:`decode_batch` takes: the rows of one ``key`` (their prompt length and
    budget), ``size`` at a time, groups in first-seen order."""
    groups: dict[Hashable, list[Row]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return [group[s : s + size] for group in groups.values() for s in range(0, len(group), size)]


@torch.no_grad()
def teacher_force(
    lm: LoadedModel, token_ids: list[int], prompt_len: int, policy: Policy | None = None, prompt_id: str = "",
    keep_history: bool = False, o_proj: dict[int, torch.Tensor] | None = None, labels: LiveLabels | None = None,
    joint: bool = True,
) -> Decoded:
    """Feed ``token_ids`` (prompt + continuation) under ``policy``; ``logprobs`` [T - P, V] of every
    continuation position, checkpoints at the end of each prompt chunk and every ``interval`` tokens after it.
    With ``labels`` (:class:`~kvdiag.replay.oracle.LiveLabels` of these tokens) the oracle policy can run and, with
    ``joint``, the result's ``joint`` holds the exact joint damage of the evicted set after each compaction."""
    T, P = len(token_ids), prompt_len
    if not 1 <= P < T:
        raise UserError(f"prompt {prompt_id!r}: needs at least one token after its {P} prompt tokens to teacher-force")
    session = Session(lm, [policy], [prompt_id], P, o_proj, keep_history, labels, joint)
    interval = policy.interval if policy else T
    with observing(lm.model):
        rows = [torch.log_softmax(session.prefill([token_ids[:P]])[0], dim=-1).cpu()]
        for start in range(P, T - 1, interval):
            end = min(start + interval, T - 1)
            logits = session.feed([token_ids[start:end]], start, all_logits=True)[0]
            rows.append(torch.log_softmax(logits, dim=-1).cpu())
            if (end - P) % interval == 0:
                session.checkpoint(end)
    return session.result(0, list(token_ids), "teacher_forced", torch.cat(rows))


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

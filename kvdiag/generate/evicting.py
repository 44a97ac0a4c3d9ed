"""``model.generate`` under a kvdiag rule: :class:`EvictingCache`, a positioned cache that compacts itself on
replay's schedule.

    cache = EvictingCache(model, "rkv", budget=128, interval=128)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=256)  # greedy, sampled, batched, ...

The checkpoints are replay's (``kvdiag.replay``'s :class:`~kvdiag.generate.Policy`): the end of each prompt chunk,
then every ``interval`` generated tokens. A checkpoint ``t`` (the cache holds the survivors of ``[0, t)``) runs at
the start of the forward that feeds position ``t``, on every layer at once: the same state replay compacts after
the forward that fed ``t - 1``, so the outputs are the same. A prompt longer than ``budget + interval`` is fed in
replay's chunks by :meth:`EvictingCache.prefill` before ``generate`` feeds its last chunk.
"""

from __future__ import annotations

import time

import torch

from kvdiag.cache import PositionedCache, distinct_rows, use_kvdiag_attention
from kvdiag.core.errors import UserError
from kvdiag.core.parsing import Selection
from kvdiag.core.schema import CHECKPOINT_INTERVAL
from kvdiag.generate.live import check_live_scorer, make_scorer
from kvdiag.generate.policy import Policy, choose, live_scores, prompt_chunks
from kvdiag.model.adapters import model_attention
from kvdiag.scorers import Scorer
from kvdiag.scorers.base import needs_o_proj


class EvictingCache(PositionedCache):
    """A cache that keeps ``budget`` entries per (layer, KV head) under ``rule`` at every checkpoint.

    model : the (adapted) causal LM the cache serves; its forwards over this cache run kvdiag's attention (the same
        kernel: SDPA or the model file's eager), which records the rule's query window and masks sliding layers by
        position (forward hooks switch it, and back).
    rule : a :class:`~kvdiag.scorers.Scorer` or a registered name (built-in, plugin, ``fitted:PATH``), with
        ``params`` for a name; or a list of them, one per batch row (the rows share budget and schedule).
    budget, interval, selection, backend, seed : as :class:`~kvdiag.generate.Policy`.
    prompt_ids : one id per batch row (seeds per-head contexts and stochastic draws as replay does; default "").
    o_proj : layer -> W_O for the ``wo_l2`` payload (read from the model when a rule needs it and none is given).

    Rules that read token ids see the ids fed so far (None once a forward fed embeddings). Batches are prompts of
    one length (no padding). The cache serves one generation; make a new one for the next. It records
    ``compressions`` (the checkpoints that compacted), ``active`` (as every positioned cache) and ``seconds`` (host
    time in scoring and choosing, and in the compaction itself).
    """

    def __init__(self, model, rule: Scorer | str | list[Scorer | str], budget: int,
                 interval: int = CHECKPOINT_INTERVAL, selection: Selection | str = "per-head", backend: str = "auto",
                 seed: int = 0, params: dict | None = None, prompt_ids: list[str] | None = None,
                 o_proj: dict | None = None, record_kept: bool = False):
        rules = rule if isinstance(rule, list) else [rule]
        if not rules:
            raise UserError("EvictingCache: give a rule (or one per batch row)")
        attention = model_attention(model)
        self.policies = [_policy(r, params, budget, interval, selection, backend, seed, attention) for r in rules]
        self.policy = self.policies[0]  # its budget and schedule are every row's
        super().__init__([layer.window for layer in attention.layers], max(p.query_window for p in self.policies))
        self.model, self.attention, self.prompt_ids = model, attention, prompt_ids
        self.windows = [layer.window for layer in attention.layers]
        self.o_proj = o_proj
        if o_proj is None and any(needs_o_proj(p.scorer) for p in self.policies):
            from kvdiag.scorers.features import o_proj_weights

            self.o_proj = o_proj_weights(model)
        self.prompt_len: int | None = None
        self.compressions: list[int] = []  # the checkpoints t at which a compaction ran
        # record_kept: per row, (t, how many (layer, KV head) slots hold each position of [0, t) [t]) per compaction
        self.kept: list[list[tuple[int, torch.Tensor]]] | None = [] if record_kept else None
        self.fed: list[torch.Tensor] | None = []  # the token ids [b, c] of each forward (None: embeddings were fed)
        self.seconds = {"score_choose": 0.0, "compact": 0.0}
        self.restore: str | None = None  # the model's attention, switched back after each forward
        if not getattr(model, "_kvdiag_evicting_hooks", False):
            model.register_forward_pre_hook(_before_forward, with_kwargs=True)
            model.register_forward_hook(_after_forward, with_kwargs=True)
            model._kvdiag_evicting_hooks = True

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> None:
        """Feed the prompt ``input_ids [b, P]`` in replay's chunks but the last (a checkpoint after each), so that
        ``model.generate(input_ids, past_key_values=cache)`` feeds only the last chunk. Needed when ``P > budget +
        interval``; harmless otherwise."""
        if self.prompt_len is not None:
            raise UserError("this EvictingCache already holds a prompt: make a new cache for each generation")
        self.prompt_len = input_ids.shape[1]
        for start, end in prompt_chunks(self.prompt_len, self.policy)[:-1]:
            ids, copy = distinct_rows(input_ids[:, start:end]) if start == 0 else (input_ids[:, start:end], None)
            self.model(ids, cache=self, use_cache=True, logits_to_keep=1)
            if copy is not None:  # rows of one prompt share their first chunk (as replay's loop); the rules and
                super().batch_select_indices(copy)  # prompt ids are already one per row
                self.fed[-1] = input_ids[:, start:end].cpu()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Make batch row ``i`` the current row ``indices[i]``: the positioned layers, the query window, and each
        row's rule, prompt id and fed token ids (finished rows leave; a shared first chunk is copied)."""
        super().batch_select_indices(indices)
        rows = indices.tolist()
        if self.fed:
            self.fed = [ids[indices.to(ids.device)] for ids in self.fed]
        if len(self.policies) > 1:
            self.policies = [self.policies[r] for r in rows]
        if self.prompt_ids is not None:
            self.prompt_ids = [self.prompt_ids[r] for r in rows]
        if self.kept:
            self.kept = [self.kept[r] for r in rows]

    @property
    def slots(self) -> int:
        """(layer, KV head) slots per row: what a kept count is a share of."""
        return sum(layer.positions.shape[1] for layer in self.layers)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 and self.due(self.layers[0].seen):
            raise RuntimeError("a forward reached the EvictingCache without its model's pre-hook (it compacts before "
                               "the masks are built): call the model the cache was made for, not a submodule")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def due(self, t: int) -> bool:
        """Whether a compaction at checkpoint ``t`` is due and has not run."""
        return (self.prompt_len is not None and len(self) > self.policy.budget and t in self.checkpoints(t, t + 1)
                and (not self.compressions or self.compressions[-1] != t))

    def checkpoints(self, start: int, end: int) -> list[int]:
        """The checkpoints ``t`` with ``start <= t < end`` (chunk ends of the prompt, then every ``interval``)."""
        P, K = self.prompt_len, self.policy.interval
        ends = [e for _, e in prompt_chunks(P, self.policy)]
        after = range(P + K * max(1, -(-(start - P) // K)), end, K) if end > P else []
        return sorted({t for t in ends if start <= t < end} | set(after))

    def before_forward(self, c: int) -> None:
        """Refuse a forward that skips a checkpoint; compact when it starts at one."""
        seen = self.layers[0].seen
        if self.prompt_len is None:  # generate's prefill: the whole prompt in one forward
            self.prompt_len = c
        if any(t > seen for t in self.checkpoints(seen, seen + c)):
            first = self.policy.budget + self.policy.interval
            raise UserError(f"a forward of {c} tokens at position {seen} crosses a checkpoint of the EvictingCache "
                            f"(budget {self.policy.budget} + interval {self.policy.interval}): a prompt longer than "
                            f"{first} tokens goes through cache.prefill(input_ids) before generate")
        if self.due(seen):
            self.checkpoint(seen)

    def checkpoint(self, t: int) -> None:
        """Compact every row to the budget at checkpoint ``t`` (the cache holds the survivors of ``[0, t)``)."""
        if self.queries is None or self.queries.rows[0] is None:
            raise RuntimeError("the EvictingCache recorded no queries: the model ran without kvdiag's attention")
        rows = self.layers[0].positions.shape[0]
        ids = self.prompt_ids or [""] * rows
        if len(ids) != rows:
            raise UserError(f"prompt_ids: {len(ids)} ids for a batch of {rows} rows; give one per row")
        policies = self.policies if len(self.policies) > 1 else self.policies * rows
        if len(policies) != rows:
            raise UserError(f"rules: {len(policies)} rules for a batch of {rows} rows; give one, or one per row")
        start = time.perf_counter()
        keep = []
        tokens = None if self.fed is None else torch.cat(self.fed, dim=1)  # [b, t]
        for row, policy in enumerate(policies):
            scores = live_scores(policy, self, row, t, self.attention, self.prompt_len, ids[row],
                                 None if tokens is None else tokens[row], self.o_proj)
            keep.append(choose(policy, scores, [p[row] for p in self.positions], t, ids[row], self.windows))
        per_layer = [None if keep[0][layer] is None else torch.stack([k[layer] for k in keep])
                     for layer in range(len(self.layers))]
        middle = time.perf_counter()
        self.compact(per_layer, self.policy.backend)
        if self.layers[0].keys.is_cuda:  # the compaction's kernels, not only their launch
            torch.cuda.synchronize(self.layers[0].keys.device)
        self.seconds["score_choose"] += middle - start
        self.seconds["compact"] += time.perf_counter() - middle
        self.compressions.append(t)
        if self.kept is not None:
            self.kept = self.kept or [[] for _ in range(rows)]
            for row, got in enumerate(self.kept):
                held = torch.cat([p[row].reshape(-1) for p in self.positions])
                got.append((t, torch.bincount(held, minlength=t)[:t].to(torch.int16)))


def _policy(rule: Scorer | str, params: dict | None, budget: int, interval: int, selection: Selection | str,
            backend: str, seed: int, attention) -> Policy:
    """The checked policy of one rule (bad input: UserError, before any generation)."""
    if isinstance(rule, Scorer) and params:
        raise UserError(f"rule {rule.name}: params apply to a rule given by name; set them on the instance")
    scorer = rule if isinstance(rule, Scorer) else make_scorer(rule, params)
    policy = Policy(scorer, budget, interval, selection, backend, seed)
    check_live_scorer(scorer, budget, interval, attention.num_heads // attention.num_kv_heads, attention.qk_head_dim)
    policy.selection.check_rule(scorer)
    policy.check_model(attention)
    return policy


def _before_forward(model, args: tuple, kwargs: dict) -> None:
    """The model's forward pre-hook: a forward over an :class:`EvictingCache` runs kvdiag's attention and first lets
    the cache compact (before transformers sizes the masks from it)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, EvictingCache):
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens, cache.fed = kwargs["inputs_embeds"], None
        cache.check_positions(tokens.shape[0], tokens.shape[1], kwargs)
        cache.before_forward(tokens.shape[1])
        if cache.fed is not None:  # after the checkpoint: it reads the ids of [0, t)
            cache.fed.append(tokens.cpu())
        cache.restore = model.config._attn_implementation
        use_kvdiag_attention(model)


def _after_forward(model, args: tuple, kwargs: dict, output) -> None:
    """The model's forward hook: its own attention again after a forward over an :class:`EvictingCache`."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, EvictingCache) and cache.restore is not None:
        if model.config._attn_implementation != cache.restore:
            model.set_attn_implementation(cache.restore)
        cache.restore = None

"""``model.generate`` under a kvdiag rule: :class:`EvictingCache`, a positioned cache that compacts itself on
replay's schedule.

    cache = EvictingCache(model, "rkv", budget=128, interval=128)
    out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=256)  # greedy, sampled, ...

The checkpoints are replay's (``kvdiag.replay``'s :class:`~kvdiag.generate.Policy`): the end of each prompt chunk,
then every ``interval`` generated tokens. A checkpoint ``t`` (the cache holds the survivors of ``[0, t)``) runs at
the start of the forward that feeds position ``t``, on every layer at once: the same state replay compacts after
the forward that fed ``t - 1``, so the outputs are the same. A prompt longer than ``budget + interval`` is fed in
replay's chunks by :meth:`EvictingCache.prefill` before ``generate`` feeds its last chunk; ``prefill="once"`` feeds
it whole and compacts once at its end, as kvpress's presses do.

Left-padded batches (prompts of different lengths, ``attention_mask`` zero on the left) run each row on its own
positions and schedule, as if it were generated alone: padding has negative positions, which no real query sees,
and a row that holds fewer entries than another after a compaction is topped up with masked filler slots (the
rows of a cache tensor hold as many slots each).
"""

from __future__ import annotations

import functools
import time

import torch

from kvdiag.cache import PositionedCache, distinct_rows, use_kvdiag_attention
from kvdiag.core.errors import UserError
from kvdiag.core.parsing import BACKENDS, Selection
from kvdiag.core.schema import CHECKPOINT_INTERVAL
from kvdiag.generate.live import (
    ArgumentError,
    ArgumentTypeError,
    check_choice_arg,
    check_count,
    check_live_scorer,
    check_model,
    check_ratio,
    kept_entries,
    max_positions,
    python_message,
    rule_scorer,
    score_layer,
)
from kvdiag.generate.policy import PREFILLS, Policy, choose, live_scores, prompt_chunks
from kvdiag.scorers import Scorer
from kvdiag.scorers.base import needs_o_proj


class EvictingCache(PositionedCache):
    """A cache that keeps ``budget`` entries per (layer, KV head) under ``rule`` at every checkpoint.

    model : the (adapted) causal LM the cache serves; its forwards over this cache run kvdiag's attention (the same
        kernel: SDPA or the model file's eager), which records the rule's query window and masks by position (forward
        hooks switch it, and back).
    rule : a :class:`~kvdiag.scorers.Scorer` or a registered name (built-in, plugin, ``fitted:PATH``), with
        ``params`` for a name; or a list of them, one per batch row (the rows share budget and schedule).
    budget : B, entries kept per (layer, KV head) at a checkpoint; or ``compression_ratio`` instead (exactly one):
        the fraction of the prompt's entries removed, kvpress's ``compression_ratio``; the budget is then
        ``max(1, int(P * (1 - compression_ratio)))`` for a prompt of ``P`` tokens (each row's own ``P`` in a
        left-padded batch), set by the first forward (``budgets``).
    interval, selection, backend, seed : as :class:`~kvdiag.generate.Policy`.
    prefill : ``"chunked"`` (replay's: the prompt in chunks of ``budget + interval`` then ``interval``, through
        :meth:`prefill`) or ``"once"`` (kvpress's: the prompt in one forward, one compaction at its end).
    prompt_ids : one id per batch row (seeds per-head contexts and stochastic draws as replay does; default "").
    o_proj : layer -> W_O for the ``wo_l2`` payload (read from the model when a rule needs it and none is given).

    Rules that read token ids see the ids fed so far (None once a forward fed embeddings). A batch is prompts of one
    length, or left-padded prompts with their ``attention_mask`` (to ``generate``, or to :meth:`prefill`). The cache
    serves one generation (a second one is refused); make a new one for the next. It records ``compressions`` (the
    steps, tokens fed, at which a compaction ran: in a left-padded batch padding counts, and ``row_compressions``
    gives each row's checkpoints on its own positions), ``active`` (as every positioned cache) and ``seconds`` (host
    time in scoring and choosing, and in the compaction itself).

    Every bad argument is one ``ValueError`` or ``TypeError`` naming it (``kvdiag.generate.live.ArgumentError``),
    before any work and without allocating in proportion to a number given.
    """

    def __init__(self, model, rule: Scorer | str | list[Scorer | str], budget: int | None = None,
                 interval: int = CHECKPOINT_INTERVAL, selection: Selection | str = "per-head", backend: str = "auto",
                 seed: int = 0, params: dict | None = None, prompt_ids: list[str] | None = None,
                 o_proj: dict | None = None, record_kept: bool = False, *, compression_ratio: float | None = None,
                 prefill: str = "chunked"):
        attention = check_model(model)
        rules = list(rule) if isinstance(rule, (list, tuple)) else [rule]
        if not rules:
            raise ArgumentError("rule=[]: give a rule, or one per batch row")
        if (budget is None) == (compression_ratio is None):
            raise ArgumentError("give exactly one of budget= (entries kept per (layer, KV head)) and "
                                f"compression_ratio= (the fraction removed); got budget={budget!r}, "
                                f"compression_ratio={compression_ratio!r}")
        budget = None if budget is None else check_count("budget", budget)
        self.compression_ratio = None if compression_ratio is None else check_ratio("compression_ratio",
                                                                                     compression_ratio)
        interval = check_count("interval", interval)
        seed = check_count("seed", seed, low=-(2**63), high=2**63 - 1)
        check_choice_arg("backend", backend, BACKENDS)
        prefill = check_choice_arg("prefill", prefill, PREFILLS)
        if not isinstance(selection, (str, Selection)):
            raise ArgumentTypeError(f"selection={selection!r}: give 'per-head', 'per-token' or 'stochastic[:TAU]'")
        try:
            selection = Selection.parse(selection, "selection")
        except UserError as err:
            raise ArgumentError(python_message(err)) from None
        if prompt_ids is not None and (not isinstance(prompt_ids, (list, tuple))
                                       or not all(isinstance(p, str) for p in prompt_ids)):
            raise ArgumentTypeError(f"prompt_ids={prompt_ids!r}: give a list of strings, one per batch row")
        if o_proj is not None and not isinstance(o_proj, dict):
            raise ArgumentTypeError(f"o_proj={type(o_proj).__name__}: give a dict layer -> W_O, or None")
        self.limit = max_positions(model)
        scorers = [_scorer(r, params, budget, interval, selection, attention, self.limit) for r in rules]
        self.model, self.attention = model, attention
        self.prompt_ids = None if prompt_ids is None else list(prompt_ids)
        self.windows = [layer.window for layer in attention.layers]
        # a budget given: the policies now; a compression ratio: once the prompt's length is known (_start)
        self._settings = dict(interval=interval, selection=selection, backend=backend, seed=seed, prefill=prefill)
        self.policies: list[Policy] = [] if budget is None else [
            _checked_policy(Policy(s, budget, **self._settings), attention) for s in scorers]
        self._scorers = scorers
        self.policy = self.policies[0] if self.policies else None  # its budget and schedule are every row's
        super().__init__(self.windows, max(max(s.query_window, 1) for s in scorers))
        self.o_proj = o_proj
        if o_proj is None and any(needs_o_proj(s) for s in scorers):
            from kvdiag.scorers.features import o_proj_weights

            self.o_proj = o_proj_weights(model)
        self.prompt_len: int | None = None  # prompt slots (tokens fed before generation, left padding included)
        self.offsets: torch.Tensor | None = None  # [b] left padding per row (None: none)
        self.compressions: list[int] = []  # the steps t (tokens fed) at which a compaction ran
        self._row_compressions: list[list[int]] | None = None  # left-padded: each row's own checkpoints
        # record_kept: per row, (t, how many (layer, KV head) slots hold each position of [0, t) [t]) per compaction
        self.kept: list[list[tuple[int, torch.Tensor]]] | None = [] if record_kept else None
        self.fed: list[torch.Tensor] | None = []  # the token ids [b, c] of each forward (None: embeddings were fed)
        self.seconds = {"score_choose": 0.0, "compact": 0.0}
        self.restore: str | None = None  # the model's attention, switched back after each forward
        if not getattr(model, "_kvdiag_evicting_hooks", False):
            model.register_forward_pre_hook(_before_forward, with_kwargs=True)
            model.register_forward_hook(_after_forward, with_kwargs=True)
            model._kvdiag_evicting_hooks = True
        if not getattr(model, "_kvdiag_evicting_generate", False):
            model.prepare_inputs_for_generation = _checking_prepare(model.prepare_inputs_for_generation)
            model._kvdiag_evicting_generate = True

    # --------------------------------------------------------------------------- budgets and schedule

    @property
    def budgets(self) -> list[int] | None:
        """Each row's budget (one entry when every row has the same); None until a ``compression_ratio`` meets its
        prompt."""
        return [p.budget for p in self.policies] if self.policies else None

    @property
    def row_compressions(self) -> list[list[int]]:
        """Per batch row, the checkpoints (its own positions) at which that row was compacted."""
        if self._row_compressions is not None:
            return [list(r) for r in self._row_compressions]
        rows = self.layers[0].positions.shape[0] if self.layers[0].is_initialized else 1
        return [list(self.compressions) for _ in range(rows)]

    def _row_policy(self, row: int) -> Policy:
        return self.policies[row] if len(self.policies) > 1 else self.policies[0]

    def _start(self, b: int, P: int, attention_mask: torch.Tensor | None) -> None:
        """The prompt: ``b`` rows of ``P`` slots, left-padded where ``attention_mask [b, P]`` is 0. Sets each row's
        padding and, for a ``compression_ratio``, each row's budget (then checked against the rule)."""
        offsets = _left_padding(attention_mask, b, P)
        self.prompt_len, self.offsets = P, offsets
        if offsets is not None:
            for layer in self.layers:
                layer.offsets = offsets.clone()
            self._row_compressions = [[] for _ in range(b)]
        if self.compression_ratio is None:
            return
        lengths = [P] if offsets is None else (P - offsets).tolist()
        budgets = [kept_entries(n, self.compression_ratio) for n in lengths]
        scorers = self._scorers if len(self._scorers) > 1 else self._scorers * len(budgets)
        if len(scorers) != len(budgets):
            raise ArgumentError(f"rule: {len(self._scorers)} rules for a batch of {b} rows; give one, or one per row")
        policies = []
        for scorer, budget, n in zip(scorers, budgets, lengths, strict=True):
            try:
                check_live_scorer(scorer, budget, self._settings["interval"], *_group(self.attention), api=True,
                                  limit=self.limit)
                policies.append(_checked_policy(Policy(scorer, budget, **self._settings), self.attention))
            except UserError as err:
                raise ArgumentError(f"compression_ratio={self.compression_ratio} keeps {budget} of a {n}-token "
                                    f"prompt's entries: {python_message(err)}") from None
        if len(set(budgets)) == 1 and len(self._scorers) == 1:
            policies = policies[:1]
        self.policies, self.policy = policies, policies[0]

    def _schedule(self, P: int, policy: Policy, start: int, end: int) -> list[int]:
        """The checkpoints ``t`` with ``start <= t < end`` of a ``P``-token prompt under ``policy``."""
        K = policy.interval
        ends = [e for _, e in prompt_chunks(P, policy)]
        after = range(P + K * max(1, -(-(start - P) // K)), end, K) if end > P else []
        return sorted({t for t in ends if start <= t < end} | set(after))

    def checkpoints(self, start: int, end: int) -> list[int]:
        """The checkpoints ``t`` with ``start <= t < end`` (chunk ends of the prompt, then every ``interval``)."""
        return self._schedule(self.prompt_len, self.policy, start, end)

    def due(self, t: int) -> bool:
        """Whether a compaction at checkpoint ``t`` is due and has not run."""
        return (self.prompt_len is not None and len(self) > self.policy.budget and t in self.checkpoints(t, t + 1)
                and (not self.compressions or self.compressions[-1] != t))

    # --------------------------------------------------------------------------- the prompt

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Feed the prompt ``input_ids [b, P]`` in replay's chunks but the last (a checkpoint after each), so that
        ``model.generate(input_ids, attention_mask=..., cache=cache)`` feeds only the last chunk. Needed when
        ``P > budget + interval`` (chunked prefill); harmless otherwise. ``attention_mask [b, P]``: 0 on each row's
        left padding (the same mask goes to ``generate``)."""
        if self.prompt_len is not None or self.layers[0].seen:
            raise ArgumentError("cache: this EvictingCache already holds a prompt; make a new EvictingCache for each "
                                "generation")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ArgumentError(f"input_ids: give token ids [batch, prompt length], got "
                                f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        self._start(input_ids.shape[0], input_ids.shape[1], attention_mask)
        if self.offsets is None:
            for start, end in prompt_chunks(self.prompt_len, self.policy)[:-1]:
                ids, copy = distinct_rows(input_ids[:, start:end]) if start == 0 else (input_ids[:, start:end], None)
                self.model(ids, cache=self, use_cache=True, logits_to_keep=1)
                if copy is not None:  # rows of one prompt share their first chunk (as replay's loop); the rules and
                    super().batch_select_indices(copy)  # prompt ids are already one per row
                    self.fed[-1] = input_ids[:, start:end].cpu()
            return
        # left padding: a forward ends at every row's chunk end (each row's schedule on its own positions)
        ends = sorted({int(o) + e for r, o in enumerate(self.offsets.tolist())
                       for _, e in prompt_chunks(self.prompt_len - o, self._row_policy(r))} - {self.prompt_len})
        start, device = 0, input_ids.device
        for end in ends:
            positions = (torch.arange(start, end)[None] - self.offsets[:, None]).clamp(min=0)
            self.model(input_ids[:, start:end], attention_mask=attention_mask[:, :end], cache=self, use_cache=True,
                       position_ids=positions.to(device), logits_to_keep=1)
            start = end

    def check_continues(self, input_ids: torch.Tensor) -> None:
        """Refuse a ``generate`` call whose ``input_ids [b, T]`` do not continue what this cache holds (a second
        generation with the same cache): its first ``seen`` ids must be the ids fed so far."""
        seen = self.layers[0].seen
        if not seen:
            return
        fed = None if not self.fed else torch.cat(self.fed, dim=1)
        differs = input_ids.shape[1] <= seen or (
            fed is not None and (fed.shape[0] != input_ids.shape[0]
                                 or not torch.equal(fed[:, :seen], input_ids[:, :seen].cpu())))
        if differs:
            raise ArgumentError(f"cache: this EvictingCache already holds {seen} tokens of another generation, which "
                                "these input_ids do not continue; a cache serves one generation: make a new "
                                "EvictingCache for each generate call")

    # --------------------------------------------------------------------------- rows

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Make batch row ``i`` the current row ``indices[i]``: the positioned layers, the query window, and each
        row's rule, prompt id, fed token ids and padding (finished rows leave; a shared first chunk is copied)."""
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
        if self.offsets is not None:
            self.offsets = self.offsets[indices.cpu()]
            self._row_compressions = [self._row_compressions[r] for r in rows]

    @property
    def slots(self) -> int:
        """(layer, KV head) slots per row: what a kept count is a share of."""
        return sum(layer.positions.shape[1] for layer in self.layers)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0 and self.prompt_len is not None and self._due_rows(self.layers[0].seen):
            raise RuntimeError("a forward reached the EvictingCache without its model's pre-hook (it compacts before "
                               "the masks are built): call the model the cache was made for, not a submodule")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    # --------------------------------------------------------------------------- checkpoints

    def before_forward(self, c: int, attention_mask: torch.Tensor | None = None, rows: int = 1) -> None:
        """Refuse a forward of ``c`` tokens (``rows`` rows) that skips a checkpoint; compact when it starts at one.
        The first forward is the prompt (``generate``'s prefill: the whole prompt in one forward), its
        ``attention_mask [rows, c]`` its padding."""
        seen = self.layers[0].seen
        if self.prompt_len is None:
            self._start(rows, c, attention_mask)
        else:
            _check_mask(attention_mask, self.offsets, seen + c)
        if self.offsets is None:
            if any(t > seen for t in self.checkpoints(seen, seen + c)):
                self._refuse_crossing(c, seen)
            if self.due(seen):
                self.checkpoint(seen)
            return
        for row, off in enumerate(self.offsets.tolist()):
            P, policy = self.prompt_len - off, self._row_policy(row)
            if any(t > seen - off for t in self._schedule(P, policy, seen - off, seen - off + c)):
                self._refuse_crossing(c, seen)
        rows = self._due_rows(seen)
        if rows:
            self._checkpoint_padded(seen, rows)

    def _refuse_crossing(self, c: int, seen: int) -> None:
        first = min(p.budget + p.interval for p in self.policies)
        raise ArgumentError(f"input_ids: a forward of {c} tokens at position {seen} crosses a checkpoint of the "
                            f"EvictingCache (budget + interval = {first}): a prompt longer than that goes through "
                            "cache.prefill(input_ids, attention_mask) before generate, or make the cache with "
                            "prefill='once'")

    def _due_rows(self, seen: int) -> list[int]:
        """The rows whose compaction at step ``seen`` is due and has not run."""
        if self.offsets is None:
            rows = self.layers[0].positions.shape[0]
            return list(range(rows)) if self.due(seen) else []
        due = []
        for row, off in enumerate(self.offsets.tolist()):
            t, policy = seen - off, self._row_policy(row)
            if t < 1 or t not in self._schedule(self.prompt_len - off, policy, t, t + 1):
                continue
            held = max(int((layer.positions[row, 0] >= 0).sum()) for layer in self.layers)
            done = self._row_compressions[row]
            if held > policy.budget and (not done or done[-1] != t):
                due.append(row)
        return due

    def checkpoint(self, t: int) -> None:
        """Compact every row to the budget at checkpoint ``t`` (the cache holds the survivors of ``[0, t)``)."""
        if self.offsets is not None:
            self._checkpoint_padded(t, self._due_rows(t))
            return
        if self.queries is None or self.queries.rows[0] is None:
            raise RuntimeError("the EvictingCache recorded no queries: the model ran without kvdiag's attention")
        rows = self.layers[0].positions.shape[0]
        ids = self.prompt_ids or [""] * rows
        if len(ids) != rows:
            raise ArgumentError(f"prompt_ids: {len(ids)} ids for a batch of {rows} rows; give one per row")
        policies = self.policies if len(self.policies) > 1 else self.policies * rows
        if len(policies) != rows:
            raise ArgumentError(f"rule: {len(policies)} rules for a batch of {rows} rows; give one, or one per row")
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
        self._timed(start, middle)
        self.compressions.append(t)
        if self.kept is not None:
            self.kept = self.kept or [[] for _ in range(rows)]
            for row, got in enumerate(self.kept):
                held = torch.cat([p[row].reshape(-1) for p in self.positions])
                got.append((t, torch.bincount(held, minlength=t)[:t].to(torch.int16)))

    def _timed(self, start: float, middle: float) -> None:
        if self.layers[0].keys.is_cuda:  # the compaction's kernels, not only their launch
            torch.cuda.synchronize(self.layers[0].keys.device)
        self.seconds["score_choose"] += middle - start
        self.seconds["compact"] += time.perf_counter() - middle

    def _checkpoint_padded(self, seen: int, rows: list[int]) -> None:
        """Left padding: compact ``rows`` at step ``seen``, each at its own checkpoint ``seen - offsets[row]`` from
        its real entries (the last ``n`` slots of each of its heads); the other rows keep their real entries. Every
        row then holds as many slots as the fullest: the others are topped up with filler slots (entries it no
        longer holds, or padding) given negative positions, which no real query sees."""
        if not rows:
            return
        if self.queries is None or self.queries.rows[0] is None:
            raise RuntimeError("the EvictingCache recorded no queries: the model ran without kvdiag's attention")
        b = self.layers[0].positions.shape[0]
        ids = self.prompt_ids or [""] * b
        if len(ids) != b:
            raise ArgumentError(f"prompt_ids: {len(ids)} ids for a batch of {b} rows; give one per row")
        if len(self.policies) not in (1, b):
            raise ArgumentError(f"rule: {len(self.policies)} rules for a batch of {b} rows; give one, or one per row")
        start = time.perf_counter()
        tokens = None if self.fed is None else torch.cat(self.fed, dim=1)  # [b, seen], padding included
        real = [[int((layer.positions[r, 0] >= 0).sum()) for layer in self.layers] for r in range(b)]  # [b][L]
        chosen: dict[int, list[torch.Tensor | None]] = {}
        for row in rows:
            off, policy = int(self.offsets[row]), self._row_policy(row)
            t = seen - off
            positions = [layer.positions[row][:, layer.positions.shape[-1] - n :]
                         for layer, n in zip(self.layers, real[row], strict=True)]
            scores = []
            for i, (layer, n, pos) in enumerate(zip(self.layers, real[row], positions, strict=True)):
                w = min(policy.query_window, t)
                keys, values = layer.keys[row][:, -n:], layer.values[row][:, -n:]
                scores.append(score_layer(policy.scorer, keys, values, pos, self.queries.get(i, row)[:, -w:], t,
                                          self.attention.layers[i], self.prompt_len - off, i, ids[row],
                                          None if tokens is None else tokens[row, off:], policy.selection,
                                          (self.o_proj or {}).get(i)))
            chosen[row] = choose(policy, scores, positions, t, ids[row], self.windows)
        middle = time.perf_counter()
        for i, layer in enumerate(self.layers):
            n = layer.positions.shape[-1]
            Hkv = layer.positions.shape[1]
            kept = []
            for r in range(b):
                pick = chosen.get(r, [None] * len(self.layers))[i]
                first = n - real[r][i]  # the row's real entries are its last real[r][i] slots
                kept.append(torch.arange(first, n).expand(Hkv, -1) if pick is None else pick + first)
            width = max(k.shape[-1] for k in kept)
            if width == n and all(chosen.get(r, [None] * len(self.layers))[i] is None for r in range(b)):
                continue  # no row drops an entry of this layer and no padding can go
            slots, fill = [], []
            for k in kept:  # row by row
                extra = width - k.shape[-1]
                if extra:  # the lowest slots the row does not keep: padding first, then evicted entries
                    free = torch.ones(Hkv, n, dtype=torch.bool)
                    free.scatter_(1, k, False)
                    k = torch.cat([free.long().argsort(dim=1, descending=True, stable=True)[:, :extra], k], dim=1)
                slots.append(k)
                fill.append(extra)
            layer.compact(torch.stack(slots), self._row_policy(0).backend)
            for r, extra in enumerate(fill):
                if extra:
                    layer.positions[r, :, :extra] = torch.arange(-extra, 0)
        self._timed(start, middle)
        self.compressions.append(seen)
        for row in rows:
            self._row_compressions[row].append(seen - int(self.offsets[row]))
        if self.kept is not None:
            self.kept = self.kept or [[] for _ in range(b)]
            for row in rows:
                t = seen - int(self.offsets[row])
                held = torch.cat([p[row].reshape(-1) for p in self.positions])
                held = held[held >= 0]
                self.kept[row].append((t, torch.bincount(held, minlength=t)[:t].to(torch.int16)))


def _group(attention) -> tuple[int, int]:
    return attention.num_heads // attention.num_kv_heads, attention.qk_head_dim


def _scorer(rule, params: dict | None, budget: int | None, interval: int, selection: Selection, attention,
            limit: int) -> Scorer:
    """The checked scorer of one rule (bad input: one ArgumentError naming the argument, before any generation)."""
    scorer = rule_scorer(rule, params)
    check_live_scorer(scorer, budget, interval, *_group(attention), api=True, limit=limit)
    if selection.stochastic and not getattr(scorer, "continuous", True):
        raise ArgumentError(f"selection={selection.spec!r}: {scorer.name} has no continuous score to draw from (a "
                            "fixed order); use 'per-head' or 'per-token' for it")
    return scorer


def _checked_policy(policy: Policy, attention) -> Policy:
    """``policy`` once the model's sliding layers allow it (one ArgumentError otherwise)."""
    try:
        policy.check_model(attention)
    except UserError as err:
        raise ArgumentError(python_message(err)) from None
    return policy


def _left_padding(mask: torch.Tensor | None, b: int, P: int) -> torch.Tensor | None:
    """[b] the leading zeros of each row of ``mask [b, P]`` (None: no padding); one ArgumentError for a mask that is
    not left padding (a zero after a one, a row of padding only)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (b, P):
        raise ArgumentError(f"attention_mask: give [batch, prompt length] = [{b}, {P}] of 0 (left padding) and 1, got "
                            f"{getattr(mask, 'shape', type(mask).__name__)}")
    ones = mask.cpu() != 0
    offsets = (~ones).long().sum(dim=1)
    if not bool((ones == (torch.arange(P)[None] >= offsets[:, None])).all()):
        raise ArgumentError("attention_mask: only left padding is supported (each row: zeros, then ones); pad on the "
                            "left (tokenizer.padding_side = 'left')")
    if bool((offsets >= P).any()):
        raise ArgumentError("attention_mask: a row is all padding; give each row at least one token")
    return offsets if bool(offsets.any()) else None


def _check_mask(mask: torch.Tensor | None, offsets: torch.Tensor | None, length: int) -> None:
    """A later forward's ``attention_mask [b, length]`` must be the prompt's padding, then ones."""
    if mask is None:
        if offsets is not None:
            raise ArgumentError("attention_mask: this cache's rows are left-padded; give generate the same "
                                "attention_mask as the prompt's")
        return
    if mask.dim() != 2 or mask.shape[1] != length:
        raise ArgumentError(f"attention_mask: {list(mask.shape)} for a cache at {length} tokens")
    pad = torch.zeros(mask.shape[0], dtype=torch.long) if offsets is None else offsets
    if pad.shape[0] != mask.shape[0] or not bool(((mask.cpu() != 0) == (torch.arange(length)[None] >= pad[:, None]))
                                                 .all()):
        raise ArgumentError("attention_mask: it is not this cache's left padding followed by ones (the padding is "
                            "fixed by the prompt; a cache serves one generation)")


def _checking_prepare(prepare):
    """``model.prepare_inputs_for_generation`` that first refuses, at a ``generate`` call's first step, an
    EvictingCache that already served another generation (``EvictingCache.check_continues``): only there are the
    call's whole ``input_ids`` seen (the forwards get the uncached tail)."""

    @functools.wraps(prepare)
    def checked(input_ids, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, EvictingCache) and kwargs.get("is_first_iteration") and input_ids is not None:
            cache.check_continues(input_ids)
        return prepare(input_ids, *args, **kwargs)

    return checked


def _before_forward(model, args: tuple, kwargs: dict) -> None:
    """The model's forward pre-hook: a forward over an :class:`EvictingCache` runs kvdiag's attention and first lets
    the cache compact (before transformers sizes the masks from it)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, EvictingCache):
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens, cache.fed = kwargs["inputs_embeds"], None
        mask = kwargs.get("attention_mask")
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            raise ArgumentError("attention_mask: give a 2D mask [batch, tokens] (1: token, 0: left padding)")
        cache.before_forward(tokens.shape[1], mask, tokens.shape[0])
        cache.check_positions(tokens.shape[0], tokens.shape[1], kwargs)
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


"""Free-running replay as ``model.generate`` under :class:`~kvdiag.generate.EvictingCache` (one cache per batch,
one rule per row): the same rows, tokens and bookkeeping as :func:`~kvdiag.replay.decoding.decode_batch`.

Replay's own parts travel as a logits processor: its coupled draws (``Sampling.pick`` with each row's generator,
the token forced by masking every other one, so ``generate``'s greedy choice is that draw) and the policy's
log-probabilities (raw fp32 logits, the rows ``decode_batch`` keeps). ``compressions`` and ``active`` come from the
cache. A finished row leaves the batch as in the loop: a stopping criterion ends the ``generate`` call at the step a
row writes EOS, the finished rows are dropped from the cache (``batch_select_indices``: entries, positions, query
window, rules, fed ids) and from the inputs, and ``generate`` continues the others from the cache (it feeds only the
tokens past ``get_seq_length``, the tokens seen). Rows of one prompt share the first prefill chunk when the prompt
is prefilled in chunks (``EvictingCache.prefill``); a prompt ``generate`` prefills in one forward is run per row.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from kvdiag.generate import EvictingCache, Policy, PositionedCache, observing
from kvdiag.model.load import LoadedModel
from kvdiag.replay.decoding import Decoded, batch_args, eos_ids
from kvdiag.replay.sampling import Sampling


class ReplayDraws(LogitsProcessor):
    """Batch row ``j`` (generation ``rows[j]``) takes ``sampling.pick(scores[j], generators[rows[j]])`` (argmax when
    greedy: ``generate``'s own choice, left as is); ``logprobs[r]`` collects ``log_softmax`` of generation ``r``'s
    raw scores [V] per step when kept."""

    def __init__(self, sampling: Sampling, generators: list, keep_logprobs: bool):
        self.sampling, self.generators, self.keep = sampling, generators, keep_logprobs
        self.rows = list(range(len(generators)))  # the generation of each batch row
        self.logprobs: list[list[torch.Tensor]] = [[] for _ in generators]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.keep:
            for r, lp in zip(self.rows, torch.log_softmax(scores.float(), dim=-1).cpu(), strict=True):
                self.logprobs[r].append(lp)
        if self.sampling.greedy:
            return scores
        picks = [self.sampling.pick(scores[j].float(), self.generators[r]) for j, r in enumerate(self.rows)]
        forced = torch.full_like(scores, float("-inf"))
        forced[torch.arange(len(picks)), torch.tensor(picks)] = 0.0
        return forced


class RowEnded(StoppingCriteria):
    """Ends the ``generate`` call (every row) at the step a row writes one of ``eos``, so that the caller can drop
    the finished rows and continue the others."""

    def __init__(self, eos: set[int]):
        self.eos = torch.tensor(sorted(eos))

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        ended = torch.isin(input_ids[:, -1], self.eos.to(input_ids.device))
        return ended.any().expand(input_ids.shape[0])


@torch.no_grad()
def generate_batch(
    lm: LoadedModel, prompts: list[list[int]], policies: list[Policy | None], max_new_tokens: int = 512,
    prompt_ids: list[str] | None = None, keep_logprobs: bool = False, o_proj: dict[int, torch.Tensor] | None = None,
    sampling: Sampling | None = None, samples: list[int] | None = None, cache_out: list | None = None,
    record_kept: bool = False,
) -> list[Decoded]:
    """As :func:`~kvdiag.replay.decoding.decode_batch` (rows of one prompt length, one budget and interval or all the
    full cache), through ``model.generate``; ``cache_out`` (a list) receives the cache (benchmarks read its
    ``seconds``); ``record_kept``: each row's ``kept_counts`` (what every compaction kept, per position)."""
    b, P, prompt_ids, sampling, samples = batch_args(prompts, max_new_tokens, prompt_ids, sampling, samples)
    model, device = lm.model, lm.model.device
    if {p is None for p in policies} == {True}:
        cache = PositionedCache.for_model(model)
    elif None in policies or len({(p.budget, p.interval) for p in policies}) != 1:
        raise ValueError("one batch needs one (budget, interval) for all rows, or all the full cache")
    else:
        pol = policies[0]
        cache = EvictingCache(model, [p.scorer for p in policies], pol.budget, pol.interval, pol.selection,
                              pol.backend, pol.seed, prompt_ids=list(prompt_ids), o_proj=o_proj,
                              record_kept=record_kept)
        cache.policies = list(policies)  # each row's own policy (selection, seed) as given
    draws = ReplayDraws(sampling, [sampling.generator(pid, s) for pid, s in zip(prompt_ids, samples, strict=True)],
                        keep_logprobs)
    eos = eos_ids(lm)
    ended = StoppingCriteriaList([RowEnded(eos)])
    ids, live, results = torch.tensor(prompts, device=device), list(range(b)), [None] * b
    with observing(model):
        if isinstance(cache, EvictingCache):
            cache.prefill(ids)
        while live:  # one generate call per stretch of steps in which no row ends
            config = GenerationConfig(max_new_tokens=max_new_tokens - (ids.shape[1] - P), do_sample=False,
                                      top_k=None, top_p=None, temperature=None, eos_token_id=sorted(eos),
                                      pad_token_id=min(eos))
            out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, generation_config=config,
                                 logits_processor=LogitsProcessorList([draws]), stopping_criteria=ended)
            last, at_max = out[:, -1].tolist(), out.shape[1] - P == max_new_tokens
            staying = [j for j, token in enumerate(last) if token not in eos and not at_max]
            if len(staying) == len(live):
                raise RuntimeError(f"generate stopped at {out.shape[1] - P} of {max_new_tokens} new tokens with no "
                                   "row finished")
            for j, r in enumerate(live):  # the cache as the finished rows left it: their bookkeeping
                if j not in staying:
                    results[r] = _decoded(out[j].tolist(), P, eos, cache,
                                          draws.logprobs[r] if keep_logprobs else None, j)
            if staying:
                keep = torch.tensor(staying)
                cache.select(keep)
                live = draws.rows = [live[j] for j in staying]
                ids = out[keep.to(out.device)]
            else:
                live = []
    if cache_out is not None:
        cache_out.append(cache)
    return results


def _decoded(tokens: list[int], P: int, eos: set[int], cache, logprobs: list[torch.Tensor] | None,
             row: int) -> Decoded:
    """Batch row ``row`` of ``generate``'s output as the loop's :class:`Decoded`: cut after its first EOS, with the
    cache's bookkeeping up to its last fed position."""
    end = next((i + 1 for i in range(P, len(tokens)) if tokens[i] in eos), len(tokens))
    tokens = tokens[:end]
    stop = "eos" if tokens[-1] in eos and len(tokens) > P else "max_new_tokens"
    T = len(tokens)
    compressions = [t for t in getattr(cache, "compressions", []) if t <= T - 1]
    if isinstance(cache, EvictingCache) and cache.layers[0].seen == T - 1 and cache.due(T - 1):
        compressions.append(T - 1)  # the loop compacts after feeding T - 2, before it knows the row ends
    kept = getattr(cache, "kept", None)
    return Decoded(tokens, P, stop, cache.active[: T - 1], compressions,
                   None if logprobs is None else torch.stack(logprobs[: T - P]),
                   kept_counts=list(kept[row]) if kept else [], slots=cache.slots if kept is not None else 0)

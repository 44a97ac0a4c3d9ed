"""``kvdiag bench label --sets``: what a set row costs; ``kvdiag bench decisions``: what ``oracle_search`` costs and
gains (:func:`run_search_bench`).

``bench label --sets``: one P-token prefix of the model; batches of N rows:

- single: N rows evicting one entry each (the oracle's single labels);
- sets at keep F: N rows evicting ``t - floor(F t)`` entries each (decisions' set rows), token sets and per-head sets;
- physical: the per-set reference (``reference_set_logprobs``: copy the cache without the set, teacher-force the H
  tokens one at a time), on a few sets.

Single and set batches are timed in alternation, batch by batch (a slow spell of the shared machine hits both), and
their labels checked against the physical reference on the sets it ran.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from kvdiag.kernels.bench import seconds
from kvdiag.label.bench import bench_tokens
from kvdiag.label.engine import OracleEngine, divergences
from kvdiag.label.reference import reference_set_logprobs
from kvdiag.model.load import LoadedModel


@dataclass
class SetBenchRow:
    rows: str  # what one row evicts
    evicted: int  # entries per (layer, KV head)
    seconds_per_batch: float  # best over the repeats
    ratio_to_single: float
    max_abs_diff: float | None  # largest |kl - physical reference kl| over the checked sets (nats)


def run_set_bench(lm: LoadedModel, prefix_len: int = 512, n: int = 16, horizon: int = 16, keep: float = 0.5,
                  repeats: int = 3, physical: int = 2, backend: str = "auto", seed: int = 0) -> dict:
    """Time a batch of ``n`` single rows against a batch of ``n`` set rows (token and per-head sets at ``keep``) and
    ``physical`` sets through the per-set reference; returns the rows and the ratios."""
    ids = bench_tokens(lm, prefix_len + horizon + 1)
    t = prefix_len
    eng = OracleEngine(lm, ids, horizon, batch_size=n, backend=backend)
    ckpt = eng.checkpoint(t)
    gen = torch.Generator().manual_seed(seed)
    L, Hkv, E = eng.num_layers, eng.num_kv_heads, t - max(1, int(keep * t))
    singles = [torch.tensor([int(i)]) for i in torch.randperm(t, generator=gen)[:n]]
    tokens = [torch.randperm(t, generator=gen)[:E].sort().values for _ in range(n)]
    heads = [torch.stack([torch.randperm(t, generator=gen)[:E] for _ in range(L * Hkv)]).view(L, Hkv, E)
             for _ in range(n)]
    kinds = {"single entry": singles, f"token set (keep {keep:g})": tokens, f"per-head set (keep {keep:g})": heads}

    def batch(sets):
        return eng._divergences(ckpt, eng.set_logits(t, ckpt.prefix, sets))["kl"]

    for sets in kinds.values():  # warm-up
        batch(sets)
    best = dict.fromkeys(kinds, float("inf"))
    for r in range(repeats):
        order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
        for name in order:
            best[name] = min(best[name], seconds(lambda s=kinds[name]: batch(s), eng.ids.device))
    labels = {name: batch(sets).double().mean(1) for name, sets in kinds.items()}
    phys_time = float("inf")
    diffs = {}
    for name, sets in kinds.items():
        worst = 0.0
        for j in range(min(physical, n)):
            def reference(s=sets[j]):
                return reference_set_logprobs(lm.model, eng.ids, t, horizon, ckpt.prefix, s)
            if name != "single entry":
                phys_time = min(phys_time, seconds(reference, eng.ids.device))
            ref = divergences(ckpt.logp_full, reference()[None], ckpt.targets)["kl"].double().mean()
            worst = max(worst, abs(float(labels[name][j]) - float(ref)))
        diffs[name] = worst
    single = best["single entry"]
    rows = [SetBenchRow(name, 1 if name == "single entry" else E, sec, sec / single, diffs[name])
            for name, sec in best.items()]
    per_set = min(v for k, v in best.items() if k != "single entry") / n
    return {"rows": rows, "prefix": t, "n": n, "horizon": horizon, "keep": keep, "evicted": E,
            "physical_seconds_per_set": phys_time, "batched_seconds_per_set": per_set,
            "physical_over_batched": phys_time / per_set}


# --------------------------------------------------------------------------- oracle_search


@torch.no_grad()
def search_candidates(lm: LoadedModel, ids: torch.Tensor, t: int, horizon: int, keep: list[float],
                      rules: list[str], selection: str = "per-head", seed: int = 0) -> dict:
    """What ``kvdiag decisions`` gives ``oracle_search`` at checkpoint ``t`` of ``ids``, built without a Trace: the
    rules' sets from their scores of the teacher-forced prefix's q/k/v (``ScoreContext``, prompt = the first t/8
    tokens), ``fast`` (Fisher labels) and ``future_attention`` (the next ``horizon`` queries), per budget; every set
    labeled exactly. Returns {"engine", "visible", "per_token", "candidates": {keep: [Candidate]}, "seconds"}."""
    from kvdiag.core.selection import Selection
    from kvdiag.decisions.search import candidate, visible_entries
    from kvdiag.decisions.sets import head_label_set, label_set, rule_set
    from kvdiag.label.fast import FisherLabeler, FisherParams
    from kvdiag.scorers import ScoreContext, get_scorer
    from kvdiag.trace.reader import rebuild_layers

    began = time.perf_counter()
    sel = Selection.parse(selection)
    eng = OracleEngine(lm, ids, horizon, batch_size=16)
    L, Hkv = eng.num_layers, eng.num_kv_heads
    visible = visible_entries(eng.attention.layers, t)
    window = None if bool(visible.all()) or sel.per_token else visible
    layers = rebuild_layers(lm, ids[: t + horizon], torch.float32)
    values = {}
    for name in rules:
        rule = get_scorer(name)
        values[name] = torch.stack([rule.scores(ScoreContext(
            layer["q"][:, :t], layer["k"][:, :t], layer["v"][:, :t], lm.attention.layers[l], max(1, t // 8), l,
            "bench", ids[:t])).double() for l, layer in enumerate(layers)])
    a, _ = FisherLabeler(lm, ids, horizon, FisherParams(), seed).effects(t)
    values["fast"] = a.double().sum((1, 2)).pow(2).mean(0) if sel.per_token else a.double().pow(2).mean(0)
    from kvdiag.model.attention import attention_rows

    pos = torch.arange(t, t + horizon)
    values["future_attention"] = torch.stack([
        attention_rows(layer["q"][:, pos], layer["k"], pos, lm.attention.layers[l], key_limit=t).double()
        .view(Hkv, -1, t).sum(1) for l, layer in enumerate(layers)])
    if sel.per_token:
        values["future_attention"] = values["future_attention"].sum((0, 1))
    out = {}
    for f in keep:
        kept = max(1, math.floor(f * t))
        sets = {}
        for name, v in values.items():
            if name in rules:
                sets[name] = rule_set(v, kept, sel, visible=window)
            else:
                sets[name] = label_set(v, kept) if sel.per_token else head_label_set(v, kept, window)
        res, _ = eng.label_sets(t, list(sets.values()))
        out[f] = [candidate(name, evict, {key: val[j] for key, val in res.items()}, L, Hkv, t)
                  for j, (name, evict) in enumerate(sets.items())]
    return {"engine": eng, "visible": visible, "per_token": sel.per_token, "candidates": out,
            "seconds": time.perf_counter() - began}


def quarters(history: list[tuple[int, float, float]]) -> list[dict]:
    """The convergence curve of one search (``Searched.history``: (steps, seconds, best label) after each step): the
    best label after R, R/4, R/16, ... steps (R the steps taken; down to the first step), fewest steps first, each
    with the share of it the 4x more steps after it took off (``gain``; None for the last): the convergence rule's
    figure at every 4x of the effort, not only at the end. The keys keep the JSON's name ``rows``."""
    from kvdiag.decisions.search import after, gain

    rows = history[-1][0]
    first = next((r for r, _, _ in history if r > 0), rows)
    out: list[dict] = []
    at = float(rows)
    while True:
        r, sec, kl = after(history, at)
        out.append({"rows": r, "seconds": sec, "kl": kl, "gain": None})
        at /= 4
        if at < first or at < 1:  # below the first step (or no steps at all): nothing earlier to compare with
            break
    for later, earlier in zip(out, out[1:], strict=False):  # each entry with the one 4x fewer rows before it
        earlier["gain"] = gain(earlier["kl"], later["kl"])
    return out[::-1]


def run_search_bench(lm: LoadedModel, prefix_len: int = 640, horizon: int = 16, keep: tuple[float, ...] = (0.5,),
                     rules: tuple[str, ...] = ("snapkv", "tova", "h2o", "streamingllm", "knorm"), rows: int = 512,
                     seconds: float = 120.0, scale: int = 4, selection: str = "per-head") -> dict:
    """``oracle_search`` at one checkpoint ``prefix_len`` of real text per budget, at the effort (``rows``,
    ``seconds``) and at ``scale`` times it: rows, seconds, its joint label and its improvement over the best
    candidate (is the search converged?)."""
    ids = bench_tokens(lm, prefix_len + horizon + 1)
    built = search_candidates(lm, ids, prefix_len, horizon, list(keep), list(rules), selection)
    from kvdiag.decisions.search import search

    out = []
    for f, cands in built["candidates"].items():
        labels = {c.name: float(c.label["kl"].double().mean()) for c in cands}
        best = min(labels, key=labels.get)
        for effort in (1, scale):
            # the 1x search stops where decisions' would (converged, or its bounds); the scaled one spends its
            # whole effort, so what it takes off the 1x label is the convergence check
            found = search(built["engine"], prefix_len, cands, built["per_token"], rows * effort, seconds * effort,
                           built["visible"], stop=effort == 1)
            kl = float(found.label["kl"].double().mean())
            out.append({"keep": f, "effort": effort, "rows_limit": rows * effort, "rows": found.rows,
                        "seconds": found.seconds, "converged": found.converged, "start": found.start,
                        "history": [list(h) for h in found.history], "quarters": quarters(found.history),
                        "start_kl": labels[best], "reconstruction_kl": found.reconstruction, "kl": kl,
                        "improvement": labels[best] - kl, "relative": (labels[best] - kl) / labels[best]
                        if labels[best] > 0 else float("nan"), "candidates": labels})
    return {"model": lm.spec, "prefix": prefix_len, "horizon": horizon, "selection": selection, "rules": list(rules),
            "setup_seconds": round(built["seconds"], 3), "rows": out}

"""``kvdiag bench label --sets``: what a set row costs. One P-token prefix of the model; batches of N rows:

- single: N rows evicting one entry each (the oracle's single labels);
- sets at keep F: N rows evicting ``t - floor(F t)`` entries each (decisions' set rows), token sets and per-head sets;
- physical: the per-set reference (``reference_set_logprobs``: copy the cache without the set, teacher-force the H
  tokens one at a time), on a few sets.

Single and set batches are timed in alternation, batch by batch (a slow spell of the shared machine hits both), and
their labels checked against the physical reference on the sets it ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdiag.kernels.bench import seconds
from kvdiag.label.bench import bench_tokens
from kvdiag.label.engine import OracleEngine, divergences
from kvdiag.label.reference import reference_set_logprobs
from kvdiag.models import LoadedModel


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

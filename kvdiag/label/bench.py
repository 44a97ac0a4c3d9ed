"""``kvdiag bench label``: the oracle engine vs the naive per-candidate loop and a plain batched forward.

All three label (or, for the ceiling, merely run) the same N candidates x H teacher-forced tokens over
one P-token prefix of the same model, in one process, so their ratio is meaningful on a noisy machine:

- engine: ``OracleEngine`` rows through the shared-prefix kernel (prefix never copied per row),
  plus the null row and the KL/JS/NLL/flips of every row;
- naive: what a careful user writes with transformers alone: per candidate, copy the cache, delete
  the entry in every layer, teacher-force the H tokens in one forward with explicit positions, KL;
- plain: the N x H tokens in one batched forward of the stock model (SDPA, a DynamicCache holding the
  prefix expanded to N rows) with no eviction and no KL: the practical ceiling.

The full-cache run through the checkpoint and the horizon (prefix K/V and P_full: ``OracleEngine.golden``)
is shared by the three methods and not timed.

``granularity`` layer or head (``run_layer_start_bench``): the same N positions x L layers (x KV heads) rows,
labeled by the engine with layer start (each row runs from the layer it evicts from) and without it (every
row runs the full depth: the method before layer start), timed batch by batch in alternation, with the
largest difference of their labels.

Every row carries the matmul FLOPs its method executes (``kvdiag.trace.cost.ModelShape.row_flops``: N x H tokens over
the P-token prefix, the engine's null row included, layer-start rows from their start layer), so the CLI prints
achieved FLOP/s and MFU against the matmul peak it measures in the same run (``kvdiag.kernels.peak``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from kvdiag.core.schema import CHUNK
from kvdiag.kernels.bench import best_seconds, cpu_peak_probe, peak_mb, seconds
from kvdiag.label.engine import OracleEngine, Row, cache_from_prefix, candidate_rows, divergences
from kvdiag.model.load import LoadedModel
from kvdiag.tasks.prompts import arith_prompts
from kvdiag.trace.cost import ModelShape


@dataclass
class LabelBenchRow:
    method: str
    seconds: float
    tokens_per_s: float
    peak_mb: float | None
    flops: float | None = None  # matmul FLOPs of one run (kvdiag.trace.cost), None where not counted

    @property
    def flops_per_s(self) -> float | None:
        return None if self.flops is None else self.flops / self.seconds


LABEL_METHODS = ("engine", "naive", "plain")


def bench_tokens(lm: LoadedModel, n: int) -> torch.Tensor:
    """``n`` real text tokens: builtin problems concatenated (teacher-forced, so no generation needed)."""
    ids: list[int] = []
    k = 8
    while len(ids) < n:
        ids = lm.tokenizer(" ".join(p.text for p in arith_prompts(k))).input_ids
        k *= 2
    return torch.tensor(ids[:n])


@torch.no_grad()
def naive_label(eng: OracleEngine, t: int, positions: list[int]) -> torch.Tensor:
    """Per candidate: copy + delete in every layer + one H-token forward with explicit positions -> kl [N, H]."""
    model, H = eng.model, eng.horizon
    prefix, logp_full = eng.golden(t)
    pos = torch.arange(t, t + H, device=eng.ids.device)[None]
    kls = []
    for i in positions:
        keep = torch.arange(t, device=eng.ids.device) != i
        cache = cache_from_prefix(model.config, [(k[:, keep], v[:, keep]) for k, v in prefix])  # indexing copies
        logits = model(eng.ids[None, t : t + H], cache=cache, position_ids=pos, use_cache=True).logits
        kls.append(divergences(logp_full, logits, eng.ids[t + 1 : t + H + 1])["kl"])
    return torch.cat(kls)


@torch.no_grad()
def plain_forward(eng: OracleEngine, t: int, n: int) -> torch.Tensor:
    """The ceiling: N x H tokens, one batched stock forward over the prefix expanded to N rows, log-softmax."""
    H = eng.horizon
    prefix, _ = eng.golden(t)
    pos = torch.arange(t, t + H, device=eng.ids.device)[None].expand(n, -1)
    logits = eng.model(eng.ids[None, t : t + H].expand(n, -1), cache=cache_from_prefix(eng.model.config, prefix, n),
                       position_ids=pos, use_cache=True).logits
    return torch.log_softmax(logits.float(), -1)


def run_label_bench(lm: LoadedModel, prefix_len: int = 512, n: int = 64, horizon: int = 16, repeats: int = 3,
                    batch_size: int | None = None, backend: str = "auto",
                    methods: tuple[str, ...] = LABEL_METHODS) -> list[LabelBenchRow]:
    """Time the three methods (best of ``repeats``) and their peak extra memory; see the module docstring.
    ``methods``: a subset of ``LABEL_METHODS`` (the GPU check skips the plain forward where the prefix expanded to
    N rows would not fit)."""
    ids = bench_tokens(lm, prefix_len + horizon + 1)
    eng = OracleEngine(lm, ids, horizon, batch_size or n, backend)
    t = prefix_len
    eng.golden(t)  # the full-cache run (prefix K/V and P_full) is shared by every method; not timed
    positions = torch.linspace(0, t - 1, n).long().tolist()
    rows = [Row(p) for p in positions]
    device = torch.device(lm.device)
    row = ModelShape.from_config(lm.model.config).row_flops(t, horizon)
    table = {
        "engine": ("engine (shared prefix, batched)", lambda: eng.label(t, rows), (n + 1) * row),  # + the null row
        "naive": ("naive per-candidate loop", lambda: naive_label(eng, t, positions), n * row),
        "plain": ("plain batched forward (no eviction)", lambda: plain_forward(eng, t, n), n * row),
    }
    chosen = {table[m][0]: table[m][1:] for m in methods}
    probe = cpu_peak_probe() if device.type == "cpu" else None
    best = best_seconds({name: fn for name, (fn, _) in chosen.items()}, device, repeats)
    return [LabelBenchRow(name, best[name], n * horizon / best[name], peak_mb(fn, device, probe), flops)
            for name, (fn, flops) in chosen.items()]


@dataclass
class HorizonBench:
    """The exact engine on the same N token rows at a base horizon and at a long one (chunked)."""

    horizons: list[int]  # [base, long]
    rows: list[LabelBenchRow]  # per horizon: best seconds of labeling the N rows, peak extra MB
    chunk: int
    plans: list[tuple[int, int]]  # per horizon: (rows per forward, steps per chunk): ``OracleEngine.plan``
    max_abs_diff: float  # largest |kl_steps(long)[:base] - kl_steps(base)|: the long run's first steps are the base's

    @property
    def cost_ratio(self) -> float:
        """Cost per labeled entry at the long horizon / at the base one (linear in H: long / base)."""
        return self.rows[1].seconds / self.rows[0].seconds

    @property
    def peak_ratio(self) -> float | None:
        base, long = (r.peak_mb for r in self.rows)
        return None if base is None or long is None or base <= 0 else long / base


def run_horizon_bench(lm: LoadedModel, prefix_len: int = 512, n: int = 64, horizon: int = 256, base: int = 16,
                      repeats: int = 3, batch_size: int | None = None, backend: str = "auto",
                      chunk: int = CHUNK) -> HorizonBench:
    """Label the same ``n`` token rows of one P-token prefix at horizon ``base`` and at ``horizon`` (chunks of
    ``chunk`` steps): best of ``repeats`` (round-robin) and the peak extra memory of each (the full-cache runs are
    shared work and not timed). The first ``base`` steps of the long labels are compared to the base labels."""
    ids = bench_tokens(lm, prefix_len + horizon + 1)
    t = prefix_len
    rows = [Row(p) for p in torch.linspace(0, t - 1, n).long().tolist()]
    engines = {h: OracleEngine(lm, ids, h, batch_size or n, backend, chunk=chunk) for h in (base, horizon)}
    for eng in engines.values():
        eng.golden(t)
    plans = {h: eng.plan(eng.checkpoint(t, layer_inputs=False)) for h, eng in engines.items()}
    names = {h: f"engine, H={h} ({rows} rows x {steps} steps per forward)" for h, (rows, steps) in plans.items()}
    fns = {names[h]: functools.partial(eng.label, t, rows) for h, eng in engines.items()}
    device = torch.device(lm.device)
    best = best_seconds(fns, device, repeats)
    probe = cpu_peak_probe() if device.type == "cpu" else None
    shape = ModelShape.from_config(lm.model.config)
    out, labels = [], {}
    for h, eng in engines.items():
        peak = peak_mb(lambda h=h, eng=eng: labels.__setitem__(h, eng.label(t, rows)[0]["kl"]), device, probe)
        out.append(LabelBenchRow(names[h], best[names[h]], n * h / best[names[h]], peak,
                                 (n + 1) * shape.row_flops(t, h)))
    diff = float((labels[horizon][:, :base] - labels[base]).abs().max())
    return HorizonBench([base, horizon], out, chunk, [plans[base], plans[horizon]], diff)


@dataclass
class LayerStartBench:
    rows: list[LabelBenchRow]  # layer start, full depth (seconds: the best of the repeats' totals)
    labeled: int  # rows labeled per run
    ratios: list[float]  # full depth / layer start, per repeat
    max_abs_diff: float  # largest |kl_steps(layer start) - kl_steps(full depth)|
    max_rel_diff: float  # the same relative to max(|kl|, 1e-6)


def run_layer_start_bench(lm: LoadedModel, granularity: str, prefix_len: int = 512, n: int = 8, horizon: int = 16,
                          repeats: int = 3, batch_size: int | None = None, backend: str = "auto") -> LayerStartBench:
    """Layer start vs full depth on the same ``granularity`` rows of ``n`` positions, both in batches of ``n`` rows
    (layer start batches the rows of one layer: N per layer), so they run the same batch shapes.

    The two methods have the same number of batches. They are timed batch by batch, alternating (batch i of one,
    then batch i of the other, the first one swapping every batch), so a slow spell of a shared machine, which lasts
    seconds to minutes, falls on both: timing each method's whole run in turn let such spells move the ratio by
    +-20%. The checkpoint's shared work (the full-cache run and the null row) is done once per method and not timed.
    Each method then labels all rows once through ``OracleEngine.label`` for its peak memory and the labels compared."""
    batch_size = batch_size or n
    ids = bench_tokens(lm, prefix_len + horizon + 1)
    engines = {
        "layer start (from the evicted layer)": OracleEngine(lm, ids, horizon, batch_size, backend, layer_start=True),
        "full depth (before layer start)": OracleEngine(lm, ids, horizon, batch_size, backend, layer_start=False),
    }
    t = prefix_len
    positions = torch.linspace(0, t - 1, n).long().tolist()
    first = next(iter(engines.values()))
    rows = candidate_rows(positions, granularity, first.num_layers, first.num_kv_heads)
    runs = []  # per method: one batch's work per entry, in the engine's batch order
    for eng in engines.values():
        ckpt = eng.checkpoint(t)
        runs.append([functools.partial(eng.label_batch, ckpt, [rows[j] for j in batch], start)
                     for start, batch in eng.batches(rows)])
    if len({len(r) for r in runs}) != 1:
        raise RuntimeError("layer start and full depth split the rows into different numbers of batches")
    device = torch.device(lm.device)
    runs[0][0](), runs[1][0]()  # warm-up
    totals = []
    for _ in range(repeats):
        total = [0.0, 0.0]
        for i, pair in enumerate(zip(*runs, strict=True)):
            for m in (0, 1) if i % 2 == 0 else (1, 0):
                total[m] += seconds(pair[m], device)
        totals.append(total)
    probe = cpu_peak_probe() if device.type == "cpu" else None
    labels, peaks = [], []
    for eng in engines.values():
        peaks.append(peak_mb(lambda eng=eng: labels.append(eng.label(t, rows)[0]["kl"].double()), device, probe))
    diff = (labels[0] - labels[1]).abs()
    best = [min(tot[m] for tot in totals) for m in (0, 1)]
    shape = ModelShape.from_config(lm.model.config)
    flops = [sum(shape.row_flops(t, horizon, eng.start_layer(r)) for r in rows) for eng in engines.values()]
    return LayerStartBench([LabelBenchRow(name, best[m], len(rows) * horizon / best[m], peaks[m], flops[m])
                            for m, name in enumerate(engines)], len(rows), [full / start for start, full in totals],
                           float(diff.max()), float((diff / labels[1].abs().clamp_min(1e-6)).max()))


@dataclass
class FastBench:
    rows: list[LabelBenchRow]  # exact (N candidates), fast (every entry [0, P))
    labeled: list[int]  # entries labeled per run, per method
    spearman: float  # fast vs exact kl_mean on the exact method's N candidates


def run_fast_bench(lm: LoadedModel, method: str = "fisher", prefix_len: int = 512, n: int = 64, horizon: int = 16,
                   repeats: int = 3, batch_size: int = 64, backend: str = "auto", seed: int = 0,
                   **params) -> FastBench:
    """Cost per labeled entry: the exact engine on ``n`` token rows vs approximate ``method`` (or ``hybrid``: Fisher
    for every entry, exact for its top M and an audit sample) on every entry of the same P-token prefix, same
    model, tokens and horizon."""
    from kvdiag.core.stats import spearman
    from kvdiag.label.fast import APPROXIMATE
    from kvdiag.label.hybrid import HybridLabeler, HybridParams

    labeler_cls, params_cls = {**APPROXIMATE, "hybrid": (HybridLabeler, HybridParams)}[method]
    ids = bench_tokens(lm, prefix_len + horizon + 1)
    eng = OracleEngine(lm, ids, horizon, batch_size, backend)
    approx = labeler_cls(lm, ids, horizon, params_cls(**params), seed)
    t = prefix_len
    eng.golden(t), approx.golden(t)  # the full-cache run is shared by both; not timed
    positions = torch.linspace(0, t - 1, n).long().tolist()
    exact_rows, all_rows = [Row(p) for p in positions], [Row(p) for p in range(t)]
    methods = {"exact (oracle engine, N candidates)": lambda: eng.label(t, exact_rows),
               f"{method} (every entry [0, P), one pass)": lambda: approx.label(t, all_rows)}
    device = torch.device(lm.device)
    probe = cpu_peak_probe() if device.type == "cpu" else None
    best = best_seconds(methods, device, repeats)
    labeled = [len(exact_rows), len(all_rows)]
    got = torch.as_tensor(approx.label(t, all_rows)["kl"])[positions]
    rho = spearman(eng.label(t, exact_rows)[0]["kl"].mean(1).numpy(), got.numpy())
    return FastBench([LabelBenchRow(name, best[name], k * horizon / best[name], peak_mb(fn, device, probe))
                      for (name, fn), k in zip(methods.items(), labeled, strict=True)], labeled, rho)


@dataclass
class MissRateBench:
    """``--method hybrid --miss-rate R`` on C windows of real text (checkpoint P each): the Fisher ranking's frontier
    (exact share -> measured top-decile miss rate, cost) and the rounds' outcome, against exact labels of every
    entry. Cost: seconds of the Fisher pass of every entry + the exact share x seconds of exact labels of every
    entry, over the latter (the exact rows a hybrid labels cost what the same rows cost in the all-exact run)."""

    checkpoints: int
    prefix: int
    horizon: int
    exact_seconds: float  # exact labels of every entry of every window (the full-cache runs not timed)
    fast_seconds: float  # the Fisher pass over every entry of every window
    frontier: list[dict]  # per exact share: share, missed, harmful, miss_rate, per_checkpoint, cost
    control: dict  # the rounds' record (adaptive.Control.as_dict + measured miss rate, cost), or why none ran
    spearman: float  # Fisher vs exact kl_mean, pooled


def run_miss_rate_bench(lm: LoadedModel, prefix_len: int = 512, checkpoints: int = 3, horizon: int = 16,
                        target: float = 0.05, exact_frac: float = 0.1, samples: int = 8, batch_size: int = 64,
                        backend: str = "auto", seed: int = 0) -> MissRateBench:
    """Exact labels and the Fisher estimate of every entry of ``checkpoints`` windows of P + H + 1 tokens (disjoint
    stretches of the builtin problems' text), timed; then the frontier of the Fisher ranking (exact top shares 0.05 ..
    1) and the rounds of ``kvdiag.label.adaptive`` with the minimum audit (seeded), both read off the exact labels."""
    from kvdiag.core.stats import spearman
    from kvdiag.label import adaptive
    from kvdiag.label.fast import FisherLabeler, FisherParams

    span = prefix_len + horizon + 1
    text = bench_tokens(lm, checkpoints * span)
    device = torch.device(lm.device)
    exact, fast, exact_s, fast_s = [], [], 0.0, 0.0
    rows = [Row(p) for p in range(prefix_len)]
    for c in range(checkpoints):
        ids = text[c * span : (c + 1) * span]
        eng = OracleEngine(lm, ids, horizon, batch_size, backend)
        eng.golden(prefix_len)  # shared work, not timed (as in every bench of this module)
        out: dict = {}
        exact_s += seconds(lambda eng=eng, out=out: out.__setitem__("e", eng.label(prefix_len, rows)[0]), device)
        exact.append(out["e"]["kl"].double().mean(1).numpy())
        fisher = FisherLabeler(lm, ids, horizon, FisherParams(samples), seed)
        fisher.golden(prefix_len)
        fast_s += seconds(lambda f=fisher, out=out: out.__setitem__("f", f.label(prefix_len, rows)), device)
        fast.append(out["f"]["kl"].double().numpy())
    n = checkpoints * prefix_len

    def cost(share: float) -> float:
        return (fast_s + share * exact_s) / exact_s

    frontier = []
    for share in adaptive.shares(adaptive.STEP):
        tops = []
        for f in fast:
            top = np.zeros(prefix_len, bool)
            top[adaptive.top_rows(f, share)] = True
            tops.append(top)
        got = sum(int(t.sum()) for t in tops) / n
        frontier.append({"share": got, **adaptive.measured_miss(exact, tops), "cost": cost(got)})
    first = [math.ceil(exact_frac * prefix_len)] * checkpoints
    rests = [prefix_len - m for m in first]
    need = adaptive.min_audit(target, sum(rests), n, exact_frac)
    control: dict = {"target": target, "exact_frac": exact_frac, "min_audit": need, "candidates": n}
    if need > sum(rests):
        control["refused"] = (f"an audit of {need} entries is needed to bound the miss rate below {target}, more than "
                              f"the {sum(rests)} outside the first exact top: the lowest cost any audit allows is "
                              "every entry exact")
    else:
        gen = np.random.default_rng(seed)
        ckpts = []
        for f, e, m, a in zip(fast, exact, first, adaptive.allot(need, rests), strict=True):
            top = np.zeros(prefix_len, bool)
            top[np.argsort(-f, kind="stable")[:m]] = True
            audit = np.zeros(prefix_len, bool)
            audit[gen.choice(np.flatnonzero(~top), a, replace=False)] = True
            ckpts.append(adaptive.Checkpoint(f, np.where(top | audit, e, np.nan), top, audit))
        ctl = adaptive.control(ckpts, target, exact_frac, lambda asks: [exact[i][r] for i, r in asks]).as_dict()
        measured = adaptive.measured_miss(exact, [c.top | c.audit for c in ckpts])
        control.update(ctl, **measured, cost=cost(ctl["exact_share"]))
    rho = spearman(np.concatenate(fast), np.concatenate(exact))
    return MissRateBench(checkpoints, prefix_len, horizon, exact_s, fast_s, frontier, control, rho)

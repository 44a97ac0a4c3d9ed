"""The cost / miss-rate frontier on the decisions checkpoints (10 MATH-500 prompts of SmolLM2, 6,546 entries, H = 8),
from the committed exact and fast (Fisher, K = 8) labels of every entry (inputs/): no model runs.

- the Fisher ranking alone: each checkpoint's top share s by Fisher label labeled exactly, s = 0.05 .. 1; the miss
  rate measured against the exact labels (harmful: the pooled top decile, ``kvdiag.label.adaptive``);
- ``--miss-rate R`` (``kvdiag.label.adaptive.control``) from ``--exact-frac 0.1`` with the minimum audit, over 20
  audit seeds: the exact share it needed (audit included), its bound and the miss rate measured;
- cost: the exact share plus the Fisher pass, as a share of exact labels of every entry. The Fisher pass's share,
  FISHER_COST, is read off the committed cost benches (bench-hybrid-{0.1,0.2}.json: hybrid's cost minus its exact
  share, 0.052 and 0.036 of exact at H = 8, P = 512): the larger.

At H = 16 and H = 128 (``horizon_frontier``): the same frontier and ``--miss-rate R`` on every entry of
reports/fast-labels-horizon's 20 checkpoints (exact labels to H = 128, fast labels at H = 16 and H = 128: its
inputs/), for each estimator of each target: the fast label at the target's horizon, and for H = 128 also the exact
label at H = 16 and the fast label at H = 16. An estimator's cost is read off the committed benches: the fast pass's
share of exact labels of every entry (fast-labels-horizon's bench-h{16,128}.json ``ratio``) and exact H = 16 over
exact H = 128 per entry (reports/bench's label-horizon-n16-h128.json, 1 / ``cost_ratio_per_entry``).

The smallest share whose measured miss rate is at most 5 % is searched on the labels it is measured on (in-sample:
optimistic), so each is also held out (:func:`held_out`): 2-fold by prompt, the share chosen on one half of the
prompts and measured on the other, and swapped.

Run from the repository root: .venv/bin/python reports/hybrid-labels-math500/miss_rate.py (writes miss-rate.md).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.io import read_table
from kvdiag.core.stats import PromptBootstrap
from kvdiag.core.tables import ci_text, md_table, number_text
from kvdiag.label import adaptive

HERE = Path("reports/hybrid-labels-math500")
HORIZON = Path("reports/fast-labels-horizon")
HORIZON_BENCH = Path("reports/bench/label-horizon-n16-h128.json")
TARGET_MISS = 0.05
FINE = [i / 100 for i in range(1, 101)]  # the shares searched for the smallest that meets TARGET_MISS
KEY = ["prompt_id", "checkpoint", "position"]
TARGETS = (0.05, 0.1, 0.2)
SEEDS = 20
N_BOOT = 1000  # cluster-bootstrap replicates of a reached miss rate
FIRST = 0.1
FOLD_SEED = 0  # the 2-fold split of the prompts that holds the share's choice out of its measurement
HELD_OUT = (  # how the lines that reach TARGET_MISS are made, in-sample and held out (:func:`held_out`)
    "In-sample: the share is searched on the labels its miss rate is measured on, so it is optimistic. Held out: "
    f"the prompts split in two halves (a shuffle with seed {FOLD_SEED}), the share searched the same way on one "
    "half (harmful: that half's pooled top decile) and measured on the other (its own top decile), then the halves "
    "swapped; the two shares chosen, and over both measured halves the exact share, missed / harmful and the miss "
    f"rate with its 95 % cluster-bootstrap CI over prompts (B = {N_BOOT:,}, each half resampled on its own, the "
    "chosen shares held: the CI leaves out the choice's own variation)."
)


def fisher_cost(here: Path) -> float:
    """The Fisher pass's cost per entry over exact's: the larger of the committed hybrid benches' (hybrid's ratio minus
    the exact share it labeled: the top ceil(F P) and the audit)."""
    out = []
    for f in sorted(here.glob("bench-hybrid-*.json")):
        b = json.loads(f.read_text())
        p = b["params"]
        out.append(b["ratio"] - (math.ceil(p["exact_frac"] * b["prefix"]) + p["audit"]) / b["prefix"])
    return max(out)


def main(inputs: Path = HERE / "inputs", out: Path = HERE) -> str:
    exact = read_table(inputs / "smollm2-labels-all.parquet")[0].filter(pl.col("granularity") == "token")
    fast = read_table(inputs / "smollm2-fast-all.parquet")[0].select(*KEY, fast="kl_mean")
    df = exact.select(*KEY, "kl_mean").join(fast, on=KEY).sort(KEY)
    assert df.height == exact.height, "every exact row has its fast label"
    groups = [g for _, g in df.group_by("prompt_id", "checkpoint", maintain_order=True)]
    e = [g["kl_mean"].to_numpy() for g in groups]
    f = [g["fast"].to_numpy() for g in groups]
    n = sum(len(x) for x in e)
    cost0 = fisher_cost(out)

    pooled = ranking_frontier(groups, "fast", "kl_mean", pooled=True)
    rows = []
    for (got, m), (share, p) in zip(ranking_frontier(groups, "fast", "kl_mean"), pooled, strict=True):
        per = np.array(m["per_checkpoint"])
        rows.append([number_text(got, 3), number_text(cost0 + got, 3), f"{m['missed']} / {m['harmful']}",
                     number_text(m["miss_rate"], 3), f"{number_text(float(np.median(per)), 2)} "
                     f"[{number_text(float(per.min()), 2)}, {number_text(float(per.max()), 2)}]",
                     f"{number_text(share, 3)}: {p['missed']} / {p['harmful']}"])
    frontier = md_table(["exact share", "cost / exact", "missed / harmful", "miss rate",
                         "per checkpoint: median [min, max]", "pooled ranking: exact share: missed / harmful"],
                        rows, "rrrrrr")

    control = control_table(e, f, cost0)
    reach = []
    for pooled, name in ((False, "per checkpoint"), (True, "pooled")):
        hit, where = first_reach(groups, "fast", "kl_mean", pooled)
        reach.append(f"- {name}: in-sample, a measured miss rate <= {TARGET_MISS} from {where}, cost "
                     f"{number_text(cost0 + hit, 3)}; {held_out(groups, 'fast', 'kl_mean', pooled, cost0)}.")
    k = adaptive.harmful_count(n)
    text = (
        "# Cost / miss-rate frontier (SmolLM2, the decisions checkpoints, H = 8)\n\n"
        f"[miss_rate.py](miss_rate.py) from the committed exact and Fisher (K = 8) labels of every entry (`inputs/`): "
        f"{len(e)} checkpoints (one per prompt), {n:,} entries, harmful: the pooled top decile ({k} entries, "
        "`kvdiag.label.adaptive`); missed: harmful and not labeled exactly. Cost: the exact share plus the Fisher "
        f"pass ({number_text(cost0, 3)} of exact labels of every entry, the larger of the committed cost benches' "
        "`bench-hybrid-*.json`), as a share of exact labels of every entry. 10 checkpoints: the frontier's rows "
        "have no CI (the per-checkpoint column shows the spread); the lines that reach the target give 95 % "
        "cluster-bootstrap CIs over prompts.\n\n"
        "## The Fisher ranking alone (no audit: the miss rate is measured here, not bounded)\n\n"
        f"The smallest exact share (steps of 0.01) whose measured miss rate is at most {TARGET_MISS}. {HELD_OUT}\n\n"
        + "\n".join(reach) + f"\n\n{frontier}\n\n"
        f"## `--miss-rate R` from `--exact-frac {FIRST}` with the minimum audit ({SEEDS} audit seeds)\n\n"
        "The rounds add 0.05 of every checkpoint's candidates to its exact top until the bound (one-sided "
        "Clopper-Pearson, 95 % with Bonferroni over the rounds) is below R; the exact share includes the audit.\n\n"
        f"{control}\n\n"
        f"{horizon_frontier(HORIZON)}"
    )
    (out / "miss-rate.md").write_text(text)
    return text


def control_table(e: list[np.ndarray], f: list[np.ndarray], cost0: float) -> str:
    """``--miss-rate R`` (``adaptive.control``) from ``--exact-frac FIRST`` with the minimum audit over SEEDS audit
    seeds, on exact labels ``e`` and fast labels ``f`` of every entry (per checkpoint [n]): the audit, the exact share
    it needed, its cost (plus the fast pass ``cost0``), the bound and the miss rate measured against ``e``."""
    n = sum(len(x) for x in e)
    rests = [len(x) - math.ceil(FIRST * len(x)) for x in e]
    rows = []
    for target in TARGETS:
        need = adaptive.min_audit(target, sum(rests), n, FIRST)
        shares, misses, bounds = [], [], []
        for seed in range(SEEDS):
            rng = np.random.default_rng(seed)
            ckpts = []
            for x, y, a in zip(f, e, adaptive.allot(need, rests), strict=True):
                top = np.zeros(len(x), bool)
                top[adaptive.top_rows(x, FIRST)] = True
                audit = np.zeros(len(x), bool)
                audit[rng.choice(np.flatnonzero(~top), a, replace=False)] = True
                ckpts.append(adaptive.Checkpoint(x, np.where(top | audit, y, np.nan), top, audit))
            ctl = adaptive.control(ckpts, target, FIRST, lambda asks: [e[i][r] for i, r in asks]).as_dict()
            shares.append(ctl["exact_share"])
            bounds.append(ctl["bound"])
            misses.append(adaptive.measured_miss(e, [c.top | c.audit for c in ckpts])["miss_rate"])
        q = np.quantile
        rows.append([number_text(target, 2), f"{need:,} ({number_text(need / n, 3)})",
                     f"{number_text(float(np.median(shares)), 3)} [{number_text(float(min(shares)), 3)}, "
                     f"{number_text(float(max(shares)), 3)}]",
                     number_text(cost0 + float(np.median(shares)), 3),
                     f"{number_text(float(np.median(bounds)), 3)}",
                     f"{number_text(float(np.median(misses)), 3)} [{number_text(float(q(misses, 0)), 3)}, "
                     f"{number_text(float(q(misses, 1)), 3)}]"])
    return md_table(["R", "audit (share)", "exact share: median [min, max]", "cost / exact (median)",
                     "bound (median)", "measured miss rate: median [min, max]"], rows, "rrrrrr")


def exact_tops(x: list[np.ndarray], share: float, pooled: bool) -> list[np.ndarray]:
    """Per checkpoint, the entries labeled exactly (bool [n]): each checkpoint's top ``share`` of estimates ``x``, or
    (``pooled``) the top ``share`` of every checkpoint's entries together, as harmful is defined."""
    if pooled:
        thr = np.sort(np.concatenate(x))[-math.ceil(share * sum(len(v) for v in x))]
        return [v >= thr for v in x]
    tops = []
    for v in x:
        top = np.zeros(len(v), bool)
        top[adaptive.top_rows(v, share)] = True
        tops.append(top)
    return tops


def ranking_frontier(groups: list[pl.DataFrame], est: str, target: str, pooled: bool = False,
                     grid: list[float] | None = None) -> list[tuple[float, dict]]:
    """(exact share, ``adaptive.measured_miss``) for each share of ``grid`` (default ``adaptive.shares``, steps of
    0.05): :func:`exact_tops` by ``est`` labeled exactly, harmful the pooled top decile of ``target``."""
    e = [g[target].to_numpy() for g in groups]
    x = [g[est].to_numpy() for g in groups]
    n = sum(len(v) for v in e)
    out = []
    for share in grid or adaptive.shares(adaptive.STEP):
        tops = exact_tops(x, share, pooled)
        out.append((sum(int(t.sum()) for t in tops) / n, adaptive.measured_miss(e, tops)))
    return out


def first_reach(groups: list[pl.DataFrame], est: str, target: str, pooled: bool) -> tuple[float, str]:
    """The smallest nominal share of ``FINE`` whose measured miss rate (:func:`ranking_frontier`) is at most
    ``TARGET_MISS``: its exact share, and a text of that share, missed / harmful and the miss rate with its 95 %
    cluster-bootstrap CI over prompts (B = N_BOOT; the exact set held, the harmful decile re-derived in each
    replicate)."""
    got, m, share = next((got, m, share) for (got, m), share in zip(
        ranking_frontier(groups, est, target, pooled, FINE), FINE, strict=True) if m["miss_rate"] <= TARGET_MISS)
    e = [g[target].to_numpy() for g in groups]
    tops = exact_tops([g[est].to_numpy() for g in groups], share, pooled)
    prompts = [g["prompt_id"][0] for g in groups]
    boot = PromptBootstrap(sorted(set(prompts)), N_BOOT, 0, 0.95)
    reps = []
    for w in boot.mult:
        pick = [i for i, p in enumerate(prompts) for _ in range(w[boot.index[p]])]
        reps.append(adaptive.measured_miss([e[i] for i in pick], [tops[i] for i in pick])["miss_rate"])
    return got, (f"exact share {number_text(got, 3)} ({m['missed']} / {m['harmful']}, miss rate "
                 f"{ci_text(m['miss_rate'], *boot.ci(np.array(reps)))})")


def prompt_folds(groups: list[pl.DataFrame]) -> list[list[int]]:
    """Two folds of the checkpoints by prompt: the sorted prompt ids shuffled (seed ``FOLD_SEED``) and halved; the
    indices into ``groups`` of each half's checkpoints."""
    prompts = sorted({g["prompt_id"][0] for g in groups})
    order = np.random.default_rng(FOLD_SEED).permutation(len(prompts))
    first = {prompts[i] for i in order[: len(prompts) // 2]}
    return [[i for i, g in enumerate(groups) if (g["prompt_id"][0] in first) == side] for side in (True, False)]


def smallest_share(groups: list[pl.DataFrame], est: str, target: str, pooled: bool) -> float:
    """The smallest nominal share of ``FINE`` whose measured miss rate on ``groups`` is at most ``TARGET_MISS``."""
    return next(share for (_, m), share in zip(ranking_frontier(groups, est, target, pooled, FINE), FINE, strict=True)
                if m["miss_rate"] <= TARGET_MISS)


def held_out(groups: list[pl.DataFrame], est: str, target: str, pooled: bool, cost: float) -> str:
    """The share of :func:`smallest_share` held out, 2-fold by prompt (``HELD_OUT``): chosen on one fold, measured
    on the other (harmful: the measured fold's pooled top decile; the exact set: its top share by ``est``), swapped;
    a text of the two shares, the exact share and missed / harmful over both measured folds, the miss rate with its
    cluster-bootstrap CI (each fold's prompts resampled on their own, the exact sets held, each fold's harmful decile
    re-derived per replicate) and the cost (``cost``: the estimator's pass)."""
    folds = prompt_folds(groups)
    chosen, measured = [], []  # measured: per fold (exact labels, exact sets, prompts) of its checkpoints
    for choose, measure in ((folds[0], folds[1]), (folds[1], folds[0])):
        share = smallest_share([groups[i] for i in choose], est, target, pooled)
        chosen.append(share)
        tops = exact_tops([groups[i][est].to_numpy() for i in measure], share, pooled)
        measured.append(([groups[i][target].to_numpy() for i in measure], tops,
                         [groups[i]["prompt_id"][0] for i in measure]))
    ms = [adaptive.measured_miss(e, tops) for e, tops, _ in measured]
    missed, harmful = sum(m["missed"] for m in ms), sum(m["harmful"] for m in ms)
    exact = sum(int(t.sum()) for _, tops, _ in measured for t in tops) / sum(len(v) for e, _, _ in measured
                                                                            for v in e)
    boots = [PromptBootstrap(sorted(set(prompts)), N_BOOT, k, 0.95) for k, (_, _, prompts) in enumerate(measured)]
    reps = []
    for b in range(N_BOOT):
        got = [0, 0]
        for boot, (e, tops, prompts) in zip(boots, measured, strict=True):
            w = boot.mult[b]
            pick = [i for i, p in enumerate(prompts) for _ in range(w[boot.index[p]])]
            m = adaptive.measured_miss([e[i] for i in pick], [tops[i] for i in pick])
            got = [got[0] + m["missed"], got[1] + m["harmful"]]
        reps.append(got[0] / got[1])
    return (f"held out, shares {number_text(chosen[0], 2)} and {number_text(chosen[1], 2)} chosen: exact share "
            f"{number_text(exact, 3)} ({missed} / {harmful}, miss rate "
            f"{ci_text(missed / harmful, *boots[0].ci(np.array(reps)))}), cost {number_text(cost + exact, 3)}")


def horizon_frontier(here: Path) -> str:
    """At H = 16 and H = 128 on every entry of fast-labels-horizon's checkpoints: the ranking frontier, one column per
    estimator, and ``--miss-rate R`` from the fast label of the target's horizon."""
    df = read_table(here / "inputs/exact_all.parquet")[0]
    for h in (16, 128):
        df = df.join(read_table(here / f"inputs/fast_{h}.parquet")[0], on=KEY, how="left")
    assert df["fast_16"].null_count() == df["fast_128"].null_count() == 0, "every exact entry has its fast labels"
    groups = [g for _, g in df.sort(KEY).group_by("prompt_id", "checkpoint", maintain_order=True)]
    fast = {h: json.loads((here / f"bench-h{h}.json").read_text())["ratio"] for h in (16, 128)}
    h128 = json.loads(HORIZON_BENCH.read_text())["cost_ratio_per_entry"]
    estimators = {  # target -> [(estimate, pooled, its cost as a share of exact labels of every entry at the target)]
        16: [("fast_16", False, fast[16]), ("fast_16", True, fast[16])],
        128: [("fast_128", False, fast[128]), ("fast_128", True, fast[128]), ("exact_16", False, 1 / h128),
              ("fast_16", False, fast[16] / h128)],
    }
    parts, closest = [], []
    for h, ests in estimators.items():
        target = f"exact_{h}"
        fronts = {(est, pooled): ranking_frontier(groups, est, target, pooled) for est, pooled, _ in ests}
        ests = [((est, pooled), f"`{est}`" + (", pooled" if pooled else ""), cost) for est, pooled, cost in ests]
        rows = []
        for i, share in enumerate(adaptive.shares(adaptive.STEP)):
            row = [number_text(share, 2)]
            for est, _, cost in ests:
                got, m = fronts[est][i]
                row += [f"{m['missed']} / {m['harmful']}", number_text(cost + got, 3)]
            rows.append(row)
            if all(fronts[est][i][1]["miss_rate"] == 0 for est, _, _ in ests):
                break  # every estimator misses nothing from here on
        head = ["share"] + [c for _, name, _ in ests for c in (f"{name}: missed / harmful", "cost")]
        e = [g[target].to_numpy() for g in groups]
        control = control_table(e, [g[f"fast_{h}"].to_numpy() for g in groups], fast[h])
        parts.append(f"### H = {h} (target `{target}`; harmful: the pooled top decile, "
                     f"{fronts[ests[0][0]][0][1]['harmful']} entries)\n\n{md_table(head, rows, 'r' * len(head))}\n\n"
                     f"`--miss-rate R` from `--exact-frac {FIRST}` with the fast label at H = {h} ({SEEDS} audit "
                     f"seeds):\n\n{control}")
        for (est, pooled), name, cost in ests:
            hit, where = first_reach(groups, est, target, pooled)
            closest.append(f"- H = {h}, {name}: the pass costs {number_text(cost, 3)}; in-sample, measured miss rate "
                           f"<= {TARGET_MISS} from {where}, cost {number_text(cost + hit, 3)}; "
                           f"{held_out(groups, est, target, pooled, cost)}.")
    return (
        "## At H = 16 and H = 128 (every entry of reports/fast-labels-horizon's checkpoints)\n\n"
        f"{len(groups)} checkpoints (10 MATH-500 prompts at 128 and 256 generated tokens), {df.height:,} entries, "
        "each labeled exactly to H = 128 (`exact_16`: the mean of its first 16 steps) and by the fast label at H = 16 "
        "and at H = 128; each estimator ranks each checkpoint's entries (pooled: all checkpoints' together) and its "
        "top share is labeled exactly at the target's horizon. Cost: the exact share plus the estimator's pass, as a "
        "share of exact labels of every entry at the target's horizon (the fast pass: fast-labels-horizon's "
        "`bench-h{16,128}.json`; exact H = 16 for the H = 128 target: 1 / "
        f"{number_text(h128, 3)}, reports/bench/label-horizon-n16-h128.json). Measured, not bounded, except by "
        f"`--miss-rate`. The lines: the smallest exact share (searched in steps of 0.01) whose measured miss rate is "
        f"at most {TARGET_MISS}. {HELD_OUT}\n\n"
        + "\n".join(closest) + "\n\n" + "\n\n".join(parts) + "\n"
    )


if __name__ == "__main__":
    print(main())

"""The cost / miss-rate frontier on the decisions checkpoints (10 MATH-500 prompts of SmolLM2, 6,546 entries, H = 8),
from the committed exact and fast (Fisher, K = 8) labels of every entry (inputs/): no model runs.

- the Fisher ranking alone: each checkpoint's top share s by Fisher label labeled exactly, s = 0.05 .. 1; the miss
  rate measured against the exact labels (harmful: the pooled top decile, ``kvdiag.label.adaptive``);
- ``--miss-rate R`` (``kvdiag.label.adaptive.control``) from ``--exact-frac 0.1`` with the minimum audit, over 20
  audit seeds: the exact share it needed (audit included), its bound and the miss rate measured;
- cost: the exact share plus the Fisher pass, as a share of exact labels of every entry. The Fisher pass's share,
  FISHER_COST, is read off the committed cost benches (bench-hybrid-{0.1,0.2}.json: hybrid's cost minus its exact
  share, 0.052 and 0.036 of exact at H = 8, P = 512): the larger.

Run from the repository root: .venv/bin/python reports/hybrid-labels-math500/miss_rate.py (writes miss-rate.md).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.io import read_table
from kvdiag.label import adaptive
from kvdiag.tables import md_table, number_text

HERE = Path("reports/hybrid-labels-math500")
KEY = ["prompt_id", "checkpoint", "position"]
TARGETS = (0.05, 0.1, 0.2)
SEEDS = 20
FIRST = 0.1


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

    rows = []
    for share in adaptive.shares(adaptive.STEP):
        tops = []
        for x in f:
            top = np.zeros(len(x), bool)
            top[adaptive.top_rows(x, share)] = True
            tops.append(top)
        got = sum(int(t.sum()) for t in tops) / n
        m = adaptive.measured_miss(e, tops)
        per = np.array(m["per_checkpoint"])
        rows.append([number_text(got, 3), number_text(cost0 + got, 3), f"{m['missed']} / {m['harmful']}",
                     number_text(m["miss_rate"], 3), f"{number_text(float(np.median(per)), 2)} "
                     f"[{number_text(float(per.min()), 2)}, {number_text(float(per.max()), 2)}]"])
    frontier = md_table(["exact share", "cost / exact", "missed / harmful", "miss rate",
                         "per checkpoint: median [min, max]"], rows, "rrrrr")

    rests = [len(x) - math.ceil(FIRST * len(x)) for x in e]
    ctl_rows = []
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
        ctl_rows.append([number_text(target, 2), f"{need:,} ({number_text(need / n, 3)})",
                         f"{number_text(float(np.median(shares)), 3)} [{number_text(float(min(shares)), 3)}, "
                         f"{number_text(float(max(shares)), 3)}]",
                         number_text(cost0 + float(np.median(shares)), 3),
                         f"{number_text(float(np.median(bounds)), 3)}",
                         f"{number_text(float(np.median(misses)), 3)} [{number_text(float(q(misses, 0)), 3)}, "
                         f"{number_text(float(q(misses, 1)), 3)}]"])
    control = md_table(["R", "audit (share)", "exact share: median [min, max]", "cost / exact (median)",
                        "bound (median)", "measured miss rate: median [min, max]"], ctl_rows, "rrrrrr")
    k = adaptive.harmful_count(n)
    text = (
        "# Cost / miss-rate frontier (SmolLM2, the decisions checkpoints, H = 8)\n\n"
        f"[miss_rate.py](miss_rate.py) from the committed exact and Fisher (K = 8) labels of every entry (`inputs/`): "
        f"{len(e)} checkpoints (one per prompt), {n:,} entries, harmful: the pooled top decile ({k} entries, "
        "`kvdiag.label.adaptive`); missed: harmful and not labeled exactly. Cost: the exact share plus the Fisher "
        f"pass ({number_text(cost0, 3)} of exact labels of every entry, the larger of the committed cost benches' "
        "`bench-hybrid-*.json`), as a share of exact labels of every entry. 10 checkpoints: the per-checkpoint "
        "columns show the spread; no CI is claimed for the pooled rates.\n\n"
        "## The Fisher ranking alone (no audit: the miss rate is measured here, not bounded)\n\n"
        f"{frontier}\n\n"
        f"## `--miss-rate R` from `--exact-frac {FIRST}` with the minimum audit ({SEEDS} audit seeds)\n\n"
        "The rounds add 0.05 of every checkpoint's candidates to its exact top until the bound (one-sided "
        "Clopper-Pearson, 95 % with Bonferroni over the rounds) is below R; the exact share includes the audit.\n\n"
        f"{control}\n"
    )
    (out / "miss-rate.md").write_text(text)
    return text


if __name__ == "__main__":
    print(main())

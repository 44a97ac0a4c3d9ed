"""ratio.md, ratio.csv: the suites' task accuracy against kvpress's compression ratio (keys/, countdown/, recall/: 50
prompts each, FullKV and six rules at budgets 64 / 128 / 256), beside summary.md's accuracy against the budget.

kvpress users read a task score against ``compression_ratio`` = 1 - kept / full (the share of the KV pairs removed).
A budget is not a ratio: the same 128 entries remove more of a long generation than of a short one, and each rule's
generations differ in length. Per generation, from generations.parquet's own columns:

    compression_ratio = 1 - mean_kv / (prompt_len + (generated - 1) / 2)

mean_kv is the mean number of cache entries the queries that produced the generated tokens attended; the
denominator is what those same queries attend with the full cache (the i-th generated token's query sees
prompt_len + i entries; FullKV's mean_kv equals it, so FullKV's ratio is 0). The ratio is the removed share averaged
over the decoding steps, kvpress's definition applied to a cache compressed as it grows.

Run from the repository root: .venv/bin/python reports/replay-suites/ratio.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.stats import wilson
from kvdiag.core.tables import markdown_table
from kvdiag.tasks.suites import SUITES, grade

HERE = Path(__file__).parent
RUNS = ("keys", "countdown", "recall")
LEVEL = 0.95


def generations(run: Path, suite: str) -> pl.DataFrame:
    """One row per generation: rule, budget, the task component's verdict and the generation's compression ratio."""
    s = SUITES[suite]
    df = pl.read_parquet(run / "generations.parquet")
    ok = [grade(s, t, a)[s.task.name] for t, a in zip(df["text"], df["answer"], strict=True)]
    full = pl.col("prompt_len") + (pl.col("generated") - 1).clip(lower_bound=0) / 2
    return df.select("prompt_id", "scorer", "budget", ratio=1 - pl.col("mean_kv") / full).with_columns(
        pl.Series("ok", ok))


def cells(df: pl.DataFrame, suite: str) -> pl.DataFrame:
    """Per (rule, budget): n, the task accuracy with its Wilson CI (one sample per prompt: independent verdicts) and
    the compression ratio's mean, SD, min and max over the cell's generations."""
    rows = []
    for (scorer, budget), g in df.group_by("scorer", "budget", maintain_order=True):
        k, n = int(g["ok"].sum()), g.height
        lo, hi = wilson(k, n, LEVEL)
        r = g["ratio"].to_numpy()
        rows.append({"suite": suite, "scorer": scorer, "budget": budget, "n": n, "correct": k, "accuracy": k / n,
                     "ci_low": lo, "ci_high": hi, "ratio_mean": float(r.mean()),
                     "ratio_sd": float(r.std(ddof=1)) if n > 1 else float("nan"), "ratio_min": float(r.min()),
                     "ratio_max": float(r.max())})
    return pl.DataFrame(rows)


def _cell(c: dict) -> str:
    return (f"{100 * c['accuracy']:.0f} % [{100 * c['ci_low']:.0f}, {100 * c['ci_high']:.0f}] "
            f"({c['correct']}/{c['n']}); ratio {c['ratio_mean']:.3f} ± {c['ratio_sd']:.3f}")


def main(here: Path = HERE, out: Path = HERE) -> None:
    table = pl.concat([cells(generations(here / run, run), run) for run in RUNS])
    table.write_csv(out / "ratio.csv")
    lines = ["# Task accuracy against the compression ratio (kvpress's layout)", "",
             "Made by ratio.py from keys/, countdown/ and recall/ generations.parquet (each one `kvdiag replay`, "
             "reproduce.sh); numbers: ratio.csv. Rows: rules; columns: the compression ratio, one per budget, headed "
             "by its mean [min, max] over every rule's generations at that budget; cells: the task component's "
             f"accuracy with its {LEVEL:.0%} Wilson CI (one sample per prompt) and k/n, and the cell's own mean "
             "compression ratio ± SD over its generations. "
             "compression_ratio = 1 - mean_kv / (prompt_len + (generated - 1) / 2): "
             "kvpress's 1 - kept / full, the share of the cache removed, averaged over the queries that produced the "
             "generated tokens (full: what each query attends under FullKV; FullKV's ratio is 0). The ratio of one "
             "budget differs between rules because their generations differ in length; summary.md gives the "
             "accuracy against the budget.", ""]
    for run in RUNS:
        t = table.filter(pl.col("suite") == run)
        budgets = sorted(b for b in t["budget"].unique() if b is not None)
        rules = t.filter(pl.col("budget").is_not_null())
        heads = []
        for b in budgets:
            r = rules.filter(pl.col("budget") == b)
            # the column's ratio over all its generations: the rules' cell means weighted by their n
            mean = float(np.average(r["ratio_mean"].to_numpy(), weights=r["n"].to_numpy()))
            heads.append(f"ratio {mean:.3f} [{r['ratio_min'].min():.3f}, {r['ratio_max'].max():.3f}] (budget {b})")
        by = {(c["scorer"], c["budget"]): c for c in t.iter_rows(named=True)}
        full = by.get(("full_kv", None))
        rows = [[s, *(_cell(by[(s, b)]) if (s, b) in by else "–" for b in budgets)]
                for s in rules["scorer"].unique(maintain_order=True)]
        lines += [f"## {run}", ""]
        if full is not None:
            lines += [f"FullKV (ratio 0): {_cell(full)}.", ""]
        lines += [markdown_table(["rule", *heads], rows), ""]
    (out / "ratio.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

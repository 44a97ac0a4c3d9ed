"""Short vs long traces: does the ranking of the rules change with trace length?

Reads the rank-eval metrics of the short-trace report (reports/math500-smollm2) and of this one and writes
comparison.md: per rule and metric (macro over checkpoints, 95% cluster-bootstrap CIs as rank-eval gives
them) the value and the rule's rank in each report, and Kendall's tau between the two orderings with its exact p
(``kvdiag.core.stats.kendall``: the permutation distribution of tau over the rules; ranks have no ties).
Run from the repository root: .venv/bin/python reports/math500-long/compare.py
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from kvdiag.core.stats import format_p, kendall

SHORT = Path("reports/math500-smollm2/rank-eval/metrics.csv")
LONG = Path("reports/math500-long/rank-eval/metrics.csv")
OUT = Path("reports/math500-long/comparison.md")
METRICS = ("auroc", "spearman", "ap")  # higher is better for each
SCOPE = "macro"  # each checkpoint counts once: a long trace's many checkpoints do not swamp the pooled value


def values(path: Path, metric: str) -> pl.DataFrame:
    df = pl.read_csv(path).filter((pl.col("metric") == metric) & (pl.col("scope") == SCOPE))
    return df.select("scorer", "value", "ci_low", "ci_high", "n")


def ranked(short: Path, long: Path, metric: str) -> pl.DataFrame:
    """The rules of both reports, each ranked among them (a rule only one report has does not shift the ranks)."""
    both = values(short, metric).join(values(long, metric), on="scorer", suffix="_long", maintain_order="left")
    rank = {side: pl.col(f"value{side}").rank("ordinal", descending=True).cast(pl.Int64) for side in ("", "_long")}
    return both.with_columns(rank=rank[""], rank_long=rank["_long"]).sort("rank_long")


def cell(row: dict, side: str) -> str:
    return f"{row['value' + side]:.3f} [{row['ci_low' + side]:.3f}, {row['ci_high' + side]:.3f}]"


def main(short: Path = SHORT, long: Path = LONG, out: Path = OUT) -> None:
    lines = ["# Short vs long traces: the rules' ranking", "",
             f"Made by `reports/math500-long/compare.py` from `{short}` (20 problems, greedy, T <= 961, checkpoints "
             f"every 128) and `{long}` (3 problems, sampled T = 0.6, top-p 0.95, T >= 4,000, checkpoints every 512). "
             f"Scope: {SCOPE} (mean over checkpoints); CIs: 95% cluster bootstrap from rank-eval. Rank 1 = best.", ""]
    for metric in METRICS:
        both = ranked(short, long, metric)
        tau = kendall(both["rank"].to_numpy(), both["rank_long"].to_numpy())
        lines += [f"## {metric}", "",
                  f"Kendall's tau between the two orderings: {tau['tau']:.2f} "
                  f"({tau['test']} p = {format_p(tau['p_value'])}, "
                  f"{tau['n']} rules; checkpoints with a value: {both['n'][0]} short, {both['n_long'][0]} long).",
                  "",
                  "| rule | short | rank | long | rank | change |", "|---|---:|---:|---:|---:|---:|"]
        for r in both.iter_rows(named=True):
            overlap = r["ci_low"] <= r["ci_high_long"] and r["ci_low_long"] <= r["ci_high"]
            lines.append(f"| {r['scorer']} | {cell(r, '')} | {r['rank']} | {cell(r, '_long')} | {r['rank_long']} | "
                         f"{r['value_long'] - r['value']:+.3f}{'' if overlap else ' (CIs disjoint)'} |")
        lines.append("")
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

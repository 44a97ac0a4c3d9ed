"""report.md: do the oracle's labels call the tokens an answer needs harmful, at H = 16 and to the end of the
generation (rest)? Reads only inputs/ (inputs.py's) and the replay's needed.csv (reports/replay-suites/SUITE).

- **Harmful** (``kvdiag.core.harm``, the default ``quantile:0.9``): a label above the 0.9-quantile of the labels of the
  checkpoints' seeded uniform samples (``sampled``), at the same horizon, pooled over the suite's checkpoints. Every
  label is analysed (``include_unresolved``): the noise floor is only known at the rows' own horizon.
- **Percentile**: the share of the same checkpoint's sampled entries whose label at that horizon is below the token's.
- Shares are means over the needed tokens with 95 % cluster-bootstrap CIs over prompts (``kvdiag.core.stats``,
  2,000 resamples, seed 0); ``n`` is the tokens (prompts) that entered.

Run from the repository root: .venv/bin/python reports/replay-suites/labels/analyze.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.harm import harm_threshold
from kvdiag.core.io import read_table
from kvdiag.core.schema import HARM
from kvdiag.core.stats import PromptBootstrap

HERE = Path(__file__).parent
INPUTS = HERE / "inputs"
SHOWN = ("16", "rest")  # the horizons of the tables (inputs hold 16, 32, 64, 128 and rest)
N_BOOT, SEED, LEVEL = 2000, 0, 0.95


def _share(boot: PromptBootstrap, values: np.ndarray, prompts: np.ndarray) -> str:
    if not len(values):
        return "–"
    mean, reps = boot.mean(values.astype(float), prompts)
    low, high = boot.ci(reps)
    return f"{mean:.2f} [{low:.2f}, {high:.2f}]"


def suite_section(suite: str, labels: pl.DataFrame, meta: dict) -> list[str]:
    sampled = labels.filter("sampled")
    thresholds = {h: harm_threshold(sampled[f"kl_{h}"].drop_nulls().to_numpy(), HARM) for h in SHOWN}
    # each needed token's percentile among its checkpoint's sampled entries, per horizon
    keys = ["prompt_id", "checkpoint", "position"]
    needed = labels.filter(pl.col("where").is_not_null())
    ref = sampled.select("prompt_id", "checkpoint", *(pl.col(f"kl_{h}").alias(f"ref_{h}") for h in SHOWN))
    pct = (needed.select(*keys, *(f"kl_{h}" for h in SHOWN)).join(ref, on=["prompt_id", "checkpoint"])
           .group_by(keys).agg(**{f"pct_{h}": (pl.col(f"ref_{h}") < pl.col(f"kl_{h}")).mean() for h in SHOWN}))
    needed = needed.join(pct, on=keys, how="left").with_columns(
        generated=pl.col("checkpoint") - pl.col("prompt_len"),
        **{f"harm_{h}": pl.col(f"kl_{h}") > thresholds[h] for h in SHOWN})
    boot = PromptBootstrap(needed["prompt_id"].unique().to_list(), N_BOOT, SEED, LEVEL)
    cfg = meta["labels"]["config"]
    lines = [f"## {suite}", "",
             f"{labels['prompt_id'].n_unique()} prompts (FullKV's generations, greedy), checkpoints "
             f"{cfg['checkpoints']} (generated tokens: {', '.join(map(str, sorted(needed['generated'].unique())))}), "
             f"{cfg['candidates']} sampled entries per checkpoint (seed {cfg['seed']}) plus every needed token written "
             f"before it; labels to the end of the generation (--horizon rest: {labels['horizon'].min()}-"
             f"{labels['horizon'].max()} steps). Harmful above "
             + ", ".join(f"{thresholds[h]:.3g} nats at {h}" for h in SHOWN)
             + f" (the {HARM} of {sampled.height} sampled labels; the checkpoints' median noise floor, the null row's "
             f"KL to the end, is {labels['noise_floor'].median():.2g} nats).", "",
             "| generated | copy | n tokens (prompts) | harmful at 16 | harmful at rest | harmless at 16, harmful at "
             "rest | median percentile at 16 | median percentile at rest | median label at 16 / rest (nats) |",
             "|---|---|---|---|---|---|---|---|---|"]
    groups = needed.sort("generated", "where").partition_by(["generated", "where"], maintain_order=True,
                                                             as_dict=True)
    pooled = needed.partition_by(["where"], maintain_order=True, as_dict=True)
    for key, g in [*groups.items(), *(((("all",) + k), g) for k, g in sorted(pooled.items()))]:
        gen, where = key
        p = g["prompt_id"].to_numpy()
        delayed = (~g["harm_16"] & g["harm_rest"]).to_numpy()
        lines.append(f"| {gen} | {where} | {g.height} ({g['prompt_id'].n_unique()}) | "
                     f"{_share(boot, g['harm_16'].to_numpy(), p)} | {_share(boot, g['harm_rest'].to_numpy(), p)} | "
                     f"{_share(boot, delayed, p)} | {g['pct_16'].median():.2f} | {g['pct_rest'].median():.2f} | "
                     f"{g['kl_16'].median():.2g} / {g['kl_rest'].median():.2g} |")
    return [*lines, ""]


def ground_truth(suite: str) -> list[str]:
    """The replay's pooled counts (success when the needed tokens were kept and when they were lost, per budget) and
    its per-rule tests: Fisher's exact test within each rule (one generation per prompt), Holm over the rules of a
    budget; the pooled counts are not tested (one prompt's generations under the six rules are not independent)."""
    path = HERE.parent / suite / "needed.csv"
    if not path.exists():
        return []
    table = pl.read_csv(path)
    rows = table.filter(pl.col("scorer") == "all rules")

    def tested(budget: int) -> str:
        rules = table.filter((pl.col("budget") == budget) & (pl.col("scorer") != "all rules")
                             & pl.col("holm_p").is_not_null()).sort("holm_p", maintain_order=True)
        if rules.height == 0:
            return "no rule's table can vary, no test"
        best = rules.row(0, named=True)
        family = f"{rules.height} rule{'s' * (rules.height != 1)}"
        return (f"per rule, Holm over the {family} tested: smallest Holm p {best['holm_p']:.2g}, "
                f"{best['scorer']} {best['kept_success']}/{best['kept_n']} kept against "
                f"{best['lost_success']}/{best['lost_n']} lost")

    out = [f"Ground truth ({suite}, reports/replay-suites/{suite}/needed.md; pooled over the rules, counts only: one "
           "prompt's generations under the six rules are not independent): the task succeeded in "]
    out[0] += "; ".join(f"{r['kept_success']}/{r['kept_n']} generations that kept the needed tokens and "
                        f"{r['lost_success']}/{r['lost_n']} that lost them at budget {r['budget']} "
                        f"({tested(r['budget'])})" for r in rows.iter_rows(named=True)) + "."
    return [*out, ""]


def main(inputs: Path = INPUTS, out: Path = HERE) -> None:
    parts = ["# Needed tokens under the oracle's labels", "",
             "Which of the tokens a suite's answer needs does the counterfactual oracle call harmful to evict, at "
             "H = 16 and to the end of the generation? Made by analyze.py from inputs/ (reproduce.sh). Columns: "
             "`copy` is where the needed token lies (the prompt's copy, or the generation's own copy of it); "
             "shares are over the needed tokens with 95 % cluster-bootstrap CIs over prompts; percentiles rank a "
             "token's label among its checkpoint's sampled entries.", ""]
    for d in sorted(p for p in inputs.iterdir() if p.is_dir()):
        labels, meta = read_table(d / "labels.parquet")
        parts += suite_section(d.name, labels, meta) + ground_truth(d.name)
    (out / "report.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()

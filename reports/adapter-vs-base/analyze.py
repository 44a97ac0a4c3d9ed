"""#43: how the countdown LoRA adapter changes kvdiag's labels and rank-eval on MATH-500 (report.md).
``analyze.py inputs`` copies the raw files from runs/adapter-vs-base (base/, adapted/: labels, scores, rank-eval;
cross/: labels); ``analyze.py`` writes report.md from them alone.

- **Scale**: per model, on its own generation, the median label, the median noise floor and the harmful threshold
  (the 0.9-quantile of the labels, rank-eval's default ``quantile:0.9``).
- **Same tokens**: the base model's Trace labeled by each model (the same seeded entries): per checkpoint the
  Spearman between the two, the share of the base model's top decile in the adapted model's top decile, the median
  ratio adapted / base; means with 95 % cluster-bootstrap CIs over prompts (2,000 resamples, seed 0).
- **Rank-eval**: each rule's pooled AUROC for harmful entries under each model (its own generation, labels and
  scores), with rank-eval's CIs, and Kendall's tau between the two orders of the rules.

Run from the repository root: .venv/bin/python reports/adapter-vs-base/analyze.py [inputs]
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.stats import PromptBootstrap, kendall, spearman

HERE = Path(__file__).parent
RUNS = Path("runs/adapter-vs-base")
KEYS = ["prompt_id", "checkpoint", "position"]
MODELS = ("base", "adapted")


def write_inputs() -> None:
    """The committed raw files: each model's labels, scores and rank-eval (its tables regenerate in
    tests/test_reports.py from these labels and scores), and the cross labels."""
    import shutil

    for m in (*MODELS, "cross"):
        (HERE / m).mkdir(exist_ok=True)
        shutil.copy(RUNS / m / "labels.parquet", HERE / m / "labels.parquet")
    for m in MODELS:
        shutil.copy(RUNS / m / "scores.parquet", HERE / m / "scores.parquet")
        shutil.copytree(RUNS / m / "rank-eval", HERE / m / "rank-eval", dirs_exist_ok=True)


def _labels(path: Path) -> pl.DataFrame:
    df = pl.read_parquet(path).filter(pl.col("granularity") == "token")
    return df.select(*KEYS, "kl_mean", "noise_floor")


def _auroc(path: Path) -> pl.DataFrame:
    metrics = pl.read_csv(path)
    return metrics.filter((pl.col("metric") == "auroc") & (pl.col("scope") == "pooled")).select(
        "scorer", "value", "ci_low", "ci_high", "n")


def _ci(boot: PromptBootstrap, values: np.ndarray, prompts: np.ndarray) -> str:
    mean, reps = boot.mean(values, prompts)
    lo, hi = boot.ci(reps)
    return f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


def main(here: Path = HERE, out: Path = HERE) -> None:
    """report.md in ``out`` from ``here``'s committed labels and rank-eval tables alone."""
    own = {m: _labels(here / m / "labels.parquet") for m in MODELS}
    lines = ["# The countdown adapter against the base model: labels and rank-eval on MATH-500", "",
             "Made by reproduce.sh and analyze.py (this folder): SmolLM2-135M with and without "
             "data/adapters/smollm2-countdown, the first 10 MATH-500 problems, 400 generated tokens, exact labels at "
             "H = 16 of 48 seeded entries per checkpoint.", "", "## Scale (each model on its own generation)", "",
             "| model | entries | checkpoints | median label (nats) | median noise floor | harmful threshold (q 0.9) |",
             "|---|---:|---:|---:|---:|---:|"]
    for m, df in own.items():
        ck = df.select("prompt_id", "checkpoint").unique().height
        lines.append(f"| {m} | {df.height} | {ck} | {df['kl_mean'].median():.3g} | {df['noise_floor'].median():.3g} "
                     f"| {df['kl_mean'].quantile(0.9):.3g} |")
    base = own["base"].rename({"kl_mean": "base"}).drop("noise_floor")
    cross = _labels(here / "cross" / "labels.parquet").rename({"kl_mean": "adapted"}).drop("noise_floor")
    both = base.join(cross, on=KEYS, how="inner")
    if both.height != base.height:
        raise SystemExit(f"{base.height - both.height} base entries have no adapted label: rerun reproduce.sh")
    rows = []
    for (pid, _), g in both.group_by("prompt_id", "checkpoint", maintain_order=True):
        x, y = g["base"].to_numpy(), g["adapted"].to_numpy()
        k = math.ceil(len(x) / 10)
        top_x, top_y = set(np.argsort(-x)[:k]), set(np.argsort(-y)[:k])
        rows.append({"prompt_id": pid, "spearman": spearman(x, y), "top": len(top_x & top_y) / k,
                     "ratio": float(np.median(y / x))})
    m = pl.DataFrame(rows)
    boot = PromptBootstrap(m["prompt_id"].unique().to_list(), 2000, 0, 0.95)
    p = m["prompt_id"].to_numpy()
    lines += ["", "## The same tokens under both models (the base model's Trace)", "",
              f"{both.height} entries, {m.height} checkpoints. Per checkpoint, then the mean [95 % CI]:", "",
              f"- Spearman(base, adapted): {_ci(boot, m['spearman'].to_numpy(), p)}",
              f"- base top decile also in the adapted top decile: {_ci(boot, m['top'].to_numpy(), p)}",
              f"- median ratio adapted / base: {_ci(boot, m['ratio'].to_numpy(), p)}"]
    auroc = {mm: _auroc(here / mm / "rank-eval" / "metrics.csv") for mm in MODELS}
    table = auroc["base"].join(auroc["adapted"], on="scorer", suffix="_adapted").sort("value", descending=True)
    tau = kendall(table["value"].to_numpy(), table["value_adapted"].to_numpy())
    lines += ["", "## Rank-eval: each rule's pooled AUROC for harmful entries (each model on its own generation)", "",
              f"Kendall's tau between the two orders of the {tau['n']} rules: {tau['tau']:.3f} (p = "
              f"{tau['p_value']:.2g}, {tau['test']}).", "",
              "| rule | base AUROC [CI] | adapted AUROC [CI] | difference |", "|---|---:|---:|---:|"]
    for r in table.iter_rows(named=True):
        lines.append(f"| {r['scorer']} | {r['value']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | "
                     f"{r['value_adapted']:.3f} [{r['ci_low_adapted']:.3f}, {r['ci_high_adapted']:.3f}] | "
                     f"{r['value_adapted'] - r['value']:+.3f} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    write_inputs() if sys.argv[1:] == ["inputs"] else main()

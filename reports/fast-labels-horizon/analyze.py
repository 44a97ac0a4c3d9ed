"""#42: the fast (fisher) label against exact labels at H = 16 and H = 128, and the short labels as predictors of
harm over 128 steps. ``analyze.py inputs`` writes inputs/ from runs/fast-labels-horizon (the rows and columns used;
exact_all.parquet, the exact labels of every entry, is read by reports/hybrid-labels-math500/miss_rate.py);
``analyze.py`` writes report.md from inputs/ and the bench JSONs alone.

Per checkpoint, on its 48 sampled entries (the exact rows; the fast runs label every entry, joined on position):
- **Spearman** between the estimate and the target;
- **AUROC** of the estimate for the target's top decile (the k = ceil(48 / 10) = 5 largest target labels);
- **miss rate**: the share of the target's top k that the estimate does not rank in its own top k;
- **median ratio** estimate / target (only where both are in nats of the same horizon).
Means over checkpoints, with 95 % cluster-bootstrap CIs over prompts (``kvdiag.core.stats``, 2,000 resamples, seed 0).

Run from the repository root: .venv/bin/python reports/fast-labels-horizon/analyze.py [inputs]
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import polars as pl
from sklearn.metrics import roc_auc_score

from kvdiag.core.stats import PromptBootstrap, spearman

HERE = Path(__file__).parent
RUNS = Path("runs/fast-labels-horizon")
KEYS = ["prompt_id", "checkpoint", "position"]
N_BOOT, SEED, LEVEL = 2000, 0, 0.95
PAIRS = [  # (estimate, target, same units)
    ("fast_16", "exact_16", True), ("fast_128", "exact_128", True),
    ("fast_16", "exact_128", False), ("exact_16", "exact_128", False), ("fast_128", "exact_16", False),
]


def write_inputs() -> None:
    exact = pl.read_parquet(RUNS / "exact-h128.parquet").filter(pl.col("granularity") == "token")
    assert (exact["horizon"] == 128).all()
    exact = exact.select(*KEYS, pl.col("kl_steps").list.head(16).list.mean().alias("exact_16"),
                         pl.col("kl_mean").alias("exact_128"), "noise_floor")
    out = HERE / "inputs"
    out.mkdir(exist_ok=True)
    exact.write_parquet(out / "exact.parquet")
    every = pl.read_parquet(RUNS / "exact-all-h128.parquet").filter(pl.col("granularity") == "token")
    assert (every["horizon"] == 128).all()
    every.select(*KEYS, pl.col("kl_steps").list.head(16).list.mean().alias("exact_16"),
                 pl.col("kl_mean").alias("exact_128")).write_parquet(out / "exact_all.parquet")
    for h in (16, 128):
        fast = pl.read_parquet(RUNS / f"fast-h{h}.parquet").filter(pl.col("granularity") == "token")
        fast.select(*KEYS, pl.col("kl_mean").alias(f"fast_{h}")).write_parquet(out / f"fast_{h}.parquet")


def checkpoint_metrics(g: pl.DataFrame, est: str, target: str, same: bool) -> dict:
    x, y = g[est].to_numpy(), g[target].to_numpy()
    k = math.ceil(len(y) / 10)
    top_y = set(np.argsort(-y, kind="stable")[:k])
    top_x = set(np.argsort(-x, kind="stable")[:k])
    harmful = np.zeros(len(y), bool)
    harmful[list(top_y)] = True
    return {"spearman": spearman(x, y), "auroc": roc_auc_score(harmful, x), "miss": len(top_y - top_x) / k,
            "ratio": float(np.median(x / y)) if same else float("nan")}


def main(inputs: Path = HERE / "inputs", out: Path = HERE) -> None:
    """report.md in ``out`` from ``inputs`` (and the bench JSONs beside it)."""
    df = pl.read_parquet(inputs / "exact.parquet")
    for h in (16, 128):
        df = df.join(pl.read_parquet(inputs / f"fast_{h}.parquet"), on=KEYS, how="left")
    missing = df.filter(pl.col("fast_16").is_null() | pl.col("fast_128").is_null()).height
    if missing:
        raise SystemExit(f"{missing} exact rows have no fast label: rerun reproduce.sh")
    groups = list(df.group_by("prompt_id", "checkpoint", maintain_order=True))
    boot = PromptBootstrap(df["prompt_id"].unique().to_list(), N_BOOT, SEED, LEVEL)
    lines = ["# The fast label at H = 16 and H = 128 against exact labels", "",
             f"Made by reproduce.sh and analyze.py (this folder). SmolLM2-135M, {df['prompt_id'].n_unique()} MATH-500 "
             f"problems, {len(groups)} checkpoints, {df.height} exact entries (48 per checkpoint, the fast labels "
             "joined on them). Means over checkpoints [95 % cluster-bootstrap CI over prompts].", "",
             "| estimate | target | Spearman | AUROC (target top decile) | miss rate (top decile) | median ratio |",
             "|---|---|---:|---:|---:|---:|"]
    for est, target, same in PAIRS:
        rows = [{"prompt_id": pid, **checkpoint_metrics(g, est, target, same)} for (pid, _), g in groups]
        m = pl.DataFrame(rows)
        cells = []
        for col in ("spearman", "auroc", "miss", "ratio"):
            if col == "ratio" and not same:
                cells.append("–")
                continue
            mean, reps = boot.mean(m[col].to_numpy(), m["prompt_id"].to_numpy())
            lo, hi = boot.ci(reps)
            cells.append(f"{mean:.3f} [{lo:.3f}, {hi:.3f}]")
        lines.append(f"| {est.replace('_', ' H=')} | {target.replace('_', ' H=')} | " + " | ".join(cells) + " |")
    lines += ["", "## Cost (`kvdiag bench label --method fast`, SmolLM2, P = 512, 16 exact candidates, best of 3)", "",
              "| H | exact ms / entry | fast ms / entry | exact / fast per entry | fast share of exact-every-entry "
              "cost | Spearman on the bench's candidates |", "|---:|---:|---:|---:|---:|---:|"]
    for h in (16, 128):
        path = inputs.parent / f"bench-h{h}.json"
        if not path.exists():
            continue
        b = json.loads(path.read_text())
        ex, fa = (1000 * r["seconds"] / k for r, k in zip(b["rows"], b["entries"], strict=True))
        lines.append(f"| {h} | {ex:.1f} | {fa:.2f} | {b['exact_over_method_per_entry']:.1f}x | {b['ratio']:.3f} | "
                     f"{b['spearman']:.3f} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    write_inputs() if sys.argv[1:] == ["inputs"] else main()

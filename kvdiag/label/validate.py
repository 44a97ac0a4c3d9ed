"""``kvdiag validate-labels``: how far approximate labels agree with exact ones, with cluster-bootstrap CIs.

The two tables are joined on the label keys; every joined entry has an exact and an approximate ``kl_mean``.
Per checkpoint (the entries of one prompt's cache at one t):

- ``spearman``: rank correlation of the approximate with the exact ``kl_mean``;
- ``auroc``: how well the approximate value separates the *exact-harmful* entries from the rest, where
  exact-harmful = exact ``kl_mean`` at or above the checkpoint's ``harmful_quantile`` quantile (default 0.9:
  the top decile of its joined entries); undefined when one class is empty;
- ``topk_overlap``: share of the exact top-``top_k`` entries that are also in the approximate top-``top_k``;
- ``median_ratio``: median of approximate / exact ``kl_mean`` over its entries with exact > 0 (calibration: 1 = right
scale).

Each is averaged over checkpoints; CIs come from a cluster bootstrap over *prompts* (checkpoints of one prompt
share a trace, so they are not independent: ``kvdiag.core.stats``). Where they disagree: each entry's
within-checkpoint percentile ranks (exact, approximate), their absolute difference averaged in quantile bins of
age, attention and payload (the last two from an optional scores file, e.g. ``kvdiag score``'s ``attention`` and
``value_norm``), with the same bootstrap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.errors import UserError
from kvdiag.core.stats import percentile_ci, prompt_multiplicities
from kvdiag.label.config import ValidateConfig  # noqa: F401  (validate's API)

KEYS = ["prompt_id", "checkpoint", "position", "granularity", "layer", "kv_head"]
METRICS = ("spearman", "auroc", "topk_overlap")  # rank agreement (the figure's panel)
SCALE = "median_ratio"  # calibration: the checkpoint's median approx / exact over entries with exact > 0


@dataclass
class Validation:
    per_checkpoint: pl.DataFrame  # prompt_id, checkpoint, n, harmful, spearman, auroc, topk_overlap, median_ratio
    summary: pl.DataFrame  # metric, mean, ci_low, ci_high, checkpoints (defined)
    disagreement: pl.DataFrame  # feature, bin, low, high, n, mean_abs_rank_diff, ci_low, ci_high, mean_rank_diff
    joined: pl.DataFrame  # KEYS + exact, approx, age (+ features) per entry


def join_labels(
    exact: pl.DataFrame, approx: pl.DataFrame, scores: pl.DataFrame | None, cfg: ValidateConfig
) -> pl.DataFrame:
    """KEYS + exact, approx, age (+ attention, payload from ``scores``) for every entry in both tables."""
    joined = exact.select(*KEYS, "age", exact=pl.col("kl_mean")).join(
        approx.select(*KEYS, approx=pl.col("kl_mean")), on=KEYS, how="inner")
    joined = joined.filter(pl.col("exact").is_not_null() & pl.col("approx").is_not_null())
    if joined.is_empty():
        raise UserError("--exact and --approx share no labeled entry (same prompts, checkpoints, positions, "
                        "granularity?); label the same Trace at the same checkpoints")
    if scores is not None:
        missing = [c for c in (cfg.attention, cfg.payload) if c not in scores.columns]
        if missing:
            raise UserError(f"--scores lacks columns {missing}: score with those rules or pass --attention/--payload")
        keys = [k for k in KEYS if k in scores.columns]
        joined = joined.join(
            scores.select(*keys, attention=pl.col(cfg.attention), payload=pl.col(cfg.payload)), on=keys, how="left"
        )
    return joined.sort(KEYS)


def _per_checkpoint(joined: pl.DataFrame, cfg: ValidateConfig) -> pl.DataFrame:
    from sklearn.metrics import roc_auc_score

    from kvdiag.core.stats import spearman

    out = []
    for (pid, t), g in joined.group_by("prompt_id", "checkpoint", maintain_order=True):
        e, a = g["exact"].to_numpy().astype(float), g["approx"].to_numpy().astype(float)
        harmful = e >= np.quantile(e, cfg.harmful_quantile)
        k = min(cfg.top_k, len(e))
        top_e, top_a = set(np.argsort(-e, kind="stable")[:k]), set(np.argsort(-a, kind="stable")[:k])
        out.append({"prompt_id": pid, "checkpoint": t, "n": len(e), "harmful": int(harmful.sum()),
                    "spearman": spearman(e, a),
                    "auroc": float(roc_auc_score(harmful, a)) if 0 < harmful.sum() < len(e) else float("nan"),
                    "topk_overlap": len(top_e & top_a) / k,
                    SCALE: float(np.median(a[e > 0] / e[e > 0])) if (e > 0).any() else float("nan")})
    return pl.DataFrame(out)


def _cluster_mean(
    values: np.ndarray, clusters: np.ndarray, mult: np.ndarray, level: float
) -> tuple[float, float, float, int]:
    """Mean of ``values [n]`` (NaN dropped) and its cluster-bootstrap CI; ``mult [B, P]`` prompt multiplicities."""
    ok = np.isfinite(values)
    if not ok.any():
        return float("nan"), float("nan"), float("nan"), 0
    sums = np.bincount(clusters[ok], weights=values[ok], minlength=mult.shape[1])
    counts = np.bincount(clusters[ok], minlength=mult.shape[1]).astype(float)
    with np.errstate(invalid="ignore", divide="ignore"):
        reps = (mult @ sums) / (mult @ counts)
    low, high, _ = percentile_ci(reps, level)
    return float(values[ok].mean()), low, high, int(ok.sum())


def _ranks(joined: pl.DataFrame) -> pl.DataFrame:
    """Within-checkpoint percentile ranks in [0, 1] of the exact and approximate values (1 = most harmful)."""
    by = ["prompt_id", "checkpoint"]
    pct = lambda c: ((pl.col(c).rank("average").over(by) - 1) / (pl.len().over(by) - 1).clip(1))
    return joined.with_columns(rank_exact=pct("exact"), rank_approx=pct("approx"))


def validate_labels(
    exact: pl.DataFrame, approx: pl.DataFrame, cfg: ValidateConfig, scores: pl.DataFrame | None = None
) -> Validation:
    """Agreement of ``approx`` with ``exact`` labels; see the module docstring."""
    cfg.validate()
    joined = _ranks(join_labels(exact, approx, scores, cfg))
    per = _per_checkpoint(joined, cfg)
    prompts = sorted(joined["prompt_id"].unique().to_list())
    index = {p: i for i, p in enumerate(prompts)}
    mult = prompt_multiplicities(len(prompts), cfg.n_boot, np.random.default_rng(cfg.seed)).astype(float)
    clusters = np.array([index[p] for p in per["prompt_id"].to_list()])
    summary = []
    for m in (*METRICS, SCALE):
        mean, low, high, n = _cluster_mean(per[m].to_numpy().astype(float), clusters, mult, cfg.level)
        summary.append({"metric": m, "mean": mean, "ci_low": low, "ci_high": high, "checkpoints": n})
    rows = []
    entry_clusters = np.array([index[p] for p in joined["prompt_id"].to_list()])
    diff = (joined["rank_approx"] - joined["rank_exact"]).to_numpy().astype(float)
    for feature in [f for f in ("age", "attention", "payload") if f in joined.columns]:
        x = joined[feature].to_numpy().astype(float)
        ok = np.isfinite(x)
        if not ok.any():
            continue
        edges = np.unique(np.quantile(x[ok], np.linspace(0, 1, cfg.bins + 1)))
        which = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, len(edges) - 2)
        for b in range(len(edges) - 1):
            sel = ok & (which == b)
            mean, low, high, n = _cluster_mean(np.where(sel, np.abs(diff), np.nan), entry_clusters, mult, cfg.level)
            rows.append({"feature": feature, "bin": b, "low": float(edges[b]), "high": float(edges[b + 1]), "n": n,
                         "mean_abs_rank_diff": mean, "ci_low": low, "ci_high": high,
                         "mean_rank_diff": float(diff[sel].mean()) if n else float("nan")})
    return Validation(per, pl.DataFrame(summary), pl.DataFrame(rows), joined)


def run_validation(exact: Path, approx: Path, out: Path, cfg: ValidateConfig, scores: Path | None = None) -> list[Path]:
    """Read the inputs (refusing bad ones before anything is written), validate, write ``out``."""
    from kvdiag.core.contracts import read_labels, read_scores, same_trace
    from kvdiag.core.io import check_writable

    cfg.validate()
    check_writable(out, "--out", "dir")
    exact_df, exact_meta = read_labels(exact, "--exact")
    approx_df, approx_meta = read_labels(approx, "--approx")
    exact_method = exact_meta.get("config", {}).get("method", "exact")
    if exact_method != "exact":
        raise UserError(f"--exact {exact} holds {exact_method} labels, not exact ones; pass labels made without "
                        "--method")
    score_df, score_meta = read_scores(scores) if scores is not None else (None, None)
    # rows are joined on their keys: every table must be about the same Trace's tokens
    same_trace({f"--exact {exact}": exact_meta, f"--approx {approx}": approx_meta,
                **({f"--scores {scores}": score_meta} if scores is not None else {})})
    res = validate_labels(exact_df, approx_df, cfg, score_df)
    inputs = {"exact": str(exact), "approx": str(approx), "scores": None if scores is None else str(scores),
              "approx_method": approx_meta.get("config", {}).get("method", "exact"),
              "approx_params": approx_meta.get("config", {}).get("params", {}),
              "exact_config": exact_meta.get("config"), "approx_config": approx_meta.get("config")}
    return write_validation(res, cfg, out, inputs)


# --------------------------------------------------------------------------- outputs


def write_validation(res: Validation, cfg: ValidateConfig, out: Path, inputs: dict) -> list[Path]:
    """validation.md, summary.csv, per_checkpoint.csv, disagreement.csv, validation.png, validation.json in ``out``."""
    from kvdiag.core.io import write_csv, write_json, write_text

    out.mkdir(parents=True, exist_ok=True)
    paths = [
        write_csv(df, out / name)
        for df, name in (
            (res.summary, "summary.csv"), (res.per_checkpoint, "per_checkpoint.csv"),
            (res.disagreement, "disagreement.csv"),
        )
    ]
    paths.append(write_text(out / "validation.md", markdown(res, cfg, inputs)))
    paths.append(
        write_json(
            out / "validation.json",
            {"kind": "label-validation", "config": asdict(cfg), "inputs": inputs, "summary": res.summary.to_dicts()},
        )
    )
    paths.append(figure(res, cfg, out / "validation.png"))
    return paths


def markdown(res: Validation, cfg: ValidateConfig, inputs: dict) -> str:
    pct = round(100 * cfg.level)
    lines = [f"# Approximate vs exact labels: {inputs.get('approx_method', '?')} vs exact", "",
             f"{res.joined.height} entries joined over {res.per_checkpoint.height} checkpoints of "
             f"{res.joined['prompt_id'].n_unique()} prompts. Exact-harmful: exact kl_mean >= the checkpoint's "
             f"{cfg.harmful_quantile:g} quantile. Means over checkpoints, {pct}% CIs from {cfg.n_boot} "
             f"cluster-bootstrap resamples of prompts (seed {cfg.seed}).", "",
             f"| metric | mean | {pct}% CI | checkpoints |", "|---|---:|---:|---:|"]
    for r in res.summary.iter_rows(named=True):
        lines.append(f"| {r['metric']} | {r['mean']:.3f} | [{r['ci_low']:.3f}, {r['ci_high']:.3f}] | "
                     f"{r['checkpoints']} |")
    lines += [
        "",
        f"Where they disagree: |percentile rank (approx) - percentile rank (exact)| within a checkpoint, by "
        f"quantile bin ({pct}% CIs); mean signed difference > 0: the approximation over-rates the bin.",
        "",
        "| feature | bin | range | entries | mean abs rank diff | CI | mean signed diff |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in res.disagreement.iter_rows(named=True):
        lines.append(f"| {r['feature']} | {r['bin']} | [{r['low']:.3g}, {r['high']:.3g}] | {r['n']} | "
                     f"{r['mean_abs_rank_diff']:.3f} | "
                     f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] | {r['mean_rank_diff']:+.3f} |")
    return "\n".join(lines) + "\n"


def figure(res: Validation, cfg: ValidateConfig, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    feats = res.disagreement["feature"].unique(maintain_order=True).to_list() if res.disagreement.height else []
    fig, axes = plt.subplots(1, 2 + len(feats), figsize=(4.2 * (2 + len(feats)), 3.6))
    ax = axes[0]
    j = res.joined.filter((pl.col("exact") > 0) & (pl.col("approx") > 0))
    ax.scatter(np.log10(j["exact"].to_numpy()), np.log10(j["approx"].to_numpy()), s=3, alpha=0.3, lw=0)
    lo = float(np.log10(min(j["exact"].min(), j["approx"].min()))) if j.height else -8.0
    hi = float(np.log10(max(j["exact"].max(), j["approx"].max()))) if j.height else 0.0
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set(xlabel="log10 exact kl_mean", ylabel="log10 approximate kl_mean", title="entries (both > 0)")
    ax = axes[1]
    for i, m in enumerate(METRICS):
        vals = res.per_checkpoint[m].to_numpy().astype(float)
        vals = vals[np.isfinite(vals)]
        ax.scatter(np.full(len(vals), i) + np.linspace(-0.15, 0.15, len(vals)), vals, s=6, alpha=0.5)
        r = res.summary.row(i, named=True)
        ax.errorbar(
            i + 0.3, r["mean"], yerr=[[r["mean"] - r["ci_low"]], [r["ci_high"] - r["mean"]]], fmt="ko", capsize=3
        )
    ax.set_xticks(range(len(METRICS)), METRICS)
    ax.set(ylim=(min(-0.05, ax.get_ylim()[0]), 1.02), title=f"per checkpoint; mean, {round(100 * cfg.level)}% CI")
    for ax, f in zip(axes[2:], feats, strict=True):
        d = res.disagreement.filter(pl.col("feature") == f)
        mean = d["mean_abs_rank_diff"].to_numpy()
        ax.errorbar(
            d["bin"].to_numpy(), mean, yerr=[mean - d["ci_low"].to_numpy(), d["ci_high"].to_numpy() - mean], fmt="o-",
            capsize=3,
        )
        ticks = [f"{a:.3g}-{b:.3g}" for a, b in zip(d["low"], d["high"], strict=True)]
        ax.set_xticks(d["bin"].to_list(), ticks, rotation=20, fontsize=7)
        ax.set(xlabel=f"{f} (quantile bins)", ylabel="mean |rank diff|", title=f"disagreement by {f}", ylim=(0, None))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

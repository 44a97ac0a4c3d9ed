"""The replay summary (shaped like the paper's Table 2) and the accuracy / KL versus budget figure."""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl
import seaborn as sns

from kvdiag.core.io import write_csv, write_text
from kvdiag.core.plotting import new_figure, save_figure, style
from kvdiag.core.tables import markdown_table

FULL_LABEL = "FullKV"


def summarize(df: pl.DataFrame) -> pl.DataFrame:
    """One row per (scorer, budget): prompts (its generations: prompts × samples), accuracy (share correct among
    generations with an answer), max-length hits, mean KL (mean over generations of each one's mean per-step KL),
    mean and peak active KV."""
    return (
        df.group_by("scorer", "budget", maintain_order=True)
        .agg(
            pl.len().alias("prompts"), pl.col("correct").is_not_null().sum().alias("answered"),
            pl.col("correct").cast(pl.Float64).mean().alias("accuracy"),
            pl.col("max_length_hit").sum().alias("max_length_hits"), pl.col("kl_mean").mean().alias("kl_mean"),
            pl.col("mean_kv").mean().alias("mean_kv"), pl.col("peak_kv").max().alias("peak_kv"),
        )
    )


def table2(summary: pl.DataFrame, scorers: list[str], budgets: list[int]) -> pl.DataFrame:
    """Rows = scorer, columns per budget: ``accuracy@B`` (%), ``max_length_hits@B``, ``kl_mean@B``. The FullKV row
    (no budget) repeats its values under every budget, as the paper's dotted FullKV line."""
    rows = []
    for scorer in scorers:
        row = {"scorer": FULL_LABEL if scorer == "full_kv" else scorer}
        for b in budgets:
            sel = summary.filter(
                (pl.col("scorer") == scorer)
                & (pl.col("budget").is_null() if scorer == "full_kv" else pl.col("budget") == b)
            )
            rec = sel.row(0, named=True) if sel.height else {}
            acc = rec.get("accuracy")
            row[f"accuracy@{b}"] = None if acc is None else 100.0 * acc
            row[f"max_length_hits@{b}"] = rec.get("max_length_hits")
            row[f"kl_mean@{b}"] = rec.get("kl_mean")
        rows.append(row)
    return pl.DataFrame(rows, schema={"scorer": pl.String, **{
        f"{m}@{b}": (pl.Int64 if m == "max_length_hits" else pl.Float64)
        for b in budgets for m in ("accuracy", "max_length_hits", "kl_mean")}})


def markdown(table: pl.DataFrame, budgets: list[int], prompts: int, teacher_forced: bool, samples: int = 1) -> str:
    """The Table-2-shaped summary as Markdown (accuracy %, max-length hits out of ``prompts * samples``
    generations, mean KL)."""
    metrics = (
        [("kl_mean", "KL")]
        if teacher_forced
        else [("accuracy", "acc %"), ("max_length_hits", "max-len"), ("kl_mean", "KL")]
    )
    head = ["scorer"] + [f"{label} @{b}" for b in budgets for _, label in metrics]
    n = prompts * samples
    rows = [[row["scorer"], *(_cell(key, row[f"{key}@{b}"], n) for b in budgets for key, _ in metrics)]
            for row in table.iter_rows(named=True)]
    mode = "teacher-forced on a Trace" if teacher_forced else "free-running decoding" + (
        f", {samples} sampled generations per prompt" if samples > 1 else "")
    notes = [
        f"Replay ({mode}) over {prompts} prompts; budget = entries kept per layer and KV head.",
        "acc %: accuracy among generations with an answer (math-verify, or a builtin suite's exact check of the "
        "whole generation); max-len: generations that hit --max-new-tokens; "
        "KL: mean over prompts of the mean per-step KL(P_full || P_policy) in nats"
        + (" on the Trace's tokens." if teacher_forced else ", along each policy's own generation."),
    ]
    if not teacher_forced and FULL_LABEL in table["scorer"].to_list():
        notes.append(f"{FULL_LABEL} (uncompressed) does not depend on the budget: its values repeat under every "
                     "budget.")
    return markdown_table(head, rows, "l" * len(head)) + "\n" + "\n".join(notes) + "\n"


def _cell(key: str, value, prompts: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if key == "accuracy":
        return f"{value:.1f}"
    if key == "max_length_hits":
        return f"{value}/{prompts}"
    return f"{value:.3g}"


def budget_figure(summary: pl.DataFrame, scorers: list[str], out_dir: Path) -> list[Path]:
    """``budget.png``/``.pdf``: accuracy and mean KL versus budget, one line per scorer (FullKV dotted)."""
    panels = [(m, label) for m, label in (("accuracy", "accuracy (%)"), ("kl_mean", "mean KL(P_full || P_policy), "
                                                                                    "nats"))
              if summary.filter(pl.col("budget").is_not_null())[m].drop_nulls().len()]
    if not panels:
        return []
    rules = [s for s in scorers if s != "full_kv"]
    colors = dict(zip(rules, sns.color_palette("colorblind", len(rules)), strict=True))
    with style():
        fig, axes = new_figure(len(panels), 4.2 * len(panels), 3.2)
        for ax, (metric, label) in zip(axes, panels, strict=True):
            scale = 100.0 if metric == "accuracy" else 1.0
            for scorer, color in colors.items():
                rows = summary.filter((pl.col("scorer") == scorer) & pl.col(metric).is_not_null()).sort("budget")
                ax.plot(
                    rows["budget"].to_list(), [v * scale for v in rows[metric].to_list()], marker="o", color=color,
                    label=scorer,
                )
            full = summary.filter((pl.col("scorer") == "full_kv") & pl.col(metric).is_not_null())
            if full.height:
                ax.axhline(full[metric][0] * scale, color="black", linestyle=":", label=FULL_LABEL)
            budgets = sorted(summary["budget"].drop_nulls().unique().to_list())
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
            values = summary.filter(pl.col("budget").is_not_null())[metric].drop_nulls()
            if metric == "accuracy":
                ax.set_ylim(-2, 102)
            elif bool((values > 0).all()):
                ax.set_yscale("log")
            ax.set_xlabel("KV budget (entries per layer and KV head)")
            ax.set_ylabel(label)
        axes[0].legend(fontsize=7)
        return save_figure(fig, out_dir, "budget")


def write_summary(df: pl.DataFrame, out_dir: Path, scorers: list[str], budgets: list[int], horizon: int = 16,
                  free: pl.DataFrame | None = None, auroc=None, exact: set[str] = frozenset(),
                  suite=None, selection: str | None = None) -> pl.DataFrame:
    """``summary.md``, ``summary.csv`` (Table-2 shape), ``budget.csv`` (every number of the figure, long form)
    and the figure, from the rows of ``generations.parquet``; free-running with FullKV: the outcomes
    (``kvdiag.replay.outcomes``); teacher-forced with joint labels: decisions to outcomes and the regret
    (``kvdiag.replay.predict``, ``free``: a free-running replay's generations of the same prompts, ``auroc``: the
    rules' ``SingleLabelAUROC``); ``exact``: prompts graded on their whole generation (their answer is the
    generation); ``suite``: the prompts' builtin suite (``kvdiag.tasks.suites.Suite``), graded by its components."""
    summary = summarize(df)
    teacher_forced = bool((df["mode"] == "teacher_forced").all())
    table = table2(summary, scorers, sorted(budgets))
    write_csv(table, out_dir / "summary.csv")
    prompts = df["prompt_id"].n_unique()
    samples = df["sample"].n_unique() if "sample" in df.columns else 1
    write_text(out_dir / "summary.md", markdown(table, sorted(budgets), prompts, teacher_forced, samples))
    write_csv(summary, out_dir / "budget.csv")
    budget_figure(summary, scorers, out_dir)
    if not teacher_forced:  # without FullKV (--no-full-kv) its comparisons are left out, the rest is written
        from kvdiag.replay.outcomes import write_outcomes

        write_outcomes(df, out_dir, exact=exact, suite=suite)
    if teacher_forced:
        from kvdiag.replay.tf_task import write_tf_task

        write_tf_task(df, out_dir)
    if teacher_forced and df["joint_kl"].drop_nulls().len():
        from kvdiag.replay.predict import write_predictions

        write_predictions(df, out_dir, horizon, free, auroc=auroc, selection=selection)
    return table

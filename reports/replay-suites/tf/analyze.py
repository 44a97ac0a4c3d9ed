"""report.md and accuracy.png: the in-loop oracle policy beside the rules, on the suites' task component.

Reads only this folder's <suite>/generations.parquet (teacher-forced replay of the full cache's generations of the
first 10 prompts) and reports/replay-suites/<suite>/generations.parquet (the free-running replay, 50 prompts).

- **Teacher-forced success** (``tf_task``, ``kvdiag.replay.tf_task``): fed the full cache's tokens, the policy's top-1
  token is the full cache's at every token where the final line writes what the answer needs. n counts sequences
  compressed at least once whose final line holds the needed texts.
- **Free-running success**: the suite's task component (``kvdiag.suites.grade``) of the rule's own generation,
  over the compressed generations (the same 10 prompts, and all 50).
- **Agreement on the needed tokens** (``tf_needed_agree``): the share of the final line's needed tokens where the
  policy's top-1 token is the full cache's, a graded teacher-forced success; top-1 agreement, all steps: the same over
  every generated token.
- **Concordance**: per (prompt, rule, budget) present in both, teacher-forced success against free-running success.
- Wilson 95 % CIs; McNemar's exact test (the Belady oracle oracle_future_rest, else oracle_future, against each
  policy, the same sequences).
- Policies: oracle_future (per (layer, KV head), the entries the full-cache run's next interval + horizon = 80 queries
  attend most), oracle_future_rest (the same over every query to the end: Belady; its own replay, <suite>-rest/),
  and the six rules.

Run from the repository root: .venv/bin/python reports/replay-suites/tf/analyze.py
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from kvdiag.plotting import new_figure, save_figure, style
from kvdiag.stats import format_p, mcnemar, wilson
from kvdiag.suites import SUITES, grade
from kvdiag.tables import markdown_table

HERE = Path(__file__).parent
FREE = HERE.parent
ORACLES = ("oracle_future", "oracle_future_rest")  # window interval + horizon (80 queries), and rest (Belady)
SUITE_NAMES = ("keys", "countdown")


def _rate(k: int, n: int) -> str:
    if not n:
        return "–"
    lo, hi = wilson(k, n)
    return f"{k}/{n} = {k / n:.2f} [{lo:.2f}, {hi:.2f}]"


def free_rows(suite: str, free: Path = FREE) -> pl.DataFrame:
    """The free-running replay's compressed generations (FullKV: all) with their task verdict."""
    s = SUITES[suite]
    df = pl.read_parquet(free / suite / "generations.parquet")
    df = df.filter((pl.col("scorer") == "full_kv") | (pl.col("compressions") > 0))
    task = [grade(s, t, a)[s.task.name] for t, a in zip(df["text"], df["answer"], strict=True)]
    return df.select("prompt_id", "scorer", "budget").with_columns(pl.Series("free", task))


def tf_generations(suite: str, here: Path = HERE) -> pl.DataFrame:
    """The teacher-forced rows of ``suite``, and of ``suite``-rest (oracle_future with window rest) when present."""
    df = pl.read_parquet(here / suite / "generations.parquet")
    rest = here / f"{suite}-rest" / "generations.parquet"
    if rest.exists():
        df = pl.concat([df, pl.read_parquet(rest).with_columns(pl.lit(ORACLES[1]).alias("scorer"))],
                       how="diagonal_relaxed")
    return df


def tf_rows(suite: str, here: Path = HERE) -> pl.DataFrame:
    df = tf_generations(suite, here)
    if "tf_needed_agree" not in df.columns:
        df = df.with_columns(pl.lit(None, pl.Float64).alias("tf_needed_agree"))
    return df.filter((pl.col("compressions") > 0) & pl.col("tf_task").is_not_null()).select(
        "prompt_id", "scorer", "budget", pl.col("tf_task").alias("tf"), pl.col("tf_needed_agree").alias("needed"),
        pl.col("top1_agree").list.eval(pl.element().cast(pl.Float64)).list.mean().alias("agree"))


def suite_section(suite: str, here: Path = HERE, free_dir: Path = FREE) -> tuple[list[str], dict]:
    tf, free = tf_rows(suite, here), free_rows(suite, free_dir)
    tf_all = tf_generations(suite, here)
    prompts = sorted(tf_all["prompt_id"].unique())
    apart = tf_all.filter((pl.col("compressions") == 0) | pl.col("tf_task").is_null()).height
    full = free.filter(pl.col("scorer") == "full_kv")
    full10 = full.filter(pl.col("prompt_id").is_in(prompts))
    on10, on50 = _rate(int(full10["free"].sum()), full10.height), _rate(int(full["free"].sum()), full.height)
    lines = [f"## {suite}", "",
             f"Teacher-forced: {len(prompts)} prompts, {tf.height} sequences with a verdict ({apart} apart: not "
             f"compressed, or the Trace's final line lacks the needed text). FullKV free-running on these prompts: "
             f"{on10}; on all 50: {on50}.", ""]
    body, plot = [], {}
    oracles = [o for o in ORACLES if o in set(tf["scorer"])]
    ref = oracles[-1]  # the tests' reference: the Belady oracle where it ran
    policies = [*oracles, *[p for p in tf["scorer"].unique(maintain_order=True) if p not in ORACLES]]
    for budget in sorted(tf["budget"].unique()):
        for pol in policies:
            t = tf.filter((pl.col("scorer") == pol) & (pl.col("budget") == budget))
            f = free.filter((pl.col("scorer") == pol) & (pl.col("budget") == budget))
            f10 = f.filter(pl.col("prompt_id").is_in(prompts))
            if pol == ref:
                test = "–"
            else:
                pair = (tf.filter((pl.col("budget") == budget) & pl.col("scorer").is_in([ref, pol]))
                        .pivot(on="scorer", index="prompt_id", values="tf").drop_nulls())
                test = format_p(mcnemar(pair[ref].to_numpy(), pair[pol].to_numpy())) if pair.height else "n/a"
            needed = t["needed"].drop_nulls()
            body.append([pol, budget, _rate(int(t["tf"].sum()), t.height),
                         f"{needed.mean():.3f}" if needed.len() else "–",
                         f"{t['agree'].mean():.3f}" if t.height else "–", test,
                         "teacher-forced only" if pol in ORACLES else _rate(int(f10["free"].sum()), f10.height),
                         "–" if pol in ORACLES else _rate(int(f["free"].sum()), f.height)])
            plot[(pol, budget)] = {"tf": (int(t["tf"].sum()), t.height), "free": (int(f["free"].sum()), f.height)}
    lines.append(markdown_table(["policy", "budget", "teacher-forced success", "agreement on the needed tokens",
                                 "top-1 agreement, all steps",
                                 f"McNemar p vs {ref}", "free-running, same prompts", "free-running, 50"], body))
    both = tf.join(free, on=["prompt_id", "scorer", "budget"], how="inner")
    if both.height:
        cells = {(a, b): both.filter((pl.col("tf") == a) & (pl.col("free") == b)).height
                 for a in (True, False) for b in (True, False)}
        lines += ["", f"Concordance of the rules' teacher-forced and free-running success (same prompt, rule and "
                      f"budget, {both.height} pairs): both succeed {cells[(True, True)]}, both fail "
                      f"{cells[(False, False)]}, teacher-forced only {cells[(True, False)]}, free-running only "
                      f"{cells[(False, True)]}."]
    plot["full_kv"] = (int(full["free"].sum()), full.height)
    return [*lines, ""], plot


def figure(plots: dict, out: Path) -> None:
    """accuracy.png / .pdf: per suite, task success against the budget; one colour per policy, dashed squares
    teacher-forced (with the oracles' Wilson bands), solid circles free-running."""
    import seaborn as sns

    with style():
        fig, axes = new_figure(len(plots), 4.2 * len(plots), 3.4)
        for ax, (suite, plot) in zip(axes, plots.items(), strict=True):
            budgets = sorted({k[1] for k in plot if k != "full_kv"})
            x = {b: i for i, b in enumerate(budgets)}
            rules = sorted({k[0] for k in plot if k != "full_kv" and k[0] not in ORACLES})
            oracles = [o for o in ORACLES if any(k[0] == o for k in plot if k != "full_kv")]
            colors = dict(zip(rules, sns.color_palette("tab10", len(rules)), strict=True))
            colors.update({ORACLES[0]: "black", ORACLES[1]: "dimgrey"})
            for pol in [*oracles, *rules]:
                for kind, ls, marker in (("tf", "--", "s"), ("free", "-", "o")):
                    if pol in ORACLES and kind == "free":
                        continue
                    pts = [(b, *plot[(pol, b)][kind]) for b in budgets if plot[(pol, b)][kind][1]]
                    if not pts:
                        continue
                    xs, ys = [x[p[0]] for p in pts], [p[1] / p[2] for p in pts]
                    ax.plot(xs, ys, ls, marker=marker, color=colors[pol], markersize=3,
                            label=f"{pol} ({'teacher-forced' if kind == 'tf' else 'free'})",
                            alpha=1.0 if pol in ORACLES or kind == "free" else 0.6)
                    if pol in ORACLES:
                        lo_hi = [wilson(p[1], p[2]) for p in pts]
                        ax.fill_between(xs, [v[0] for v in lo_hi], [v[1] for v in lo_hi], color=colors[pol],
                                        alpha=0.12)
            k, n = plot["full_kv"]
            ax.axhline(k / n, color="grey", lw=1, ls=":", label="FullKV (free)")
            ax.set(xticks=list(x.values()), xticklabels=[str(b) for b in budgets], ylim=(-0.03, 1.03),
                   xlabel="active KV budget (entries per layer and KV head)", ylabel="task success", title=suite)
        axes[-1].legend(fontsize=5, loc="center left", bbox_to_anchor=(1.0, 0.5))
        save_figure(fig, out, "accuracy")


def main(here: Path = HERE, free: Path = FREE, out: Path = HERE, plot: bool = True) -> None:
    """report.md (and accuracy.png / .pdf unless not ``plot``) in ``out`` from ``here``'s teacher-forced and ``free``'s
    free-running generations."""
    lines = ["# The in-loop oracle policy beside the rules (teacher-forced)", "",
             "Made by reproduce.sh and analyze.py (this folder). Dashed: teacher-forced success (10 prompts, the "
             "full cache's generation fed under each policy); solid: free-running success (50 prompts, the rule's own "
             "generation). The oracle policies read the future queries, so they exist only teacher-forced.", ""]
    plots = {}
    for suite in SUITE_NAMES:
        if not (here / suite / "generations.parquet").exists():
            continue
        section, plots[suite] = suite_section(suite, here, free)
        lines += section
    (out / "report.md").write_text("\n".join(lines))
    if plot:
        figure(plots, out)


if __name__ == "__main__":
    main()

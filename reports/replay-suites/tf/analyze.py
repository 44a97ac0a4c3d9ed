"""report.md and accuracy.png: the in-loop oracle policies beside the rules, on the suites' task component.

Reads only this folder's <suite>/generations.parquet (teacher-forced replay of the full cache's generations of the
first 10 prompts) and reports/replay-suites/<suite>/generations.parquet (the free-running replay, 50 prompts).

- **Teacher-forced success** (``tf_task``, ``kvdiag.replay.tf_task``): fed the full cache's tokens, the policy's top-1
  token is the full cache's at every token where the final line writes what the answer needs. n counts sequences
  compressed at least once whose final line holds the needed texts.
- **Free-running success**: the suite's task component (``kvdiag.tasks.suites.grade``) of the rule's own generation,
  over the compressed generations (the same 10 prompts, and all 50).
- **Agreement on the needed tokens** (``tf_needed_agree``): the share of the final line's needed tokens where the
  policy's top-1 token is the full cache's, a graded teacher-forced success; top-1 agreement, all steps: the same over
  every generated token; KL: the mean over sequences of the mean per-step KL(P_full || P_policy).
- **Concordance**: per (prompt, rule, budget) present in both, teacher-forced success against free-running success.
- Wilson 95 % CIs; McNemar's exact test (the Belady oracle oracle_future_rest, else oracle_future, against each
  policy, the same sequences).
- **Regret against oracle_future_rest** (regret.csv, one row per suite, budget and policy): each policy's mean
  teacher-forced KL (nats) minus oracle_future_rest's on the same prompts, with its cluster-bootstrap CI; per prompt
  the ratio policy / oracle_future_rest (geometric mean over prompts with its cluster-bootstrap CI, plain median, the
  prompts where the policy's KL is lower: its wins) and the exact sign test over the prompts
  (``kvdiag.replay.predict.regret``, the replay's regret.csv: ``kvdiag.core.stats.compare``, 2000 replicates, seed
  0); and per budget the prompts on which some policy's KL is below oracle_future_rest's (where it is beaten, it is
  a reference, not an oracle). Every sequence enters (compressed or not).
- Policies: oracle_future (per (layer, KV head), the entries the full-cache run's next interval + horizon = 80 queries
  attend most), oracle_future_rest (the same over every query to the end: Belady; its own replay, <suite>-rest/),
  and the six rules, selected per (layer, KV head) at 64 / 128 / 256; and at 256 with one keep set for every layer
  and KV head (per-token selection, <suite>-per-token/) the same policies and the exact-label oracle (greedy on exact
  labels at H = 16: each live entry ranked by the KL of evicting it with what is already gone), which needs it.

Run from the repository root: .venv/bin/python reports/replay-suites/tf/analyze.py
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from kvdiag.core.io import write_csv
from kvdiag.core.plotting import new_figure, save_figure, style
from kvdiag.core.stats import PromptBootstrap, format_p, format_test, mcnemar, sign_test, wilson
from kvdiag.core.tables import markdown_table
from kvdiag.replay.predict import regret
from kvdiag.tasks.suites import SUITES, grade

HERE = Path(__file__).parent
FREE = HERE.parent
ORACLES = ("oracle", "oracle_future", "oracle_future_rest")  # exact labels; attention of 80 queries; of all (Belady)
COLORS = dict(zip(ORACLES, ("darkred", "black", "dimgrey"), strict=True))
SUITE_NAMES = ("keys", "countdown")
N_BOOT, SEED, LEVEL = 2000, 0, 0.95  # the replay summary's regret.csv (kvdiag.replay.predict.write_predictions)


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
    """The teacher-forced rows of ``suite`` (per-head selection), and of ``suite``-rest (oracle_future with window
    rest, renamed) when present."""
    df = pl.read_parquet(here / suite / "generations.parquet")
    rest = here / f"{suite}-rest" / "generations.parquet"
    if rest.exists():
        df = pl.concat([df, pl.read_parquet(rest).with_columns(pl.lit(ORACLES[2]).alias("scorer"))],
                       how="diagonal_relaxed")
    return df


def tf_rows(df: pl.DataFrame) -> pl.DataFrame:
    """The sequences of teacher-forced generations ``df`` with a verdict: success, needed-token and top-1 agreement,
    KL."""
    if "tf_needed_agree" not in df.columns:
        df = df.with_columns(pl.lit(None, pl.Float64).alias("tf_needed_agree"))
    return df.filter((pl.col("compressions") > 0) & pl.col("tf_task").is_not_null()).select(
        "prompt_id", "scorer", "budget", pl.col("tf_task").alias("tf"), pl.col("tf_needed_agree").alias("needed"),
        pl.col("top1_agree").list.eval(pl.element().cast(pl.Float64)).list.mean().alias("agree"), "kl_mean")


def reference_kl(tf: pl.DataFrame) -> list[str]:
    """The exact-label oracle's teacher-forced KL against every other policy at its budget, paired by prompt (exact
    sign test: 10 prompts)."""
    out = []
    for budget in sorted(tf.filter(pl.col("scorer") == ORACLES[0])["budget"].unique()):
        wide = tf.filter(pl.col("budget") == budget).pivot(on="scorer", index="prompt_id", values="kl_mean")
        cells = []
        for pol in [c for c in wide.columns if c not in ("prompt_id", ORACLES[0])]:
            pair = wide.select(ORACLES[0], pol).drop_nulls()
            cells.append(f"{pol} {format_test(sign_test(pair[ORACLES[0]].to_numpy() - pair[pol].to_numpy()))}")
        out += ["", f"The exact-label oracle's KL against each policy's at budget {budget}, paired by prompt "
                    "(lower: the oracle's): " + "; ".join(cells) + "."]
    return out


def policy_table(tf: pl.DataFrame, free: pl.DataFrame, prompts: list[str], ref: str) -> tuple[list[str], dict]:
    """One row per (budget, policy) of ``tf`` (oracles first): teacher-forced success, agreements, KL, McNemar's test
    against ``ref`` and (rules) the free-running success of ``free`` on ``prompts`` and on all; and the plot's
    points."""
    body, plot = [], {}
    oracles = [o for o in ORACLES if o in set(tf["scorer"])]
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
                         f"{t['agree'].mean():.3f}", f"{t['kl_mean'].mean():.3f}", test,
                         "teacher-forced only" if pol in ORACLES else _rate(int(f10["free"].sum()), f10.height),
                         "–" if pol in ORACLES else _rate(int(f["free"].sum()), f.height)])
            plot[(pol, budget)] = {"tf": (int(t["tf"].sum()), t.height), "free": (int(f["free"].sum()), f.height)}
    table = markdown_table(["policy", "budget", "teacher-forced success", "agreement on the needed tokens",
                            "top-1 agreement, all steps", "KL (nats)", f"McNemar p vs {ref}",
                            "free-running, same prompts", "free-running, 50"], body)
    return [table], plot


def horizon_probe(suite: str, pt: pl.DataFrame, here: Path = HERE) -> list[str]:
    """The exact-label oracle with a horizon past the next compression (``suite``-oracle-h80/, its first prompts)
    against the per-token policies ``pt`` on the same prompts."""
    path = here / f"{suite}-oracle-h80" / "generations.parquet"
    if not path.exists():
        return []
    h80 = tf_rows(pl.read_parquet(path))
    prompts = sorted(h80["prompt_id"].unique())
    same = pt.filter(pl.col("prompt_id").is_in(prompts))
    cells = [f"{pol} {g['kl_mean'].mean():.3f} ({int(g['tf'].sum())}/{g.height})"
             for (pol,), g in same.group_by("scorer", maintain_order=True)]
    return ["", f"The exact-label oracle with labels over 80 steps (the next compression's 64 and 16 more; "
                f"{suite}-oracle-h80/, the first {len(prompts)} prompts, 5x the cost): KL {h80['kl_mean'].mean():.3f}, "
                f"success {int(h80['tf'].sum())}/{h80.height}; the per-token policies on the same prompts (the "
                f"oracle at H = 16), KL (success): "
                + "; ".join(cells) + "."]


def _num(v: float) -> str:
    return "–" if v is None or v != v else f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def regret_section(tf_all: pl.DataFrame) -> tuple[list[str], pl.DataFrame]:
    """Every policy's teacher-forced KL against oracle_future_rest's in ``tf_all`` (the per-head generations and the
    rest window's, renamed), paired by prompt: the lines of report.md and the rows of regret.csv (empty without the
    rest window's replay)."""
    ref = ORACLES[2]
    if ref not in set(tf_all["scorer"]):
        return [], pl.DataFrame()
    boot = PromptBootstrap(tf_all["prompt_id"].unique().to_list(), N_BOOT, SEED, LEVEL)
    reg = regret(tf_all, boot, ref)
    wide = tf_all.pivot(on="scorer", index=["prompt_id", "budget"], values="kl_mean")
    others = [c for c in wide.columns if c not in ("prompt_id", "budget", ref)]
    lines = ["", f"### Regret against {ref} (teacher-forced KL, nats)", "",
             f"Each policy's mean teacher-forced KL minus {ref}'s on the same prompts [95 % cluster-bootstrap CI]; "
             f"per prompt the ratio policy / {ref}: geometric mean over prompts [cluster-bootstrap CI], plain median, "
             f"wins (prompts where the policy's KL is lower) out of the prompts that entered, exact sign test. Rows "
             "by budget and regret.", ""]
    lines.append(markdown_table(
        ["policy", "budget", "KL", f"{ref} KL", "regret [CI]", "ratio, geometric mean [CI]", "ratio, median",
         "wins", "p sign"],
        [[r["scorer"], str(r["budget"]), _num(r["kl"]), _num(r["reference_kl"]),
          f"{_num(r['regret'])} [{_num(r['regret_low'])}, {_num(r['regret_high'])}]",
          f"{_num(r['ratio_geomean'])} [{_num(r['ratio_geomean_low'])}, {_num(r['ratio_geomean_high'])}]",
          _num(r["ratio_median"]), f"{r['prompts_below_reference']}/{r['prompts']}",
          format_p(r["p_value"], r["p_resolution"])] for r in reg.iter_rows(named=True)]))
    cells, beaten_any = [], False
    for budget in sorted(wide["budget"].unique()):
        w = wide.filter(pl.col("budget") == budget).drop_nulls(ref)
        below = w.filter(pl.any_horizontal(pl.col(c) < pl.col(ref) for c in others))
        beaten_any |= below.height > 0
        best = reg.filter((pl.col("budget") == budget) & (pl.col("scorer") != ORACLES[1])).row(0, named=True)
        cells.append(f"{budget}: some policy lower on {below.height} of {w.height} prompts; the best rule "
                     f"{best['scorer']} regret {_num(best['regret'])}, ratio {_num(best['ratio_geomean'])} "
                     f"[{_num(best['ratio_geomean_low'])}, {_num(best['ratio_geomean_high'])}], wins "
                     f"{best['prompts_below_reference']}/{best['prompts']}, p {format_p(best['p_value'])}")
    verdict = ("no policy it is compared with is below it on any prompt at any budget, so on this window (the whole "
               "teacher-forced trajectory) it is an oracle for these policies" if not beaten_any else
               "some policy is below it on some prompt, so it is the future-attention reference, not an oracle")
    lines += ["Per budget (the best rule: the rules' lowest mean KL; oracle_future is not a rule): "
              + "; ".join(cells) + f". {ref}: {verdict}."]
    return lines, reg


def suite_section(suite: str, here: Path = HERE, free_dir: Path = FREE) -> tuple[list[str], dict, pl.DataFrame]:
    """The suite's lines of report.md, its plot's points and its rows of regret.csv."""
    tf_all = tf_generations(suite, here)
    tf, free = tf_rows(tf_all), free_rows(suite, free_dir)
    prompts = sorted(tf_all["prompt_id"].unique())
    apart = tf_all.filter((pl.col("compressions") == 0) | pl.col("tf_task").is_null()).height
    full = free.filter(pl.col("scorer") == "full_kv")
    full10 = full.filter(pl.col("prompt_id").is_in(prompts))
    on10, on50 = _rate(int(full10["free"].sum()), full10.height), _rate(int(full["free"].sum()), full.height)
    lines = [f"## {suite}", "",
             f"Teacher-forced: {len(prompts)} prompts, {tf.height} sequences with a verdict ({apart} apart: not "
             f"compressed, or the Trace's final line lacks the needed text). FullKV free-running on these prompts: "
             f"{on10}; on all 50: {on50}.", "",
             "### Per-head selection (each layer and KV head keeps its own budget), as in the free-running replay", ""]
    ref = [o for o in ORACLES if o in set(tf["scorer"])][-1]  # the tests' reference: the Belady oracle where it ran
    table, plot = policy_table(tf, free, prompts, ref)
    lines += table
    both = tf.join(free, on=["prompt_id", "scorer", "budget"], how="inner")
    if both.height:
        cells = {(a, b): both.filter((pl.col("tf") == a) & (pl.col("free") == b)).height
                 for a in (True, False) for b in (True, False)}
        lines += ["", f"Concordance of the rules' teacher-forced and free-running success (same prompt, rule and "
                      f"budget, {both.height} pairs): both succeed {cells[(True, True)]}, both fail "
                      f"{cells[(False, False)]}, teacher-forced only {cells[(True, False)]}, free-running only "
                      f"{cells[(False, True)]}."]
    reg_lines, reg = regret_section(tf_all)
    lines += reg_lines
    per_token = here / f"{suite}-per-token" / "generations.parquet"
    if per_token.exists():
        pt = tf_rows(pl.read_parquet(per_token))
        table, pt_plot = policy_table(pt, free.clear(), prompts, ORACLES[0])
        lines += ["", "### One keep set for every layer and KV head (per-token selection), as the exact-label oracle "
                      "needs", "",
                  f"The same sequences at budget 256 ({suite}-per-token/); the free-running replay selected per head, "
                  "so it has no row here.", "", *table, *reference_kl(pt)]
        plot.update({("oracle", b): v for (pol, b), v in pt_plot.items() if pol == ORACLES[0]})
        lines += horizon_probe(suite, pt, here)
    plot["full_kv"] = (int(full["free"].sum()), full.height)
    return [*lines, ""], plot, reg.select(pl.lit(suite).alias("suite"), pl.all()) if reg.height else reg


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
            colors.update(COLORS)
            for pol in [*oracles, *rules]:
                for kind, ls, marker in (("tf", "--", "s"), ("free", "-", "o")):
                    if pol in ORACLES and kind == "free":
                        continue
                    pts = [(b, *plot[(pol, b)][kind]) for b in budgets if (pol, b) in plot and plot[(pol, b)][kind][1]]
                    if not pts:
                        continue
                    xs, ys = [x[p[0]] for p in pts], [p[1] / p[2] for p in pts]
                    ax.plot(xs, ys, ls, marker=marker, color=colors[pol], markersize=3,
                            label=f"{pol} ({'teacher-forced' if kind == 'tf' else 'free'}"
                                  f"{', per-token' if pol == ORACLES[0] else ''})",
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
    """report.md, regret.csv (and accuracy.png / .pdf unless not ``plot``) in ``out`` from ``here``'s teacher-forced
    and ``free``'s free-running generations."""
    lines = ["# The in-loop oracle policies beside the rules (teacher-forced)", "",
             "Made by reproduce.sh and analyze.py (this folder). Dashed: teacher-forced success (10 prompts, the "
             "full cache's generation fed under each policy); solid: free-running success (50 prompts, the rule's own "
             "generation). The oracle policies read the future queries, so they exist only teacher-forced.", ""]
    plots, regrets = {}, []
    for suite in SUITE_NAMES:
        if not (here / suite / "generations.parquet").exists():
            continue
        section, plots[suite], reg = suite_section(suite, here, free)
        lines += section
        regrets += [reg] if reg.height else []
    (out / "report.md").write_text("\n".join(lines))
    if regrets:
        write_csv(pl.concat(regrets), out / "regret.csv")
    if plot:
        figure(plots, out)


if __name__ == "__main__":
    main()

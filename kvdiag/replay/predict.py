"""From decisions to outcomes: how well each compression's joint damage, and each rule's single-label AUROC,
predict what follows in the loop; and every rule's in-loop regret against the reference policy.

Inputs: a teacher-forced replay with joint labels (``joint_kl`` per compression, ``kvdiag.replay.oracle``), and
optionally a free-running replay of the same prompts (fidelity and first divergence per generation,
``kvdiag.replay.outcomes``) and rank-eval's per-rule AUROC on the same Trace.

- **Per compression** (pooled over runs): Spearman between the joint damage ``J_c`` at checkpoint ``t_c`` and the
  teacher-forced KL that follows it, over ``[t_c + H, t_{c+1})``: the steps after the label's own horizon ``H`` (the
  first ``H`` steps are what the label measures, so they would correlate by construction).
- **Per run** (prompt, rule, budget): Spearman between the mean joint damage and the run's mean KL, its free-running
  fidelity (share of samples whose answer equals FullKV's) and first-divergence step (mean over samples).
- **Per rule** (each budget, across rules): Spearman between single-label AUROC and minus the mean in-loop KL, and
  between minus the mean joint damage and minus the mean in-loop KL.
- **Regret**: a rule's mean teacher-forced KL minus the reference policy's (``oracle_future`` when the sweep ran
  it, else ``oracle``; both read the queries they are judged on, so a rule can beat them: a reference, not a
  bound; the CSV columns keep the name ``oracle_*``), paired by prompt, with the ratio of means and per prompt
  and the paired tests (``kvdiag.core.stats.compare``: exact sign test below 30 prompts; and the exact sign-flip
  permutation test).
- **Where a rule beats the reference** (:func:`beaten`): per (prompt, budget) where its KL is below the reference's,
  the compression whose following segment gains it the most, the two joint labels there, and why: ``set`` (the rule's
  evicted set has the lower exact label: what the future attends most is not what hurts least to lose) or ``state``
  (its set's label is not lower, yet the KL that follows is: the caches differ by earlier compressions and by what the
  label's horizon does not see; choosing step by step is not optimal over steps).

Every CI is a 95% cluster bootstrap over prompts (``PromptBootstrap``: resample prompts, keep all their runs and
compressions; the same resamples for every statistic, so rank-eval's AUROC replicates align when seeded alike).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import polars as pl

from kvdiag.core.stats import (
    TEST_NAMES,
    PromptBootstrap,
    cluster_means,
    compare,
    format_p,
    permutation_test,
    spearman,
    spearman_ci,
)
from kvdiag.replay.oracle import ORACLE, ORACLE_FUTURE
from kvdiag.scorers.names import REPLAY_ONLY


def reference_policy(tf: pl.DataFrame) -> str | None:
    """The reference policy a sweep's regret is measured against: ``oracle_future`` if it ran, else ``oracle``."""
    ran = set(tf["scorer"].unique().to_list())
    return next((name for name in (ORACLE_FUTURE, ORACLE) if name in ran), None)


def compression_table(tf: pl.DataFrame, horizon: int) -> pl.DataFrame:
    """One row per compression of a teacher-forced replay with joint labels: prompt_id, scorer, budget, t (the
    checkpoint), joint (its joint damage, nats), kl_after (mean KL over ``[t + horizon, next checkpoint)``; null when
    that is empty)."""
    rows = []
    # a run that never compacted (a budget covering the sequence) has no compression to tabulate
    for r in tf.filter(pl.col("joint_kl").is_not_null() & (pl.col("compressions") > 0)).iter_rows(named=True):
        steps, kl, P, T = r["compression_steps"], np.asarray(r["kl_steps"]), r["prompt_len"], len(r["token_ids"])
        # kl[j] is the step that predicts position P + j (teacher_force's logprobs row j)
        ends = [*steps[1:], T]
        for t, end, joint in zip(steps, ends, r["joint_kl"], strict=True):
            lo, hi = max(t + horizon, P) - P, end - P
            rows.append({"prompt_id": r["prompt_id"], "scorer": r["scorer"], "budget": r["budget"], "t": t,
                         "joint": joint, "kl_after": float(kl[lo:hi].mean()) if hi > lo else None})
    return pl.DataFrame(rows, schema={"prompt_id": pl.String, "scorer": pl.String, "budget": pl.Int64, "t": pl.Int64,
                                      "joint": pl.Float64, "kl_after": pl.Float64})


def run_table(tf: pl.DataFrame, free: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per (prompt, scorer, budget): joint (mean joint damage over its compressions), kl (teacher-forced mean
    KL) and, with ``free`` (rows with ``fidelity``, ``first_divergence``), fidelity and divergence (means over
    samples; a sample identical to FullKV diverges at its length)."""
    runs = tf.select("prompt_id", "scorer", "budget", pl.col("joint_kl").list.mean().alias("joint"),
                     pl.col("kl_mean").alias("kl"))
    if free is None:
        return runs
    agg = free.filter(pl.col("budget").is_not_null()).group_by("prompt_id", "scorer", "budget").agg(
        pl.col("fidelity").cast(pl.Float64).mean().alias("fidelity"),
        pl.col("first_divergence").fill_null(pl.col("generated")).cast(pl.Float64).mean().alias("divergence"),
    )
    return runs.join(agg, on=["prompt_id", "scorer", "budget"], how="left")


def correlations(tf: pl.DataFrame, horizon: int, boot: PromptBootstrap, free: pl.DataFrame | None = None,
                 auroc: dict[str, tuple[float, np.ndarray]] | None = None) -> pl.DataFrame:
    """The decisions-to-outcomes table: one row per (level, predictor, outcome[, budget]) with Spearman and CI.

    auroc : rule -> (pooled single-label AUROC, its replicates [B] on ``boot``'s resamples) from rank-eval.
    """
    rows = []

    def add(level, predictor, outcome, budget, stats):
        rows.append({"level": level, "predictor": predictor, "outcome": outcome, "budget": budget, **stats})

    comp = compression_table(tf, horizon).drop_nulls("kl_after")
    if comp.height:
        add("compression", "joint damage", "KL after the horizon", None,
            spearman_ci(boot, comp["joint"].to_numpy(), comp["kl_after"].to_numpy(), comp["prompt_id"].to_numpy()))
    runs = run_table(tf, free)
    for outcome, sign in (("kl", 1.0), ("fidelity", -1.0), ("divergence", -1.0)):
        if outcome in runs.columns:  # higher damage should mean more KL, less fidelity, earlier divergence
            add("run", "joint damage", outcome if sign > 0 else f"minus {outcome}", None,
                spearman_ci(boot, runs["joint"].to_numpy(), sign * runs[outcome].to_numpy(),
                            runs["prompt_id"].to_numpy()))
    for budget in sorted(runs["budget"].unique().to_list()):
        sel = runs.filter((pl.col("budget") == budget) & ~pl.col("scorer").is_in(REPLAY_ONLY))
        rules = sorted(sel["scorer"].unique().to_list())
        means = {r: _rule_means(boot, sel.filter(pl.col("scorer") == r)) for r in rules}
        kl = {r: means[r]["kl"] for r in rules}
        add("rule", "minus joint damage", "minus KL", budget,
            _across(boot, rules, {r: _neg(means[r]["joint"]) for r in rules}, {r: _neg(kl[r]) for r in rules}))
        if auroc:
            named = [r for r in rules if r in auroc]
            add("rule", "single-label AUROC", "minus KL", budget,
                _across(boot, named, {r: auroc[r] for r in named}, {r: _neg(kl[r]) for r in named}))
    return pl.DataFrame(rows, schema={"level": pl.String, "predictor": pl.String, "outcome": pl.String,
                                      "budget": pl.Int64, "spearman": pl.Float64, "ci_low": pl.Float64,
                                      "ci_high": pl.Float64, "n": pl.Int64})


def _neg(pair: tuple[float, np.ndarray]) -> tuple[float, np.ndarray]:
    return -pair[0], -pair[1]


def _rule_means(boot: PromptBootstrap, runs: pl.DataFrame) -> dict[str, tuple[float, np.ndarray]]:
    prompts = runs["prompt_id"].to_numpy()
    return {c: boot.mean(runs[c].to_numpy(), prompts) for c in ("joint", "kl")}


def _across(boot: PromptBootstrap, rules: list[str], x: dict, y: dict) -> dict:
    """Spearman across ``rules`` of x[r] against y[r] (each (value, replicates [B])), CI from the replicates; ``n``:
    the rules with both values defined (those that entered)."""
    rules = [r for r in rules if np.isfinite(x[r][0]) and np.isfinite(y[r][0])]
    if len(rules) < 3:
        return {"spearman": float("nan"), "ci_low": float("nan"), "ci_high": float("nan"), "n": len(rules)}
    rho = spearman(np.array([x[r][0] for r in rules]), np.array([y[r][0] for r in rules]))
    reps = np.empty(0)
    if boot.mult is not None:
        xr, yr = np.stack([x[r][1] for r in rules]), np.stack([y[r][1] for r in rules])  # [R, B]
        reps = np.array([spearman(xr[:, b], yr[:, b]) for b in range(xr.shape[1])])
    low, high = boot.ci(reps)
    return {"spearman": rho, "ci_low": low, "ci_high": high, "n": len(rules)}


def regret(tf: pl.DataFrame, boot: PromptBootstrap, reference: str = ORACLE) -> pl.DataFrame:
    """Per (scorer, budget): mean teacher-forced KL, the ``reference`` oracle policy's, their paired difference
    (regret) and ratio of means with cluster-bootstrap CIs, the per-prompt ratio (geometric mean with its CI, median,
    prompts where the rule beat the oracle) and two exact paired tests of the per-prompt differences: the sign test
    (``kvdiag.core.stats.compare``: exact below 30 prompts) and the sign-flip permutation test of their mean;
    ``prompts``: where both ran (the pairs that entered). Every other policy, the other oracle included, is a row."""
    runs = tf.select("prompt_id", "scorer", "budget", pl.col("kl_mean").alias("kl"))
    oracle = runs.filter(pl.col("scorer") == reference).select("prompt_id", "budget", pl.col("kl").alias("oracle"))
    rows = []
    for (scorer, budget), g in runs.filter(pl.col("scorer") != reference).join(
            oracle, on=["prompt_id", "budget"]).group_by("scorer", "budget", maintain_order=True):
        x, o, prompts = g["kl"].to_numpy(), g["oracle"].to_numpy(), g["prompt_id"].to_numpy()
        c = compare(boot, x, o, prompts)
        r, t = c["ratios"], c["test"]
        perm = permutation_test(cluster_means(x - o, prompts)[1])
        rows.append({"scorer": scorer, "budget": budget, "reference": reference, "kl": float(x.mean()),
                     "reference_kl": float(o.mean()),
                     "regret": c["diff"], "regret_low": c["diff_ci"][0], "regret_high": c["diff_ci"][1],
                     "ratio": c["ratio"], "ratio_low": c["ratio_ci"][0], "ratio_high": c["ratio_ci"][1],
                     "ratio_geomean": r["geomean"], "ratio_geomean_low": r["geomean_ci"][0],
                     "ratio_geomean_high": r["geomean_ci"][1], "ratio_median": r["median"],
                     "prompts_above_reference": t.above, "prompts_below_reference": t.below, "test": t.test,
                     "p_value": t.p, "p_resolution": t.resolution, "test_permutation": perm.test,
                     "p_permutation": perm.p, "p_permutation_resolution": perm.resolution, "prompts": t.n})
    # rules with the same sets tie: maintain_order keeps them in the rules' order (polars may order ties either way)
    return pl.DataFrame(rows).sort("budget", "regret", maintain_order=True) if rows else pl.DataFrame()


BEATEN_SCHEMA = {
    "scorer": pl.String, "budget": pl.Int64, "prompt_id": pl.String, "kl": pl.Float64, "reference_kl": pl.Float64,
    "regret": pl.Float64, "t": pl.Int64, "compression": pl.Int64, "compressions": pl.Int64, "gain": pl.Float64,
    "gain_share": pl.Float64, "joint": pl.Float64, "reference_joint": pl.Float64, "reason": pl.String,
}


def segment_kl(row: dict) -> list[float]:
    """Per compression ``c`` of a teacher-forced run, the summed KL of the steps after it and before the next one
    (positions ``[t_c, t_{c+1})``, the last to the end; only generated positions)."""
    steps, kl, P, T = row["compression_steps"], np.asarray(row["kl_steps"]), row["prompt_len"], len(row["token_ids"])
    # kl[j] is the step that predicts position P + j (teacher_force's logprobs row j)
    return [float(kl[max(t, P) - P : max(end, P) - P].sum()) for t, end in zip(steps, [*steps[1:], T], strict=True)]


def beaten(tf: pl.DataFrame, reference: str) -> pl.DataFrame:
    """Every (rule, budget, prompt) whose mean KL is below the ``reference`` oracle's, with the compression (``t``,
    ``compression`` of ``compressions``) after which the rule gains most on the oracle (``gain``: the rule's segment
    KL minus the oracle's, summed over that segment's steps; ``gain_share``: that over the whole run's difference),
    the exact joint labels of the two evicted sets there and the ``reason``: ``set`` where the rule's set has the
    lower label (the future's attention is not the damage), else ``state`` (the caches differ by earlier choices, or
    the harm lies past the label's horizon); ``no joint labels`` without them. Both runs share their schedule."""
    runs = {(r["prompt_id"], r["scorer"], r["budget"]): r for r in tf.iter_rows(named=True)}
    rows = []
    for (pid, scorer, budget), r in runs.items():
        o = runs.get((pid, reference, budget))
        if scorer in REPLAY_ONLY or o is None or not r["kl_mean"] < o["kl_mean"]:
            continue
        if r["compression_steps"] != o["compression_steps"]:
            raise ValueError(f"{scorer} and {reference} compressed {pid} at different steps (B={budget})")
        gains = np.subtract(segment_kl(r), segment_kl(o))
        c = int(np.argmin(gains))
        total = (r["kl_mean"] - o["kl_mean"]) * len(r["kl_steps"])
        joint, reference_joint = ((r["joint_kl"][c], o["joint_kl"][c]) if r["joint_kl"] and o["joint_kl"]
                               else (None, None))
        reason = "no joint labels" if joint is None else "set" if joint < reference_joint else "state"
        rows.append({"scorer": scorer, "budget": budget, "prompt_id": pid, "kl": r["kl_mean"],
                     "reference_kl": o["kl_mean"], "regret": r["kl_mean"] - o["kl_mean"],
                     "t": r["compression_steps"][c], "compression": c + 1, "compressions": len(gains),
                     "gain": float(gains[c]), "gain_share": float(gains[c] / total), "joint": joint,
                     "reference_joint": reference_joint, "reason": reason})
    return pl.DataFrame(rows, schema=BEATEN_SCHEMA).sort("budget", "scorer", "prompt_id")


def first_sets(tf: pl.DataFrame, reference: str) -> tuple[int, int]:
    """At each run's first compression the rule and the oracle evict from the same full cache: how many (rule,
    budget, prompt) runs evict a set with a lower exact joint label than the oracle's there, of how many compared."""
    runs = {(r["prompt_id"], r["scorer"], r["budget"]): r for r in tf.filter(pl.col("compressions") > 0)
            .iter_rows(named=True)}
    pairs = [(r["joint_kl"][0], runs[(pid, reference, b)]["joint_kl"][0]) for (pid, s, b), r in runs.items()
             if s not in REPLAY_ONLY and (pid, reference, b) in runs and r["joint_kl"]
             and runs[(pid, reference, b)]["joint_kl"]]
    return sum(a < b for a, b in pairs), len(pairs)


def single_label_auroc(labels: str | os.PathLike, scores: str | os.PathLike, rules: list[str], params: dict[str, dict],
                       n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> SingleLabelAUROC:
    """Each of ``rules``' pooled single-label AUROC (rank-eval's defaults) on a labels and a scores file of one Trace,
    with its replicates on rank-eval's cluster bootstrap over that Trace's prompts: the same resamples as the
    replay's ``PromptBootstrap`` when both have the same prompts and seed, otherwise an independent draw.
    ``params``: rule -> the parameters the replay ran it with; a rule scored with others is named in ``notes``.
    Bad input (unreadable files, files of two Traces, a rule without a score column): ``UserError``."""
    from kvdiag.core.contracts import read_labels, read_scores, same_trace
    from kvdiag.core.errors import UserError
    from kvdiag.rankeval.evaluate import check_inputs, rank_eval

    label_df, label_meta = read_labels(labels, "--auroc LABELS", full=False)
    score_df, score_meta = read_scores(scores, "--auroc SCORES")
    check_inputs(label_meta, score_meta, ("--auroc LABELS", "--auroc SCORES"))
    same_trace({f"--auroc LABELS {labels}": label_meta, f"--auroc SCORES {scores}": score_meta})
    missing = [r for r in rules if r not in score_df.columns]
    if missing:
        raise UserError(f"--auroc {scores}: no score column for {', '.join(missing)}; score the Trace with every "
                        "replayed rule (kvdiag score --scorers ...)")
    result = rank_eval(label_df, score_df, scores_meta=score_meta, scorers=tuple(rules), n_boot=n_boot, seed=seed,
                       ci_level=level, reference=None)
    scored = score_meta.get("scorers", {})
    notes = [f"{r}: scored with {scored[r]}, replayed with {params[r]}" for r in rules
             if r in scored and scored[r] != params[r]]
    values = result.metrics.filter((pl.col("metric") == "auroc") & (pl.col("scope") == "pooled"))
    auroc = {r["scorer"]: (r["value"], result.replicates[(r["scorer"], "auroc", "pooled")])
             for r in values.iter_rows(named=True)}
    harm = f"{result.config.harm} (kl_mean > {result.summary['harm_threshold']:.3g} nats)"
    return SingleLabelAUROC(auroc, sorted(label_df["prompt_id"].unique().to_list()), harm, notes)


@dataclass
class SingleLabelAUROC:
    """rank-eval's pooled AUROC per rule: ``auroc[rule] = (value, replicates [B])``, the prompts it was measured on,
    its harm definition, and the rules whose scored parameters differ from the replay's."""

    auroc: dict[str, tuple[float, np.ndarray]]
    prompts: list[str]
    harm: str
    notes: list[str]


def write_predictions(tf: pl.DataFrame, out_dir, horizon: int, free: pl.DataFrame | None = None, n_boot: int = 2000,
                      seed: int = 0, level: float = 0.95, auroc: SingleLabelAUROC | None = None,
                      selection: str | None = None) -> None:
    """``compressions.csv``, ``correlations.csv``, ``regret.csv`` and ``beaten.csv`` (with an oracle policy) and
    ``decisions.md`` from a teacher-forced replay with joint labels; ``free``: a free-running replay's generations
    (its outcomes join on prompt, rule and budget); ``selection``: the sweep's (the action space every policy chose
    in, named in the summary)."""
    from kvdiag.core.io import write_csv, write_text
    from kvdiag.core.tables import markdown_table
    from kvdiag.replay.outcomes import outcome_rows

    boot = PromptBootstrap(tf["prompt_id"].unique().to_list(), n_boot, seed, level)
    outcomes = None if free is None else outcome_rows(free).filter(pl.col("prompt_id").is_in(tf["prompt_id"]))
    comp = compression_table(tf, horizon)
    corr = correlations(tf, horizon, boot, outcomes, None if auroc is None else auroc.auroc)
    write_csv(comp, out_dir / "compressions.csv")
    write_csv(corr, out_dir / "correlations.csv")

    def num(v, fmt=".3g"):
        return "–" if v is None or v != v else format(v, fmt)

    lines = [f"# Decisions to outcomes ({tf['prompt_id'].n_unique()} prompts, teacher-forced, label horizon "
             f"{horizon})", "",
             "Spearman with 95% cluster-bootstrap CIs over prompts; n: the pairs that entered (both sides defined):",
             ""]
    lines.append(markdown_table(
        ["level", "predictor", "outcome", "budget", "Spearman [CI]", "n"],
        [[r["level"], r["predictor"], r["outcome"], num(r["budget"], "d") if r["budget"] is not None else "all",
          f"{num(r['spearman'])} [{num(r['ci_low'])}, {num(r['ci_high'])}]", str(r["n"])]
         for r in corr.iter_rows(named=True)]))
    if auroc is not None:
        same = auroc.prompts == boot.prompts
        lines += ["", f"Single-label AUROC: rank-eval's pooled AUROC (harmful: {auroc.harm}) on "
                  f"{len(auroc.prompts)} prompts, "
                  + ("the replay's own, on the same bootstrap resamples." if same else
                     "not the replay's prompts; its bootstrap is drawn independently of the replay's.")]
        lines += [f"- parameters differ: {n}" for n in auroc.notes]
    reference = reference_policy(tf)
    if reference is not None:
        lines += regret_lines(tf, boot, reference, out_dir, selection, num)
    write_text(out_dir / "decisions.md", "\n".join(lines) + "\n")


def regret_lines(tf: pl.DataFrame, boot: PromptBootstrap, reference: str, out_dir, selection: str | None,
                 num) -> list[str]:
    """``regret.csv`` and ``beaten.csv`` against the ``reference`` oracle policy; their lines of decisions.md."""
    from kvdiag.core.io import write_csv
    from kvdiag.core.tables import markdown_table

    reg, won = regret(tf, boot, reference), beaten(tf, reference)
    if not reg.height:  # the oracle alone: nothing to compare
        return []
    write_csv(reg, out_dir / "regret.csv")
    write_csv(won, out_dir / "beaten.csv")
    n = int(reg["prompts"].max())
    space = {"per-head": "per (layer, KV head), the rules' own action space",
             "per-token": "token sets (the same positions in every layer and KV head)"}.get(selection, selection)
    lines = ["", f"In-loop regret against the reference policy `{reference}` (it reads the queries it is then judged "
             "on, so it is a reference, not a bound: see below where a rule beats it; mean teacher-forced KL minus "
             "the reference's, "
             "paired by prompt; ratio of means = rule / reference; per-prompt ratio: geometric mean over prompts of "
             "rule / reference with its CI, and the prompts where the rule's KL exceeds the reference's; p sign: "
             + " / ".join(TEST_NAMES[t] for t in sorted(set(reg["test"]))) + "; p perm.: "
             + " / ".join(TEST_NAMES[t] for t in sorted(set(reg["test_permutation"])))
             + f" of the mean, over prompts). Every policy selects {space}"
             + (" (`--selection " + selection + "`)." if selection else "."), ""]
    if n < 6:
        lines += [f"With {n} prompts no two-sided exact test can reach p < 0.05 (the smallest p is "
                  f"{2 / 2 ** n:.4g}, all {n} on one side): read the counts and the CIs.", ""]
    lines.append(markdown_table(
        ["scorer", "budget", "KL", "reference KL", "regret [CI]", "ratio of means [CI]", "per-prompt ratio [CI]",
         "above reference", "p sign", "p perm."],
        [[r["scorer"], str(r["budget"]), num(r["kl"]), num(r["reference_kl"]),
          f"{num(r['regret'])} [{num(r['regret_low'])}, {num(r['regret_high'])}]",
          f"{num(r['ratio'])} [{num(r['ratio_low'])}, {num(r['ratio_high'])}]",
          f"{num(r['ratio_geomean'])} [{num(r['ratio_geomean_low'])}, {num(r['ratio_geomean_high'])}]",
          f"{r['prompts_above_reference']}/{r['prompts']}", format_p(r["p_value"], r["p_resolution"]),
          format_p(r["p_permutation"], r["p_permutation_resolution"])]
         for r in reg.iter_rows(named=True)]))
    negative = reg.filter(pl.col("regret") < 0)
    lines += ["", f"Where a rule beats `{reference}` (its KL below the reference's on a prompt; beaten.csv): "
              f"{won.height} of {reg['prompts'].sum()} (rule, budget, prompt) runs; mean regret below 0 for "
              f"{negative.height} of {reg.height} (rule, budget) rows"
              + (": " + ", ".join(f"{r['scorer']}@{r['budget']}" for r in negative.iter_rows(named=True))
                 if negative.height else "") + "."]
    if won.height:
        reasons = won["reason"].value_counts(sort=True)
        wins, compared = first_sets(tf, reference)
        lines += [
            "For each, the compression after which the rule gains most (gain: the rule's KL minus the reference's "
            "summed over the steps to the next compression; share: of the run's whole difference) and the exact "
            "joint labels of the two evicted sets there. Reason `set`: the rule's set has the lower label, so what "
            "the future attends most is not what hurts least to lose (attention is not damage); `state`: its set's "
            "label is not lower, yet the KL that follows is, so the caches differ by earlier compressions or by harm "
            "past the label's horizon (choosing step by step is not optimal over steps). Reasons: "
            + ", ".join(f"{r['reason']} {r['count']}" for r in reasons.iter_rows(named=True))
            + f". At the first compression, where both evict from the same full cache, a rule's set has the lower "
            f"label in {wins} of {compared} runs.", ""]
        lines.append(markdown_table(
            ["scorer", "budget", "prompt", "regret", "t (c / C)", "gain", "share", "rule joint", "reference joint",
             "reason"],
            [[r["scorer"], str(r["budget"]), r["prompt_id"], num(r["regret"]),
              f"{r['t']} ({r['compression']}/{r['compressions']})", num(r["gain"]), num(r["gain_share"], ".0%"),
              num(r["joint"]), num(r["reference_joint"]), r["reason"]] for r in won.iter_rows(named=True)]))
    cost = tf.group_by("scorer", maintain_order=True).agg(
        (pl.col("label_seconds").sum() / pl.col("compressions").sum()).alias("s"),
        (pl.col("label_rows").sum() / pl.col("compressions").sum()).alias("rows"))
    cost = {r["scorer"]: r for r in cost.iter_rows(named=True)}
    o = cost.pop(reference)
    rules = tf.filter(~pl.col("scorer").is_in(REPLAY_ONLY))
    per = rules["label_seconds"].sum() / rules["compressions"].sum()
    what = ("its future attention and its own joint label together" if reference == ORACLE_FUTURE
            else "its label rows, sets at the label horizon, and its joint label")
    lines += ["", f"Oracle cost: `{reference}` {o['s']:.2f} s and {o['rows']:.0f} label rows per compression ({what}); "
              f"a rule's joint label costs {num(per)} s per compression (all rules pooled; "
              f"{num(min(c['s'] for c in cost.values()))}–{num(max(c['s'] for c in cost.values()))} s by rule)."]
    return lines

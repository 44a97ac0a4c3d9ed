"""What the decisions say, with cluster-bootstrap CIs over prompts (resample prompts; every checkpoint of a drawn prompt
counts, as in rank-eval: ``prompt_multiplicities(P, B, default_rng(seed))`` over the sorted prompt ids).

Per (decision, budget): mean joint damage (``kl_mean`` of the set row) over its checkpoints; the paired difference
with the reference (``best``: the rule with the least mean damage at that budget) and its paired test; the regret
against ``oracle_greedy`` (difference, ratio of means and per-prompt ratio, on the checkpoints both decided); the
additivity ratio (joint damage / sum of the set's single labels; token sets). Per budget: the best rule, the headroom
factor (best rule / best oracle, of means and per prompt), whether ``oracle_greedy`` beats ``oracle_single``, and the
Spearman correlation across rules between rank-eval's AUROC and minus the joint damage, with its CI (the same
resamples for both). Pairs: how often superadditive pairs share a near-duplicate key, the token or adjacency, against
every tested pair, and how far above additive they are. Every test and ratio summary is ``kvdiag.core.stats.compare``'s
(exact sign test below 30 prompts).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.errors import UserError
from kvdiag.core.io import read_json, read_table, write_csv, write_json, write_table, write_text
from kvdiag.core.parsing import REST
from kvdiag.core.schema import KEYS
from kvdiag.core.stats import TEST_NAMES, PromptBootstrap, compare, format_p, format_test, spearman
from kvdiag.core.tables import md_table, number_text
from kvdiag.decisions.config import RANDOM_REFERENCE, Budget
from kvdiag.decisions.interactions import NEAR_DUPLICATE

ORACLES = ("oracle_single", "oracle_greedy", "fast", "future_attention", "oracle_search")
SEARCH = "oracle_search"


def _paired(df: pl.DataFrame, a: str, b: str, budget: str) -> pl.DataFrame:
    """Checkpoints where both decisions were labeled at ``budget``: prompt_id, checkpoint, x (a), y (b)."""
    sel = df.filter(pl.col("budget") == budget)
    x = sel.filter(pl.col("decision") == a).select("prompt_id", "checkpoint", x="kl_mean")
    y = sel.filter(pl.col("decision") == b).select("prompt_id", "checkpoint", y="kl_mean")
    return x.join(y, on=["prompt_id", "checkpoint"]).drop_nulls()


def distinct_names(decisions: pl.DataFrame) -> pl.DataFrame:
    """``decisions`` with the random reference named ``RANDOM_REFERENCE``: files written before it had that name call
    it ``random``, the name of the zoo's random rule, and a group-by on ``decision`` would average the two."""
    old = (pl.col("kind") == "reference") & (pl.col("decision") == "random")
    return decisions.with_columns(decision=pl.when(old).then(pl.lit(RANDOM_REFERENCE)).otherwise(pl.col("decision")))


def _compare(labeled: pl.DataFrame, boot: PromptBootstrap, a: str, b: str, budget: str) -> dict | None:
    """``a`` against ``b`` at ``budget`` on the checkpoints both decided (``kvdiag.core.stats.compare``): the mean
    difference
    (a - b) and the ratio of means with their cluster-bootstrap CIs, the per-prompt ratio summary and the paired test
    (exact sign test below 30 prompts); JSON-ready."""
    p = _paired(labeled, a, b, budget)
    if not p.height:
        return None
    c = compare(boot, p["x"].to_numpy(), p["y"].to_numpy(), p["prompt_id"].to_numpy())
    test = c.pop("test")
    return {"a": a, "b": b, **c, "test": {**test.as_dict(), "resolution": test.resolution}}


def _headline(table: pl.DataFrame, labeled: pl.DataFrame, boot: PromptBootstrap, budget: str,
              best_rule: str | None) -> dict:
    """Per budget: the best oracle (the reference of ``ORACLES`` with the lowest mean damage, decided everywhere), the
    headroom factor (best rule / best oracle, ratio of means), and whether oracle_greedy beats oracle_single and the
    best rule (paired differences)."""
    sub = table.filter((pl.col("budget") == budget) & pl.col("decision").is_in(list(ORACLES))
                       & (pl.col("n") == pl.col("n_total")) & (pl.col("n") > 0))
    space = table.filter((pl.col("budget") == budget) & (pl.col("decision") == best_rule))["space"]
    if space.len():  # like with like: an oracle in the best rule's action space
        sub = sub.filter(pl.col("space") == space[0])
    best_oracle = sub.sort("mean_kl", maintain_order=True).row(0, named=True)["decision"] if sub.height else None
    out = {"best_rule": best_rule, "best_oracle": best_oracle, "space": space[0] if space.len() else None,
           "headroom": None, "greedy_vs_single": None, "greedy_vs_best_rule": None}
    if best_rule is not None and best_oracle is not None:
        out["headroom"] = _compare(labeled, boot, best_rule, best_oracle, budget)
    out["greedy_vs_single"] = _compare(labeled, boot, "oracle_greedy", "oracle_single", budget)
    if best_rule is not None:
        out["greedy_vs_best_rule"] = _compare(labeled, boot, "oracle_greedy", best_rule, budget)
    return out


def summarize(decisions: pl.DataFrame, meta: dict, pairs: pl.DataFrame | None = None,
              labels: pl.DataFrame | None = None, scores: pl.DataFrame | None = None) -> dict[str, pl.DataFrame | dict]:
    """The tables of a decisions run (module docstring). ``labels``/``scores``: for the AUROC-vs-decision Spearman
    (the run's files or the :func:`token_inputs` a report ships; ``res["inputs"]``: those inputs)."""
    cfg = meta.get("config") or {}
    n_boot, seed, level = int(cfg.get("n_boot", 1000)), int(cfg.get("seed", 0)), 0.95
    boot = PromptBootstrap(decisions["prompt_id"].unique().to_list(), n_boot, seed, level)
    budgets = list(dict.fromkeys(cfg.get("budgets") or decisions["budget"].unique(maintain_order=True).to_list()))
    decisions = distinct_names(decisions)
    decisions, stochastic = _stochastic_means(decisions if "sample" in decisions.columns
                                              else decisions.with_columns(sample=pl.lit(None, pl.Int64)))
    decisions = windows(decisions, cfg.get("read_window"))
    labeled = decisions.filter(pl.col("kl_mean").is_not_null())
    rules = [d for d in cfg.get("rules", []) if d in set(decisions["decision"])]
    rules += [f"{d} (stochastic)" for d in rules if f"{d} (stochastic)" in set(decisions["decision"])]
    present = set(decisions["decision"])
    names = rules + [d for d in (*ORACLES, "random", RANDOM_REFERENCE) if d in present and d not in rules]
    if "evicted_positions" not in decisions.columns:  # files from before stored sets: the space is unknown
        decisions = decisions.with_columns(evicted_positions=pl.lit(None, pl.List(pl.Int64)))
    reps: dict[tuple[str, str], np.ndarray] = {}
    rows = []
    for budget in budgets:
        for name in names:
            sel = labeled.filter((pl.col("decision") == name) & (pl.col("budget") == budget))
            total = decisions.filter((pl.col("decision") == name) & (pl.col("budget") == budget)).height
            value, r = boot.mean(sel["kl_mean"].to_numpy(), sel["prompt_id"].to_numpy())
            reps[(name, budget)] = r
            low, high = boot.ci(r)
            held = sel.filter(pl.col("kl_held_out").is_not_null())
            held_value, held_r = boot.mean(held["kl_held_out"].to_numpy(), held["prompt_id"].to_numpy())
            read = sel.filter(pl.col("kl_read").is_not_null())
            read_value, read_r = boot.mean(read["kl_read"].to_numpy(), read["prompt_id"].to_numpy())
            ratio = sel.filter(pl.col("sum_single") > 0).select(pl.col("kl_single_window") / pl.col("sum_single"))
            ratio = ratio.to_series().to_numpy() if ratio.height else np.empty(0)
            rows.append({"decision": name, "kind": "rule" if name in rules else "reference", "budget": budget,
                         "space": _space(decisions.filter(pl.col("decision") == name)),
                         "mean_kl": value, "ci_low": low, "ci_high": high, "n": sel.height, "n_total": total,
                         "read_steps_median": sel["read_steps"].median(),
                         "mean_kl_read": read_value, "read_ci_low": boot.ci(read_r)[0],
                         "read_ci_high": boot.ci(read_r)[1], "n_read": read.height,
                         "mean_kl_held_out": held_value, "held_out_ci_low": boot.ci(held_r)[0],
                         "held_out_ci_high": boot.ci(held_r)[1], "n_held_out": held.height,
                         "mean_evicted": float(sel["evicted"].mean()) if sel.height else None,
                         "additivity_median": float(np.median(ratio)) if len(ratio) else None,
                         "additivity_q25": float(np.quantile(ratio, 0.25)) if len(ratio) else None,
                         "additivity_q75": float(np.quantile(ratio, 0.75)) if len(ratio) else None})
    table = pl.DataFrame(rows)
    best = {}
    for budget in budgets:
        cand = table.filter((pl.col("budget") == budget) & (pl.col("kind") == "rule") & pl.col("mean_kl").is_not_nan())
        cand = cand.filter(pl.col("n") == pl.col("n_total"))  # a rule undefined somewhere cannot be "the best"
        best[budget] = cand.sort("mean_kl", maintain_order=True).row(0, named=True)["decision"] if cand.height else None
    reference = cfg.get("reference", "best")
    paired_rows = []
    for budget in budgets:
        ref = best[budget] if reference == "best" else (None if reference == "none" else reference)
        for name in names:
            for against, what in ((ref, "reference"), ("oracle_greedy", "regret")):
                if against is None or against == name or against not in names:
                    continue
                c = _compare(labeled, boot, name, against, budget)
                if c is None:
                    continue
                paired_rows.append({"decision": name, "against": against, "what": what, "budget": budget,
                                    "diff": c["diff"], "diff_ci_low": c["diff_ci"][0], "diff_ci_high": c["diff_ci"][1],
                                    "test": c["test"]["test"], "p_value": c["p_value"],
                                    "p_resolution": c["test"]["resolution"], "below": c["test"]["below"],
                                    "ratio": c["ratio"], "ratio_ci_low": c["ratio_ci"][0],
                                    "ratio_ci_high": c["ratio_ci"][1], **_ratio_columns(c["ratios"]), "n": c["n"]})
    paired = pl.DataFrame(paired_rows) if paired_rows else pl.DataFrame()
    headline = {"best_rule": best, "reference": reference,
                "budgets": {b: _headline(table, labeled, boot, b, best[b]) for b in budgets}}
    headroom = _search_headroom(labeled, boot, budgets, best, [r for r in rules if not r.endswith(" (stochastic)")])
    for b in budgets:
        headline["budgets"][b]["search_headroom"] = (
            _compare(labeled, boot, best[b], SEARCH, b) if best[b] is not None and SEARCH in present else None)
    sto_rows = []
    for budget in budgets:
        for name in [r for r in rules if r.endswith(" (stochastic)")]:
            det = name.removesuffix(" (stochastic)")
            c = _compare(labeled, boot, name, det, budget)
            if c is None:
                continue
            spread = stochastic.filter((pl.col("decision") == name) & (pl.col("budget") == budget))["spread"]
            sto_rows.append({"decision": det, "budget": budget, "stochastic_minus_deterministic": c["diff"],
                             "ci_low": c["diff_ci"][0], "ci_high": c["diff_ci"][1], "test": c["test"]["test"],
                             "p_value": c["p_value"], "p_resolution": c["test"]["resolution"],
                             "stochastic_lower": c["test"]["below"], "stochastic_higher": c["test"]["above"],
                             "mean_spread": float(spread.mean()) if spread.len() else None, "n": c["n"]})
    inputs = token_inputs(labels, scores, rules) if labels is not None and scores is not None else None
    spearman = _auroc_spearman(labeled, rules, budgets, reps, boot, inputs, meta)
    held_out = _held_out(labeled, boot, budgets, best, [r for r in rules if not r.endswith(" (stochastic)")])
    return {"summary": table, "inputs": inputs, "paired": paired, "spearman": spearman, "headline": headline,
            "held_out": held_out,
            "stochastic": pl.DataFrame(sto_rows), "headroom": headroom, "search": _search_cost(decisions, budgets),
            "pairs": pair_summary(pairs) if pairs is not None and pairs.height else pl.DataFrame()}


def windows(decisions: pl.DataFrame, single_window: int | str | None = None) -> pl.DataFrame:
    """``decisions`` with each row's damage split by the window its decision read (``read_steps``: 0 for a rule,
    which reads no step after the checkpoint): ``kl_read``, the mean per-step KL over the steps it read (null when
    none), and ``kl_held_out``, over the judged steps after them (null when it read them all); and
    ``kl_single_window``, the mean over the single labels' window (``single_window`` steps: the run's read window;
    None or rest: the whole judged window), what a set's sum of single labels is compared with. Files from before
    ``read_steps`` was stored hold no split (nulls)."""
    if "read_steps" not in decisions.columns:
        decisions = decisions.with_columns(read_steps=pl.lit(None, pl.Int64))
    steps, read = pl.col("kl_steps"), pl.col("read_steps")
    single = (pl.col("kl_mean") if single_window is None or single_window == REST
              else steps.list.head(int(single_window)).list.mean())
    return decisions.with_columns(
        kl_read=pl.when(read > 0).then(steps.list.head(read).list.mean()),
        kl_held_out=pl.when(read < steps.list.len()).then(steps.list.slice(read).list.mean()),
        kl_single_window=single)


def held_out_pairs(labeled: pl.DataFrame, rule: str, reference: str, budget: str) -> pl.DataFrame:
    """``rule`` against a ``reference`` that read the future, at ``budget``, split at the steps the reference read:
    prompt_id, checkpoint, read (its steps), and the two damages on the steps it read (``x_read``: the rule,
    ``y_read``: the reference) and on the judged steps after them (``x_held``, ``y_held``); the checkpoints where it
    left steps unread."""
    sel = labeled.filter(pl.col("budget") == budget)
    x = sel.filter(pl.col("decision") == rule).select("prompt_id", "checkpoint", x_steps="kl_steps")
    y = sel.filter((pl.col("decision") == reference) & (pl.col("read_steps") > 0)
                   & (pl.col("read_steps") < pl.col("kl_steps").list.len()))
    y = y.select("prompt_id", "checkpoint", read="read_steps", y_read="kl_read", y_held="kl_held_out")
    both = y.join(x, on=["prompt_id", "checkpoint"])
    return both.with_columns(x_read=pl.col("x_steps").list.head(pl.col("read")).list.mean(),
                             x_held=pl.col("x_steps").list.slice(pl.col("read")).list.mean()).drop("x_steps")


def _held_out(labeled: pl.DataFrame, boot: PromptBootstrap, budgets: list[str], best: dict,
              rules: list[str]) -> pl.DataFrame:
    """Per budget, reference that read the future and rule: the rule / the reference on the steps the reference read
    (in-window: what it chose its set on) and on the judged steps after them (held out), each per prompt (the
    geometric mean over prompts of each prompt's geometric mean over checkpoints, with its CI; the plain median of
    the prompts' ratios; the prompts where the rule does less damage, its wins) with the exact paired test of the
    differences (sign test below 30 prompts)."""
    present = set(labeled["decision"])  # labeled went through windows(): read_steps is there (null in old files)
    rows = []
    for budget in budgets:
        for ref in [o for o in ORACLES if o in present]:
            for rule in rules:
                p = held_out_pairs(labeled, rule, ref, budget)
                if not p.height:
                    continue
                row = {"budget": budget, "reference": ref, "rule": rule, "best": rule == best.get(budget),
                       "read_steps_median": float(p["read"].median()), "n": p.height}
                for part, (x, y) in {"read": ("x_read", "y_read"), "held_out": ("x_held", "y_held")}.items():
                    c = compare(boot, p[x].to_numpy(), p[y].to_numpy(), p["prompt_id"].to_numpy())
                    r = c["ratios"]
                    row.update({f"{part}_ratio_geomean": r["geomean"], f"{part}_ratio_low": r["geomean_ci"][0],
                                f"{part}_ratio_high": r["geomean_ci"][1], f"{part}_ratio_median": r["median"],
                                f"{part}_rule_wins": r["below"], f"{part}_prompts": r["n"],
                                f"{part}_test": c["test"].test, f"{part}_p_value": c["p_value"],
                                f"{part}_p_resolution": c["test"].resolution})
                rows.append(row)
    if not rows:
        return pl.DataFrame()
    order = pl.col("budget").replace_strict(budgets, list(range(len(budgets))), return_dtype=pl.Int64)
    return pl.DataFrame(rows).sort(order, "reference", "held_out_ratio_geomean", maintain_order=True)


def _space(rows: pl.DataFrame) -> str:
    """A decision's action space: ``token`` (its sets evict the same entries from every cell) or ``per-head``."""
    return "token" if rows.height and rows["evicted_positions"].is_not_null().all() else "per-head"


def _search_headroom(labeled: pl.DataFrame, boot: PromptBootstrap, budgets: list[str], best: dict,
                     rules: list[str]) -> pl.DataFrame:
    """Per budget and rule: the rule / oracle_search per checkpoint (each prompt's geometric mean of its checkpoints'
    ratios; over prompts their geometric mean with its CI, median, and the prompts where the rule does less damage
    than the search: its wins), the ratio of means, and the exact paired test of the differences (sign test below 30
    prompts). ``best``: the budget's best rule, chosen on these same checkpoints."""
    if SEARCH not in set(labeled["decision"]):
        return pl.DataFrame()
    rows = []
    for budget in budgets:
        for rule in rules:
            c = _compare(labeled, boot, rule, SEARCH, budget)
            if c is None:
                continue
            rows.append({"budget": budget, "rule": rule, "best": rule == best.get(budget),
                         **_ratio_columns(c["ratios"]), "ratio_dropped": c["ratios"]["dropped"],
                         "ratio_of_means": c["ratio"], "diff": c["diff"], "diff_ci_low": c["diff_ci"][0],
                         "diff_ci_high": c["diff_ci"][1], "test": c["test"]["test"], "p_value": c["p_value"],
                         "p_resolution": c["test"]["resolution"], "n": c["n"]})
    if not rows:
        return pl.DataFrame()
    order = pl.col("budget").replace_strict(budgets, list(range(len(budgets))), return_dtype=pl.Int64)
    return pl.DataFrame(rows).sort(order, "ratio_geomean", maintain_order=True)  # ties: the rules' order


def _search_cost(decisions: pl.DataFrame, budgets: list[str]) -> pl.DataFrame:
    """Per budget (in the run's order): oracle_search's effort (median rows and seconds), its improvement over its
    starting candidate (median nats; checkpoints where it improved) and where it started (candidate: count, most
    first, ties by name)."""
    found = decisions.filter((pl.col("decision") == SEARCH) & pl.col("kl_mean").is_not_null())
    if not found.height or "search_start" not in found.columns:
        return pl.DataFrame()
    rows = []
    for budget in budgets:
        g = found.filter(pl.col("budget") == budget)
        if not g.height:
            continue
        starts = g["search_start"].value_counts().sort("count", "search_start", descending=[True, False])
        rows.append({"budget": budget, "n": g.height, "rows_median": float(g["cost_rows"].median()),
                     "seconds_median": float(g["cost_seconds"].median()),
                     "improvement_median": float(g["search_improvement"].median()),
                     "improved": int((g["search_improvement"] > 0).sum()),
                     "converged": int(g["search_converged"].sum()) if "search_converged" in g.columns else None,
                     # relative to the label it searched: the read window's where it read part of the judged one
                     "relative_improvement_median": float(g.select(pl.col("search_improvement") / (pl.coalesce(
                         "kl_read", "kl_mean") + pl.col("search_improvement"))).to_series().median()),
                     "starts": ", ".join(f"{s} {n}" for s, n in starts.iter_rows())})
    return pl.DataFrame(rows)


def _ratio_columns(r: dict) -> dict:
    """The per-prompt ratio summary as flat columns."""
    return {"ratio_geomean": r["geomean"], "ratio_geomean_low": r["geomean_ci"][0],
            "ratio_geomean_high": r["geomean_ci"][1], "ratio_median": r["median"], "ratio_below_one": r["below"],
            "ratio_prompts": r["n"]}


def _stochastic_means(decisions: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The deterministic rows plus, per (prompt, checkpoint, rule, budget) of stochastic draws, one row
    ``"<rule> (stochastic)"`` holding the mean joint damage over the draws; and the draws' spread (std) there."""
    draws = decisions.filter(pl.col("sample").is_not_null())
    base = decisions.filter(pl.col("sample").is_null())
    if not draws.height:
        return base, pl.DataFrame()
    per = draws.group_by("prompt_id", "checkpoint", "decision", "budget", maintain_order=True).agg(
        pl.col("kl_mean").mean(), pl.col("evicted").first(), pl.col("kind").first(), pl.col("status").first(),
        spread=pl.col("kl_mean").std())
    per = per.with_columns(decision=pl.col("decision") + " (stochastic)")
    rows = per.drop("spread").with_columns(sum_single=pl.lit(None, pl.Float64))
    return pl.concat([base, rows], how="diagonal_relaxed"), per


def token_inputs(labels: pl.DataFrame, scores: pl.DataFrame, rules: list[str]) -> dict[str, pl.DataFrame]:
    """All the AUROC-vs-decision Spearman reads of the labels and scores: ``token_scores`` (KEYS + one column per rule;
    without token rows, each token's is the mean over layers and KV heads of its head rows, as mean_rank) and the
    ``token_labels`` that match them (KEYS, kl_mean, noise_floor), sorted by KEYS. Idempotent: a report ships these
    (``INPUTS``, a few MB) instead of every head score and label, and its spearman.csv regenerates from them."""
    rules = [r for r in rules if r in scores.columns]
    token = scores.filter(pl.col("granularity") == "token")
    if token.height == 0:
        token = (scores.filter(pl.col("granularity") == "head").group_by("prompt_id", "checkpoint", "position")
                 .agg(pl.col(r).mean() for r in rules)
                 .with_columns(granularity=pl.lit("token"), layer=pl.lit(-1, pl.Int64), kv_head=pl.lit(-1, pl.Int64)))
    token = token.select(*KEYS, *rules).sort(KEYS)
    lab = (labels.filter(pl.col("granularity") == "token").join(token.select(KEYS), on=list(KEYS), how="semi")
           .select(*KEYS, "kl_mean", "noise_floor").sort(KEYS))
    return {"token_scores": token, "token_labels": lab}


def _auroc_spearman(labeled, rules, budgets, reps, boot: PromptBootstrap, inputs: dict | None, meta) -> pl.DataFrame:
    """Across rules, per budget: Spearman(AUROC, - mean joint damage), CI from the same prompt resamples;
    ``inputs``: :func:`token_inputs`."""
    if inputs is None or len(rules) < 3:
        return pl.DataFrame()
    from kvdiag.rankeval import rank_eval

    token, lab = inputs["token_scores"], inputs["token_labels"]
    rules = [r for r in rules if r in token.columns]
    harm = (meta.get("harm") or {})
    result = rank_eval(lab, token, n_boot=len(boot.mult) if boot.mult is not None else 0,
                       seed=int((meta.get("config") or {}).get("seed", 0)), reference=None, scorers=tuple(rules),
                       harm=harm.get("harm", "quantile:0.9"), noise_mult=float(harm.get("noise_mult", 1.0)),
                       include_unresolved=bool(harm.get("include_unresolved", False)))
    auroc = result.metrics.filter((pl.col("metric") == "auroc") & (pl.col("scope") == "pooled"))
    a = {r["scorer"]: r["value"] for r in auroc.iter_rows(named=True)}
    aligned = sorted(lab["prompt_id"].unique().to_list()) == boot.prompts and boot.mult is not None
    rows = []
    for budget in budgets:
        names = [r for r in rules if np.isfinite(a.get(r, np.nan)) and len(reps.get((r, budget), []))]
        damage = {r: labeled.filter((pl.col("decision") == r) & (pl.col("budget") == budget))["kl_mean"].mean()
                  for r in names}
        names = [r for r in names if damage[r] is not None]
        if len(names) < 3:
            continue
        rho = spearman(np.array([a[r] for r in names]), -np.array([damage[r] for r in names]))
        low = high = float("nan")
        if aligned:
            ar = np.stack([result.replicates[(r, "auroc", "pooled")] for r in names])  # [R, B]
            dr = np.stack([reps[(r, budget)] for r in names])
            rr = np.array([spearman(ar[:, b], -dr[:, b]) for b in range(ar.shape[1])])
            low, high = boot.ci(rr)
        rows.append({"budget": budget, "spearman": rho, "ci_low": low, "ci_high": high, "rules": len(names),
                     "note": "" if aligned else "no CI: rank-eval's prompts differ from the decisions'"})
    return pl.DataFrame(rows)


def pair_summary(pairs: pl.DataFrame) -> pl.DataFrame:
    """How often superadditive pairs share a near-duplicate key, the token, or adjacency, against all tested pairs."""
    pairs = pairs.with_columns(near_duplicate=pl.col("key_cosine") >= NEAR_DUPLICATE)
    rows = []
    for group, df in (("superadditive", pairs.filter(pl.col("superadditive"))), ("all tested", pairs)):
        ratio = df["pair_kl"] / (df["single_i"] + df["single_j"])
        rows.append({"pairs": group, "n": df.height,
                     **{f"share_{c}": float(df[c].mean()) if df.height else None
                        for c in ("near_duplicate", "same_token", "adjacent")},
                     "median_key_cosine": float(df["key_cosine"].median()) if df.height else None,
                     "median_pair_over_sum": float(ratio.median()) if df.height else None,
                     "share_pair_over_sum_above_2": float((ratio > 2).mean()) if df.height else None})
    return pl.DataFrame(rows)


# --------------------------------------------------------------------------- outputs


def _fmt_ci(value, low, high, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    ci = "" if low is None or math.isnan(low) else f" [{number_text(low, digits)}, {number_text(high, digits)}]"
    return number_text(value, digits) + ci


def to_markdown(res: dict, meta: dict) -> str:
    """summary.md: per budget, every decision's joint damage with CIs; the headline comparisons; Spearman; pairs."""
    table, paired = res["summary"], res["paired"]
    cfg = meta.get("config") or {}
    labels = meta.get("labels") or {}
    text = (f"# Decisions: the joint damage of each rule's evicted set\n\n"
            f"Selection `{cfg.get('selection')}`, horizon {cfg.get('horizon')}, budgets "
            f"{', '.join(cfg.get('budgets', []))}; "
            f"single labels: {labels.get('method', 'none') if labels else 'none'}. Joint damage: `kl_mean` of the set "
            f"row (nats, mean over the horizon), mean over checkpoints, {res.get('level', 95)}% cluster-bootstrap CI "
            f"over prompts (B = {cfg.get('n_boot')}).\n\n")
    heads = res["headline"].get("budgets") or {}
    read = cfg.get("read_window")
    if read is not None and read != cfg.get("horizon"):  # the references chose on part of the judged window
        text += (f"**The references read only the first {read} steps of the {cfg.get('horizon')} judged**: on this "
                 "window they are references, not oracles (a rule can beat them, and does where the tables say so); "
                 "below, \"best oracle\" and \"headroom\" are comparisons with them, not bounds. How each does on "
                 "the steps it read and on those it did not: **In-window and held out**.\n\n")
    if heads:
        text += ("## Headline\n\nPer budget: the best rule; the best oracle (the lowest mean damage among "
                 f"{', '.join(ORACLES)}); the headroom factor, best rule / best oracle: the ratio of mean joint "
                 "damage, and per prompt (each prompt's ratio; their geometric mean with its CI, median, and the "
                 "prompts where the best rule is below the oracle); oracle_greedy against oracle_single and against "
                 "the best rule (mean difference, nats; paired by checkpoint; p: exact sign test over prompts below "
                 "30 prompts, else the paired bootstrap). `oracle_single` and `oracle_greedy` evict token sets (the "
                 "same positions in every layer and KV head); `fast` and, at per-head selection, the rules choose each "
                 "layer's and KV head's own set, so they can beat the token-set oracles.\n\n")
        rows = []
        for budget, h in heads.items():
            def cmp(c):
                if not c:
                    return "n/a"
                return f"{_fmt_ci(c['diff'], *c['diff_ci'], 3)}, {format_test(c['test'])}"
            hr = h.get("headroom")
            rows.append([budget, h.get("best_rule") or "n/a", h.get("best_oracle") or "n/a",
                         _fmt_ci(hr["ratio"], *hr["ratio_ci"], 3) if hr else "n/a", _per_prompt(hr),
                         cmp(h.get("greedy_vs_single")), cmp(h.get("greedy_vs_best_rule"))])
        text += md_table(["budget", "best rule", "best oracle", "headroom: ratio of means",
                          "headroom per prompt: geometric mean [CI], median, below 1, p",
                          "oracle_greedy − oracle_single", "oracle_greedy − best rule"], rows, "lllrrrr") + "\n"
    text += _search_markdown(res, heads, read is None or read == cfg.get("horizon"))
    text += _held_out_markdown(res)
    for budget in table["budget"].unique(maintain_order=True).to_list():
        rows = []
        sub = table.filter(pl.col("budget") == budget).sort("mean_kl", nulls_last=True, maintain_order=True)
        regret = {r["decision"]: r for r in paired.filter((pl.col("budget") == budget) & (pl.col("what") == "regret"))
                  .iter_rows(named=True)} if paired.height else {}
        for r in sub.iter_rows(named=True):
            g = regret.get(r["decision"])
            rows.append([r["decision"] + (" (ref)" if r["kind"] == "reference" else "") + f" [{r['space']}]",
                         _fmt_ci(r["mean_kl"], r["ci_low"], r["ci_high"]),
                         f"{r['n']}/{r['n_total']}",
                         _greedy_ratio(g),
                         number_text(r["additivity_median"], 3) if r["additivity_median"] is not None else ""])
        text += f"## {budget}\n\nBest rule: **{res['headline']['best_rule'].get(budget)}**.\n\n"
        text += md_table(["decision", "joint damage", "checkpoints",
                          "/ oracle_greedy: per checkpoint, geometric mean [CI] (ratio of means)",
                          "joint / sum of singles"], rows,
                         "lrrrr") + "\n"
    if res["spearman"].height:
        text += ("## Does single-entry AUROC predict the decision?\n\nSpearman across rules of rank-eval's AUROC and "
                 "minus the joint damage:\n\n")
        rows = [[r["budget"], _fmt_ci(r["spearman"], r["ci_low"], r["ci_high"]), r["rules"]]
                for r in res["spearman"].iter_rows(named=True)]
        text += md_table(["budget", "Spearman", "rules"], rows, "lrr") + "\n"
    if res["stochastic"].height:
        text += ("## Stochastic against deterministic selection\n\nPer rule and budget: the mean over checkpoints of "
                 "(mean joint damage of the stochastic draws − the deterministic per-head set's), with its CI; lower: "
                 "the checkpoints where the stochastic draws' mean is lower; p: the exact sign test over prompts below "
                 "30 prompts, else the paired bootstrap; spread: the mean over checkpoints of the draws' standard "
                 "deviation.\n\n")
        rows = [[r["decision"], r["budget"], _fmt_ci(r["stochastic_minus_deterministic"], r["ci_low"], r["ci_high"]),
                 f"{r['stochastic_lower']}/{r['n']}", f"{format_p(r['p_value'], r['p_resolution'])} "
                 f"({TEST_NAMES[r['test']]})",
                 number_text(r["mean_spread"], 3) if r["mean_spread"] is not None else "n/a", r["n"]]
                for r in res["stochastic"].iter_rows(named=True)]
        text += md_table(["rule", "budget", "stochastic − deterministic", "lower", "p", "spread", "checkpoints"], rows,
                         "llrrrrr") + "\n"
    if res["pairs"].height:
        text += (f"## Superadditive pairs\n\nTwo entries each harmless alone (single label at or below the harm "
                 f"threshold), harmful together. Near-duplicate key: cosine >= {NEAR_DUPLICATE} (mean over layers and "
                 f"KV heads).\n\n")
        p = res["pairs"]
        text += md_table(list(p.columns), [list(r) for r in p.rows()], "l" + "r" * (len(p.columns) - 1)) + "\n"
    return text


def _search_markdown(res: dict, heads: dict, searched_judged: bool = True) -> str:
    """The headroom against oracle_search (per budget: the best rule's ratio per prompt, its wins, the exact test;
    every rule's own ratio in headroom.csv) and the search's effort. ``searched_judged``: the search read the whole
    judged window (else it is a reference here, not a bound, and the text says so)."""
    found = [(b, h["search_headroom"]) for b, h in heads.items() if h.get("search_headroom")]
    if not found:
        return ""
    bound = ("it is at most every rule's and reference's damage at every checkpoint" if searched_judged else
             "**here it searched only the first steps of the judged window (--read-window), so on the judged window "
             "it is not a bound: a rule can do less damage, and its wins count where it does**")
    wins = "0 by construction" if searched_judged else "counted"
    text = ("## Headroom against oracle_search\n\n`oracle_search` searches the rules' own action space (per (layer, "
            "KV head) sets under per-head selection, token sets under per-token) from the best of every candidate "
            "(each rule's set, each reference's and any `--search-from` run's), and its result is a set whose exact "
            f"joint label is lower than that start's, or the start itself: {bound}. "
            "Headroom: best rule / oracle_search per "
            "checkpoint (each prompt's geometric mean of its checkpoints' ratios; over prompts the geometric mean "
            f"[cluster-bootstrap CI], the median, and the prompts where the rule did less damage, its wins: {wins}); "
            "the exact paired test of the differences (sign test below 30 prompts). The best rule is "
            "chosen (least mean damage) on these same checkpoints, which favours it; every rule's own ratio is in "
            "`headroom.csv`.\n\n")
    rows = []
    for budget, c in found:
        r = c["ratios"]
        rows.append([budget, heads[budget]["best_rule"], heads[budget].get("space") or "n/a",
                     _fmt_ci(r["geomean"], *r["geomean_ci"], 3), number_text(r["median"], 3),
                     f"{r['below']}/{r['n']}", number_text(c["ratio"], 3) if c["ratio"] == c["ratio"] else "n/a",
                     format_test(c["test"])])
    text += md_table(["budget", "best rule", "space", "headroom: geometric mean [CI]", "median", "rule wins",
                      "ratio of means", "best rule − oracle_search"], rows, "lllrrrrr") + "\n"
    hr = res.get("headroom")
    if hr is not None and hr.height:
        text += ("Each rule's own ratio to oracle_search, per prompt as above (the five lowest geometric means per "
                 "budget; every rule in `headroom.csv`):\n\n")
        rows = []
        for (budget,), g in hr.group_by("budget", maintain_order=True):
            rows += [[budget, r["rule"] + (" (best)" if r["best"] else ""),
                      _fmt_ci(r["ratio_geomean"], r["ratio_geomean_low"], r["ratio_geomean_high"], 3),
                      number_text(r["ratio_median"], 3), f"{r['ratio_below_one']}/{r['ratio_prompts']}",
                      f"{format_p(r['p_value'], r['p_resolution'])} ({TEST_NAMES[r['test']]})"]
                     for r in g.head(5).iter_rows(named=True)]
        text += md_table(["budget", "rule", "geometric mean [CI]", "median", "rule wins", "p"], rows,
                         "llrrrr") + "\n"
    cost = res.get("search")
    if cost is not None and cost.height:
        text += ("oracle_search's effort per (checkpoint, budget): sets labeled and seconds (medians), its "
                 "improvement over its starting candidate (median, nats and relative; checkpoints improved), the "
                 "checkpoints where it stopped converged (4x more effort had taken under 1 % off its label) rather "
                 "than at its bound of sets or seconds, and where it started:\n\n")
        rows = [[r["budget"], number_text(r["rows_median"], 4), number_text(r["seconds_median"], 3),
                 number_text(r["improvement_median"], 3), number_text(r["relative_improvement_median"], 3),
                 f"{r['improved']}/{r['n']}", "n/a" if r.get("converged") is None else f"{r['converged']}/{r['n']}",
                 r["starts"]] for r in cost.iter_rows(named=True)]
        text += md_table(["budget", "rows", "seconds", "improvement", "relative", "improved", "converged", "starts"],
                         rows, "lrrrrrrl") + "\n"
    return text


def _held_out_markdown(res: dict) -> str:
    """The best rule against each reference that read the future, on the steps it read and on those it did not."""
    h = res.get("held_out")
    if h is None or not h.height:
        return ""
    text = ("## In-window and held out\n\nEach reference that reads the future (`oracle_single`'s labels, `fast`, "
            "`oracle_greedy`, `oracle_search`, `future_attention`) chose its set on the first steps of the judged "
            "window (read: their median number); every set is judged on the whole window. Best rule / reference "
            "on the steps the reference read (in-window, where it chose) and on the judged steps after them (held "
            "out, where it did not): per prompt, the geometric mean of the prompts' ratios [cluster-bootstrap CI], "
            "their plain median, the prompts where the rule did less damage (wins) and the exact sign test of the "
            "paired differences (below 30 prompts). The best rule is the least mean damage on the whole judged "
            "window, chosen on these same checkpoints; every rule's ratios are in `held_out.csv`.\n\n")
    rows = []
    for r in h.filter(pl.col("best")).iter_rows(named=True):
        cells = []
        for part in ("read", "held_out"):
            cells += [_fmt_ci(r[f"{part}_ratio_geomean"], r[f"{part}_ratio_low"], r[f"{part}_ratio_high"], 3),
                      number_text(r[f"{part}_ratio_median"], 3), f"{r[f'{part}_rule_wins']}/{r[f'{part}_prompts']}",
                      format_p(r[f"{part}_p_value"], r[f"{part}_p_resolution"])]
        rows.append([r["budget"], r["rule"], r["reference"], number_text(r["read_steps_median"], 4), *cells])
    text += md_table(["budget", "best rule", "reference", "read", "in-window: rule / reference", "median", "wins",
                      "p", "held out: rule / reference", "median", "wins", "p"], rows, "lllrrrrrrrrr") + "\n"
    return text


def _greedy_ratio(g: dict | None) -> str:
    """A paired row's ratio to oracle_greedy as a cell: the per-checkpoint geometric mean [CI] (the ratio of means)."""
    if not g:
        return ""
    mean = number_text(g["ratio"], 3) if g["ratio"] is not None and g["ratio"] == g["ratio"] else "n/a"
    return f"{_fmt_ci(g['ratio_geomean'], g['ratio_geomean_low'], g['ratio_geomean_high'], 3)} ({mean})"


def _per_prompt(c: dict | None) -> str:
    """A comparison's per-prompt ratio summary as a cell: ``1.2 [0.8, 1.9], median 1.1, 4/10 below 1``."""
    if not c or not c["ratios"]["n"]:
        return "n/a"
    r = c["ratios"]
    dropped = f" ({r['dropped']} checkpoints with a zero side left out)" if r["dropped"] else ""
    return (f"{_fmt_ci(r['geomean'], *r['geomean_ci'], 3)}, median {number_text(r['median'], 3)}, "
            f"{r['below']}/{r['n']} below 1{dropped}, {format_test(c['test'], wins=False)}")


REFERENCE_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def figure(table: pl.DataFrame, out: Path) -> list[Path]:
    """decisions.png/.pdf: joint damage against the budget per decision on the judged window, log y, the oracles
    dotted; beside it, when some reference read only part of the window, each decision's damage on the judged steps
    after the ones it read (``mean_kl_held_out``: a rule reads none, so its held-out damage is its whole window's)."""
    from kvdiag.core.plotting import line_styles, new_figure, save_figure, style

    budgets = table["budget"].unique(maintain_order=True).to_list()
    x = {b: Budget.parse(b).value for b in budgets}
    held = "mean_kl_held_out" in table.columns and table.filter(
        (pl.col("kind") == "reference") & (pl.col("n_held_out") > 0) & (pl.col("read_steps_median") > 0)).height > 0
    panels = [("mean_kl", "judged window")] + ([("mean_kl_held_out", "held out: steps after what each read")]
                                               if held else [])
    names = table["decision"].unique(maintain_order=True).to_list()
    # each rule its own (colour, marker) (the zoo's `random` rule too: it is a rule); the references (by kind) dotted,
    # black (the oracles) or grey (the random reference), each its own marker
    kinds = set(table.filter(pl.col("kind") == "reference")["decision"].to_list())
    refs = [n for n in names if n in kinds]
    styles = line_styles([n for n in names if n not in kinds])
    styles |= {n: ("black" if n in ORACLES else "grey", REFERENCE_MARKERS[i % len(REFERENCE_MARKERS)])
               for i, n in enumerate(refs)}
    with style():
        fig, axes = new_figure(len(panels), 9 if len(panels) == 1 else 13.5, 4.5)
        for ax, (column, title) in zip(axes, panels, strict=True):
            for name in names:
                sub = table.filter((pl.col("decision") == name) & pl.col(column).is_not_nan()
                                   & pl.col(column).is_not_null()).sort("budget")
                if not sub.height:
                    continue
                xs = [x[b] for b in sub["budget"]]
                order = np.argsort(xs)
                ys = np.maximum(sub[column].to_numpy(), 1e-9)[order]
                color, marker = styles[name]
                ref = name in kinds
                ax.plot(np.array(xs)[order], ys, ls=":" if ref else "-", marker=marker, ms=4 if ref else 5,
                        lw=1.6 if ref else 1, color=color, label=name)
            ax.set(yscale="log", xlabel="keep fraction" if budgets[0].startswith("keep") else "budget (entries)",
                   ylabel="joint damage (mean KL, nats)", title=title if held else None)
            if budgets[0].startswith("keep"):
                ax.set_xscale("log", base=2)
        # outside the axes: inside, a legend of 20-40 lines covers some decision's line wherever it goes
        fig.legend(*axes[0].get_legend_handles_labels(), fontsize=6, ncol=1 if len(names) <= 30 else 2,
                   loc="outside right upper")
        return save_figure(fig, out, "decisions")


OUTPUTS = ("summary.csv", "paired.csv", "spearman.csv", "pairs_summary.csv", "stochastic.csv", "headroom.csv",
           "search.csv", "held_out.csv", "summary.md",
           "summary.json",
           "decisions.png", "decisions.pdf")
INPUTS = {"token_scores": "inputs/token_scores.parquet", "token_labels": "inputs/token_labels.parquet"}


def summarize_files(out: str | os.PathLike, labels: str | os.PathLike | None = None,
                    scores: str | os.PathLike | None = None) -> dict:
    """Summarize ``OUT/decisions.parquet`` (and pairs.parquet) into ``OUTPUTS`` in the same directory. With ``labels``
    and ``scores``, write what the AUROC-vs-decision Spearman reads of them into ``OUT/inputs/`` (``INPUTS``); without,
    read it from there when present (a committed report ships those, not the labels and scores)."""
    out = Path(out)
    decisions, meta = read_table(out / "decisions.parquet", "decisions")
    pairs = pl.read_parquet(out / "pairs.parquet", glob=False) if (out / "pairs.parquet").is_file() else None
    label_df = read_table(labels, "--labels")[0] if labels is not None else None
    score_df = read_table(scores, "--scores")[0] if scores is not None else None
    shipped = {name: out / INPUTS[name] for name in INPUTS}
    if label_df is None and score_df is None and all(p.is_file() for p in shipped.values()):
        label_df, score_df = (read_table(shipped[n], n)[0] for n in ("token_labels", "token_scores"))
    res = summarize(decisions, meta, pairs, label_df, score_df)
    if labels is not None and res["inputs"] is not None:
        for name, df in res["inputs"].items():
            write_table(df, shipped[name], {"what": f"{name} of the AUROC-vs-decision Spearman (token_inputs)"})
    write_csv(res["summary"], out / "summary.csv")
    write_csv(res["paired"], out / "paired.csv")
    write_csv(res["spearman"], out / "spearman.csv")
    write_csv(res["pairs"], out / "pairs_summary.csv")
    write_csv(res["stochastic"], out / "stochastic.csv")
    write_csv(res["headroom"], out / "headroom.csv")
    write_csv(res["search"], out / "search.csv")
    write_csv(res["held_out"], out / "held_out.csv")
    write_text(out / "summary.md", to_markdown(res, meta))
    write_json(out / "summary.json", {"headline": res["headline"], "over_budget": meta.get("over_budget")})
    figure(res["summary"], out)
    return res


def load_summary(path: str | os.PathLike) -> dict:
    """What ``kvdiag decisions`` wrote into ``path``: config.json, summary.md, summary.json (the report reads this)."""
    path = Path(path)
    missing = [f for f in ("config.json", "summary.md", "summary.json") if not (path / f).is_file()]
    if missing:
        raise UserError(f"{', '.join(missing)} missing (kvdiag decisions did not finish)")
    out = {"config": read_json(path / "config.json", "config.json"), "summary.md": (path / "summary.md").read_text(),
           "summary": read_json(path / "summary.json", "summary.json"),
           "has_figure": (path / "decisions.png").is_file()}
    if bad := [f"{k}.json" for k in ("config", "summary") if not isinstance(out[k], dict)]:
        raise UserError(f"{path}: {', '.join(bad)} is not the JSON object kvdiag decisions writes; re-run it")
    return out

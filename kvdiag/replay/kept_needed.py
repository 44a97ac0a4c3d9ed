"""Which of the tokens a suite's answer needs each rule kept, and how that relates to the task's success: the
``needed.csv`` / ``needed.md`` tables of a free-running replay of a builtin suite with needs (``kvdiag.tasks.needed``),
from ``generations.parquet`` alone (its ``needed_*`` columns).

Per generation (a rule's compressed ones): at the last compaction before the generation's final line (what the
cache held when the answer was read), the mean share of (layer, KV head) slots that held each needed token, for the
prompt's copy and for the generation's own copy (a token written after that compaction is held whole: share 1);
``kept``: every needed token of the prompt's copy, or every one of the generation's copy, held in at least
``KEPT_SHARE`` of its slots. Then per (rule, budget) and pooled per budget: the task component's success among
generations that kept and among those that did not (Wilson CIs).

The test is per rule: within one rule at one budget each prompt enters once (one generation per prompt), so its
units are independent across prompts, and Fisher's exact test (two-sided) of success against kept applies; the
rules of a budget are one family, Holm-adjusted (valid however their tests depend on each other: they share the
prompts). The pooled row ("all rules") is counts only: its generations of one prompt are not independent, so no
test pools them; its Holm p is the family's smallest (Holm's first step: Bonferroni's test that no rule's success
depends on kept). A rule's table that cannot vary given its margins (every generation kept, or every one lost, or
no success, or every one a success) has a one-point conditional distribution (p = 1 whatever happened): it has no
test and stays out of the family; so does a rule with more than one generation of a prompt (sampled generations).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from kvdiag.core.contracts import FULL_KV
from kvdiag.core.io import write_csv, write_text
from kvdiag.core.stats import PromptBootstrap, fisher_two_sided, format_p, holm, wilson
from kvdiag.core.tables import markdown_table
from kvdiag.tasks.needed import KEPT_SHARE
from kvdiag.tasks.suites import Suite, grade

ALL_RULES = "all rules"  # the pooled row of a budget


def _at_reading(r: dict) -> int | None:
    """Index in ``kept_steps`` of the last compaction at or before the final line's first token (None: none)."""
    steps = [i for i, t in enumerate(r["kept_steps"] or []) if t <= r["final_line_at"]]
    return steps[-1] if steps else None


def needed_rows(df: pl.DataFrame, suite: Suite, share: float = KEPT_SHARE) -> pl.DataFrame:
    """One row per compressed rule generation with needed tokens: its task verdict and what it kept of them when
    its final line was read (module docstring)."""
    rows = []
    for r in df.filter((pl.col("scorer") != FULL_KV) & (pl.col("compressions") > 0)).iter_rows(named=True):
        if not r.get("needed_positions"):
            continue
        i = _at_reading(r)
        by = {"prompt": [], "answer": []}
        for where, kept in zip(r["needed_where"], r["needed_kept"], strict=True):
            value = None if i is None else kept[i]
            by[where].append(1.0 if value is None else value)  # written after the compaction: held whole
        mean = {w: float(np.mean(v)) if v else None for w, v in by.items()}
        whole = {w: bool(v) and min(v) >= share for w, v in by.items()}
        rows.append({"prompt_id": r["prompt_id"], "sample": r.get("sample") or 0, "scorer": r["scorer"],
                     "budget": r["budget"], "success": grade(suite, r["text"], r["answer"])[suite.task.name],
                     "kept_prompt": mean["prompt"], "kept_answer": mean["answer"],
                     "wrote_needed": bool(by["answer"]), "kept": whole["prompt"] or whole["answer"]})
    return pl.DataFrame(rows, infer_schema_length=None)


def _rates(g: pl.DataFrame, level: float, test: bool) -> dict:
    """Success among kept and not kept (counts, rates, Wilson CIs) and, when ``test`` (one rule's generations, one
    per prompt) and the 2x2 table can vary given its margins, Fisher's exact p (else None; module docstring)."""
    out = {}
    table = []
    for name, sub in (("kept", g.filter(pl.col("kept"))), ("lost", g.filter(~pl.col("kept")))):
        k, n = int(sub["success"].sum()), sub.height
        lo, hi = wilson(k, n, level) if n else (float("nan"), float("nan"))
        out.update({f"{name}_n": n, f"{name}_success": k, f"{name}_rate": k / n if n else None,
                    f"{name}_lo": lo, f"{name}_hi": hi})
        table.append([k, n - k])
    table = np.array(table)
    varies = table.sum(1).all() and table.sum(0).all()  # both groups and both outcomes present
    out["fisher_p"] = fisher_two_sided(table) if test and varies else None
    return out


def needed_summary(rows: pl.DataFrame, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> pl.DataFrame:
    """Per (rule, budget), then pooled per budget: n (generations that entered), prompts, the mean kept shares with
    cluster-bootstrap CIs over prompts, the share that kept, the task's success among kept and not kept
    (:func:`_rates`), and per budget the family of per-rule Fisher tests: ``holm_p`` (Holm over the rules tested at
    that budget; on the pooled row the smallest of them) and ``rules_tested`` (the family's size)."""
    boot = PromptBootstrap(rows["prompt_id"].unique().to_list(), n_boot, seed, level)
    out = []
    groups = [((s, b), g) for (s, b), g in rows.group_by("scorer", "budget", maintain_order=True)]
    groups += [((ALL_RULES, b), g) for (b,), g in rows.group_by("budget", maintain_order=True)]
    for (scorer, budget), g in groups:
        row = {"scorer": scorer, "budget": budget, "n": g.height, "prompts": g["prompt_id"].n_unique(),
               "wrote_needed": int(g["wrote_needed"].sum())}
        for col in ("kept_prompt", "kept_answer"):
            vals = g.filter(pl.col(col).is_not_null())
            if vals.height:
                mean, reps = boot.mean(vals[col].to_numpy(), vals["prompt_id"].to_numpy())
                lo, hi = boot.ci(reps)
            else:
                mean = lo = hi = None
            row.update({col: mean, f"{col}_lo": lo, f"{col}_hi": hi})
        k = int(g["kept"].sum())
        lo, hi = wilson(k, g.height, level)
        one_per_prompt = scorer != ALL_RULES and row["prompts"] == g.height
        row.update({"kept_n": k, "kept_share": k / g.height, "kept_share_lo": lo, "kept_share_hi": hi,
                    **_rates(g, level, one_per_prompt)})
        out.append(row)
    for budget in dict.fromkeys(r["budget"] for r in out):  # Holm over the rules of a budget with a test
        rows_b = [r for r in out if r["budget"] == budget]
        tested = [r for r in rows_b if r["scorer"] != ALL_RULES and r["fisher_p"] is not None]
        adjusted = dict(zip(map(id, tested), holm(np.array([r["fisher_p"] for r in tested], dtype=float)),
                            strict=True))
        for r in rows_b:
            q = (min(adjusted.values(), default=None) if r["scorer"] == ALL_RULES else adjusted.get(id(r)))
            r.update(holm_p=None if q is None else float(q), rules_tested=len(tested))
    return pl.DataFrame(out, infer_schema_length=None).sort("budget", maintain_order=True)


def _pct(v, lo, hi) -> str:
    return "–" if v is None else f"{100 * v:.0f} % [{100 * lo:.0f}, {100 * hi:.0f}]"


def _holm_cell(r: dict) -> str:
    if r["holm_p"] is None:
        return "–"
    return format_p(r["holm_p"]) + (f" (smallest of {r['rules_tested']})" if r["scorer"] == ALL_RULES else "")


def write_needed(df: pl.DataFrame, suite: Suite, out_dir, n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95, share: float = KEPT_SHARE) -> pl.DataFrame | None:
    """``needed.csv`` (:func:`needed_summary`) and ``needed.md`` from free-running generations with needed tokens
    (``share``: as :func:`needed_rows`, said in the notes); None (nothing written) when no compressed generation
    records them."""
    rows = needed_rows(df, suite, share)
    if rows.height == 0:
        return None
    summary = needed_summary(rows, n_boot, seed, level)
    write_csv(summary, out_dir / "needed.csv")
    head = ["rule", "budget", "n", "prompt copy kept", "own copy kept", "kept", f"{suite.task.name} if kept",
            f"{suite.task.name} if lost", "Fisher p", "Holm p"]
    table = []
    for r in summary.iter_rows(named=True):
        table.append([r["scorer"], str(r["budget"]), str(r["n"]),
                      _pct(r["kept_prompt"], r["kept_prompt_lo"], r["kept_prompt_hi"]),
                      _pct(r["kept_answer"], r["kept_answer_lo"], r["kept_answer_hi"]) + f" ({r['wrote_needed']})",
                      f"{r['kept_n']}/{r['n']}",
                      "–" if not r["kept_n"] else f"{r['kept_success']}/{r['kept_n']} "
                      + _pct(r["kept_rate"], r["kept_lo"], r["kept_hi"]),
                      "–" if not r["lost_n"] else f"{r['lost_success']}/{r['lost_n']} "
                      + _pct(r["lost_rate"], r["lost_lo"], r["lost_hi"]),
                      "–" if r["fisher_p"] is None else format_p(r["fisher_p"]), _holm_cell(r)])
    text = (f"What each rule kept of the tokens builtin:{suite.name}'s answer needs (needed.csv), over its compressed "
            f"generations (n), when the final line was read: the cache after the last compaction before that line.\n\n"
            + markdown_table(head, table, "l" * len(head)) + "\n"
            f"- prompt copy / own copy kept: the mean share of (layer, KV head) slots holding each needed token of the "
            f"prompt's copy / of the copy the generation wrote (in parentheses: generations that wrote it), "
            f"{level:.0%} cluster-bootstrap CI over prompts ({n_boot} replicates, seed {seed}); a token written after "
            "that compaction counts as held.\n"
            f"- kept: every needed token of one copy held in at least {share:.0%} of its slots.\n"
            f"- {suite.task.name} if kept / lost: the task component's success among generations that kept / did not, "
            f"Wilson {level:.0%} CIs.\n"
            "- Fisher p: Fisher's exact test, two-sided, of success against kept within one rule at one budget: one "
            "generation per prompt, so its units are independent across prompts. – where the rule's table cannot "
            "vary given its margins (every generation kept, or every one lost, or no success, or every one a "
            "success: p = 1 whatever happened); such a rule is not tested. Holm p: Holm's adjustment over the rules "
            "tested at that budget (valid however their tests depend on each other: they share the prompts).\n"
            f"- {ALL_RULES}: every rule's generations at that budget pooled, counts only (n generations of "
            "the same prompts, so not independent: no test pools them); its Holm p is the smallest of the budget's, "
            "of the rules tested (Holm's first step: Bonferroni's test that no rule's success depends on kept).\n")
    write_text(out_dir / "needed.md", text)
    return summary

"""What a policy's decisions did to the generation, against FullKV's generation of the same prompt and sample.

Per policy row (matched to the FullKV row of the same ``prompt_id`` and ``sample``):

- **fidelity**: the answer (:func:`answer_of`: the whole generation for a suite graded on it, else the
  :func:`final_answer`) equals FullKV's; meaningful even where FullKV is wrong;
  undefined (null) where FullKV wrote no final answer (no ``\\boxed{}``, and no number before EOS);
- **first divergence**: the first generated step whose token differs from FullKV's (null: never diverged);
- **length ratio**: generated tokens / FullKV's generated tokens;
- **loop**: the generation repeats a span (:func:`has_loop`: an ``LOOP_NGRAM``-token n-gram at least
  ``LOOP_REPEATS`` times);
- accuracy and max-length hits as graded by the sweep.

A rule's outcomes are measured only on its **compressed** generations (``compressions > 0``): a generation that ended
before the cache reached the budget is FullKV's own and says nothing about the rule (fidelity 1 by construction); they
are counted apart (``uncompressed``), and every rate states its n. Rates carry a Wilson interval when every prompt has
one sample, else a cluster bootstrap over prompts (samples of a prompt are not independent); means carry the cluster
bootstrap. The paired tests compare, at each budget, the rule with the highest fidelity against each other rule on
the (prompt, sample) units where either of the two compressed: the bootstrap CI of the difference in fidelity and,
with one sample per prompt, McNemar's exact p-value; with several samples, the exact sign test (or the bootstrap p
from 30 prompts on) of the per-prompt mean differences (``kvdiag.core.stats``).
"""

from __future__ import annotations

import re

import numpy as np
import polars as pl

from kvdiag.core.contracts import FULL_KV
from kvdiag.core.errors import UserError
from kvdiag.core.io import write_csv, write_text
from kvdiag.core.stats import TEST_NAMES, PromptBootstrap, cluster_means, format_p, holm, mcnemar, paired_test, wilson
from kvdiag.core.tables import markdown_table
from kvdiag.tasks.suites import Suite, grade

LOOP_NGRAM = 12  # tokens of the repeated span (ours; long enough that counting lines never repeat)
LOOP_REPEATS = 3  # occurrences that make a loop
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")


def final_answer(text: str, finished: bool = True) -> str | None:
    """The last ``\\boxed{…}`` content (balanced braces), else (when the generation ``finished``: it wrote EOS) the
    last number, else None: the last number of a generation cut at the length limit is not its answer."""
    start = text.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i:j].strip()
    if not finished:
        return None
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def has_loop(tokens: list[int], n: int = LOOP_NGRAM, repeats: int = LOOP_REPEATS) -> bool:
    """Whether some ``n``-gram of ``tokens`` occurs at least ``repeats`` times."""
    counts: dict[tuple, int] = {}
    for i in range(len(tokens) - n + 1):
        key = tuple(tokens[i : i + n])
        counts[key] = counts.get(key, 0) + 1
        if counts[key] >= repeats:
            return True
    return False


def first_divergence(gen: list[int], ref: list[int]) -> int | None:
    """The first index where ``gen`` and ``ref`` differ (a length difference counts); None when equal."""
    for i, (a, b) in enumerate(zip(gen, ref, strict=False)):
        if a != b:
            return i
    return None if len(gen) == len(ref) else min(len(gen), len(ref))


def answer_of(row: dict, exact: bool = False) -> str | None:
    """A generation's answer: its whole text (stripped) for a suite graded on the whole generation (``exact``),
    else its :func:`final_answer`."""
    return row["text"].strip() if exact else final_answer(row["text"], row["stop"] == "eos")


def outcome_rows(df: pl.DataFrame, exact: set[str] = frozenset(), suite: Suite | None = None) -> pl.DataFrame:
    """One row per generation of ``generations.parquet`` (free-running) with its outcomes against FullKV;
    ``exact``: prompt ids whose answer is the whole generation (the builtin suites' exact check); ``suite``: the
    builtin suite of the prompts, whose components each add a column (the generation's verdict on it)."""
    if "compressions" not in df.columns:  # without it every rule's outcomes would be over no generation
        raise UserError("generations.parquet has no compressions column (written before kvdiag recorded it): rerun "
                        "kvdiag replay into a new --out")
    if "sample" not in df.columns:
        df = df.with_columns(pl.lit(0, pl.Int64).alias("sample"))
    rows = []
    full = {(r["prompt_id"], r["sample"]): r for r in df.filter(pl.col("scorer") == FULL_KV).iter_rows(named=True)}
    for r in df.iter_rows(named=True):
        gen = r["token_ids"][r["prompt_len"] :]
        ans = answer_of(r, r["prompt_id"] in exact)
        ref = full.get((r["prompt_id"], r["sample"]))
        out = {"prompt_id": r["prompt_id"], "sample": r["sample"], "scorer": r["scorer"], "budget": r["budget"],
               "correct": r["correct"], "max_length_hit": r["max_length_hit"], "loop": has_loop(gen),
               "final_answer": ans, "kl_mean": r["kl_mean"], "generated": r["generated"],
               "compressed": None if r["scorer"] == FULL_KV else r["compressions"] > 0,
               "fidelity": None, "first_divergence": None, "diverged": None, "length_ratio": None}
        if suite is not None:
            out.update(grade(suite, r["text"], r["answer"]))
        if ref is not None and r["scorer"] != FULL_KV:
            ref_gen = ref["token_ids"][ref["prompt_len"] :]
            ref_ans = answer_of(ref, r["prompt_id"] in exact)
            step = first_divergence(gen, ref_gen)
            out.update(fidelity=None if ref_ans is None else ans == ref_ans, first_divergence=step,
                       diverged=step is not None, length_ratio=len(gen) / max(len(ref_gen), 1))
        rows.append(out)
    return pl.DataFrame(rows, infer_schema_length=None)


def summarize_outcomes(out: pl.DataFrame, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> pl.DataFrame:
    """One row per (scorer, budget): each outcome's value and CI over its compressed generations (columns
    ``<metric>``, ``<metric>_lo/_hi``, ``<metric>_n``); ``generations`` in all, ``uncompressed`` left out."""
    boot = PromptBootstrap(out["prompt_id"].unique().to_list(), n_boot, seed, level)
    single = bool(out.group_by("prompt_id").agg(pl.col("sample").n_unique())["sample"].max() == 1)
    rows = []
    for (scorer, budget), g in out.group_by("scorer", "budget", maintain_order=True):
        row = {"scorer": scorer, "budget": budget, "generations": g.height, "prompts": g["prompt_id"].n_unique(),
               "uncompressed": int((g["compressed"] == False).sum())}  # noqa: E712 (null: FullKV)
        g = g.filter(pl.col("compressed").is_null() | pl.col("compressed"))
        for metric in ("correct", "fidelity", "diverged", "loop", "max_length_hit", "length_ratio", "kl_mean"):
            sel = g.filter(pl.col(metric).is_not_null())
            vals = sel[metric].cast(pl.Float64).to_numpy()
            mean, reps = boot.mean(vals, sel["prompt_id"].to_numpy())
            binary = metric not in ("length_ratio", "kl_mean")
            lo, hi = wilson(int(vals.sum()), len(vals), level) if binary and single else boot.ci(reps)
            row.update({metric: mean, f"{metric}_lo": lo, f"{metric}_hi": hi, f"{metric}_n": len(vals)})
        steps = g["first_divergence"].drop_nulls()
        row["first_divergence_median"] = float(steps.median()) if steps.len() else None
        rows.append(row)
    return pl.DataFrame(rows, infer_schema_length=None)


def paired_tests(out: pl.DataFrame, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> pl.DataFrame:
    """At each budget: the rule with the highest fidelity (on its compressed generations) against every other rule,
    on the units where either compressed; ``test``/``p_value``: McNemar's exact test with one sample per prompt, else
    ``kvdiag.core.stats.paired_test`` of the per-prompt mean differences."""
    boot = PromptBootstrap(out["prompt_id"].unique().to_list(), n_boot, seed, level)
    single = bool(out.group_by("prompt_id").agg(pl.col("sample").n_unique())["sample"].max() == 1)
    rules = out.filter(pl.col("scorer") != FULL_KV)
    rows = []
    for (budget,), g in rules.group_by("budget", maintain_order=True):
        fid = (g.filter(pl.col("compressed")).group_by("scorer").agg(pl.col("fidelity").cast(pl.Float64).mean())
               .sort("fidelity", "scorer", descending=[True, False], nulls_last=True))
        if fid.height == 0:  # no rule compressed at this budget (it holds every prompt whole): nothing to compare
            continue
        best = fid["scorer"][0]
        wide = g.pivot(on="scorer", index=["prompt_id", "sample"], values="fidelity")
        comp = g.pivot(on="scorer", index=["prompt_id", "sample"], values="compressed")
        for other in fid["scorer"][1:]:
            either = comp.select("prompt_id", "sample", either=pl.col(best) | pl.col(other))
            pair = wide.select("prompt_id", "sample", best, other).join(either, on=["prompt_id", "sample"])
            pair = pair.filter(pl.col("either")).drop_nulls()
            a, b = pair[best].cast(pl.Float64).to_numpy(), pair[other].cast(pl.Float64).to_numpy()
            prompts = pair["prompt_id"].to_numpy()
            diff, reps = boot.mean(a - b, prompts)
            lo, hi = boot.ci(reps)
            if single:
                test, p, res = "mcnemar", mcnemar(a == 1, b == 1), 0.0
            else:
                t = paired_test(cluster_means(a - b, prompts)[1], reps)
                test, p, res = t.test, t.p, t.resolution
            rows.append({"budget": budget, "best": best, "other": other, "units": len(a),
                         "prompts": int(np.unique(prompts).size), "fidelity_diff": diff, "diff_lo": lo,
                         "diff_hi": hi, "test": test, "p_value": p, "p_resolution": res})
    return pl.DataFrame(rows, infer_schema_length=None)


def component_summary(out: pl.DataFrame, suite: Suite, level: float = 0.95, n_boot: int = 2000,
                      seed: int = 0) -> pl.DataFrame:
    """One row per (scorer, budget, component of ``suite``): ``passed`` of ``n`` generations (a rule's compressed
    ones; FullKV's all) and the rate's CI (Wilson with one sample per prompt, else the cluster bootstrap over
    prompts); ``uncompressed``: the rule's generations left out."""
    boot = PromptBootstrap(out["prompt_id"].unique().to_list(), n_boot, seed, level)
    single = bool(out.group_by("prompt_id").agg(pl.col("sample").n_unique())["sample"].max() == 1)
    rows = []
    for (scorer, budget), g in out.group_by("scorer", "budget", maintain_order=True):
        left = int((g["compressed"] == False).sum())  # noqa: E712 (null: FullKV)
        g = g.filter(pl.col("compressed").is_null() | pl.col("compressed"))
        for c in suite.components:
            vals = g[c.name].cast(pl.Float64).to_numpy()
            rate, reps = boot.mean(vals, g["prompt_id"].to_numpy())
            lo, hi = wilson(int(vals.sum()), len(vals), level) if single else boot.ci(reps)
            rows.append({"scorer": scorer, "budget": budget, "component": c.name, "role": c.role,
                         "passed": int(vals.sum()), "n": len(vals), "rate": rate, "rate_lo": lo, "rate_hi": hi,
                         "prompts": g["prompt_id"].n_unique(), "uncompressed": left})
    return pl.DataFrame(rows, infer_schema_length=None)


def component_tests(out: pl.DataFrame, suite: Suite, n_boot: int = 2000, seed: int = 0,
                    level: float = 0.95) -> pl.DataFrame:
    """Per (budget, component): each rule against FullKV (on the rule's compressed generations, FullKV's of the same
    prompt and sample) and each pair of rules (on the units where either compressed): passes of each, the discordant
    pairs (``a_only``, ``b_only``), the difference in rate with its cluster-bootstrap CI, and p: McNemar's exact test
    with one sample per prompt, else ``kvdiag.core.stats.paired_test`` of the per-prompt mean differences;
    ``p_holm``: Holm-adjusted within the (budget, component) family."""
    boot = PromptBootstrap(out["prompt_id"].unique().to_list(), n_boot, seed, level)
    single = bool(out.group_by("prompt_id").agg(pl.col("sample").n_unique())["sample"].max() == 1)
    key = ["prompt_id", "sample"]
    full = out.filter(pl.col("scorer") == FULL_KV)
    rules = out.filter(pl.col("scorer") != FULL_KV)
    names = list(dict.fromkeys(rules["scorer"].to_list()))
    rows = []
    for (budget,), g in rules.group_by("budget", maintain_order=True):
        for c in suite.components:
            family = []
            pairs = [(FULL_KV, r) for r in names] if full.height else []
            pairs += [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
            for a, b in pairs:
                left = full if a == FULL_KV else g.filter(pl.col("scorer") == a)
                right = g.filter(pl.col("scorer") == b)
                pair = left.select(*key, pl.col(c.name).alias("a"), pl.col("compressed").alias("a_c")).join(
                    right.select(*key, pl.col(c.name).alias("b"), pl.col("compressed").alias("b_c")), on=key)
                either = pl.col("b_c") if a == FULL_KV else pl.col("a_c") | pl.col("b_c")
                pair = pair.filter(either)
                x, y = pair["a"].to_numpy().astype(bool), pair["b"].to_numpy().astype(bool)
                prompts = pair["prompt_id"].to_numpy()
                diff, reps = boot.mean(x.astype(float) - y, prompts)
                lo, hi = boot.ci(reps)
                if single:
                    test, p = "mcnemar", mcnemar(x, y) if len(x) else float("nan")
                else:
                    t = paired_test(cluster_means(x.astype(float) - y, prompts)[1], reps)
                    test, p = t.test, t.p
                family.append({"budget": budget, "component": c.name, "a": a, "b": b, "units": len(x),
                               "prompts": int(np.unique(prompts).size), "a_passed": int(x.sum()),
                               "b_passed": int(y.sum()), "a_only": int((x & ~y).sum()), "b_only": int((~x & y).sum()),
                               "diff": diff, "diff_lo": lo, "diff_hi": hi, "test": test, "p_value": p})
            for row, adj in zip(family, holm(np.array([r["p_value"] for r in family])), strict=True):
                rows.append({**row, "p_holm": float(adj)})
    return pl.DataFrame(rows, infer_schema_length=None)


def write_components(out: pl.DataFrame, suite: Suite, out_dir, n_boot: int = 2000, seed: int = 0,
                     level: float = 0.95) -> pl.DataFrame:
    """``components.csv`` (:func:`component_summary`), ``components_paired.csv`` (:func:`component_tests`) and
    ``components.md``: per budget a row per rule, a column per component (passed/n, rate and CI), the task component
    first; then the task component's paired tests."""
    summary = component_summary(out, suite, level, n_boot, seed)
    tests = component_tests(out, suite, n_boot, seed, level)
    write_csv(summary, out_dir / "components.csv")
    write_csv(tests, out_dir / "components_paired.csv")
    order = [suite.task, *(c for c in suite.components if c.role == "step"),
             *(c for c in suite.components if c.role == "format")]
    cells = {(r["scorer"], r["budget"], r["component"]): r for r in summary.iter_rows(named=True)}
    scorers = list(dict.fromkeys(summary["scorer"].to_list()))
    budgets = sorted(summary["budget"].drop_nulls().unique().to_list())
    rows = []
    for budget in [None, *budgets]:
        for scorer in scorers:
            if (scorer == FULL_KV) != (budget is None) or (scorer, budget, order[0].name) not in cells:
                continue
            row = [scorer, "full" if budget is None else str(budget)]
            for c in order:
                r = cells[(scorer, budget, c.name)]
                row.append("–" if not r["n"] else f"{r['passed']}/{r['n']} = {100 * r['rate']:.0f} % "
                           f"[{100 * r['rate_lo']:.0f}, {100 * r['rate_hi']:.0f}]")
            row.append(str(cells[(scorer, budget, order[0].name)]["uncompressed"]) if budget is not None else "–")
            rows.append(row)
    single = bool(out.group_by("prompt_id").agg(pl.col("sample").n_unique())["sample"].max() == 1)
    ci = "Wilson (one sample per prompt)" if single else f"cluster bootstrap over prompts ({n_boot} replicates)"
    head = ["scorer", "budget", *(f"{c.name} ({c.role})" for c in order), "uncompressed (left out)"]
    text = (f"Components of builtin:{suite.name} (components.csv): the headline is the task component "
            f"({suite.task.name}); format failures are reported beside it, not folded in. Each cell: passed/n = "
            f"rate [{level:.0%} CI, {ci}], n = a rule's compressed generations (FullKV: all).\n\n"
            + markdown_table(head, rows, "l" * len(head)) + "\n"
            + "\n".join(f"- {c.name} ({c.role}): {c.what}." for c in order) + "\n")
    task = tests.filter(pl.col("component") == suite.task.name)
    if task.height:
        name = "McNemar's exact test" if single else "the paired test of the per-prompt mean differences"
        text += (f"\nPaired tests on {suite.task.name} (components_paired.csv has every component): at each budget "
                 "each rule against FullKV (units: the rule's compressed generations) and each pair of rules (units "
                 "where either compressed); a/b only: units only a/only b passed; difference a - b with its "
                 f"{level:.0%} cluster-bootstrap CI; p: {name}; Holm: adjusted within the budget's family.\n\n")
        text += markdown_table(
            ["budget", "a", "b", "units", "a passed", "b passed", "a only", "b only", "a - b, points [CI]", "p",
             "p (Holm)"],
            [[str(r["budget"]), r["a"], r["b"], str(r["units"]), str(r["a_passed"]), str(r["b_passed"]),
              str(r["a_only"]), str(r["b_only"]),
              f"{100 * r['diff']:.3g} [{100 * r['diff_lo']:.3g}, {100 * r['diff_hi']:.3g}]",
              format_p(r["p_value"]), format_p(r["p_holm"])] for r in task.iter_rows(named=True)],
            "l" * 11) + "\n"
    write_text(out_dir / "components.md", text)
    return summary


METRICS = [("correct", "acc %"), ("fidelity", "fidelity %"), ("diverged", "diverged %"), ("loop", "loops %"),
           ("max_length_hit", "max-len %"), ("length_ratio", "length ratio"), ("kl_mean", "KL")]


def write_outcomes(df: pl.DataFrame, out_dir, n_boot: int = 2000, seed: int = 0, level: float = 0.95,
                   exact: set[str] = frozenset(), suite: Suite | None = None) -> pl.DataFrame:
    """``outcomes.csv`` (every generation's outcomes), ``outcomes_summary.csv``, ``paired.csv`` and
    ``outcomes.md`` from free-running ``generations.parquet`` rows (without FullKV's, from ``--no-full-kv``: no
    fidelity and no paired.csv) (``exact``, ``suite``: as :func:`outcome_rows`); with a ``suite`` that has
    components, also :func:`write_components` and, where the generations record needed tokens,
    ``kvdiag.replay.kept_needed.write_needed``."""
    out = outcome_rows(df, exact, suite)
    if suite is not None and suite.components:
        write_components(out, suite, out_dir, n_boot, seed, level)
        if "needed_positions" in df.columns:
            from kvdiag.replay.kept_needed import write_needed

            write_needed(df, suite, out_dir, n_boot, seed, level)
    summary = summarize_outcomes(out, n_boot, seed, level)
    full = bool((out["scorer"] == FULL_KV).any())  # fidelity and its paired tests compare with FullKV's generation
    paired = paired_tests(out, n_boot, seed, level) if full else None
    write_csv(out, out_dir / "outcomes.csv")
    write_csv(summary, out_dir / "outcomes_summary.csv")
    if paired is not None:
        write_csv(paired, out_dir / "paired.csv")
    single = summary["generations"].max() == summary["prompts"].max()
    head = ["scorer", "budget", "compressed", "fidelity n", *(label for _, label in METRICS),
            "first div. (median step)"]
    rows = []
    for r in summary.sort("budget", "scorer", nulls_last=False).iter_rows(named=True):
        cells = []
        for metric, _ in METRICS:
            v, lo, hi = r[metric], r[f"{metric}_lo"], r[f"{metric}_hi"]
            k = 1.0 if metric in ("length_ratio", "kl_mean") else 100.0
            cells.append("–" if v is None or v != v else f"{k * v:.3g} [{k * lo:.3g}, {k * hi:.3g}]")
        fd = r["first_divergence_median"]
        rows.append([r["scorer"], "full" if r["budget"] is None else str(r["budget"]),
                     "–" if r["scorer"] == FULL_KV else f"{r['generations'] - r['uncompressed']}/{r['generations']}",
                     str(r["fidelity_n"]), *cells,
                     "–" if fd is None else f"{fd:.0f}"])
    ci = "Wilson (one sample per prompt)" if single else "cluster bootstrap over prompts"
    notes = [
        f"{summary['prompts'].max()} prompts, {summary['generations'].max()} generations per (rule, budget). A rule's "
        "outcomes are over its compressed generations only (compressed: generations that compressed the cache at "
        "least once / all; the others ended before the cache reached the budget, are FullKV's own generation, and are "
        "left out); fidelity n: those where FullKV wrote a final answer. "
        f"{level:.0%} CIs: rates {ci}, means cluster bootstrap over prompts ({n_boot} replicates, seed {seed}).",
        "fidelity: same final answer as FullKV's generation of the same prompt and sample ("
        + ("the whole generation: the suite grades all of it" if exact and set(out["prompt_id"]) <= set(exact) else
           "the last \\boxed{}, else in a generation that wrote EOS the last number; null where FullKV wrote none"
           + ("; the whole generation for the prompts graded on it" if exact else ""))
        + "); diverged: the generated tokens differ from FullKV's; "
        f"loops: a {LOOP_NGRAM}-token span repeated {LOOP_REPEATS}+ times; length ratio: generated / FullKV's.",
    ]
    if not full:
        notes.append("This replay ran without FullKV (--no-full-kv): fidelity, diverged, length ratio and first "
                     "divergence compare with FullKV's generation and are not measured (–), nor is the paired "
                     "fidelity test (no paired.csv); rerun with FullKV for them.")
    text = markdown_table(head, rows, "l" * len(head)) + "\n" + "\n".join(notes) + "\n"
    if paired is not None and paired.height:
        text += ("\nPaired (paired.csv): at each budget the rule with the highest fidelity against each other rule, on "
                 "the (prompt, sample) units where either compressed: the difference in fidelity with its "
                 f"{level:.0%} CI, and p ("
                 + ("McNemar's exact test" if single else "of the per-prompt mean differences") + ").\n\n")
        text += markdown_table(
            ["budget", "best", "other", "units (prompts)", "fidelity difference, points [CI]", "test", "p"],
            [[str(r["budget"]), r["best"], r["other"], f"{r['units']} ({r['prompts']})",
              f"{100 * r['fidelity_diff']:.3g} [{100 * r['diff_lo']:.3g}, {100 * r['diff_hi']:.3g}]",
              TEST_NAMES.get(r["test"], r["test"]), format_p(r["p_value"], r["p_resolution"])]
             for r in paired.iter_rows(named=True)], "l" * 7) + "\n"
    write_text(out_dir / "outcomes.md", text)
    return summary

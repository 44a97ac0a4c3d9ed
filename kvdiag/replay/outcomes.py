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

Rates carry a Wilson interval when every prompt has one sample, else a cluster bootstrap over prompts (samples of a
prompt are not independent); means carry the cluster bootstrap. The paired tests compare, at each budget, the rule
with the highest fidelity against each other rule on the same (prompt, sample) units: the bootstrap CI of the
difference in fidelity and, with one sample per prompt, McNemar's exact p-value.
"""

from __future__ import annotations

import re

import polars as pl
from scipy.stats import binomtest

from kvdiag.io import write_csv, write_text
from kvdiag.stats import PromptBootstrap
from kvdiag.tables import markdown_table

LOOP_NGRAM = 12  # tokens of the repeated span (ours; long enough that counting lines never repeat)
LOOP_REPEATS = 3  # occurrences that make a loop
FULL_KV = "full_kv"
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


def outcome_rows(df: pl.DataFrame, exact: set[str] = frozenset()) -> pl.DataFrame:
    """One row per generation of ``generations.parquet`` (free-running) with its outcomes against FullKV;
    ``exact``: prompt ids whose answer is the whole generation (the builtin suites' exact check)."""
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
               "fidelity": None, "first_divergence": None, "diverged": None, "length_ratio": None}
        if ref is not None and r["scorer"] != FULL_KV:
            ref_gen = ref["token_ids"][ref["prompt_len"] :]
            ref_ans = answer_of(ref, r["prompt_id"] in exact)
            step = first_divergence(gen, ref_gen)
            out.update(fidelity=None if ref_ans is None else ans == ref_ans, first_divergence=step,
                       diverged=step is not None, length_ratio=len(gen) / max(len(ref_gen), 1))
        rows.append(out)
    return pl.DataFrame(rows, infer_schema_length=None)


def wilson(k: int, n: int, level: float) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    ci = binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    return float(ci.low), float(ci.high)


def summarize_outcomes(out: pl.DataFrame, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> pl.DataFrame:
    """One row per (scorer, budget): each outcome's value and CI (columns ``<metric>``, ``<metric>_lo/_hi``, n)."""
    boot = PromptBootstrap(out["prompt_id"].unique().to_list(), n_boot, seed, level)
    single = bool(out.group_by("prompt_id").agg(pl.col("sample").n_unique())["sample"].max() == 1)
    rows = []
    for (scorer, budget), g in out.group_by("scorer", "budget", maintain_order=True):
        row = {"scorer": scorer, "budget": budget, "generations": g.height, "prompts": g["prompt_id"].n_unique()}
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
    """At each budget: the rule with the highest fidelity against every other rule, on their shared units."""
    boot = PromptBootstrap(out["prompt_id"].unique().to_list(), n_boot, seed, level)
    single = bool(out.group_by("prompt_id").agg(pl.col("sample").n_unique())["sample"].max() == 1)
    rules = out.filter(pl.col("scorer") != FULL_KV)
    rows = []
    for (budget,), g in rules.group_by("budget", maintain_order=True):
        # ties keep the rules' order in the generations: the same best on every run
        fid = (g.group_by("scorer", maintain_order=True).agg(pl.col("fidelity").cast(pl.Float64).mean())
               .sort("fidelity", descending=True, maintain_order=True))
        best = fid["scorer"][0]
        wide = g.pivot(on="scorer", index=["prompt_id", "sample"], values="fidelity")
        for other in fid["scorer"][1:]:
            pair = wide.select("prompt_id", best, other).drop_nulls()
            a, b = pair[best].cast(pl.Float64).to_numpy(), pair[other].cast(pl.Float64).to_numpy()
            diff, reps = boot.mean(a - b, pair["prompt_id"].to_numpy())
            lo, hi = boot.ci(reps)
            p = None
            if single:
                n10, n01 = int(((a == 1) & (b == 0)).sum()), int(((a == 0) & (b == 1)).sum())
                p = float(binomtest(n10, n10 + n01).pvalue) if n10 + n01 else 1.0
            rows.append({"budget": budget, "best": best, "other": other, "units": len(a), "fidelity_diff": diff,
                         "diff_lo": lo, "diff_hi": hi, "mcnemar_p": p})
    return pl.DataFrame(rows, infer_schema_length=None)


METRICS = [("correct", "acc %"), ("fidelity", "fidelity %"), ("diverged", "diverged %"), ("loop", "loops %"),
           ("max_length_hit", "max-len %"), ("length_ratio", "length ratio"), ("kl_mean", "KL")]


def write_outcomes(df: pl.DataFrame, out_dir, n_boot: int = 2000, seed: int = 0, level: float = 0.95,
                   exact: set[str] = frozenset()) -> pl.DataFrame:
    """``outcomes.csv`` (every generation's outcomes), ``outcomes_summary.csv``, ``paired.csv`` and
    ``outcomes.md`` from free-running ``generations.parquet`` rows that include FullKV (``exact``: as
    :func:`outcome_rows`)."""
    out = outcome_rows(df, exact)
    summary = summarize_outcomes(out, n_boot, seed, level)
    paired = paired_tests(out, n_boot, seed, level)
    write_csv(out, out_dir / "outcomes.csv")
    write_csv(summary, out_dir / "outcomes_summary.csv")
    write_csv(paired, out_dir / "paired.csv")
    single = summary["generations"].max() == summary["prompts"].max()
    head = ["scorer", "budget", *(label for _, label in METRICS), "first div. (median step)"]
    rows = []
    for r in summary.sort("budget", "scorer", nulls_last=False).iter_rows(named=True):
        cells = []
        for metric, _ in METRICS:
            v, lo, hi = r[metric], r[f"{metric}_lo"], r[f"{metric}_hi"]
            k = 1.0 if metric in ("length_ratio", "kl_mean") else 100.0
            cells.append("–" if v is None or v != v else f"{k * v:.3g} [{k * lo:.3g}, {k * hi:.3g}]")
        fd = r["first_divergence_median"]
        rows.append([r["scorer"], "full" if r["budget"] is None else str(r["budget"]), *cells,
                     "–" if fd is None else f"{fd:.0f}"])
    ci = "Wilson (one sample per prompt)" if single else "cluster bootstrap over prompts"
    notes = [
        f"{summary['prompts'].max()} prompts, {summary['generations'].max()} generations per (rule, budget); "
        f"{level:.0%} CIs: rates {ci}, means cluster bootstrap over prompts ({n_boot} replicates, seed {seed}).",
        "fidelity: same final answer as FullKV's generation of the same prompt and sample ("
        + ("the whole generation: the suite grades all of it" if exact and set(out["prompt_id"]) <= set(exact) else
           "the last \\boxed{}, else in a generation that wrote EOS the last number; null where FullKV wrote none"
           + ("; the whole generation for the prompts graded on it" if exact else ""))
        + "); diverged: the generated tokens differ from FullKV's; "
        f"loops: a {LOOP_NGRAM}-token span repeated {LOOP_REPEATS}+ times; length ratio: generated / FullKV's.",
    ]
    if paired.height:
        best = paired.group_by("budget").agg(pl.col("best").first()).sort("budget")
        notes.append("Paired (paired.csv): highest fidelity per budget: " + ", ".join(
            f"B={b} {s}" for b, s in best.iter_rows()) + "; the difference to each other rule with its CI"
            + (" and McNemar's exact p." if single else "."))
    write_text(out_dir / "outcomes.md", markdown_table(head, rows, "l" * len(head)) + "\n" + "\n".join(notes) + "\n")
    return summary

"""generalisation.md and its CSVs (-best-known, -current-known, -split, -swaps, -reach, -gemma3-reach, -search,
-gemma3-search, -descent, -gemma3-descent, -descent-half, -gemma3-descent-half, -held-out-descent, -pooled-known):
issue #54's generalisation check.

The first and the last table each read, per model, two committed runs of ``reproduce-h128.sh`` made by one search
(``RUN_PAIRS``: dfe37b9's search with cell-wise recombination, and the descent, which supersedes it): one where every
reference reads the first 64 of the 128 judged steps (``--read-window 64``: ``MODEL-h128-half/``,
``MODEL-h128-half-descent/``) and one where every reference reads all 128 (the 128-step search's run). On steps
64-127, which the first run's references never read and the second run's did, the same reference's damage chosen
without those steps (held out) is set against its damage chosen with them (in-sample): per (checkpoint, budget) the
mean per-step KL over steps 64-127 of each run's set (``kl_steps``, exact set rows through the chunked engine).

Per model, budget and reference (``fast``, ``future_attention``, ``oracle_search``): the mean damage of each, and per
prompt the ratio held out / in-sample (``kvdiag.core.stats.compare``: the geometric mean over prompts of each prompt's
ratio [95 % cluster-bootstrap CI, 2000 replicates, seed 0], the plain median, the prompts where the held-out set did
less damage, the exact sign test). A ratio near 1 says the set chosen on 128 steps gained nothing on steps 64-127 from
having read them; below 1, the held-out set is better there: the in-sample search fell short of what a search of the
first half found, so the 128-step search is not near the best set. The rules read no future; their rows are the
same decisions in both runs, and the check that they agree (relative 1e-4) guards the pairing.

The second table: the best set known over the whole 128 steps. Both runs by dfe37b9's search judge every set on the
same 128 steps of the same checkpoints, so per (checkpoint, budget) the lowest ``kl_mean`` among every reference's
set of both runs is a decision no rule's or reference's set there beats; against it and against the 128-step run's
``oracle_search``, the best rule (least mean damage over the 128 steps on these prompts; the rules are the same rows
in both runs) per prompt (as above), and which set was the best known at how many checkpoints (a tie, the same
damage, goes to the 64-step run's set, listed first). The third table: each model's latest 128-step search
(``CURRENT``) against that best known set (:func:`current_known_table`).

Then the rerun tables, each from :func:`rerun_table` with its row of ``RERUNS``: ``smollm2-h128-search-split/``, the
128-step search rerun on the first 3 problems after ``oracle_search`` stopped recombination at half its seconds,
against both searches above; ``smollm2-h128-search-swaps/``, the same rerun after the search dropped recombination
for swaps alone; ``smollm2-h128-search-reach/``, the same rerun after the swaps stopped moving entries of large
attention weight while others are left; ``gemma3-h128-search-reach/``, gemma3-270m's 128-step search rerun on the
same 3 problems with that search; ``smollm2-h128-search-reach10/`` and ``gemma3-h128-search-reach5/``, each model's
128-step search on all its problems by that search, against the same run by dfe37b9's; ``smollm2-h128-search/`` and
``gemma3-h128-search/``, the same by the descent that replaced the swaps; and each model's 128-step descent against
its 64-step descent (``MODEL-h128-half-descent/``) over all 128 steps; ``smollm2-h128-search-reconstruction/``,
SmolLM2's 128-step descent at keep 0.25 started from the reconstruction set, against ``smollm2-h128-search/``. Last,
the first table's check made by the descent (``generalisation-held-out-descent.csv``), and each model's latest
128-step search against the best of every set every committed 128-step run made
(``generalisation-pooled-known.csv``, :func:`pooled_table`).

Run from the repository root: .venv/bin/python reports/decisions-math500/generalisation.py
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.io import write_csv
from kvdiag.core.stats import PromptBootstrap, compare, format_p
from kvdiag.core.tables import markdown_table

HERE = Path(__file__).parent
MODELS = ("smollm2", "gemma3")
REFERENCES = ("fast", "future_attention", "oracle_search")
HALF, WHOLE = 64, 128  # the first run's read window; both runs' judged window
N_BOOT, SEED, LEVEL = 2000, 0, 0.95
KEYS = ["prompt_id", "checkpoint", "budget"]  # one (checkpoint, budget) of a prompt
RULE_RTOL = 1e-4  # the rules' rows of the two runs: the same sets through the same engine (batches may differ)
RECOMBINED = "smollm2-h128-search-recombined"  # SmolLM2's 128-step search, 10 prompts, by dfe37b9's search
GEMMA3_RECOMBINED = "gemma3-h128-search-recombined"  # gemma3-270m's, 5 prompts, by dfe37b9's search
SEARCH = "smollm2-h128-search"  # SmolLM2's on all 10 problems by the descent that replaced the swaps
GEMMA3_SEARCH = "gemma3-h128-search"  # gemma3-270m's on all 5 problems by the descent
# each model's (run reading 64 steps, run reading 128) made by one search, so that the held-out / in-sample ratio
# compares reading 64 steps with reading 128, not two searches: by dfe37b9's (the first table) and by the descent (the
# last, which supersedes it)
RUN_PAIRS = {"generalisation.csv": {"smollm2": ("smollm2-h128-half", RECOMBINED),
                                    "gemma3": ("gemma3-h128-half", GEMMA3_RECOMBINED)},
             "generalisation-held-out-descent.csv": {"smollm2": ("smollm2-h128-half-descent", SEARCH),
                                                     "gemma3": ("gemma3-h128-half-descent", GEMMA3_SEARCH)}}


def late_damage(path: Path) -> pl.DataFrame:
    """prompt_id, checkpoint, budget, decision, read_steps, late: the mean KL of steps HALF..WHOLE-1 of each row."""
    df = pl.read_parquet(path, columns=["prompt_id", "checkpoint", "budget", "decision", "read_steps", "kl_steps",
                                        "horizon"])
    if not (df["horizon"] == WHOLE).all():
        raise ValueError(f"{path}: judged on {sorted(set(df['horizon']))} steps, not {WHOLE}")
    return df.with_columns(pl.col("kl_steps").list.slice(HALF, WHOLE - HALF).list.mean().alias("late")).drop(
        "kl_steps", "horizon")


def pairs(here: Path, model: str, runs: tuple[str, str]) -> pl.DataFrame:
    """The two runs' (``runs``: the one reading 64 steps, the one reading 128) rows on the first's prompts, joined by
    (prompt, checkpoint, budget, decision)."""
    half = late_damage(here / runs[0] / "decisions.parquet")
    whole = late_damage(here / runs[1] / "decisions.parquet")
    keys = ["prompt_id", "checkpoint", "budget", "decision"]
    joined = half.join(whole, on=keys, suffix="_whole")
    refs = joined.filter(pl.col("decision").is_in(REFERENCES))
    if not ((refs["read_steps"] == HALF) & (refs["read_steps_whole"] == WHOLE)).all():
        raise ValueError(f"{model}: the references did not read {HALF} and {WHOLE} steps")
    rules = joined.filter((pl.col("read_steps") == 0) & pl.col("late").is_not_null())  # skipped: infeasible
    if not rules.height or not np.allclose(rules["late"], rules["late_whole"], rtol=RULE_RTOL, atol=0):
        raise ValueError(f"{model}: the rules' rows of the two runs differ beyond {RULE_RTOL} (not the same sets?)")
    return refs


def _by_budget(df: pl.DataFrame) -> Iterator[tuple[PromptBootstrap, str, pl.DataFrame]]:
    """(bootstrap over ``df``'s prompts, budget, ``df``'s rows of it) per budget, largest keep fraction first; one
    bootstrap serves every budget of ``df``."""
    boot = PromptBootstrap(df["prompt_id"].unique().to_list(), N_BOOT, SEED, LEVEL)
    for budget in sorted(df["budget"].unique().to_list(), key=lambda b: -float(b.removeprefix("keep:"))):
        yield boot, budget, df.filter(pl.col("budget") == budget)


def _paired(boot: PromptBootstrap, g: pl.DataFrame, x: str, y: str, prefix: str, lower: str) -> dict:
    """Columns ``prefix + ...`` of the per-prompt ratio ``g[x] / g[y]`` (``kvdiag.core.stats.compare``): its geometric
    mean with CI, plain median, the prompts where ``x`` is lower (column ``prefix + lower``), and the paired test."""
    c = compare(boot, g[x].to_numpy(), g[y].to_numpy(), g["prompt_id"].to_numpy())
    r = c["ratios"]
    return {f"{prefix}ratio_geomean": r["geomean"], f"{prefix}ratio_low": r["geomean_ci"][0],
            f"{prefix}ratio_high": r["geomean_ci"][1], f"{prefix}ratio_median": r["median"],
            f"{prefix}{lower}": r["below"], f"{prefix}prompts": r["n"], f"{prefix}test": c["test"].test,
            f"{prefix}p_value": c["p_value"], f"{prefix}p_resolution": c["test"].resolution}


def table(runs: dict[str, tuple[str, str]], here: Path = HERE) -> pl.DataFrame:
    """The held-out / in-sample table of one ``RUN_PAIRS`` entry (model -> (run reading 64 steps, run reading 128))."""
    rows = []
    for model, pair in runs.items():
        for boot, budget, b in _by_budget(pairs(here, model, pair)):
            for ref in REFERENCES:
                g = b.filter(pl.col("decision") == ref)
                rows.append({"model": model, "budget": budget, "reference": ref, "checkpoints": g.height,
                             "held_out_damage": float(g["late"].mean()),
                             "in_sample_damage": float(g["late_whole"].mean()),
                             **_paired(boot, g, "late", "late_whole", "", "held_out_lower")})
    return pl.DataFrame(rows)


def best_known(here: Path, model: str) -> pl.DataFrame:
    """Per (checkpoint, budget) of the half run: prompt_id, budget, best_rule_kl, search_kl (the 128-step run's
    oracle_search), known_kl and known (the set with the lowest kl_mean among every reference of both runs: the first
    table's pair, by dfe37b9's search)."""
    cols = ["prompt_id", "checkpoint", "budget", "decision", "read_steps", "kl_mean"]
    half_run, whole_run = RUN_PAIRS["generalisation.csv"][model]
    half = pl.read_parquet(here / half_run / "decisions.parquet", columns=cols)
    whole = pl.read_parquet(here / whole_run / "decisions.parquet", columns=cols).filter(
        pl.col("prompt_id").is_in(half["prompt_id"].unique().to_list()))
    refs = pl.concat([half.filter(pl.col("read_steps") > 0).with_columns(
                          (pl.col("decision") + f" (read {HALF})").alias("decision")),
                      whole.filter(pl.col("read_steps") > 0).with_columns(
                          (pl.col("decision") + f" (read {WHOLE})").alias("decision"))])
    rules = whole.filter((pl.col("read_steps") == 0) & (pl.col("decision") != "random"))
    # a rule enters the choice only where it ran at every checkpoint (infeasible rows are null)
    best_rule = rules.group_by("budget", "decision").agg(pl.col("kl_mean").mean(), pl.col("kl_mean").null_count()
                                                         .alias("skipped")).filter(pl.col("skipped") == 0).sort(
        "kl_mean", "decision").group_by("budget", maintain_order=True).first().select(
        "budget", pl.col("decision").alias("best_rule"))
    rule_rows = rules.join(best_rule, on="budget").filter(pl.col("decision") == pl.col("best_rule")).select(
        *KEYS, "best_rule", pl.col("kl_mean").alias("best_rule_kl"))
    known = refs.sort("kl_mean").group_by(KEYS, maintain_order=True).first().select(
        *KEYS, pl.col("decision").alias("known"), pl.col("kl_mean").alias("known_kl"))
    search = whole.filter(pl.col("decision") == "oracle_search").select(*KEYS, pl.col("kl_mean").alias("search_kl"))
    return rule_rows.join(search, on=KEYS).join(known, on=KEYS)


def known_table(known: dict[str, pl.DataFrame]) -> pl.DataFrame:
    """The second table from each model's :func:`best_known` frame (``known``: model -> frame)."""
    rows = []
    for model, frame in known.items():
        for boot, budget, g in _by_budget(frame):
            row = {"model": model, "budget": budget, "best_rule": g["best_rule"][0], "checkpoints": g.height,
                   "best_rule_damage": float(g["best_rule_kl"].mean()), "search_damage": float(g["search_kl"].mean()),
                   "known_damage": float(g["known_kl"].mean()),
                   "known_by": ", ".join(f"{r['known']} {r['count']}"
                                         for r in g["known"].value_counts(sort=True).iter_rows(named=True))}
            for name in ("search", "known"):
                row.update(_paired(boot, g, "best_rule_kl", f"{name}_kl", f"{name}_", "rule_lower"))
            rows.append(row)
    return pl.DataFrame(rows)


SPLIT = "smollm2-h128-search-split"  # the 128-step search rerun after recombination's time cap (86401e2), 3 prompts
SWAPS = "smollm2-h128-search-swaps"  # the same, after the search dropped recombination for swaps alone
REACH = "smollm2-h128-search-reach"  # the same, after the swaps left entries of large attention weight alone
GEMMA3_REACH = "gemma3-h128-search-reach"  # gemma3-270m's 128-step search rerun so, on the same 3 problems
REACH10 = "smollm2-h128-search-reach10"  # SmolLM2's 128-step search on all 10 problems by that search
GEMMA3_REACH5 = "gemma3-h128-search-reach5"  # gemma3-270m's on all 5 problems by that search
CURRENT = {"smollm2": SEARCH, "gemma3": GEMMA3_SEARCH}  # each model's latest 128-step search
RECONSTRUCTION = "smollm2-h128-search-reconstruction"  # SmolLM2's descent from the reconstruction set, keep 0.25
# each model's search started from every set of the runs above as well (--search-from): SmolLM2 at keep 0.5 and 0.25,
# gemma3 at keep 0.5, where the pooled table found a set below the latest search
SEARCH_FROM = {"smollm2": "smollm2-h128-search-from", "gemma3": "gemma3-h128-search-from"}


# The rerun tables, in order: (rerun, CSV, heading, text, the searches it is set against: name -> (run, label)).
RERUNS = [
    (SPLIT, "generalisation-split.csv", "The 128-step search with recombination capped at half its seconds",
     f"`{SPLIT}/`: the 128-step search rerun on the first 3 problems after `oracle_search` stopped "
     "recombination at half its seconds (before: at half its rows only, and in 120 s it never reached its "
     "swaps), against the committed 128-step search and the 64-step search at the same checkpoints, all "
     "judged on the same 128 steps: mean damage, the searches' set rows (rerun / before / 64-step; the "
     "rerun ran alone, the committed searches shared the 2 cores with another run, so they got fewer rows "
     "in their 120 s), and per prompt the ratio rerun / other (geometric mean [95 % cluster-bootstrap CI], "
     "plain median, prompts where the rerun did less damage, exact sign test; with 3 prompts the smallest "
     "two-sided p is 0.25).",
     {"before": (RECOMBINED, "before"), "half": ("smollm2-h128-half", "64-step search")}),
    (SWAPS, "generalisation-swaps.csv", "The 128-step search by swaps alone",
     f"`{SWAPS}/`: the 128-step search rerun on the same 3 problems after `oracle_search` dropped "
     "recombination (every row goes to gradient-proposed swaps), against the rerun above (with "
     "recombination for half its seconds; both ran alone on the idle 2 cores, at 512 rows or 120 s), the "
     "committed 128-step search and the 64-step search, all judged on the same 128 steps; columns as above.",
     {"split": (SPLIT, "with recombination"), "before": (RECOMBINED, "before"),
      "half": ("smollm2-h128-half", "64-step search")}),
    (REACH, "generalisation-reach.csv", "The 128-step search with swaps of small attention weight first",
     f"`{REACH}/`: the 128-step search rerun on the same 3 problems after `oracle_search`'s swaps stopped "
     "moving entries whose attention weight exceeds 0.5 while any other swap is untried (the gradient's "
     "linear prediction fails for them), against the rerun by swaps alone above (both ran alone on the idle "
     "2 cores, at 512 rows or 120 s), the committed 128-step search and the 64-step search, all judged on the "
     "same 128 steps; columns as above.",
     {"swaps": (SWAPS, "swaps alone"), "before": (RECOMBINED, "before"),
      "half": ("smollm2-h128-half", "64-step search")}),
    (GEMMA3_REACH, "generalisation-gemma3-reach.csv", "gemma3-270m: the 128-step search as above",
     f"`{GEMMA3_REACH}/`: gemma3-270m's 128-step search rerun on the same 3 problems with the search of the "
     "table above (alone on the idle 2 cores, 512 rows or 120 s), against its committed 128-step search "
     "(with recombination, sharing the cores) and its 64-step search at the same checkpoints, all judged on the "
     "same 128 steps; columns as above.",
     {"before": (GEMMA3_RECOMBINED, "before"), "half": ("gemma3-h128-half", "64-step search")}),
    (REACH10, "generalisation-search.csv", "SmolLM2: the 128-step search on all 10 problems",
     f"`{REACH10}/`: SmolLM2's 128-step search on all 10 problems by the search of the two tables above (alone on "
     f"the idle 2 cores, 512 rows or 120 s), against `{RECOMBINED}/`, the same run by dfe37b9's search (with "
     "recombination, sharing the cores), all judged on the same 128 steps; columns as above (with 10 prompts the "
     "smallest two-sided p is 0.002).",
     {"before": (RECOMBINED, "before")}),
    (GEMMA3_REACH5, "generalisation-gemma3-search.csv", "gemma3-270m: the 128-step search on all 5 problems",
     f"`{GEMMA3_REACH5}/`: gemma3-270m's 128-step search on all 5 problems by the same search (alone on the idle 2 "
     f"cores, 512 rows or 120 s), against `{GEMMA3_RECOMBINED}/`, the same run by dfe37b9's search (with "
     "recombination, sharing the cores), and the 64-step search at the same checkpoints, all judged on the same 128 "
     "steps; columns as above (with 5 prompts the smallest two-sided p is 0.0625).",
     {"before": (GEMMA3_RECOMBINED, "before"), "half": ("gemma3-h128-half", "64-step search")}),
    (SEARCH, "generalisation-descent.csv", "SmolLM2: the 128-step search by descent",
     f"`{SEARCH}/`: SmolLM2's 128-step search on all 10 problems by `oracle_search`'s straight-through descent "
     "(127 steps and one exact row per (checkpoint, budget): `--search-rows 128 --search-seconds 0`, a bound that "
     f"does not depend on the machine's load), against `{REACH10}/` (the swap search of the tables above, 512 rows "
     f"or 120 s alone on the idle 2 cores) and `{RECOMBINED}/` (dfe37b9's search), all judged on the same 128 "
     "steps; columns as above (rows: the sets each search labeled; with 10 prompts the smallest two-sided p is "
     "0.002).",
     {"swaps": (REACH10, "swaps"), "before": (RECOMBINED, "before")}),
    (GEMMA3_SEARCH, "generalisation-gemma3-descent.csv", "gemma3-270m: the 128-step search by descent",
     f"`{GEMMA3_SEARCH}/`: gemma3-270m's 128-step search on all 5 problems by the descent (127 steps and one exact "
     f"row per (checkpoint, budget), as `{SEARCH}/`), against `{GEMMA3_REACH5}/` (the swap search, 512 rows or 120 s "
     f"alone on the idle 2 cores), `{GEMMA3_RECOMBINED}/` (dfe37b9's search) and the 64-step search, all judged on "
     "the same 128 steps; columns as above (with 5 prompts the smallest two-sided p is 0.0625).",
     {"swaps": (GEMMA3_REACH5, "swaps"), "before": (GEMMA3_RECOMBINED, "before"),
      "half": ("gemma3-h128-half", "64-step search")}),
    (SEARCH, "generalisation-descent-half.csv", "SmolLM2: the 128-step descent against the 64-step descent",
     f"`{SEARCH}/` against `smollm2-h128-half-descent/` (the same descent, 127 steps and one exact row per "
     "(checkpoint, budget), reading only the first 64 steps) on the latter's 5 problems, both judged on all 128 "
     "steps; columns as above (rerun: the 128-step descent).",
     {"half": ("smollm2-h128-half-descent", "64-step descent")}),
    (GEMMA3_SEARCH, "generalisation-gemma3-descent-half.csv",
     "gemma3-270m: the 128-step descent against the 64-step descent",
     f"`{GEMMA3_SEARCH}/` against `gemma3-h128-half-descent/`, as above.",
     {"half": ("gemma3-h128-half-descent", "64-step descent")}),
    (RECONSTRUCTION, "generalisation-reconstruction.csv", "SmolLM2: the 128-step descent from the reconstruction set",
     f"`{RECONSTRUCTION}/`: SmolLM2's 128-step search on all 10 problems at keep 0.25 by the descent started from the "
     "reconstruction set where that set is below every candidate (kvdiag/decisions/reconstruction.py; 128 rows per "
     "(checkpoint, budget) as before: the reconstruction's row, 126 steps and the result's exact row), against "
     f"`{SEARCH}/` (the descent from the best candidate: 127 steps and one exact row), both judged on the same 128 "
     "steps; columns as above (with 10 prompts the smallest two-sided p is 0.002). The reconstruction's rounds of 4 "
     "and its W_O weighting were chosen on `kvdiag bench decisions`' checkpoint (docs/benchmarks.md), not on these.",
     {"descent": (SEARCH, "descent")}),
]


def _searched(here: Path, run: str, name: str) -> pl.DataFrame:
    """``run``'s ``oracle_search`` rows: KEYS, its damage over the judged steps as ``name``, its set rows as
    ``name + '_rows'``."""
    cols = [*KEYS, "decision", "kl_mean", "cost_rows"]
    return pl.read_parquet(here / run / "decisions.parquet", columns=cols).filter(
        pl.col("decision") == "oracle_search").select(*KEYS, pl.col("kl_mean").alias(name),
                                                     pl.col("cost_rows").alias(f"{name}_rows"))


def current_known_table(known: dict[str, pl.DataFrame], here: Path = HERE) -> pl.DataFrame:
    """Per model and budget, the latest 128-step search (``CURRENT``) against the best set known of
    the second table (``known``: model -> its :func:`best_known` frame, from the two runs by dfe37b9's search) on the
    half run's prompts: per prompt the ratio current / best known (geometric mean, plain median, prompts where the
    current search did less damage, exact sign test)."""
    rows = []
    for model, frame in known.items():
        j = frame.join(_searched(here, CURRENT[model], "current_kl"), on=KEYS)
        rows += [{"model": model, "budget": budget, "checkpoints": g.height,
                  "current_damage": float(g["current_kl"].mean()), "known_damage": float(g["known_kl"].mean()),
                  **_paired(boot, g, "current_kl", "known_kl", "", "current_lower")}
                 for boot, budget, g in _by_budget(j)]
    return pl.DataFrame(rows)


def pooled_known(here: Path, model: str) -> tuple[pl.DataFrame, int, int]:
    """Every committed set judged on the same 128 steps pooled (but ``SEARCH_FROM``'s run, which starts from them, and
    ``RECONSTRUCTION``'s, made after it, set against the latest search in its own rerun table):
    per (checkpoint, budget) of the latest 128-step search (``CURRENT[model]``), KEYS, latest_kl and latest_mask (its
    ``oracle_search``), known_kl and known_mask (the lowest ``kl_mean`` of any set, rule or reference, of every
    ``MODEL-h128*/`` run judged on 128 steps, the latest included), known (``run:decision`` of that set; a tie goes to
    the latest search) and runs (how many runs have that (checkpoint, budget)); with it the rule rows ((checkpoint,
    budget, rule)) whose set differs between runs, and all of them. A set that two runs both made must label the same
    in both (``RULE_RTOL``): the same checkpoints and steps, so the sets are comparable. Not every rule makes the same
    set in every run: each set is pooled as the set it is."""
    cols = [*KEYS, "decision", "kind", "horizon", "kl_mean", "evicted_mask"]
    rows = []
    for path in sorted(here.glob(f"{model}-h128*/decisions.parquet")):
        run = path.parent.name
        if run == SEARCH_FROM[model]:  # it started from these sets: the table after it sets it against them
            continue
        if run == RECONSTRUCTION:  # made after SEARCH_FROM's run, which could not start from it: its own table
            continue
        df = pl.read_parquet(path, columns=cols).filter(pl.col("kl_mean").is_not_null())
        if set(df["horizon"].unique().to_list()) != {WHOLE}:
            raise ValueError(f"{path}: judged on {sorted(df['horizon'].unique().to_list())} steps, not {WHOLE}")
        rows.append(df.with_columns(pl.lit(run).alias("run"), pl.lit(run == CURRENT[model]).alias("latest")))
    sets = pl.concat(rows)
    same = sets.group_by(*KEYS, "evicted_mask").agg(pl.len().alias("rows"), (
        (pl.col("kl_mean").max() - pl.col("kl_mean").min()) / pl.col("kl_mean").max().clip(1e-12)).alias("rel"))
    same = same.filter(pl.col("rows") > 1)
    if same.height == 0 or float(same["rel"].max()) > RULE_RTOL:
        raise ValueError(f"{model}: a set labels differently across the 128-step runs (relative "
                         f"{same['rel'].max() if same.height else None})")
    rules = sets.filter(pl.col("kind") == "rule").group_by(*KEYS, "decision").agg(
        pl.col("evicted_mask").n_unique().alias("sets"))
    latest = sets.filter(pl.col("latest") & (pl.col("decision") == "oracle_search")).select(
        *KEYS, pl.col("kl_mean").alias("latest_kl"), pl.col("evicted_mask").alias("latest_mask"))
    ranked = sets.join(latest.select(KEYS), on=KEYS).sort("kl_mean", pl.col("latest").not_(), "run", "decision")
    known = ranked.group_by(KEYS, maintain_order=True).agg(
        pl.col("kl_mean").first().alias("known_kl"), (pl.col("run") + ":" + pl.col("decision")).first().alias("known"),
        pl.col("evicted_mask").first().alias("known_mask"), pl.col("run").n_unique().alias("runs"))
    return latest.join(known, on=KEYS), rules.filter(pl.col("sets") > 1).height, rules.height


def pooled_table(pooled: dict[str, tuple[pl.DataFrame, int, int]]) -> pl.DataFrame:
    """Per model and budget, from each model's :func:`pooled_known` (``pooled``: model -> it): the latest search /
    the best set known per prompt (geometric mean, plain median, prompts where the latest search is lower, exact sign
    test), the checkpoints where the latest search is the best set known, and which sets are where it is not."""
    rows = []
    for model, (frame, differing, rule_rows) in pooled.items():
        for boot, budget, g in _by_budget(frame):
            others = g.filter(pl.col("latest_kl") > pl.col("known_kl"))
            rows.append({"model": model, "budget": budget, "checkpoints": g.height,
                         "runs_min": int(g["runs"].min()), "runs_max": int(g["runs"].max()),
                         "latest_damage": float(g["latest_kl"].mean()), "known_damage": float(g["known_kl"].mean()),
                         "latest_is_known": g.height - others.height,
                         "known_by": ", ".join(f"{r['known']} {r['count']}" for r in others["known"].value_counts(
                             sort=True).sort("count", "known", descending=[True, False]).iter_rows(named=True)),
                         "worst_ratio": float((g["latest_kl"] / g["known_kl"]).max()),
                         "rule_rows_differing": differing, "rule_rows": rule_rows,
                         **_paired(boot, g, "latest_kl", "known_kl", "", "latest_lower")})
    return pl.DataFrame(rows)


def search_from_table(pooled: dict[str, tuple[pl.DataFrame, int, int]], here: Path = HERE) -> pl.DataFrame:
    """Per model and budget of ``SEARCH_FROM``'s run: its ``oracle_search`` (from every set of the pooled runs as
    well) against the best set known before it (``pooled``: model -> its :func:`pooled_known`) and against the latest
    search, per prompt (geometric mean [CI], plain median, prompts where it is lower, exact sign test; where it is
    the same set, the pair is level), the checkpoints where it is at most the best known, where it is that very set,
    and where its search started from an earlier run's set."""
    rows = []
    for model, run in SEARCH_FROM.items():
        frame = pooled[model][0]
        found = pl.read_parquet(here / run / "decisions.parquet", columns=[*KEYS, "decision", "kl_mean",
                                                                           "search_start", "evicted_mask"]).filter(
            pl.col("decision") == "oracle_search").select(*KEYS, "search_start", pl.col("kl_mean").alias("from_kl"),
                                                           pl.col("evicted_mask").alias("from_mask"))
        # the same set as the best known (or the latest search's) is the same decision: its two labels differ only
        # by another batch's rounding, so the pair is set level (ratio 1, neither lower)
        j = frame.join(found, on=KEYS).with_columns(
            pl.when(pl.col("from_mask") == pl.col("known_mask")).then(pl.col("known_kl")).otherwise(
                pl.col("from_kl")).alias("from_kl_vs_known"),
            pl.when(pl.col("from_mask") == pl.col("latest_mask")).then(pl.col("latest_kl")).otherwise(
                pl.col("from_kl")).alias("from_kl_vs_latest"))
        for boot, budget, g in _by_budget(j):
            rows.append({"model": model, "budget": budget, "checkpoints": g.height,
                         "from_damage": float(g["from_kl"].mean()), "known_damage": float(g["known_kl"].mean()),
                         "latest_damage": float(g["latest_kl"].mean()),
                         "at_most_known": int((g["from_kl_vs_known"] <= g["known_kl"]).sum()),
                         "same_set_as_known": int((g["from_mask"] == g["known_mask"]).sum()),
                         "started_from_earlier": int(g["search_start"].str.starts_with("search_from").sum()),
                         **_paired(boot, g, "from_kl_vs_known", "known_kl", "known_", "from_lower"),
                         **_paired(boot, g, "from_kl_vs_latest", "latest_kl", "latest_", "from_lower")})
    return pl.DataFrame(rows)


def rerun_table(run: str, others: dict[str, str], here: Path = HERE) -> pl.DataFrame:
    """Per budget, ``oracle_search``'s damage over the 128 steps in the rerun ``run`` against each of ``others``
    (name -> run) at the same checkpoints: per prompt the ratio rerun / other (geometric mean, plain median, prompts
    where the rerun did less damage, exact sign test), and each search's set rows (median)."""
    j = _searched(here, run, "rerun")
    for name, other in others.items():
        j = j.join(_searched(here, other, name), on=KEYS)
    runs = ["rerun", *others]
    rows = []
    for boot, budget, g in _by_budget(j):
        row = {"budget": budget, "checkpoints": g.height, **{name: float(g[name].mean()) for name in runs},
               **{f"{name}_rows_median": float(g[f"{name}_rows"].median()) for name in runs}}
        for other in others:
            row.update(_paired(boot, g, "rerun", other, f"{other}_", "rerun_lower"))
        rows.append(row)
    return pl.DataFrame(rows)


def _rerun_lines(table: pl.DataFrame, others: dict[str, str]) -> list[str]:
    """A rerun table in Markdown: mean damage of each search, their rows, and the rerun / other ratios."""
    return [markdown_table(
        ["budget", "rerun", *others.values(), "rows (median)",
         *(h for label in others.values() for h in (f"rerun / {label} [CI]", "median", "rerun lower", "p"))],
        [[r["budget"], _num(r["rerun"]), *(_num(r[o]) for o in others),
          " / ".join(f"{r[run + '_rows_median']:.0f}" for run in ("rerun", *others)),
          *(cell for o in others for cell in (
              _ci(r, o + "_"), _num(r[o + "_ratio_median"]),
              f"{r[o + '_rerun_lower']}/{r[o + '_prompts']}", format_p(r[o + "_p_value"], r[o + "_p_resolution"])))]
         for r in table.iter_rows(named=True)])]


def _num(v: float) -> str:
    return f"{v:.3g}"


def _ci(r: dict, prefix: str = "") -> str:
    """``prefix``'s ratio as ``geomean [low, high]``."""
    return f"{_num(r[prefix + 'ratio_geomean'])} [{_num(r[prefix + 'ratio_low'])}, {_num(r[prefix + 'ratio_high'])}]"


def _held_out_lines(csv: str, search: str, out: Path, here: Path) -> list[str]:
    """Write ``csv`` (:func:`table` of ``RUN_PAIRS[csv]``, made by ``search``) to ``out``; its text and table in
    Markdown."""
    runs = RUN_PAIRS[csv]
    df = table(runs, here)
    write_csv(df, out / csv)
    return [f"Made by generalisation.py from each model's two runs by {search}: "
            f"{', '.join(f'`{half}/`' for half, _ in runs.values())} (every reference read steps 0-{HALF - 1}) and "
            f"{', '.join(f'`{whole}/`' for _, whole in runs.values())} (every reference read steps 0-{WHOLE - 1}), "
            f"on the first run's prompts. Damage: mean per-step KL (nats) over steps {HALF}-{WHOLE - 1} of each "
            "(checkpoint, budget), averaged over checkpoints. Held out / in-sample per prompt: geometric mean over "
            "prompts [95 % cluster-bootstrap CI], plain median, prompts where the held-out set did less damage (of the "
            "prompts that entered), exact sign test (with 5 prompts the smallest two-sided p is 0.0625).", "",
            markdown_table(
                ["model", "budget", "reference", "held out (read 0-63)", "in-sample (read 0-127)",
                 "held out / in-sample [CI]", "median", "held out lower", "p"],
                [[r["model"], r["budget"], f"`{r['reference']}`", _num(r["held_out_damage"]),
                  _num(r["in_sample_damage"]), _ci(r), _num(r["ratio_median"]),
                  f"{r['held_out_lower']}/{r['prompts']}", format_p(r["p_value"], r["p_resolution"])]
                 for r in df.iter_rows(named=True)])]


def main(here: Path = HERE, out: Path = HERE) -> None:
    """generalisation.md, generalisation.csv, -best-known.csv, -current-known.csv, -split.csv, -swaps.csv, -reach.csv,
    -gemma3-reach.csv, -search.csv, -gemma3-search.csv, -descent.csv, -gemma3-descent.csv, -descent-half.csv,
    -gemma3-descent-half.csv, -reconstruction.csv, -held-out-descent.csv and -pooled-known.csv in ``out`` from
    ``here``'s runs."""
    lines = ["# The generalisation check: chosen without steps 64-127, judged on them", "",
             "The first table is the check made by dfe37b9's search, the last the same check made by the descent "
             "(`oracle_search` as it is now): the descent's supersedes it.", "",
             *_held_out_lines("generalisation.csv", "dfe37b9's search", out, here)]
    best = {model: best_known(here, model) for model in MODELS}  # read once: the second and third tables share it
    known = known_table(best)
    write_csv(known, out / "generalisation-best-known.csv")
    lines += ["", "## The best set known over the 128 steps", "",
              "Per (checkpoint, budget), the lowest mean damage over all 128 steps among every reference's set of "
              "both runs by dfe37b9's search (read 64 or 128 steps): no set either run made beats it there. The "
              "best rule (least mean damage over the 128 steps on these prompts) against it and against the 128-step "
              "run's `oracle_search`, per prompt as above (rule lower: prompts where the rule did less damage).", ""]
    lines.append(markdown_table(
        ["model", "budget", "best rule", "its damage", "`oracle_search` (read 128)", "best known", "best known is",
         "best rule / search [CI]", "median", "rule lower", "p", "best rule / best known [CI]", "median",
         "rule lower", "p"],
        [[r["model"], r["budget"], r["best_rule"], _num(r["best_rule_damage"]), _num(r["search_damage"]),
          _num(r["known_damage"]), r["known_by"],
          *(cell for name in ("search", "known") for cell in (
              _ci(r, name + "_"), _num(r[name + "_ratio_median"]), f"{r[name + '_rule_lower']}/{r[name + '_prompts']}",
              format_p(r[name + "_p_value"], r[name + "_p_resolution"])))]
         for r in known.iter_rows(named=True)]))
    current = current_known_table(best, here)
    write_csv(current, out / "generalisation-current-known.csv")
    lines += ["", "## The latest searches against the best set known", "",
              f"`{SEARCH}/`'s and `{GEMMA3_SEARCH}/`'s `oracle_search` (each model's 128-step search by the descent "
              "of the tables 'SmolLM2: the 128-step search by descent' and 'gemma3-270m: the 128-step search by "
              "descent' below) against the best set "
              "known of the table above, on the same 5 prompts and "
              "128 steps: mean damage, and per prompt the ratio latest / best known as above (latest lower: "
              "prompts where the latest search did less damage).", ""]
    lines.append(markdown_table(
        ["model", "budget", "latest search", "best known", "latest / best known [CI]", "median", "latest lower",
         "p"],
        [[r["model"], r["budget"], _num(r["current_damage"]), _num(r["known_damage"]), _ci(r), _num(r["ratio_median"]),
          f"{r['current_lower']}/{r['prompts']}", format_p(r["p_value"], r["p_resolution"])]
         for r in current.iter_rows(named=True)]))
    for run, csv, heading, text, others in RERUNS:
        rerun = rerun_table(run, {name: other for name, (other, _) in others.items()}, here)
        write_csv(rerun, out / csv)
        labels = {name: label for name, (_, label) in others.items()}
        lines += ["", f"## {heading}", "", text, "", *_rerun_lines(rerun, labels)]
    lines += ["", "## The generalisation check by the descent", "",
              *_held_out_lines("generalisation-held-out-descent.csv", "the descent", out, here)]
    known_sets = {model: pooled_known(here, model) for model in MODELS}  # read once: the last two tables share it
    pooled = pooled_table(known_sets)
    write_csv(pooled, out / "generalisation-pooled-known.csv")
    lines += ["", "## The latest searches against every set committed", "",
              f"Every set of every `MODEL-h128*/` run but the `-search-from/` ones, which start from these sets (the "
              f"next table), and `{RECONSTRUCTION}/`, made after them (its own table above) (each judged on the "
              f"same {WHOLE} steps of the same checkpoints: "
              "a set that two runs made labels the same in both, relative 1e-4; not every rule made the same set in "
              "every run: " + ", ".join(f"{m} {d} of {n}" for m, d, n in pooled.select(
                  "model", "rule_rows_differing", "rule_rows").unique(maintain_order=True).iter_rows()) +
              " (checkpoint, budget, rule) rows evict another set in some runs than in others (lazyeviction's at "
              "gemma3's algebra_1349, keep 0.5: two entries of one cell swapped; on gemma3 `-h128-half/`, "
              "`-h128-search-reach/` and `-h128-search-recombined/` against the rest: those three, made before the "
              "gemma3 Trace and scores were remade on 2026-12-07, read another scores file, not kept: the scores "
              "recompute bit for bit from the current Trace at kvdiag f1fbfd6 and now, and rank the two swapped "
              "entries 0.5006 against 0.4749, no tie; decisions runs now record their scores' sha256), and each set "
              "is pooled as the set it is), rule or reference, whatever it read and whichever "
              f"search made it, pooled per (checkpoint, budget) of `{SEARCH}/` and `{GEMMA3_SEARCH}/`: the lowest "
              "mean damage over the 128 steps is the best set known there (a tie goes to the latest search). "
              "Latest is best: the checkpoints where the latest `oracle_search` is that set; where it is not, the "
              "run and decision that beat it, with the largest latest / best known ratio. Per prompt the ratio "
              "latest / best known as above (at 1 where the latest is the best).", "",
              markdown_table(
                  ["model", "budget", "checkpoints", "runs pooled", "latest search", "best known", "latest is best",
                   "beaten by", "largest ratio", "latest / best known [CI]", "median"],
                  [[r["model"], r["budget"], str(r["checkpoints"]),
                    f"{r['runs_min']}" if r["runs_min"] == r["runs_max"] else f"{r['runs_min']}-{r['runs_max']}",
                    _num(r["latest_damage"]), _num(r["known_damage"]), f"{r['latest_is_known']}/{r['checkpoints']}",
                    r["known_by"] or "-", _num(r["worst_ratio"]), _ci(r), _num(r["ratio_median"])]
                   for r in pooled.iter_rows(named=True)])]
    started = search_from_table(known_sets, here)
    write_csv(started, out / "generalisation-search-from.csv")
    lines += ["", "## The search from every set committed", "",
              f"{', '.join(f'`{r}/`' for r in SEARCH_FROM.values())}: each model's 128-step search again "
              "(`--search-rows 128 --search-seconds 0`, the descent) at the budgets where the table above found a set "
              "below the latest search, started from the best of its own candidates and of every pooled run's lowest "
              "set at each (checkpoint, budget) (`--search-from`, each labeled again). Against the best set known "
              "before it (the table above) and the latest search: mean damage over the 128 steps, per prompt the "
              "ratio (geometric mean [95 % cluster-bootstrap CI], plain median, prompts where the new search is "
              "lower, exact sign test; where it is the very same set the pair counts as level: its two labels differ "
              "only by another batch's rounding); at most: checkpoints where it is at most the best known; same set: "
              "where it is that set (its steps found nothing lower); started: where its start was an earlier run's "
              "set.", "",
              markdown_table(
                  ["model", "budget", "checkpoints", "search from all", "best known before", "latest search",
                   "at most best known", "same set", "started from an earlier set", "new / best known [CI]", "median",
                   "lower",
                   "p", "new / latest [CI]", "median", "lower", "p"],
                  [[r["model"], r["budget"], str(r["checkpoints"]), _num(r["from_damage"]), _num(r["known_damage"]),
                    _num(r["latest_damage"]), f"{r['at_most_known']}/{r['checkpoints']}",
                    f"{r['same_set_as_known']}/{r['checkpoints']}", f"{r['started_from_earlier']}/{r['checkpoints']}",
                    *(cell for name in ("known", "latest") for cell in (
                        _ci(r, name + "_"), _num(r[name + "_ratio_median"]),
                        f"{r[name + '_from_lower']}/{r[name + '_prompts']}",
                        format_p(r[name + "_p_value"], r[name + "_p_resolution"])))]
                   for r in started.iter_rows(named=True)])]
    (out / "generalisation.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

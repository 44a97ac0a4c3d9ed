"""windows.md and windows.csv: every policy's teacher-forced KL against the rest-window future-attention policy's.

Reads only this folder's generations.parquet (oracle_future at its default window interval + horizon = 80 queries and
the six rules) and rest/generations.parquet (the same replay with oracle_future's window the rest of the trace:
every query to the end, Belady-style; its rules' rows are the same decisions on the same tokens). The rest window's
oracle_future is renamed oracle_future_rest; the rules come from rest/ and oracle_future (80 queries) from here.

Per budget and policy (``kvdiag.replay.predict.regret``, as replay's regret.csv: ``kvdiag.core.stats.compare``, 2000
cluster-bootstrap replicates, seed 0): the mean KL minus oracle_future_rest's [CI], per prompt the ratio policy /
oracle_future_rest (geometric mean [CI], plain median, wins: prompts where the policy's KL is lower) and the exact sign
test over the 5 prompts; per budget, the prompts on which some rule, and the 80-query policy, is below it.

Run from the repository root: .venv/bin/python reports/replay-tf-math500/windows.py
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from kvdiag.core.io import write_csv
from kvdiag.core.stats import PromptBootstrap, format_p
from kvdiag.core.tables import markdown_table
from kvdiag.replay.predict import regret

HERE = Path(__file__).parent
SHORT, REST = "oracle_future", "oracle_future_rest"
N_BOOT, SEED, LEVEL = 2000, 0, 0.95  # the replay summary's regret.csv (kvdiag.replay.predict.write_predictions)


def _num(v: float) -> str:
    return "–" if v is None or v != v else f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def policies(here: Path = HERE) -> pl.DataFrame:
    """The rules and oracle_future_rest from rest/, oracle_future (80 queries) from here: prompt_id, scorer, budget,
    kl_mean."""
    cols = ("prompt_id", "scorer", "budget", "kl_mean")
    rest = pl.read_parquet(here / "rest" / "generations.parquet").select(cols).with_columns(
        pl.when(pl.col("scorer") == SHORT).then(pl.lit(REST)).otherwise(pl.col("scorer")).alias("scorer"))
    short = pl.read_parquet(here / "generations.parquet").select(cols).filter(pl.col("scorer") == SHORT)
    return pl.concat([rest, short])


def main(here: Path = HERE, out: Path = HERE) -> None:
    """windows.md and windows.csv in ``out`` from ``here``'s two generations.parquet."""
    df = policies(here)
    boot = PromptBootstrap(df["prompt_id"].unique().to_list(), N_BOOT, SEED, LEVEL)
    reg = regret(df, boot, REST)
    write_csv(reg, out / "windows.csv")
    wide = df.pivot(on="scorer", index=["prompt_id", "budget"], values="kl_mean")
    rules = [c for c in wide.columns if c not in ("prompt_id", "budget", REST, SHORT)]
    lines = [f"# The policies against the rest-window future-attention policy ({REST}), teacher-forced", "",
             f"Made by windows.py from generations.parquet ({SHORT}: per (layer, KV head) the entries the full cache's "
             f"next interval + horizon = 80 queries attend most) and rest/generations.parquet (the same over every "
             f"query to the end, renamed {REST}; the six rules). Each policy's mean teacher-forced KL (nats) minus "
             f"{REST}'s on the same prompts [95 % cluster-bootstrap CI]; per prompt the ratio policy / {REST}: "
             "geometric mean over prompts [cluster-bootstrap CI], plain median, wins (prompts where the policy's KL "
             "is lower) out of the prompts that entered, exact sign test (with 5 prompts the smallest two-sided p is "
             "0.0625). Rows by budget and regret.", ""]
    lines.append(markdown_table(
        ["policy", "budget", "KL", f"{REST} KL", "regret [CI]", "ratio, geometric mean [CI]", "ratio, median", "wins",
         "p sign"],
        [[r["scorer"], str(r["budget"]), _num(r["kl"]), _num(r["reference_kl"]),
          f"{_num(r['regret'])} [{_num(r['regret_low'])}, {_num(r['regret_high'])}]",
          f"{_num(r['ratio_geomean'])} [{_num(r['ratio_geomean_low'])}, {_num(r['ratio_geomean_high'])}]",
          _num(r["ratio_median"]), f"{r['prompts_below_reference']}/{r['prompts']}",
          format_p(r["p_value"], r["p_resolution"])] for r in reg.iter_rows(named=True)]))
    cells, by_rule, by_short = [], 0, 0
    for budget in sorted(wide["budget"].unique()):
        w = wide.filter(pl.col("budget") == budget).drop_nulls(REST)
        rule_below = w.filter(pl.any_horizontal(pl.col(c) < pl.col(REST) for c in rules)).height
        short_below = w.filter(pl.col(SHORT) < pl.col(REST)).height
        by_rule, by_short = by_rule + rule_below, by_short + short_below
        best = reg.filter((pl.col("budget") == budget) & (pl.col("scorer") != SHORT)).row(0, named=True)
        cells.append(f"{budget}: some rule lower on {rule_below} of {w.height} prompts, {SHORT} on {short_below}; "
                     f"the best rule {best['scorer']} regret {_num(best['regret'])}, ratio "
                     f"{_num(best['ratio_geomean'])} [{_num(best['ratio_geomean_low'])}, "
                     f"{_num(best['ratio_geomean_high'])}], median {_num(best['ratio_median'])}, wins "
                     f"{best['prompts_below_reference']}/{best['prompts']}, p {format_p(best['p_value'])}")
    verdict = ("no policy it is compared with is below it on any prompt at any budget, so on this window (the whole "
               "teacher-forced trajectory) it is an oracle for these policies" if not by_rule + by_short else
               f"no rule is below it on any prompt, but {SHORT} is on {by_short} (prompt, budget) pairs, so it is the "
               "rest-window future-attention reference, not an oracle" if not by_rule else
               "some rule is below it on some prompt, so it is the rest-window future-attention reference, not an "
               "oracle")
    lines += ["Per budget (the best rule: the rules' lowest mean KL): " + "; ".join(cells) + f". {REST}: {verdict}.",
              ""]
    (out / "windows.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()

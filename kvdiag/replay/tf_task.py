"""The teacher-forced task success of a replayed builtin suite (``tf_task.csv`` / ``tf_task.md``), from the
``tf_task`` and ``top1_agree`` columns of ``generations.parquet`` (``kvdiag.replay.teacher_forced``).

Fed the full cache's own tokens, a policy "succeeds" on a sequence when its most likely token is the full cache's at
every token where the final line writes what the answer needs: it would have written the answer as the full cache
did, given the same text before it. This is how the policies that read the future (``oracle``, ``oracle_future``:
teacher-forced only) enter the accuracy-against-budget view beside the rules. It is not a free-running outcome: one
slip earlier in a generation changes everything after it, which teacher forcing never sees.

Per (policy, budget): n (sequences compressed at least once whose Trace's final line holds the needed texts; the
others are counted apart), successes with Wilson CIs, the mean per-step top-1 agreement, the mean share of the final
line's needed tokens with top-1 agreement (``tf_needed_agree``: a graded success), and McNemar's exact test
of each policy against the best policy of that budget (the same sequences, Holm-adjusted per budget).
"""

from __future__ import annotations

import numpy as np
import polars as pl

from kvdiag.core.io import write_csv, write_text
from kvdiag.core.stats import format_p, holm, mcnemar, wilson
from kvdiag.core.tables import markdown_table


def tf_task_table(df: pl.DataFrame, level: float = 0.95) -> pl.DataFrame:
    """One row per (scorer, budget) of a teacher-forced replay with ``tf_task`` values (module docstring)."""
    rows = df.filter(pl.col("tf_task").is_not_null() & (pl.col("compressions") > 0))
    apart = df.filter(pl.col("tf_task").is_null() | (pl.col("compressions") == 0))
    out = []
    for (scorer, budget), g in rows.group_by("scorer", "budget", maintain_order=True):
        k, n = int(g["tf_task"].sum()), g.height
        lo, hi = wilson(k, n, level)
        agree = [float(np.mean(a)) for a in g["top1_agree"].to_list() if a]
        needed = g["tf_needed_agree"].drop_nulls() if "tf_needed_agree" in g.columns else pl.Series([], dtype=float)
        out.append({"scorer": scorer, "budget": budget, "n": n, "prompts": g["prompt_id"].n_unique(),
                    "success": k, "rate": k / n, "lo": lo, "hi": hi, "top1_agree": float(np.mean(agree)),
                    "needed_agree": float(needed.mean()) if needed.len() else None,
                    "apart": apart.filter((pl.col("scorer") == scorer) & (pl.col("budget") == budget)).height})
    table = pl.DataFrame(out, infer_schema_length=None)
    return _tests(table, rows)


def _tests(table: pl.DataFrame, rows: pl.DataFrame) -> pl.DataFrame:
    """``best`` (the budget's most successful policy), McNemar's exact p against it on the shared sequences and its
    Holm adjustment within the budget."""
    p_raw, best_of = [], []
    for r in table.iter_rows(named=True):
        same = table.filter(pl.col("budget") == r["budget"]).sort(["rate", "scorer"], descending=[True, False])
        best = same["scorer"][0]
        best_of.append(best)
        if best == r["scorer"]:
            p_raw.append(None)
            continue
        pair = (rows.filter((pl.col("budget") == r["budget"]) & pl.col("scorer").is_in([best, r["scorer"]]))
                .pivot(on="scorer", index="prompt_id", values="tf_task").drop_nulls())
        p_raw.append(mcnemar(pair[best].to_numpy(), pair[r["scorer"]].to_numpy()) if pair.height else None)
    table = table.with_columns(pl.Series("best", best_of), pl.Series("p_vs_best", p_raw, dtype=pl.Float64))
    adjusted = []
    for (budget,), g in table.group_by("budget", maintain_order=True):
        mask = g["p_vs_best"].is_not_null().to_numpy()
        adj = np.full(g.height, np.nan)
        if mask.any():
            adj[mask] = holm(g["p_vs_best"].to_numpy()[mask])
        adjusted += [(budget, s, a) for s, a in zip(g["scorer"], adj, strict=True)]
    holm_col = {(b, s): None if np.isnan(a) else float(a) for b, s, a in adjusted}
    return table.with_columns(pl.Series("p_holm", [holm_col[(b, s)] for b, s in zip(table["budget"], table["scorer"],
                                                                                  strict=True)], dtype=pl.Float64))


def write_tf_task(df: pl.DataFrame, out_dir, level: float = 0.95) -> pl.DataFrame | None:
    """``tf_task.csv`` and ``tf_task.md`` when the rows hold ``tf_task`` values; the table, or None."""
    if "tf_task" not in df.columns or not df["tf_task"].drop_nulls().len():
        return None
    table = tf_task_table(df, level)
    write_csv(table, out_dir / "tf_task.csv")
    lines = ["# Teacher-forced task success", "",
             "Fed the full cache's tokens, a policy succeeds on a sequence when its top-1 token is the full cache's at "
             "every token where the final line writes what the answer needs (`kvdiag.replay.tf_task`). n: sequences "
             "compressed at least once whose final line holds the needed texts; `apart`: the others. Wilson "
             f"{level:.0%} CIs; McNemar's exact test against the budget's best policy, Holm-adjusted per budget.", ""]
    body = [[r["scorer"], r["budget"], r["n"], f"{r['success']}/{r['n']}",
             f"{r['rate']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}]", f"{r['top1_agree']:.3f}",
             "–" if r["needed_agree"] is None else f"{r['needed_agree']:.3f}",
             "best" if r["scorer"] == r["best"] else format_p(r["p_holm"]), r["apart"]]
            for r in table.sort("budget", "scorer").iter_rows(named=True)]
    lines.append(markdown_table(["policy", "budget", "n", "success", "rate [CI]", "top-1 agreement",
                                 "agreement on the final line's needed tokens", "p vs best (Holm)", "apart"], body))
    write_text(out_dir / "tf_task.md", "\n".join(lines) + "\n")
    return table

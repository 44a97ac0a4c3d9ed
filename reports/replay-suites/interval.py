"""interval.md: builtin:keys compressed every 64 against every 128 tokens (keys/ and keys-interval128/, the same 50
prompts, rules and budgets): the task component (recalled) per (rule, budget) under each interval, McNemar's exact
test on the paired generations (Holm-adjusted over the cells), and pooled over the rules.

Run from the repository root: .venv/bin/python reports/replay-suites/interval.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from kvdiag.core.stats import format_p, holm, mcnemar
from kvdiag.core.tables import markdown_table
from kvdiag.tasks.suites import SUITES, grade

HERE = Path(__file__).parent


def _verdicts(run: Path) -> pl.DataFrame:
    s = SUITES["keys"]
    df = pl.read_parquet(run / "generations.parquet")
    ok = [grade(s, t, a)[s.task.name] for t, a in zip(df["text"], df["answer"], strict=True)]
    return df.select("prompt_id", "scorer", "budget", "compressions").with_columns(pl.Series("ok", ok))


def main(here: Path = HERE, out: Path = HERE) -> None:
    a, b = _verdicts(here / "keys"), _verdicts(here / "keys-interval128")
    j = a.join(b, on=["prompt_id", "scorer", "budget"], suffix="_128", how="inner", nulls_equal=True)
    cells = [(sc, bu, g) for (sc, bu), g in j.filter(pl.col("scorer") != "full_kv")
             .group_by("scorer", "budget", maintain_order=True)]
    p = np.array([mcnemar(g["ok_128"].to_numpy(), g["ok"].to_numpy()) for _, _, g in cells])
    adj = holm(p)
    rows = [[sc, bu, g.height, f"{int(g['ok'].sum())}/{g.height}", f"{int(g['ok_128'].sum())}/{g.height}",
             int((g["ok_128"] & ~g["ok"]).sum()), int((g["ok"] & ~g["ok_128"]).sum()), format_p(pv), format_p(pa)]
            for (sc, bu, g), pv, pa in zip(cells, p, adj, strict=True)]
    rules = j.filter(pl.col("scorer") != "full_kv")
    full = j.filter(pl.col("scorer") == "full_kv")
    lines = ["# builtin:keys: a compaction every 64 tokens against every 128", "",
             "Made by interval.py from keys/ and keys-interval128/ (each one `kvdiag replay`, reproduce.sh). The same "
             f"50 prompts; the task component (recalled). FullKV: {int(full['ok'].sum())}/{full.height} and "
             f"{int(full['ok_128'].sum())}/{full.height}. McNemar's exact test on the paired generations, Holm over "
             f"the {len(cells)} cells.", "",
             markdown_table(["rule", "budget", "n", "interval 64", "interval 128", "only 128", "only 64", "p",
                             "p (Holm)"], rows), "",
             f"Pooled over the rules: {int(rules['ok'].sum())}/{rules.height} at interval 64, "
             f"{int(rules['ok_128'].sum())}/{rules.height} at 128 (McNemar p = "
             f"{format_p(mcnemar(rules['ok_128'].to_numpy(), rules['ok'].to_numpy()))}; generations of one prompt "
             "are not independent, so this pooled p is descriptive)."]
    (out / "interval.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

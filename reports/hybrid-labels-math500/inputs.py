"""analyze.py's inputs, committed: the columns and rows of reproduce.sh's outputs that analyze.py reads, in the same
layout (``inputs/``), so that report.md regenerates without the model (tests/test_reports.py).

- ``smollm2-labels-all.parquet``: the exact labels of every entry (keys, kl_mean, noise_floor, age; token rows);
- ``smollm2-fast-all.parquet``: the fast labels of every entry (keys, kl_mean);
- ``smollm2-hybrid-{0.1,0.2}.parquet``: which entries each hybrid run labeled exactly (keys, method) and, in its
  metadata, the miss rate its audit estimated;
- ``smollm2*/decisions.parquet``: the oracle_single rows of the decisions from exact labels (``smollm2``) and from
  hybrid labels (prompt_id, checkpoint, decision, budget, kl_mean).

Run from the repository root after reproduce.sh: .venv/bin/python reports/hybrid-labels-math500/inputs.py
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from kvdiag.core.io import read_table, write_table

D = Path("runs/decisions-math500")
OUT = Path("reports/hybrid-labels-math500/inputs")
KEY = ["prompt_id", "checkpoint", "position"]
HYBRID = ("hybrid-0.1", "hybrid-0.2")
FILES = {  # file -> (the columns analyze.py reads, the metadata keys it reads)
    "smollm2-labels-all.parquet": ([*KEY, "granularity", "kl_mean", "noise_floor", "age"], ()),
    "smollm2-fast-all.parquet": ([*KEY, "kl_mean"], ()),
    **{f"smollm2-{h}.parquet": ([*KEY, "method"], ("miss_rate",)) for h in HYBRID},
    **{f"{d}/decisions.parquet": (["prompt_id", "checkpoint", "decision", "budget", "kl_mean"], ())
       for d in ("smollm2", *(f"smollm2-oracle-{h}" for h in HYBRID))},
}


def slim(runs: Path, name: str) -> tuple[pl.DataFrame, dict]:
    """The rows and columns of ``runs/name`` that analyze.py reads, and the metadata it reads, with the source named."""
    columns, keys = FILES[name]
    df, meta = read_table(runs / name, name)
    if "granularity" in columns:
        df = df.filter(pl.col("granularity") == "token")
    if "decision" in columns:
        df = df.filter(pl.col("decision") == "oracle_single")
    return df.select(columns), {**{k: meta[k] for k in keys}, "source": f"{name}: {', '.join(columns)}"}


def main(runs: Path = D, out: Path = OUT) -> None:
    for name in FILES:
        df, meta = slim(runs, name)
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        write_table(df, out / name, meta)
        print(f"wrote {out / name} ({df.height} rows)")


if __name__ == "__main__":
    main()

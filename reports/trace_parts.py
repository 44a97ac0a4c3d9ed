"""The Trace's part of the committed figure tables, as the raw inputs those tables are made again from without it.

The Traces of reports/math500-smollm2 and reports/math500-long are not committed (hundreds of MB). What the figures
took from them is in the committed CSVs, column for column, at full float64 precision:

- ``delayed_reads_entries.csv``'s first columns are ``features.trace_first_reads`` of every labeled entry: written
  as ``figures/first_reads.parquet`` (what ``kvdiag figures`` now writes itself; ``make_figures(reads=...)`` reads it);
- math500-long's figures computed read pressure and value payload from its Trace (its score run wrote no
  ``scores.features.parquet``): ``blind_spot_points.csv`` holds them for every analysed label (none at a checkpoint
  without eligible entries), written as ``figures/read_pressure_payload.parquet`` in the features file's schema
  (``make_figures(features=...)`` reads it).

Each file's metadata names the run's settings and Trace (from its figures.json) and the CSV it was taken from.
Run from the repository root: .venv/bin/python reports/trace_parts.py
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import polars as pl

from kvdiag.core.io import read_json, write_table
from kvdiag.figures.config import FigureParams
from kvdiag.figures.delayed_reads import read_settings
from kvdiag.figures.registry import READS_SCHEMA
from kvdiag.scorers.token_features import SCHEMA as FEATURES_SCHEMA

RUNS = {"reports/math500-smollm2/figures": False, "reports/math500-long/figures": True}  # -> take the features too
FROM = "taken column for column from the committed {} of the run in figures.json (its Trace is not committed)"


def first_reads(figures: Path) -> tuple[pl.DataFrame, dict]:
    """The first reads of the run whose figures are in ``figures`` and their metadata (``first_reads.parquet``)."""
    info = read_json(figures / "figures.json")
    entries = pl.read_csv(figures / "delayed_reads_entries.csv", schema_overrides=READS_SCHEMA)
    meta = {"kind": "first_reads", "params": read_settings(FigureParams(**info["params"])),
            "trace": info["inputs"]["trace"], "source": FROM.format("delayed_reads_entries.csv")}
    return entries.select(list(READS_SCHEMA)), meta


def pressure_payload(figures: Path) -> tuple[pl.DataFrame, dict]:
    """Read pressure and value payload of every analysed label of the run in ``figures`` and their metadata."""
    info = read_json(figures / "figures.json")
    points = pl.read_csv(figures / "blind_spot_points.csv", schema_overrides=FEATURES_SCHEMA)
    meta = {"kind": "token_features", "trace": info["inputs"]["trace"],
            "params": asdict(FigureParams(**info["params"]).token_features),
            "source": FROM.format("blind_spot_points.csv") + "; the analysed labels only"}
    return points.select(list(FEATURES_SCHEMA)), meta


def main(runs: dict[str, bool] = RUNS) -> None:
    for run, features in runs.items():
        figures = Path(run)
        for name, (df, meta) in {"first_reads.parquet": first_reads(figures),
                                 **({"read_pressure_payload.parquet": pressure_payload(figures)} if features else {})
                                 }.items():
            write_table(df, figures / name, meta)
            print(f"wrote {figures / name} ({df.height} rows)")


if __name__ == "__main__":
    main()

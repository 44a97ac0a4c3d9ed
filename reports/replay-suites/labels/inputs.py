"""The needed-token labels' inputs: which positions to label (``include``), and what analyze.py reads (``inputs``).

- ``include SUITE``: the FullKV generations of ``reports/replay-suites/SUITE/generations.parquet`` hold each
  prompt's needed tokens (``needed_positions``/``needed_where``: the prompt's copy and the generation's); the Trace of
  the same prompts (runs/needed-labels-SUITE/trace) must hold the very same tokens (greedy, the same model), else
  this stops: positions are only meaningful in the sequence they were found in. Writes ``include.json`` (for
  ``kvdiag label --include``) and ``needed.parquet`` beside the Trace.
- ``inputs SUITE``: from the run's ``labels.parquet`` (``--horizon rest``), the committed inputs
  ``inputs/SUITE/labels.parquet``: per labeled entry its keys, ``sampled`` (in the checkpoint's seeded uniform
  sample: the rows the harm threshold is taken from), ``where`` (prompt / answer for a needed token, null otherwise),
  the prompt length, the horizon it got and ``kl_H`` for H in HORIZONS and rest (``kvdiag.label.horizons``).

Run from the repository root: .venv/bin/python reports/replay-suites/labels/inputs.py include|inputs SUITE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl

from kvdiag.core.io import read_table, write_table
from kvdiag.label.horizons import at_horizons
from kvdiag.trace.manifest import TraceFiles

HERE = Path(__file__).parent
HORIZONS = (16, 32, 64, 128, "rest")
KEY = ["prompt_id", "checkpoint", "position"]


def run_dir(suite: str) -> Path:
    return Path(f"runs/needed-labels-{suite}")


def include(suite: str) -> None:
    """include.json and needed.parquet of the suite's Trace, from the replay's FullKV generations."""
    trace = TraceFiles(run_dir(suite) / "trace")
    tokens = pl.read_parquet(trace.path / "tokens.parquet")
    full = pl.read_parquet(HERE.parent / suite / "generations.parquet").filter(pl.col("scorer") == "full_kv")
    rows, positions = [], {}
    for pid in trace.prompt_ids:
        mine = tokens.filter(pl.col("prompt_id") == pid).sort("position")["token_id"].to_list()
        gen = full.filter(pl.col("prompt_id") == pid).row(0, named=True)
        if mine != list(gen["token_ids"]):
            raise SystemExit(f"{pid}: the Trace's tokens differ from FullKV's generation in the replay; the needed "
                             "positions would not be the same tokens")
        positions[pid] = sorted(gen["needed_positions"])
        rows += [{"prompt_id": pid, "position": p, "where": w}
                 for p, w in zip(gen["needed_positions"], gen["needed_where"], strict=True)]
    (run_dir(suite) / "include.json").write_text(json.dumps(positions))
    pl.DataFrame(rows).write_parquet(run_dir(suite) / "needed.parquet")


def inputs(suite: str) -> None:
    """inputs/SUITE/labels.parquet from the run's labels (kl at every horizon) and needed positions."""
    from kvdiag.label.config import LabelConfig, candidate_positions

    labels, meta = read_table(run_dir(suite) / "labels.parquet")
    cfg = meta["config"]
    sample = LabelConfig(candidates=cfg["candidates"], seed=cfg["seed"])  # the seeded sample, without include
    trace = TraceFiles(run_dir(suite) / "trace")
    sampled = pl.DataFrame(
        [{"prompt_id": pid, "checkpoint": t, "position": p, "sampled": True}
         for pid, t in labels.select("prompt_id", "checkpoint").unique().sort(["prompt_id", "checkpoint"]).rows()
         for p in candidate_positions(pid, t, sample)],
        schema={"prompt_id": pl.String, "checkpoint": pl.Int64, "position": pl.Int64, "sampled": pl.Boolean})
    wide = (at_horizons(labels, HORIZONS, keys=KEY).pivot(on="at", index=KEY, values="kl_mean")
            .rename({str(h): f"kl_{h}" for h in HORIZONS}))
    needed = pl.read_parquet(run_dir(suite) / "needed.parquet").cast({"position": pl.Int64})
    out = (labels.select(*KEY, "horizon", "noise_floor").cast({"checkpoint": pl.Int64, "position": pl.Int64})
           .join(wide.cast({"checkpoint": pl.Int64, "position": pl.Int64}), on=KEY)
           .join(sampled, on=KEY, how="left").with_columns(pl.col("sampled").fill_null(False))
           .join(needed, on=["prompt_id", "position"], how="left")
           .with_columns(prompt_len=pl.col("prompt_id").replace_strict(
               {pid: trace.prompt_len(pid) for pid in trace.prompt_ids}, return_dtype=pl.Int64))
           .sort(KEY))
    dest = HERE / "inputs" / suite
    dest.mkdir(parents=True, exist_ok=True)
    write_table(out, dest / "labels.parquet", {"kind": "needed-labels inputs", "suite": suite,
                                                "labels": {k: meta[k] for k in ("config", "label", "model")}})


def main(argv: list[str] | None = None) -> None:
    step, suite = (argv if argv is not None else sys.argv[1:])[:2]
    {"include": include, "inputs": inputs}[step](suite)


if __name__ == "__main__":
    main()

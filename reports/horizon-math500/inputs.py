"""analyze.py's inputs, committed: the rows and columns of reproduce.sh's outputs that analyze.py reads, with every
horizon's value derived here from the runs' per-step KL (``kvdiag.label.horizons.at_horizons``: the mean of the first
H steps of the same rows), so that the tables regenerate without the model or the Trace (tests/test_reports.py).
One folder per model: inputs/smollm2/, inputs/gemma3/.

- ``labels.parquet``: the exact labels of the sampled entries (prompt_id, checkpoint, position, age, noise_floor at
  the longest horizon, prompt_len, token_text) and ``kl_H`` for every H in HORIZONS;
- ``token_scores.parquet``: every rule's token score of those entries (higher = keep);
- ``decisions.parquet``: each decision's set (prompt_id, checkpoint, decision, kind, budget, kept, status) and its
  joint damage ``kl_H`` for every H (null where nothing was labeled: a rule over the budget);
- ``kept.parquet``: per decision and sampled entry, the share of the (layer, KV head) cells that keep it.

Run from the repository root after reproduce.sh's runs: .venv/bin/python reports/horizon-math500/inputs.py [MODEL ...]
(default: every model of MODELS)
"""

from __future__ import annotations

import sys
from pathlib import Path

import polars as pl

from kvdiag.core.io import read_table, write_table
from kvdiag.label.horizons import at_horizons
from kvdiag.trace.manifest import TraceFiles

D = Path("runs/horizon-math500")
OUT = Path("reports/horizon-math500/inputs")
HORIZONS = (8, 16, 32, 64, 128, 256)
MODELS = ("smollm2", "gemma3")  # the run names' prefixes: smollm2-trace, gemma3-labels-h256.parquet, ...
KEY = ["prompt_id", "checkpoint", "position"]
DECISION_KEY = ["prompt_id", "checkpoint", "decision", "budget"]


def wide(table: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """``keys`` + ``kl_H`` per H of HORIZONS, from the rows' ``kl_steps`` (null where a row's horizon is shorter)."""
    long = at_horizons(table, HORIZONS, keys=keys)
    return long.pivot(on="at", index=keys, values="kl_mean").rename({str(h): f"kl_{h}" for h in HORIZONS})


def labels(runs: Path, model: str) -> pl.DataFrame:
    lab = read_table(runs / f"{model}-labels-h256.parquet", "labels")[0].filter(pl.col("granularity") == "token")
    trace = TraceFiles(runs / f"{model}-trace")
    text = trace.tokens.select("prompt_id", "position", "token_text")
    plen = pl.DataFrame({"prompt_id": trace.prompt_ids, "prompt_len": [trace.prompt_len(p) for p in trace.prompt_ids]})
    out = (lab.select(*KEY, "age", "noise_floor", "horizon").join(wide(lab, [*KEY]), on=KEY)
           .join(plen, on="prompt_id").join(text, on=["prompt_id", "position"]))
    assert out.height == lab.height, "a labeled entry without its token or prompt length"
    return out.sort(KEY)


def token_scores(runs: Path, model: str, entries: pl.DataFrame) -> pl.DataFrame:
    scores = read_table(runs / f"{model}-scores.parquet", "scores")[0].filter(pl.col("granularity") == "token")
    rules = [c for c in scores.columns if c not in (*KEY, "granularity", "layer", "kv_head")]
    out = entries.select(KEY).join(scores.select(*KEY, *rules), on=KEY)
    assert out.height == entries.height, "a labeled entry without its scores"
    return out.sort(KEY)


def decisions(runs: Path, model: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    dec = read_table(runs / f"{model}-decisions/decisions.parquet", "decisions")[0].filter(pl.col("sample").is_null())
    labeled = dec.filter(pl.col("kl_steps").is_not_null())
    out = (dec.select(*DECISION_KEY, "kind", "kept", "status", "horizon")
           .join(wide(labeled, DECISION_KEY), on=DECISION_KEY, how="left"))
    return out.sort(DECISION_KEY), dec


def kept(dec: pl.DataFrame, entries: pl.DataFrame, cells: int) -> pl.DataFrame:
    """Per (decision row, sampled entry): 1 - (cells evicting it) / (layers x KV heads)."""
    heads = (dec.filter(pl.col("status").is_in(["ok", "nothing_evicted"]))  # the others have no set
             .select(*DECISION_KEY, "evicted_heads")
             .with_columns(position=pl.int_ranges(pl.col("evicted_heads").list.len()))
             .explode("evicted_heads", "position"))
    out = entries.select(KEY).join(heads, on=["prompt_id", "checkpoint", "position"])
    return (out.select(*DECISION_KEY, "position", kept_share=1 - pl.col("evicted_heads") / cells)
            .sort([*DECISION_KEY, "position"]))


def main(models: tuple[str, ...] = MODELS, runs: Path = D, out: Path = OUT) -> None:
    for model in models:
        (out / model).mkdir(parents=True, exist_ok=True)
        lab = labels(runs, model)
        trace = TraceFiles(runs / f"{model}-trace")
        dec, raw = decisions(runs, model)
        for name, df in {"labels.parquet": lab, "token_scores.parquet": token_scores(runs, model, lab),
                         "decisions.parquet": dec,
                         "kept.parquet": kept(raw, lab, trace.num_layers * trace.num_kv_heads)}.items():
            write_table(df, out / model / name, {"source": f"{runs}: reproduce.sh's outputs, slimmed by inputs.py"})


if __name__ == "__main__":
    main(tuple(sys.argv[1:]) or MODELS)

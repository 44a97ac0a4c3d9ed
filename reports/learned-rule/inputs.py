"""The committed inputs of this report (inputs/), from reproduce.sh's runs: what analyze.py reads, so that
tests/test_reports.py makes report.md again without the model.

- ``models/<variant>.json``: each variant's fitted model (model.json's rule, features and that model's section),
  ``variants.csv`` (their out-of-fold metrics on the training prompts), ``chosen.json`` (the variant that is the
  rule, reports/learned-rule/model.json); ``round1/``: the same for the first round; each round's rule's held-out
  ``decisions.parquet``, and ``decisions-best-variant.parquet`` for round 2's best variant (before the ablations
  entered the choice);
- ``heldout_features.parquet``: every live feature of each (layer, KV head) cell of the 240 held-out labelled
  entries of reports/horizon-math500 (their labels and the rules' token scores are read from there), float32;
- ``decisions.parquet``: the held-out decisions rows (the learned rule and the rules beside it);
- ``replay-<suite>.parquet``: the learned rule's outcomes in the loop (the rules' are reports/replay-suites' and
  reports/replay-math500's);
- ``bench-score.json``: ``kvdiag bench score`` of the rule, round 2's best variant and SnapKV;
- ``grade.json``, ``leaderboard-row.md``: its row on the sealed benchmark (kvdiag grade's rows.json and row).

    python reports/learned-rule/inputs.py
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import polars as pl

RUN = Path("runs/learned-rule")
OUT = Path("reports/learned-rule/inputs")
HORIZON = Path("reports/horizon-math500/inputs/smollm2")
HELDOUT_TRACE = Path("runs/decisions-math500-h128/smollm2-trace")
SUITES = ("keys", "countdown", "recall", "math500")


def variants(fits: Path, out: Path) -> None:
    """Each variant's model (the parts analyze.py reads), the variants' table and the chosen one, into ``out``."""
    (out / "models").mkdir(parents=True, exist_ok=True)
    for name in pl.read_csv(fits / "variants.csv")["variant"]:
        model = json.loads((fits / name / "model.json").read_text())
        keep = {k: model[k] for k in ("kind", "rule", "features", "aggregation", "harm", "harm_threshold")}
        (out / "models" / f"{name}.json").write_text(json.dumps({**keep, model["rule"]: model[model["rule"]]}) + "\n")
    for f in ("variants.csv", "chosen.json"):
        shutil.copy(fits / f, out / f)


def decisions(path: Path, out: Path) -> None:
    from kvdiag.core.io import read_table

    read_table(path)[0].select("prompt_id", "checkpoint", "budget", "decision", "kind", "kl_mean", "evicted",
                               "evicted_heads").write_parquet(out)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from fit_variants import ALL

    from kvdiag.core.io import read_table
    from kvdiag.fit.run import feature_table
    from kvdiag.trace import Trace

    for run, out in ((RUN / "round1", OUT / "round1"), (RUN, OUT)):
        variants(run / "fits", out)
        decisions(run / "decisions" / "decisions.parquet", out / "decisions.parquet")
    # round 2's best variant before its ablations entered the choice (boosted-all-tokens)
    decisions(RUN / "round2-first" / "decisions" / "decisions.parquet", OUT / "decisions-best-variant.parquet")

    labels = read_table(HORIZON / "labels.parquet")[0]
    keys = labels.select("prompt_id", "checkpoint", "position").with_columns(
        granularity=pl.lit("token"), layer=pl.lit(-1), kv_head=pl.lit(-1))
    feats = feature_table(Trace(HELDOUT_TRACE), keys, ALL, progress=True, cells=True)
    feats.with_columns(pl.col(ALL).cast(pl.Float32)).write_parquet(OUT / "heldout_features.parquet")

    shutil.copy(RUN / "bench-score.json", OUT / "bench-score.json")
    from kvdiag.replay.run import generation_outcomes

    for suite in SUITES:  # a replay or grade run not made yet is left out (analyze.py skips its section)
        run = RUN / f"replay-{suite}"
        if (run / "generations.parquet").is_file():  # without FullKV the run writes no outcomes.csv
            generation_outcomes(run).drop("final_answer").write_parquet(OUT / f"replay-{suite}.parquet")
    if (RUN / "grade" / "rows.json").is_file():
        grade = json.loads((RUN / "grade" / "rows.json").read_text())
        (OUT / "grade.json").write_text(json.dumps(grade, indent=1) + "\n")
        shutil.copy(RUN / "grade" / "leaderboard-row.md", OUT / "leaderboard-row.md")


if __name__ == "__main__":
    main()

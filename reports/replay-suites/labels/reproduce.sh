#!/usr/bin/env bash
# Regenerates this report (run from the repository root, after reports/replay-suites/reproduce.sh: its FullKV
# generations say where the needed tokens are). Per suite: a Trace of the first N prompts (greedy, the same model and
# template as the replay, so the same tokens: inputs.py checks), exact labels at generated tokens 128 and 256 of a
# seeded sample of 16 entries per checkpoint plus every needed token written before it (--include), each to the end
# of its generation (--horizon rest; H = 16 derives from the same rows' per-step KL), then analyze.py.
# A rerun continues from runs/needed-labels-*/ (the label parts).
set -euo pipefail
K=${K:-.venv/bin/kvdiag}
PY=${PY:-.venv/bin/python}
N=${N:-10}  # prompts per suite (the report: 10)
D=reports/replay-suites/labels
for suite in ${SUITES:-keys countdown}; do
    model=smollm2
    [ "$suite" = countdown ] && model=smollm2+data/adapters/smollm2-countdown
    R=runs/needed-labels-$suite
    # a rerun continues the Trace (its finished prompts are kept)
    $K trace --model "$model" --prompts "builtin:$suite:$N" --max-new-tokens 400 --store 0 --out "$R/trace" --quiet
    $PY $D/inputs.py include "$suite"
    $K label --trace "$R/trace" --checkpoints every:128 --w-obs 32 --candidates 16 --include "$R/include.json" \
        --horizon rest --out "$R/labels.parquet" --quiet
    $PY $D/inputs.py inputs "$suite"
done
$PY $D/analyze.py

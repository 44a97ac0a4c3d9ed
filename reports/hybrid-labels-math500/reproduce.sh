#!/usr/bin/env bash
# Regenerates this report (run from the repository root). Needs reports/decisions-math500/reproduce.sh's SmolLM2
# outputs in runs/decisions-math500 (the Trace, exact labels of every entry, head scores, the decisions).
set -euo pipefail
K=.venv/bin/kvdiag
D=runs/decisions-math500
T=$D/smollm2-trace
R=reports/hybrid-labels-math500
L="--trace $T --checkpoints every:512 --candidates all --horizon 8"
$K label $L --method fast --out $D/smollm2-fast-all.parquet
for f in 0.1 0.2; do
    $K label $L --method hybrid --exact-frac $f --audit 32 --out $D/smollm2-hybrid-$f.parquet
    $K decisions --trace $T --scores $D/smollm2-scores-head.parquet --labels $D/smollm2-hybrid-$f.parquet \
        --keep 0.5,0.25,0.125 --infeasible skip --references oracle_single --scorers random --pairs 0 \
        --out $D/smollm2-oracle-hybrid-$f
    # cost: hybrid against exact labels of every entry, the same prefix and horizon, in one run
    $K bench label --method hybrid --exact-frac $f --audit 32 --prefix 512 --horizon 8 --n 64 --repeats 2 \
        --out $R/bench-hybrid-$f.json
done
.venv/bin/python $R/analyze.py
# the committed inputs of report.md (what analyze.py reads, tests/test_reports.py regenerates report.md from them)
.venv/bin/python $R/inputs.py
# the cost / miss-rate frontier of the Fisher ranking and of --miss-rate R's rounds, from the committed inputs
.venv/bin/python $R/miss_rate.py

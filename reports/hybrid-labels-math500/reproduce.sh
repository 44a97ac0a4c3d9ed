#!/usr/bin/env bash
# Regenerates this report (run from the repository root). Needs reports/decisions-math500/reproduce.sh's SmolLM2
# outputs in runs/decisions-math500 (the Trace, exact labels of every entry, head scores, the decisions).
set -euo pipefail
K=.venv/bin/kvdiag
S=runs/math500
D=runs/decisions-math500
L="--trace $S/trace --checkpoints every:128 --candidates all --horizon 16"
$K label $L --method fast --out $D/smollm2-fast-all.parquet
for f in 0.1 0.2; do
    $K label $L --method hybrid --exact-frac $f --audit 32 --out $D/smollm2-hybrid-$f.parquet
    $K decisions --trace $S/trace --scores $D/smollm2-scores-head.parquet --labels $D/smollm2-hybrid-$f.parquet \
        --keep 0.5,0.25,0.125 --infeasible skip --references oracle_single --scorers random --pairs 0 \
        --out $D/smollm2-oracle-hybrid-$f
done
# cost: hybrid against exact labels of every entry, the same entries, in one run
$K bench label --method hybrid --exact-frac 0.1 --audit 32 --prefix 512 --out reports/hybrid-labels-math500/bench.json
.venv/bin/python reports/hybrid-labels-math500/analyze.py

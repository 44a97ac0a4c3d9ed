#!/usr/bin/env bash
# Regenerates this report (#42: the fast label against exact labels at H = 16 and H = 128, with its cost). Run from
# the repository root; outputs in runs/fast-labels-horizon, a rerun continues (Trace and label parts).
# SmolLM2-135M, the first 10 problems of data/math500-first20.jsonl, 400 generated tokens each (greedy; no end of
# sequence before them), checkpoints every 128 generated tokens that leave room for 128 steps (128 and 256).
# Exact: a seeded sample of 48 entries per checkpoint labeled to H = 128 (H = 16 is the mean of the same rows' first
# 16 steps: kvdiag.label.horizons), and every entry exactly to H = 128. Fast (fisher, K = 8): every entry, at H = 16
# and at H = 128 (two runs).
# Cost: kvdiag bench label --method fast at H = 16 and H = 128 (P = 512, 16 exact candidates, best of 3).
set -euo pipefail
K=${K:-.venv/bin/kvdiag}
PY=${PY:-.venv/bin/python}
R=runs/fast-labels-horizon
D=reports/fast-labels-horizon
mkdir -p $R $D/inputs
$K trace --prompts data/math500-first20.jsonl --limit 10 --max-new-tokens 400 --min-new-tokens 400 --store 0 \
    --out $R/trace --quiet
C="--trace $R/trace --checkpoints every:128 --quiet"
$K label $C --candidates 48 --horizon 128 --out $R/exact-h128.parquet
# every entry exactly (6,692; ~25 min): reports/hybrid-labels-math500/miss-rate.md's frontier at H = 16 and H = 128
$K label $C --candidates all --horizon 128 --out $R/exact-all-h128.parquet
$K label $C --method fast --candidates all --horizon 16 --out $R/fast-h16.parquet
$K label $C --method fast --candidates all --horizon 128 --out $R/fast-h128.parquet
for H in 16 128; do
    $K bench label --method fast --prefix 512 --n 16 --horizon $H --repeats 3 --out $D/bench-h$H.json \
        > $D/bench-h$H.txt
done
$PY $D/analyze.py inputs
$PY $D/analyze.py

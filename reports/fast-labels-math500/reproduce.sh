#!/usr/bin/env bash
# Fast (fisher) labels for every cached entry at the checkpoints of the MATH-500 report, validated against its exact
# labels (reports/math500-smollm2/labels.parquet: every:128, 64 candidates per checkpoint, horizon 16, a subset of the
# entries labeled here). Run from the repository root. Needs the Trace runs/math500/trace, made by the first line of
# reports/math500-smollm2/reproduce.sh. About 45 min on a 2-core CPU shared with other jobs (~1 min per checkpoint).
set -euo pipefail
.venv/bin/kvdiag label --trace runs/math500/trace --out runs/fast-labels-math500/fast.parquet --checkpoints every:128 --candidates all --horizon 16 --method fast --fisher-samples 8   # 2026-12-01 run: --out runs/fast8/fast.parquet, validate-labels --out runs/fast8/val, files copied here
.venv/bin/kvdiag validate-labels --exact reports/math500-smollm2/labels.parquet --approx runs/fast-labels-math500/fast.parquet --scores reports/math500-smollm2/scores.parquet --out reports/fast-labels-math500
cp runs/fast-labels-math500/fast.parquet reports/fast-labels-math500/fast-labels.parquet
# cost per labeled entry, fast vs exact (same P, H), and layer start vs full depth
.venv/bin/kvdiag bench label --method fast --fisher-samples 8 --repeats 3 >> reports/bench/label-fast.txt
.venv/bin/kvdiag bench label --granularity layer --n 16 --repeats 1 > reports/bench/label-layer.txt

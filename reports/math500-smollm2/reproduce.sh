#!/usr/bin/env bash
# Regenerates this report; the prompts are data/math500-first20.jsonl (the report was made from the same 20
# records read as ../shared/datasets/math500.jsonl --limit 20: see data/README.md).
# Run from the repository root; outputs go to runs/math500 (about 40 min on a 2-core CPU).
set -euo pipefail
.venv/bin/kvdiag trace --model smollm2 --prompts data/math500-first20.jsonl --limit 20 --max-new-tokens 512 --out runs/math500/trace
.venv/bin/kvdiag label --trace runs/math500/trace --out runs/math500/labels.parquet --checkpoints every:128 --candidates 64 --horizon 16
.venv/bin/kvdiag score --trace runs/math500/trace --labels runs/math500/labels.parquet --scorers all --out runs/math500/scores.parquet
.venv/bin/kvdiag rank-eval --labels runs/math500/labels.parquet --scores runs/math500/scores.parquet --out runs/math500/rank-eval
.venv/bin/kvdiag figures --trace runs/math500/trace --labels runs/math500/labels.parquet --scores runs/math500/scores.parquet --out runs/math500/figures --rank-eval runs/math500/rank-eval
.venv/bin/kvdiag rank-eval --labels runs/math500/labels.parquet --scores runs/math500/scores.parquet --eligible avokv_e --out runs/math500/rank-eval-eligible
.venv/bin/kvdiag fit --trace runs/math500/trace --labels runs/math500/labels.parquet --scores runs/math500/scores.parquet --out runs/math500/fit
.venv/bin/kvdiag report --run runs/math500

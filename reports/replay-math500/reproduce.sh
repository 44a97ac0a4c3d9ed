#!/usr/bin/env bash
# Regenerates this report: the first 20 MATH-500 problems (data/math500-first20.jsonl), 4 coupled samples each
# (temperature 0.6, top-p 0.95), FullKV + 6 rules x 3 budgets, per-token selection every 64 tokens.
# Run from the repository root; a rerun continues from runs/replay-math500/parts.
set -euo pipefail
.venv/bin/kvdiag replay --prompts data/math500-first20.jsonl --samples 4 --temperature 0.6 --top-p 0.95 \
    --scorers streamingllm,snapkv,tova,rkv,avokv_e,cake --budget 64,128,256 --interval 64 --selection per-token \
    --param avokv_e.w_delay=64 --max-new-tokens 320 --no-kl --batch-size 24 --out runs/replay-math500
for f in summary.md summary.csv budget.csv budget.png budget.pdf outcomes.md outcomes.csv outcomes_summary.csv \
    paired.csv config.json generations.parquet; do cp runs/replay-math500/$f reports/replay-math500/; done

#!/usr/bin/env bash
# Regenerates this report: 50 recall prompts (399 tokens each on SmolLM2), FullKV + 6 rules x 3 budgets, greedy.
# Run from the repository root (about 45 min on a 2-core CPU); a rerun continues from runs/replay-recall/parts.
set -euo pipefail
.venv/bin/kvdiag replay --prompts builtin:recall:50 --scorers streamingllm,snapkv,tova,rkv,avokv_e,cake \
    --budget 64,128,256 --interval 32 --param avokv_e.w_delay=32 --max-new-tokens 192 --batch-size 32 \
    --out runs/replay-recall
for f in summary.md summary.csv budget.csv budget.png budget.pdf outcomes.md outcomes.csv outcomes_summary.csv \
    paired.csv config.json generations.parquet; do cp runs/replay-recall/$f reports/replay-recall/; done

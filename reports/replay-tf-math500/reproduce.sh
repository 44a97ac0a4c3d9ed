#!/usr/bin/env bash
# Regenerates this report: teacher-forced replay of SmolLM2's greedy traces of the first 5 MATH-500 problems
# (256-320 new tokens), the oracle policy + 6 rules x 3 budgets, exact joint labels of every compression, joined
# with the free-running outcomes of reports/replay-math500 (run its reproduce.sh first) and with the single-label
# AUROC of reports/math500-smollm2. Run from the repository root; reruns continue from runs/*/parts.
set -euo pipefail
.venv/bin/kvdiag trace --prompts data/math500-first20.jsonl --limit 5 --max-new-tokens 320 --min-new-tokens 256 \
    --store none --out runs/tf-trace
.venv/bin/kvdiag replay --teacher-forced runs/tf-trace --scorers oracle,streamingllm,snapkv,tova,rkv,avokv_e,cake \
    --budget 64,128,256 --interval 64 --selection per-token --param avokv_e.w_delay=64 --horizon 16 \
    --outcomes runs/replay-math500 \
    --auroc reports/math500-smollm2/labels.parquet reports/math500-smollm2/scores.parquet \
    --out runs/replay-tf-math500
for f in summary.md summary.csv budget.csv budget.png budget.pdf decisions.md compressions.csv correlations.csv \
    regret.csv config.json generations.parquet; do cp runs/replay-tf-math500/$f reports/replay-tf-math500/; done

#!/usr/bin/env bash
# Regenerates this report: teacher-forced replay of SmolLM2's greedy traces of the first 5 MATH-500 problems
# (256-320 new tokens) under per-(layer, KV head) selection: the future-attention oracle policy oracle_future (per
# cell, the entries the full-cache run's next interval + horizon = 80 queries attend most) + 6 rules x 3 budgets,
# exact joint labels of every compression, the single-label AUROC of reports/math500-smollm2. No --outcomes: the
# free-running reports/replay-math500 ran per-token selection, so its outcomes are other decisions' than these.
# Then (#54) the same replay with oracle_future's window the rest of the trace (every query to the end: Belady), into
# rest/: the rules' rows are the same decisions on the same tokens, so rest/regret.csv is their regret against the
# rest-window policy (one name, one window per replay); windows.py sets every policy, the 80-query oracle_future
# included, against it (windows.md / windows.csv).
# Run from the repository root; reruns continue from runs/*/parts. About 45 min on 2 shared CPU cores for the first
# replay; beside another job on the same 2 cores the trace took 9 min (peak RSS 1.2 GB) and the rest-window replay
# 62 min (peak RSS 2.5 GB).
set -euo pipefail
.venv/bin/kvdiag trace --prompts data/math500-first20.jsonl --limit 5 --max-new-tokens 320 --min-new-tokens 256 \
    --store none --out runs/tf-trace
.venv/bin/kvdiag replay --teacher-forced runs/tf-trace \
    --scorers oracle_future,streamingllm,snapkv,tova,rkv,avokv_e,cake --budget 64,128,256 --interval 64 \
    --selection per-head --param avokv_e.w_delay=64 --horizon 16 \
    --auroc reports/math500-smollm2/labels.parquet reports/math500-smollm2/scores.parquet \
    --out runs/replay-tf-math500
for f in summary.md summary.csv budget.csv budget.png budget.pdf decisions.md compressions.csv correlations.csv \
    regret.csv beaten.csv config.json generations.parquet; do cp runs/replay-tf-math500/$f reports/replay-tf-math500/; done
.venv/bin/kvdiag replay --teacher-forced runs/tf-trace \
    --scorers oracle_future,streamingllm,snapkv,tova,rkv,avokv_e,cake --budget 64,128,256 --interval 64 \
    --selection per-head --param avokv_e.w_delay=64 --param oracle_future.window=rest --horizon 16 \
    --auroc reports/math500-smollm2/labels.parquet reports/math500-smollm2/scores.parquet \
    --out runs/replay-tf-math500-rest
mkdir -p reports/replay-tf-math500/rest
for f in summary.md summary.csv budget.csv budget.png budget.pdf decisions.md compressions.csv correlations.csv \
    regret.csv beaten.csv config.json generations.parquet; do
    cp runs/replay-tf-math500-rest/$f reports/replay-tf-math500/rest/
done
.venv/bin/python reports/replay-tf-math500/windows.py

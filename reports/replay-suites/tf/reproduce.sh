#!/usr/bin/env bash
# Regenerates this report (run from the repository root, after reports/replay-suites/labels/reproduce.sh: its
# Traces are the full cache's greedy generations of the first 10 prompts of each suite, the same tokens as the
# free-running replay's FullKV rows). Teacher-forced replay of each Trace under the six rules of the free-running
# report and the future-attention oracle policy oracle_future (per (layer, KV head), the entries the full-cache run's
# next interval + horizon = 80 queries attend most), budgets 64 / 128 / 256, interval 64, per-head selection, the
# prompt compressed too (as in the free-running report), no joint labels (--no-joint); then oracle_future with
# window rest (every query to the end: Belady) in its own replay (<suite>-rest/: one name, one window per replay);
# then, with one keep set for every layer and KV head (--selection per-token), which the exact-label oracle policy
# needs, that oracle (greedy on exact labels at H = 16 of every live entry at every compression), oracle_future and
# the six rules at budget 256 (<suite>-per-token/; the oracle takes about 2 min per prompt, so one budget).
# Each row records its per-step top-1 agreement with the full cache and the teacher-forced task success
# (kvdiag.replay.tf_task); analyze.py sets them beside the free-running outcomes of the same prompts, and sets every
# policy's teacher-forced KL against oracle_future_rest's (report.md's regret tables, regret.csv).
# A rerun continues from runs/replay-suites-tf-*. About 10 min per suite, 3 min per rest run and 25 min per per-token
# run on the idle machine.
set -euo pipefail
K=${K:-.venv/bin/kvdiag}
PY=${PY:-.venv/bin/python}
TF="--budget 64,128,256 --interval 64 --horizon 16 --no-joint"
FILES="summary.md summary.csv budget.csv tf_task.md tf_task.csv config.json generations.parquet"
for suite in ${SUITES:-keys countdown}; do
    T=runs/needed-labels-$suite/trace
    $K replay --teacher-forced "$T" --scorers oracle_future,streamingllm,snapkv,tova,rkv,avokv_e,cake $TF \
        --param avokv_e.w_delay=32 --out "runs/replay-suites-tf-$suite"
    $K replay --teacher-forced "$T" --scorers oracle_future --param oracle_future.window=rest $TF \
        --out "runs/replay-suites-tf-$suite-rest"
    $K replay --teacher-forced "$T" --scorers oracle,oracle_future,streamingllm,snapkv,tova,rkv,avokv_e,cake \
        --selection per-token --budget 256 --interval 64 --horizon 16 --no-joint --param avokv_e.w_delay=32 \
        --out "runs/replay-suites-tf-$suite-per-token"
    for run in "$suite" "$suite-rest" "$suite-per-token"; do
        mkdir -p "reports/replay-suites/tf/$run"
        for f in $FILES; do cp "runs/replay-suites-tf-$run/$f" "reports/replay-suites/tf/$run/"; done
    done
done
# the exact-label oracle with labels over 80 steps (past the next compression), countdown's first 3 prompts (about
# 9 min each: 5x the labels of H = 16)
$K replay --teacher-forced runs/needed-labels-countdown/trace --scorers oracle --selection per-token --budget 256 \
    --interval 64 --horizon 80 --no-joint --limit 3 --out runs/replay-suites-tf-countdown-oracle-h80
H80=reports/replay-suites/tf/countdown-oracle-h80
mkdir -p $H80
for f in $FILES; do cp "runs/replay-suites-tf-countdown-oracle-h80/$f" $H80/; done
$PY reports/replay-suites/tf/analyze.py

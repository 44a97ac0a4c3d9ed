#!/usr/bin/env bash
# Regenerates this report (#43: how the countdown LoRA adapter changes kvdiag's label and rank-eval results). Run
# from the repository root; outputs in runs/adapter-vs-base (a rerun continues: Traces and label parts).
# SmolLM2-135M (base) and SmolLM2-135M + data/adapters/smollm2-countdown (adapted), the first 10 problems of
# data/math500-first20.jsonl, 400 generated tokens each (greedy, no end of sequence before them), the pipeline of
# reports/math500-smollm2 at H = 16: exact labels of 48 seeded entries per checkpoint (every 128 generated tokens),
# every rule's scores of them, rank-eval. Each model on its own generation; and, on the same tokens, the base
# model's Trace labeled by the adapted model (--model ... --force: the same seeded entries).
# The base Trace is reports/fast-labels-horizon's (the same command; made here when absent).
set -euo pipefail
K=${K:-.venv/bin/kvdiag}
PY=${PY:-.venv/bin/python}
A=smollm2+data/adapters/smollm2-countdown
R=runs/adapter-vs-base
D=reports/adapter-vs-base
TRACE="--prompts data/math500-first20.jsonl --limit 10 --max-new-tokens 400 --min-new-tokens 400 --store 0 --quiet"
LABEL="--checkpoints every:128 --candidates 48 --horizon 16 --quiet"
mkdir -p $R/base $R/adapted $R/cross
$K trace --model smollm2 $TRACE --out runs/fast-labels-horizon/trace
$K trace --model $A $TRACE --out $R/adapted/trace
for m in base adapted; do
    T=$R/$m/trace
    [ $m = base ] && T=runs/fast-labels-horizon/trace
    $K label --trace $T $LABEL --out $R/$m/labels.parquet
    $K score --trace $T --labels $R/$m/labels.parquet --scorers all --out $R/$m/scores.parquet --quiet
    $K rank-eval --labels $R/$m/labels.parquet --scores $R/$m/scores.parquet --out $R/$m/rank-eval
done
$K label --trace runs/fast-labels-horizon/trace --model $A --force $LABEL --out $R/cross/labels.parquet
$PY $D/analyze.py inputs
$PY $D/analyze.py

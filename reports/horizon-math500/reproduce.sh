#!/usr/bin/env bash
# Regenerates this report (run from the repository root; outputs in runs/horizon-math500).
# SmolLM2-135M: the first 10 MATH-500 problems of data/math500-first20.jsonl, 776 new tokens each (512 + 256 + 8; no
# end of sequence before them). Greedy decoding: the first 520 tokens are those of reports/decisions-math500, so the
# checkpoint (after 512 generated tokens) holds the same cache; the longest horizon is 256 (264 steps remain).
# Exact labels at H = 256 of a seeded sample of NCAND entries per checkpoint (every shorter horizon is the mean of the
# first H steps of the same rows' kl_steps: kvdiag.label.horizons.at_horizons); every rule's scores of every entry
# (token rows for the AUROC, head rows for the decisions); decisions at H = 256, keep 0.5 / 0.25 / 0.125, per-head
# selection, for 12 rules and the random and future_attention references (their joint damage at every shorter horizon
# derives from kl_steps in the same way). No oracle_single (it needs exact labels of every entry at H = 256: ~90 min
# here), no oracle_greedy or oracle_search (each many times that).
# About 1 h 40 min on the shared 2-core CPU (load 3-5 from other jobs): trace 35 min, scores 5 min, labels 25 min and
# decisions 34 min (these two ran side by side).
set -euo pipefail
K=${K:-.venv/bin/kvdiag}
D=runs/horizon-math500
mkdir -p "$D"
NCAND=24
C="--checkpoints every:512"
RULES=avokv_e,avokv_e_no_delay,avokv_e_no_payload,snapkv,h2o,tova,rkv,cake,streamingllm,vase,knorm,lazyeviction
T=$D/smollm2-trace
[ -f $T/manifest.json ] || $K trace --model smollm2 --max-new-tokens 776 --min-new-tokens 776 \
    --prompts data/math500-first20.jsonl --limit 10 --out $T
$K score --trace $T $C --granularity token,head --scorers all --out $D/smollm2-scores.parquet
$K label --trace $T $C --candidates $NCAND --horizon 256 --out $D/smollm2-labels-h256.parquet
$K decisions --trace $T --scores $D/smollm2-scores.parquet --keep 0.5,0.25,0.125 --horizon 256 --scorers $RULES \
    --references random,future_attention --pairs 0 --infeasible skip --out $D/smollm2-decisions
# the committed inputs (the rows and columns analyze.py reads), then the tables
.venv/bin/python reports/horizon-math500/inputs.py
.venv/bin/python reports/horizon-math500/analyze.py

#!/usr/bin/env bash
# Regenerates this report (run from the repository root; outputs in runs/horizon-math500).
# gemma3-270m: the same settings on the first 5 problems (NCAND_GEMMA3 sampled entries per checkpoint); its sliding
# layers' decision budgets count only the entries they still attend (as in reports/decisions-math500).
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
# gemma3-270m (load 6-8, nice -n 15): trace 10 min, scores 0.5 min, labels 10 min and decisions 17 min (side by side).
set -euo pipefail
K=${K:-.venv/bin/kvdiag}
D=runs/horizon-math500
mkdir -p "$D"
NCAND=24
NCAND_GEMMA3=12  # sized to ~35 min of one core for the whole gemma3 run (3.35 s per H = 256 label at load 1-2)
C="--checkpoints every:512"
RULES=avokv_e,avokv_e_no_delay,avokv_e_no_payload,snapkv,h2o,tova,rkv,cake,streamingllm,vase,knorm,lazyeviction
for m in smollm2 gemma3; do
    if [ $m = smollm2 ]; then model=smollm2; n=10; ncand=$NCAND; else model=gemma3-270m; n=5; ncand=$NCAND_GEMMA3; fi
    T=$D/$m-trace
    [ -f $T/manifest.json ] || $K trace --model $model --max-new-tokens 776 --min-new-tokens 776 \
        --prompts data/math500-first20.jsonl --limit $n --out $T
    $K score --trace $T $C --granularity token,head --scorers all --out $D/$m-scores.parquet
    $K label --trace $T $C --candidates $ncand --horizon 256 --out $D/$m-labels-h256.parquet
    $K decisions --trace $T --scores $D/$m-scores.parquet --keep 0.5,0.25,0.125 --horizon 256 --scorers $RULES \
        --references random,future_attention --pairs 0 --infeasible skip --out $D/$m-decisions
done
# the committed inputs (the rows and columns analyze.py reads, inputs/<model>/), then the tables
.venv/bin/python reports/horizon-math500/inputs.py smollm2 gemma3
.venv/bin/python reports/horizon-math500/analyze.py

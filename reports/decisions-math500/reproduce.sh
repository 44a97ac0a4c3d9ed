#!/usr/bin/env bash
# Regenerates this report (run from the repository root; outputs in runs/decisions-math500).
# SmolLM2-135M: the first 10 MATH-500 problems of data/math500-first20.jsonl, 520 new tokens each (no end of sequence
# before them); one checkpoint per problem, after 512 generated tokens; every cached entry labeled exactly there
# (horizon 8); every rule's scores of every entry at every (layer, KV head); decisions at keep 0.5 / 0.25 / 0.125,
# per-head selection; oracle_greedy evicts 25% of the entries per step; future_attention keeps per cell what the
# full-cache run's next 8 queries attend most; oracle_search starts from the best of every rule's and reference's set
# and improves it by exact set rows (at most 512 rows or 120 s per (checkpoint, budget)). gemma3-270m: the first 5
# problems, the same settings; its sliding layers' budgets count only the entries they still attend (the last 512).
# About 1 h on a 2-core CPU (SmolLM2: trace 6 min, labels of every entry 3 min, scores 2 min, decisions 12 min).
# oracle_search then began with a cell-wise recombination of the candidates, which kvdiag dropped after commit
# dfe37b9: to remake these runs exactly, set K to the kvdiag of a checkout of dfe37b9 (see reproduce-h128.sh).
set -euo pipefail
K=${K:-.venv/bin/kvdiag}
D=runs/decisions-math500
mkdir -p "$D"
G="--max-new-tokens 520 --min-new-tokens 520 --prompts data/math500-first20.jsonl"
C="--checkpoints every:512"
for m in smollm2 gemma3; do
    if [ $m = smollm2 ]; then model=smollm2; n=10; else model=gemma3-270m; n=5; fi
    T=$D/$m-trace
    [ -f $T/manifest.json ] || $K trace --model $model $G --limit $n --out $T
    $K label --trace $T --out $D/$m-labels-all.parquet $C --candidates all --horizon 8
    $K score --trace $T $C --granularity head --scorers all,kvpress:all --out $D/$m-scores-head.parquet
    $K decisions --trace $T --scores $D/$m-scores-head.parquet --labels $D/$m-labels-all.parquet \
        --keep 0.5,0.25,0.125 --infeasible skip --greedy-chunk 0.25 --pair-candidates 12 \
        --references oracle_single,oracle_greedy,fast,random,future_attention,oracle_search \
        --search-rows 512 --search-seconds 120 --out $D/$m
done
# stochastic against deterministic selection: VaSE and two other rules, 4 draws per checkpoint
$K decisions --trace $D/smollm2-trace --scores $D/smollm2-scores-head.parquet --keep 0.5,0.25,0.125 \
    --infeasible skip --horizon 8 --selection stochastic:0.1 --draws 4 --scorers vase,rkv,attention \
    --references random --pairs 0 --out $D/smollm2-stochastic
# the committed report: the summaries, figures and tables, the decisions and pairs, and inputs/ (the token scores and
# labels the AUROC-vs-decision Spearman reads: spearman.csv regenerates from them)
for m in smollm2 smollm2-stochastic gemma3; do
    mkdir -p reports/decisions-math500/$m
    for f in summary.md summary.csv paired.csv spearman.csv pairs_summary.csv stochastic.csv headroom.csv search.csv \
             summary.json config.json decisions.png decisions.pdf decisions.parquet pairs.parquet \
             inputs/token_scores.parquet inputs/token_labels.parquet; do
        to=reports/decisions-math500/$m/$f
        if [ -f $D/$m/$f ]; then mkdir -p "$(dirname $to)" && cp $D/$m/$f $to; fi
    done
done

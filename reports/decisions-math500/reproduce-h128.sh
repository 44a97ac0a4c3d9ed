#!/usr/bin/env bash
# Regenerates smollm2-h128/, the -h128-search/ and the -h128-half/ runs (run from the repository root; outputs in
# runs/decisions-math500-h128). smollm2-h128/: every decision
# judged on 128 teacher-forced steps (--horizon 128), the references that read the future choosing on the first 8
# (--read-window 8), as smollm2/'s did, judged on the 120 steps they did not read too (issue #54's cautionary
# table, made by kvdiag itself), and every rule's damage over the 128 steps.
# SmolLM2-135M: the first 10 MATH-500 problems of data/math500-first20.jsonl, 680 new tokens each (greedy: the first
# 520 are smollm2/'s), one checkpoint per problem after 512 generated tokens; exact single labels of every entry there at H = 8
# (oracle_single ranks by them); head scores of 18 rules (the AvoKV-E ablations and the kvpress copies left out to
# bound the cost: 69 set rows of 128 steps per checkpoint); references oracle_single, fast, future_attention (the
# next 8 queries), random and oracle_search (searching the 8 steps: 256 rows or 60 s per (checkpoint, budget), or
# converged); oracle_greedy is left out (about 1,300 relabelled rows per checkpoint). Per-head selection, keep 0.5 /
# 0.25 / 0.125. About 1 h 40 min on a 2-core CPU shared with other jobs (trace 25 min, scores 1 min, labels 3 min,
# decisions about 5 min per checkpoint).
# smollm2-h128-search/ and gemma3-h128-search/ are made by oracle_search's descent (kvdiag after a2f43b1: its 1 %
# rule judged only once a step found a set below the start), and so are the two -h128-half-descent/;
# gemma3-h128-search-reach5/, smollm2-h128-search-reach10/, smollm2-h128-search-swaps/ and the two -reach/ by its
# swaps (K from d334f7e, or a4bdfb6 for -swaps/); every other run here by the swaps with a cell-wise recombination
# of the candidates first, which kvdiag dropped after commit dfe37b9: to remake those exactly, run this with K set to
# the kvdiag of a checkout of dfe37b9 (git worktree add ../kvdiag-dfe37b9 dfe37b9 && make -C ../kvdiag-dfe37b9 venv;
# K=../kvdiag-dfe37b9/.venv/bin/kvdiag); smollm2-h128-search-recombined/ and gemma3-h128-search-recombined/ are
# the smollm2-h128-search and gemma3-h128-search commands below run so (with the swap search's effort:
# --search-rows 512 --search-seconds 120), with --out $D/MODEL-h128-search-recombined.
set -euo pipefail
K=${K:-.venv/bin/kvdiag}
D=runs/decisions-math500-h128
RULES=attention,attention_x_age,h2o,snapkv,tova,streamingllm,rkv,lazyeviction,thinkv,knorm,value_norm,vatp,random,avokv_e,vase,cake,obcache,longflow
mkdir -p "$D"
T=$D/smollm2-trace
[ -f $T/manifest.json ] || $K trace --model smollm2 --max-new-tokens 680 --min-new-tokens 680 \
    --prompts data/math500-first20.jsonl --limit 10 --out $T
[ -f $D/scores-head.parquet ] || $K score --trace $T --checkpoints every:512 --granularity head --scorers $RULES \
    --out $D/scores-head.parquet
[ -f $D/labels-h8.parquet ] || $K label --trace $T --checkpoints every:512 --candidates all --horizon 8 \
    --out $D/labels-h8.parquet
$K decisions --trace $T --scores $D/scores-head.parquet --labels $D/labels-h8.parquet \
    --keep 0.5,0.25,0.125 --horizon 128 --read-window 8 --infeasible skip --pairs 0 \
    --references oracle_single,fast,random,future_attention,oracle_search --search-rows 256 --search-seconds 60 \
    --out $D/smollm2-h128
# the long-horizon search, on the same 10 checkpoints: every reference reads the whole judged window of 128 steps (no
# --read-window), so on it oracle_search (from the best of every rule's and reference's set; 127 steps and one exact
# row per (checkpoint, budget), or converged) is at most every decision by construction; oracle_single is left out (its
# labels are the 8-step ones). About 7 min per checkpoint on an idle 2-core CPU; /usr/bin/time -v gives its peak RSS.
# Made by the search as it is now (straight-through descent), bounded by sets labeled alone (127 steps and the
# result's exact row per (checkpoint, budget): --search-seconds 0), so that the machine's load does not change it.
/usr/bin/time -v -o $D/smollm2-h128-search.time $K decisions --trace $T --scores $D/scores-head.parquet \
    --keep 0.5,0.25,0.125 --horizon 128 --infeasible skip --pairs 0 \
    --references fast,random,future_attention,oracle_search --search-rows 128 --search-seconds 0 \
    --out $D/smollm2-h128-search
# the same by the swap search the descent replaced (K from d334f7e: swaps that leave entries of attention weight
# above 0.5 alone while others remain; 512 rows or 120 s, alone on the idle 2 cores)
/usr/bin/time -v -o $D/smollm2-h128-search-reach10.time $K decisions --trace $T --scores $D/scores-head.parquet \
    --keep 0.5,0.25,0.125 --horizon 128 --infeasible skip --pairs 0 \
    --references fast,random,future_attention,oracle_search --search-rows 512 --search-seconds 120 \
    --out $D/smollm2-h128-search-reach10
# gemma3-270m, the same long-horizon search on the first 5 problems (680 new tokens, one checkpoint after 512): its
# sliding layers' budgets count only the entries they still attend (the last 512); by the descent as above
G=$D/gemma3-trace
[ -f $G/manifest.json ] || $K trace --model gemma3-270m --max-new-tokens 680 --min-new-tokens 680 \
    --prompts data/math500-first20.jsonl --limit 5 --out $G
[ -f $D/gemma3-scores-head.parquet ] || $K score --trace $G --checkpoints every:512 --granularity head \
    --scorers $RULES --out $D/gemma3-scores-head.parquet
/usr/bin/time -v -o $D/gemma3-h128-search.time $K decisions --trace $G --scores $D/gemma3-scores-head.parquet \
    --keep 0.5,0.25,0.125 --horizon 128 --infeasible skip --pairs 0 \
    --references fast,random,future_attention,oracle_search --search-rows 128 --search-seconds 0 \
    --out $D/gemma3-h128-search
# the same by the swap search (K from d334f7e; 512 rows or 120 s, alone on the idle 2 cores)
/usr/bin/time -v -o $D/gemma3-h128-search-reach5.time $K decisions --trace $G --scores $D/gemma3-scores-head.parquet \
    --keep 0.5,0.25,0.125 --horizon 128 --infeasible skip --pairs 0 \
    --references fast,random,future_attention,oracle_search --search-rows 512 --search-seconds 120 \
    --out $D/gemma3-h128-search-reach5
# the generalisation check (issue #54): every reference, oracle_search included, reads only the first 64 of the 128
# steps judged, so its held-out figure is the damage on the 64 steps after them, which no decision read; the first 5
# problems of each model (SmolLM2: the scores filtered to them, as the 3-prompt run did), otherwise as above
# (kvdiag's own table I/O keeps the scores' metadata: the Trace they were made from)
first() { .venv/bin/python -c "import sys, polars as pl; from kvdiag.core.io import read_table, write_table
d, meta = read_table(sys.argv[1]); ids = sys.argv[3].split(',')
write_table(d.filter(pl.col('prompt_id').is_in(ids)), sys.argv[2], meta)" "$@"; }
P5=test_precalculus_807.json,test_intermediate_algebra_1994.json,test_algebra_2584.json,test_number_theory_572.json
P5=$P5,test_algebra_1349.json
[ -f $D/scores-head-first5.parquet ] || first $D/scores-head.parquet $D/scores-head-first5.parquet $P5
for m in smollm2 gemma3; do
    S=$D/scores-head-first5.parquet; TR=$T
    if [ $m = gemma3 ]; then S=$D/gemma3-scores-head.parquet; TR=$G; fi
    /usr/bin/time -v -o $D/$m-h128-half.time $K decisions --trace $TR --scores $S --keep 0.5,0.25,0.125 \
        --horizon 128 --read-window 64 --infeasible skip --pairs 0 \
        --references fast,random,future_attention,oracle_search --search-rows 512 --search-seconds 120 \
        --out $D/$m-h128-half
    # the same by the descent (127 steps and one exact row per (checkpoint, budget) on the 64 steps it reads), so that
    # the generalisation check's headline compares the descent reading 64 steps with the descent reading 128
    /usr/bin/time -v -o $D/$m-h128-half-descent.time $K decisions --trace $TR --scores $S --keep 0.5,0.25,0.125 \
        --horizon 128 --read-window 64 --infeasible skip --pairs 0 \
        --references fast,random,future_attention,oracle_search --search-rows 128 --search-seconds 0 \
        --out $D/$m-h128-half-descent
done
# the 128-step search again on the first 3 problems, with recombination stopped at half the seconds (86401e2)
[ -f $D/scores-head-first3.parquet ] || first $D/scores-head.parquet $D/scores-head-first3.parquet \
    test_algebra_1349.json,test_algebra_2584.json,test_intermediate_algebra_1994.json
/usr/bin/time -v -o $D/smollm2-h128-search-split.time $K decisions --trace $T --scores $D/scores-head-first3.parquet \
    --keep 0.5,0.25,0.125 --horizon 128 --infeasible skip --pairs 0 \
    --references fast,random,future_attention,oracle_search --search-rows 512 --search-seconds 120 \
    --out $D/smollm2-h128-search-split
# and again by swaps alone, no recombination (the runs above need K from dfe37b9 to be remade, this one K from a4bdfb6:
# its swaps still moved entries of any attention weight)
/usr/bin/time -v -o $D/smollm2-h128-search-swaps.time $K decisions --trace $T --scores $D/scores-head-first3.parquet \
    --keep 0.5,0.25,0.125 --horizon 128 --infeasible skip --pairs 0 \
    --references fast,random,future_attention,oracle_search --search-rows 512 --search-seconds 120 \
    --out $D/smollm2-h128-search-swaps
# and again after the swaps stopped moving entries of attention weight above 0.5 while any other swap is untried
/usr/bin/time -v -o $D/smollm2-h128-search-reach.time $K decisions --trace $T --scores $D/scores-head-first3.parquet \
    --keep 0.5,0.25,0.125 --horizon 128 --infeasible skip --pairs 0 \
    --references fast,random,future_attention,oracle_search --search-rows 512 --search-seconds 120 \
    --out $D/smollm2-h128-search-reach
# gemma3-270m's 128-step search rerun with that search on the same 3 problems
[ -f $D/gemma3-scores-head-first3.parquet ] || first $D/gemma3-scores-head.parquet $D/gemma3-scores-head-first3.parquet \
    test_algebra_1349.json,test_algebra_2584.json,test_intermediate_algebra_1994.json
/usr/bin/time -v -o $D/gemma3-h128-search-reach.time $K decisions --trace $G --scores $D/gemma3-scores-head-first3.parquet \
    --keep 0.5,0.25,0.125 --horizon 128 --infeasible skip --pairs 0 \
    --references fast,random,future_attention,oracle_search --search-rows 512 --search-seconds 120 \
    --out $D/gemma3-h128-search-reach
for run in smollm2-h128 smollm2-h128-search smollm2-h128-search-reach10 smollm2-h128-search-recombined gemma3-h128-search \
           gemma3-h128-search-reach5 gemma3-h128-search-recombined smollm2-h128-half gemma3-h128-half \
           smollm2-h128-half-descent gemma3-h128-half-descent \
           smollm2-h128-search-split smollm2-h128-search-swaps smollm2-h128-search-reach gemma3-h128-search-reach; do
mkdir -p reports/decisions-math500/$run
for f in summary.md summary.csv paired.csv spearman.csv headroom.csv search.csv held_out.csv summary.json config.json \
         decisions.png decisions.pdf decisions.parquet pairs.parquet inputs/token_scores.parquet \
         inputs/token_labels.parquet; do
    to=reports/decisions-math500/$run/$f
    if [ -f $D/$run/$f ] && [ "$(wc -c < $D/$run/$f)" -gt 1 ]; then mkdir -p "$(dirname $to)" && cp $D/$run/$f $to; fi
done
done
# each model's 128-step search again where generalisation.md's pooled table found a set below it (gemma3 at keep 0.5,
# SmolLM2 at keep 0.5 and 0.25), started from every committed 128-step run's lowest set as well (--search-from: the
# report's copies made above; each labeled again), by the descent as above
from() { for r in "$@"; do printf -- "--search-from %s " "reports/decisions-math500/$r/decisions.parquet"; done; }
/usr/bin/time -v -o $D/gemma3-h128-search-from.time $K decisions --trace $G --scores $D/gemma3-scores-head.parquet \
    --keep 0.5 --horizon 128 --infeasible skip --pairs 0 \
    --references fast,random,future_attention,oracle_search --search-rows 128 --search-seconds 0 \
    $(from gemma3-h128-search gemma3-h128-half-descent gemma3-h128-half gemma3-h128-search-recombined \
           gemma3-h128-search-reach5 gemma3-h128-search-reach) \
    --out $D/gemma3-h128-search-from
/usr/bin/time -v -o $D/smollm2-h128-search-from.time $K decisions --trace $T --scores $D/scores-head.parquet \
    --keep 0.5,0.25 --horizon 128 --infeasible skip --pairs 0 \
    --references fast,random,future_attention,oracle_search --search-rows 128 --search-seconds 0 \
    $(from smollm2-h128-search smollm2-h128 smollm2-h128-half-descent smollm2-h128-half smollm2-h128-search-recombined \
           smollm2-h128-search-reach10 smollm2-h128-search-reach smollm2-h128-search-split smollm2-h128-search-swaps) \
    --out $D/smollm2-h128-search-from
for run in smollm2-h128-search-from gemma3-h128-search-from; do
for f in summary.md summary.csv paired.csv headroom.csv search.csv summary.json config.json decisions.png \
         decisions.pdf decisions.parquet pairs.parquet; do
    if [ -f $D/$run/$f ]; then mkdir -p reports/decisions-math500/$run && cp $D/$run/$f reports/decisions-math500/$run/; fi
done
done
# SmolLM2's 128-step search again at keep 0.25, by the descent started from the reconstruction set
# (kvdiag/decisions/reconstruction.py; the same 128 rows per (checkpoint, budget): its row, 126 steps, the result's)
/usr/bin/time -v -o $D/smollm2-h128-search-reconstruction.time $K decisions --trace $T --scores $D/scores-head.parquet \
    --keep 0.25 --horizon 128 --infeasible skip --pairs 0 \
    --references fast,random,future_attention,oracle_search --search-rows 128 --search-seconds 0 \
    --out $D/smollm2-h128-search-reconstruction
for f in summary.md summary.csv paired.csv headroom.csv search.csv summary.json config.json decisions.png \
         decisions.pdf decisions.parquet pairs.parquet; do
    to=reports/decisions-math500/smollm2-h128-search-reconstruction
    if [ -f $D/smollm2-h128-search-reconstruction/$f ]; then mkdir -p $to && cp $D/smollm2-h128-search-reconstruction/$f $to/; fi
done
# the generalisation check on steps 64-127: the -h128-half-descent runs against the -h128-search runs (and the
# -h128-half runs against the -h128-search-recombined runs, both by dfe37b9's search)
.venv/bin/python reports/decisions-math500/generalisation.py

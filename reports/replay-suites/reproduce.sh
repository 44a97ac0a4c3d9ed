#!/usr/bin/env bash
# Regenerates this report (run from the repository root; outputs in runs/replay-suites-*, then copied here).
# SmolLM2-135M-Instruct, greedy, free-running, incremental compression as deployed (the prompt is compressed too,
# interval 64), FullKV + six rules at budgets 64 / 128 / 256 (all below the distance from a needed token to the line
# that reads it); no KL against FullKV (--no-kl: it would double the cost). SUITES picks what to run (default: all):
#   keys:      builtin:keys:50 (LENGTH 40: about 310 generated tokens, each code read about 290 tokens after it was
#              copied), the base model.
#   countdown: builtin:countdown:50 (LENGTH 40), the base model with the LoRA adapter data/adapters/smollm2-countdown.
#   recall:    builtin:recall:50 (the regraded recall suite: one code, count to 20, the code again; about 140
#              generated tokens, the code read about 130 after it was copied), the base model, --max-new-tokens 192.
#   keys-interval128: keys with a compaction every 128 tokens (and the prompt in chunks of 128), into keys-interval128/.
set -euo pipefail
K=${K:-.venv/bin/kvdiag}
N=${N:-50}  # prompts per suite (the report: 50)
RULES=streamingllm,snapkv,tova,rkv,avokv_e,cake
COMMON="--scorers $RULES --budget 64,128,256 --param avokv_e.w_delay=32 --batch-size 32 --no-kl"
for run in ${SUITES:-keys countdown recall keys-interval128}; do
    suite=${run%-interval128}
    interval=64
    [ "$run" != "$suite" ] && interval=128
    model=smollm2
    [ "$suite" = countdown ] && model=smollm2+data/adapters/smollm2-countdown
    max_new=400
    [ "$suite" = recall ] && max_new=192
    $K replay --model "$model" --prompts "builtin:$suite:$N" $COMMON --interval $interval --max-new-tokens $max_new \
        --out "runs/replay-suites-$run"
    mkdir -p "reports/replay-suites/$run"
    for f in summary.md summary.csv budget.csv budget.png budget.pdf outcomes.md outcomes.csv outcomes_summary.csv \
        paired.csv components.md components.csv components_paired.csv needed.md needed.csv config.json \
        generations.parquet; do cp "runs/replay-suites-$run/$f" "reports/replay-suites/$run/"; done
done
.venv/bin/python reports/replay-suites/ratio.py  # ratio.md, ratio.csv: accuracy against the compression ratio

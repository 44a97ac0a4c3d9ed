#!/usr/bin/env bash
# Regenerates this report: the embedded Gemma 3 270M (base; sliding window 512 on 15 of 18 layers) in the loop, greedy,
# FullKV + StreamingLLM, SnapKV, TOVA, R-KV, compacted every 32 tokens.
# recall: 20 builtin:recall prompts at LENGTH 10 (212 tokens each, 2 shots), budgets 64 and 128;
# --max-new-tokens 70 is the expected answer's exact length (the base model writes no EOS: it goes on with a made-up
# next example; stops.py); no KL. math: problems 1 and 3 of data/math500-first20.jsonl (math-sample.jsonl), budgets
# 64 and 128, 192 new tokens, KL against FullKV.
# Run from the repository root: about 6 CPU-minutes (52 min of wall time at nice 10 on the shared 2-core CPU);
# a rerun continues from runs/.
set -euo pipefail
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
nice -n 10 .venv/bin/kvdiag replay --model gemma3-270m --prompts builtin:recall:20:10 \
    --scorers streamingllm,snapkv,tova,rkv --budget 64,128 --interval 32 --max-new-tokens 70 --batch-size 80 --no-kl \
    --out runs/replay-gemma3-recall
nice -n 10 .venv/bin/kvdiag replay --model gemma3-270m --prompts reports/replay-gemma3/math-sample.jsonl \
    --scorers streamingllm,snapkv,tova,rkv --budget 64,128 --interval 32 --max-new-tokens 192 --batch-size 8 \
    --out runs/replay-gemma3-math
for run in recall math; do
    for f in summary.md summary.csv budget.csv budget.png outcomes.md outcomes.csv outcomes_summary.csv paired.csv \
        components.md components.csv components_paired.csv config.json generations.parquet; do
        if [ -f runs/replay-gemma3-$run/$f ]; then cp runs/replay-gemma3-$run/$f reports/replay-gemma3/$run/; fi
    done
done
.venv/bin/python reports/replay-gemma3/stops.py reports/replay-gemma3/recall/generations.parquet

#!/usr/bin/env bash
# Regenerates reports/replay-suites/keys (#43): 50 builtin:keys prompts (SmolLM2, greedy), FullKV + 6 rules x 3 budgets,
# compacted every 64 generated tokens, prompt included; the components, outcomes and kept-needed-tokens tables.
# Run from the repository root; a rerun continues from runs/replay-suites-keys/parts (finished units are kept).
# avokv_e.w_delay=32 (= W_obs): its delay buffer must fit the smallest budget (64 entries). --max-new-tokens 400: the
# expected answers are about 310 tokens (reports/suites-fullkv: FullKV wrote EOS on 20/20 at 311).
# The smoke test of this script overrides PROMPTS, SCORERS, BUDGETS, OUT and DEST (e.g. into /tmp); KVDIAG names the CLI.
set -euo pipefail
KVDIAG=${KVDIAG:-.venv/bin/kvdiag}
PROMPTS=${PROMPTS:-builtin:keys:50}
SCORERS=${SCORERS:-streamingllm,snapkv,tova,rkv,avokv_e,cake}
BUDGETS=${BUDGETS:-64,128,256}
OUT=${OUT:-runs/replay-suites-keys}
DEST=${DEST:-reports/replay-suites/keys}
nice -n 5 "$KVDIAG" replay --model smollm2 --prompts "$PROMPTS" --scorers "$SCORERS" --budget "$BUDGETS" \
    --interval 64 --param avokv_e.w_delay=32 --max-new-tokens 400 --batch-size 32 --out "$OUT"
mkdir -p "$DEST"
for f in summary.md summary.csv budget.csv budget.png budget.pdf outcomes.md outcomes.csv outcomes_summary.csv \
    paired.csv components.md components.csv components_paired.csv needed.md needed.csv config.json \
    generations.parquet; do cp "$OUT/$f" "$DEST/"; done

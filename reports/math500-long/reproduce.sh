#!/usr/bin/env bash
# Regenerates the long-trace report. Run from the repository root; outputs go to runs/math500-long
# (about 30 min on an idle 2-core CPU; the trace is most of it). Three MATH-500 problems (data/, the
# first records of the subset the short-trace report uses), sampled at T = 0.6, top-p 0.95 with at
# least 4,000 generated tokens, labelled every 512 positions with the short report's settings
# (64 candidates, horizon 16); then compare.py sets the rules' ranking beside the short report's.
set -euo pipefail
R=runs/math500-long
run() {  # run one kvdiag command and record it in $R/commands.json (the report lists them)
    .venv/bin/kvdiag "$@"
    .venv/bin/python -c 'import sys; from kvdiag.report.run import record_command; record_command(sys.argv[1], ["kvdiag", *sys.argv[2:]])' "$R" "$@"
}
run trace --model smollm2 --prompts data/math500-first20.jsonl --limit 3 --sample --temperature 0.6 --top-p 0.95 --min-new-tokens 4000 --max-new-tokens 4600 --out $R/trace
run label --trace $R/trace --out $R/labels.parquet --checkpoints every:512 --candidates 64 --horizon 16
run score --trace $R/trace --labels $R/labels.parquet --scorers all --out $R/scores.parquet
run rank-eval --labels $R/labels.parquet --scores $R/scores.parquet --out $R/rank-eval
run figures --trace $R/trace --labels $R/labels.parquet --scores $R/scores.parquet --out $R/figures --rank-eval $R/rank-eval
run report --run $R
.venv/bin/python reports/math500-long/compare.py

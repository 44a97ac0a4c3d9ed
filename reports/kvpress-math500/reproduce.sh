#!/usr/bin/env bash
# kvpress presses graded beside kvdiag's rules on the oracle labels of reports/math500-smollm2.
# Needs the Trace those labels came from in runs/math500/trace (reports/math500-smollm2/reproduce.sh, first line)
# and kvpress: pip install -e '.[kvpress]' && pip install --no-deps kvpress==0.5.5 (make test installs both).
# Run from the repository root; about 25 min on a 2-core CPU.
set -euo pipefail
R=reports/kvpress-math500
# every gradable press with kvpress's defaults; the two budget-dependent ones at rank-eval's eviction fraction rho = 0.5
.venv/bin/kvdiag score --trace runs/math500/trace --labels reports/math500-smollm2/labels.parquet \
    --scorers kvpress:all \
    --param kvpress:StreamingLLMPress.compression_ratio=0.5 --param kvpress:CriticalKVPress.compression_ratio=0.5 \
    --out $R/scores_kvpress.parquet
.venv/bin/python $R/merge_scores.py reports/math500-smollm2/scores.parquet $R/scores_kvpress.parquet $R/scores_all.parquet
.venv/bin/kvdiag rank-eval --labels reports/math500-smollm2/labels.parquet --scores $R/scores_all.parquet --out $R/rank-eval

#!/usr/bin/env bash
# SmolLM2-135M's FullKV accuracy on the dependency suites, component by component (greedy, 20 prompts, one batch each,
# kvdiag's decode path without a policy). Run from the repository root; about 20-35 min each on a busy 2-core CPU.
set -euo pipefail
for suite in keys countdown; do
    nice -n 10 .venv/bin/python reports/suites-fullkv/measure.py builtin:$suite:20 400 \
        > reports/suites-fullkv/$suite.txt 2>/dev/null
done

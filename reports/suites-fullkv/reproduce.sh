#!/usr/bin/env bash
# SmolLM2-135M's FullKV accuracy on the dependency suites, component by component (greedy, 20 prompts, one batch each,
# kvdiag's decode path without a policy). Run from the repository root; about 20-35 min each on a busy 2-core CPU.
set -euo pipefail
for suite in keys countdown; do
    nice -n 10 .venv/bin/python reports/suites-fullkv/measure.py builtin:$suite:20 400 \
        > reports/suites-fullkv/$suite.txt 2>/dev/null
done
# the countdown suite on the model with the LoRA adapter data/adapters/smollm2-countdown
nice -n 10 .venv/bin/python reports/suites-fullkv/measure.py builtin:countdown:20 400 \
    smollm2+data/adapters/smollm2-countdown > reports/suites-fullkv/countdown-adapter.txt 2>/dev/null
# gemma3-270m (the embedded GGUF, converted once) on the same 20 prompts of each suite, no adapter
for suite in keys countdown; do
    nice -n 10 .venv/bin/python reports/suites-fullkv/measure.py builtin:$suite:20 400 gemma3-270m \
        > reports/suites-fullkv/$suite-gemma3.txt 2>/dev/null
done

#!/usr/bin/env bash
# #42 on the GPU: the fast (fisher, K = 8) label's cost per labeled entry against exact labels, at H = 16 and 128,
# random:llama-3.1-8b in bf16 (random weights at the real shape: the Spearman printed is not a quality figure).
# As horizon.sh: bash reports/gpu-check/fast.sh OUTDIR on a CUDA machine after `make gpu-bundle` here.
set -euo pipefail
out=${1:?usage: fast.sh OUTDIR}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" build/gpu-bundle/*.whl
export PYTHONPATH=$site PYTHONUNBUFFERED=1
bench() { python3 -m kvdiag bench label --model random:llama-3.1-8b --dtype bfloat16 --device cuda --repeats 3 \
    --method fast "$@"; }
bench --prefix 4096 --n 64 --horizon 16 --out "$out/fast-h16-p4096.json"
bench --prefix 4096 --n 64 --horizon 128 --out "$out/fast-h128-p4096.json"
bench --prefix 16384 --n 64 --horizon 16 --out "$out/fast-h16-p16384.json"

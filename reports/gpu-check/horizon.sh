#!/usr/bin/env bash
# #42 on the GPU: exact labels at H = 128 and 256 against H = 16 (cost per labeled entry, peak memory), the
# token engine on random:llama-3.1-8b in bf16 (random weights at the real shape; no download). Run on a CUDA
# machine from the checkout root after `make gpu-bundle` here: bash reports/gpu-check/horizon.sh OUTDIR
# (installs the bundle's wheels beside the machine's torch, as `make gpu-check` does).
set -euo pipefail
out=${1:?usage: horizon.sh OUTDIR}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" build/gpu-bundle/*.whl
export PYTHONPATH=$site PYTHONUNBUFFERED=1
bench() { python3 -m kvdiag bench label --model random:llama-3.1-8b --dtype bfloat16 --device cuda --repeats 3 "$@"; }
bench --prefix 4096 --n 16 --horizon 128 --out "$out/h128-p4096-n16.json"
bench --prefix 4096 --n 64 --horizon 128 --out "$out/h128-p4096-n64.json"
bench --prefix 16384 --n 16 --horizon 128 --out "$out/h128-p16384-n16.json"
bench --prefix 4096 --n 16 --horizon 256 --out "$out/h256-p4096-n16.json"

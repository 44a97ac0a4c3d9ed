#!/usr/bin/env bash
# #42 on the GPU, random:llama-3.1-8b in bf16 (random weights at the real shape; no download; a Spearman printed is
# not a quality figure). Run on a CUDA machine from the checkout root after `make gpu-bundle` here:
#   bash reports/gpu-check/bench.sh OUTDIR horizon   # exact labels at H = 128 and 256 against H = 16 (horizon.log)
#   bash reports/gpu-check/bench.sh OUTDIR fast      # the fast (fisher, K = 8) label against exact, H = 16 and 128
# It installs the bundle's wheels beside the machine's torch, as `make gpu-check` does.
set -euo pipefail
out=${1:?usage: bench.sh OUTDIR horizon|fast}
what=${2:?usage: bench.sh OUTDIR horizon|fast}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" build/gpu-bundle/*.whl
export PYTHONPATH=$site PYTHONUNBUFFERED=1
bench() { python3 -m kvdiag bench label --model random:llama-3.1-8b --dtype bfloat16 --device cuda --repeats 3 "$@"; }
case $what in
horizon)
    bench --prefix 4096 --n 16 --horizon 128 --out "$out/h128-p4096-n16.json"
    bench --prefix 4096 --n 64 --horizon 128 --out "$out/h128-p4096-n64.json"
    bench --prefix 16384 --n 16 --horizon 128 --out "$out/h128-p16384-n16.json"
    bench --prefix 4096 --n 16 --horizon 256 --out "$out/h256-p4096-n16.json" ;;
fast)
    bench --method fast --prefix 4096 --n 64 --horizon 16 --out "$out/fast-h16-p4096.json"
    bench --method fast --prefix 4096 --n 64 --horizon 128 --out "$out/fast-h128-p4096.json"
    bench --method fast --prefix 16384 --n 64 --horizon 16 --out "$out/fast-h16-p16384.json" ;;
*) echo "bench.sh: $what: use horizon or fast" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# One device call: build for 90a, smoke-test the forward, time the tile candidates.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(which nvcc)")")} FLASH_EXT_CUDA_ARCHS=90a MAX_JOBS=16 FLASH_EXT_PTXAS_VERBOSE=1
nvidia-smi -L; python3 -c "import torch; print(torch.__version__)"
( nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -I csrc benchmarks/tune_fwd_tiles.cu -o /tmp/tune > "$OUT/tune_build.log" 2>&1 ) &
start=$(date +%s)
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"; grep -E "spill" "$OUT/build.log" | sort | uniq -c
wait
PYTHONUNBUFFERED=1 python3 scripts/fwd_smoke.py 2>&1 | tee "$OUT/smoke.log" | grep -v "^ok" 
/tmp/tune 2>&1 | tee "$OUT/tune.log"

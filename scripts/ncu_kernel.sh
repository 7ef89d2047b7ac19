#!/usr/bin/env bash
# Hardware counters (Nsight Compute) of one launch of one flash_ext kernel, on one benchmark shape (16k tokens,
# hidden 2048, bf16, as benchmarks/bench_attention.py): where a kernel's time goes (tensor pipe busy, issue
# slots, warp stall reasons, memory), which timing alone cannot say.
#
#   bash scripts/ncu_kernel.sh [--kernel REGEX] [--head-dim D] [--seqlen S] [--causal] [--deterministic]
#   defaults: --kernel attention_bwd_dkdv_sm90 --head-dim 128 --seqlen 8192 (the sm90 dK/dV kernel)
#
# Runs forward + backward three times and profiles the kernel's third launch (the first two warm up), with
# --clock-control none (the device's notes: leave the clocks alone). Writes $OUT/ncu_<kernel>_hd<D>_<S>.txt.
# NCU_RAW=1: every metric of ncu's full set, one per line (--set full --page raw; grep it for pipes, shared memory).
# Needs flash_ext built in place (python setup.py build_ext --inplace) and ncu on the PATH.
set -euo pipefail

OUT=${OUT:-/tmp/flash_ext_out}
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KERNEL=attention_bwd_dkdv_sm90
HEAD_DIM=128
SEQLEN=8192
CAUSAL=False
DETERMINISTIC=False
while [ $# -gt 0 ]; do
  case "$1" in
    --kernel) KERNEL=$2; shift ;;
    --head-dim) HEAD_DIM=$2; shift ;;
    --seqlen) SEQLEN=$2; shift ;;
    --causal) CAUSAL=True ;;
    --deterministic) DETERMINISTIC=True ;;
    *) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 64 ;;
  esac
  shift
done
mkdir -p "$OUT"
suffix=""
[ "${NCU_RAW:-0}" = 1 ] && suffix=_raw
report="$OUT/ncu_${KERNEL}_hd${HEAD_DIM}_${SEQLEN}${suffix}.txt"

cd "$REPO"
if [ "${NCU_RAW:-0}" = 1 ]; then
  what=(--set full --page raw)
else
  what=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis
        --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats)
fi
PYTHONPATH="$REPO" ncu --clock-control none --kernel-name "regex:$KERNEL" --launch-skip 2 --launch-count 1 "${what[@]}" \
  "$PY" - <<PYTHON >"$report" 2>&1
import torch
import flash_ext

tokens, hidden, head_dim, seqlen = 16384, 2048, $HEAD_DIM, $SEQLEN
shape = (tokens // seqlen, seqlen, hidden // head_dim, head_dim)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
for _ in range(3):
    out = flash_ext.attention(q, k, v, causal=$CAUSAL, deterministic=$DETERMINISTIC)
    out.backward(torch.ones_like(out))
torch.cuda.synchronize()
PYTHON
echo "ncu_kernel.sh: $report ($(grep -c . "$report") lines)"
grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Registers Per Thread" "$report" | head -n 12

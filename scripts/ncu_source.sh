#!/usr/bin/env bash
# Per-SASS-instruction Nsight Compute counters (SourceCounters: warp-stall samples, L2 sectors and the
# "excessive" sectors of uncoalesced accesses, shared wavefronts) of one kernel at a benchmark shape, as
# CSV, to find which instruction of ours costs what FlashAttention-2's equivalent does not.
#
#   bash scripts/ncu_source.sh NAME KERNEL_REGEX [profile_kernels.py ARGS]
#   e.g. bash scripts/ncu_source.sh fwd128 attention_fwd --head-dim 128
#        bash scripts/ncu_source.sh fa2_fwd128 flash_fwd_kernel --head-dim 128 --impl sdpa_flash
#
# Writes $OUT/src_NAME.csv.gz (every SASS line of the kernel with its counters). Uses the extension
# built in place (run after a build). Environment: OUT, PYTHON.
set -uo pipefail
OUT=${OUT:-/tmp/flash_ext_out}
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
name=$1 kernel=$2
shift 2
report=/tmp/ncu_src_$name
rm -f "$report.ncu-rep"
PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 120 \
  ncu --clock-control none --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats \
  --kernel-name "regex:$kernel" -o "$report" "$PY" "$REPO/benchmarks/profile_kernels.py" "$@" >/dev/null 2>&1
echo "ncu $name: rc $?"
ncu -i "$report.ncu-rep" --page source --print-source sass --csv 2>&1 | gzip >"$OUT/src_$name.csv.gz"
echo "ncu $name source page: rc ${PIPESTATUS[0]}, $(zcat "$OUT/src_$name.csv.gz" | wc -l) lines"

#!/usr/bin/env bash
# Kernel checks that need nvcc but no GPU (this 2-core machine): compile the generated translation units in
# csrc/instantiations/ for sm_90a, one object per TU, two at a time.
#
#   bash scripts/local_ptxas.sh spills [TU ...]   every kernel that spills: "<tu>: <kernel>  <N> bytes spill
#                                                 stores, <M> bytes spill loads" (nothing printed: no spills)
#   bash scripts/local_ptxas.sh sass [TU ...]     md5 of each TU's SASS (addresses stripped), to show that a
#                                                 change leaves kernels byte-identical: run it in two trees
#                                                 (e.g. a git worktree) and diff the outputs
#
# TU: file names in csrc/instantiations/ (default: all of them); TREE=dir checks another checkout (default: this
# one); CUOBJDUMP=path, or PYTHON=a python with triton installed (its wheel carries a cuobjdump), for sass.
# About 5-30 s per TU (the sm90 dK/dV TUs up to ~2 minutes). A device build prints the same ptxas report
# (scripts/gpu_check.sh: ptxas.txt); this one is for checking before spending device time.
set -euo pipefail

MODE=${1:-}
case "$MODE" in
  spills|sass) shift ;;
  *) echo "usage: bash scripts/local_ptxas.sh spills|sass [TU ...]" >&2; exit 64 ;;
esac
TREE=$(cd "${TREE:-$(dirname "${BASH_SOURCE[0]}")/..}" && pwd)
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || true)}
if [ "$MODE" = sass ] && [ -z "$CUOBJDUMP" ]; then
  # The CUDA 13 toolkit here has no cuobjdump; triton's wheel ships one (PYTHON: a python with triton).
  CUOBJDUMP=$("${PYTHON:-python3}" -c 'import triton, os; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))' 2>/dev/null || true)
fi
[ "$MODE" = spills ] || [ -x "$CUOBJDUMP" ] || { echo "local_ptxas.sh: no cuobjdump found" >&2; exit 1; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ $# -eq 0 ]; then
  set -- $(cd "$TREE/csrc/instantiations" && ls ./*.cu | sed 's|^\./||')
fi

check_one() {  # TU
  local tu=$1 cubin="$WORK/${1%.cu}.cubin" log="$WORK/${1%.cu}.log"
  if ! (cd "$TREE" && nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr -DFLASH_EXT_WITH_CUDA \
          -gencode=arch=compute_90a,code=sm_90a -Xptxas=-v -Icsrc -cubin -o "$cubin" "csrc/instantiations/$tu") \
       >"$log" 2>&1; then
    echo "$tu: BUILD FAILED"; grep -m 5 error "$log"; return
  fi
  if [ "$MODE" = spills ]; then
    # ptxas prints "Compiling entry function '<kernel>'" and, two lines on, its spill bytes.
    awk -v tu="$tu" '/Compiling entry function/ { kernel = $0; sub(/.*function .\x27?/, "", kernel); sub(/\x27.*/, "", kernel) }
                     /bytes spill stores/ && !/ 0 bytes spill stores, 0 bytes spill loads/ {
                       line = $0; sub(/^ */, "", line); print tu ": " kernel "  " line }' "$log"
  else
    echo "$("$CUOBJDUMP" -sass "$cubin" | grep -E '^\s+/\*[0-9a-f]{4,}\*/' | sed -E 's@/\*[0-9a-f]+\*/@@g' | md5sum | cut -c1-12)  $tu"
  fi
}
export -f check_one
export MODE TREE WORK CUOBJDUMP
printf '%s\n' "$@" | xargs -P 2 -I {} bash -c 'check_one "$@"' _ {} | sort -k2 -k1

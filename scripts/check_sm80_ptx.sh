#!/usr/bin/env bash
# Runs the sm_80 code path of the kernels on a newer GPU (an H100 / H200 here; there is no A100): builds a
# copy of this checkout with FLASH_EXT_CUDA_ARCHS="80+ptx" -- PTX for compute_80 only, which the driver
# JIT-compiles for the local GPU when a kernel first loads, so the source compiled with __CUDA_ARCH__ = 800
# runs (its `#if __CUDA_ARCH__ < 900` branches: 32-bit shared stores instead of stmatrix in the dK/dV
# kernel, the forward's first-row re-read) -- and runs a focused selection of the CUDA tests on it. The
# driver's JIT takes seconds per kernel, so the selection is small; the timings mean nothing.
#
#   bash scripts/check_sm80_ptx.sh [PYTEST -k EXPRESSION]
#
# Writes $OUT/sm80_ptx.txt (build status, flash_ext.info(), the pytest summary). Environment: OUT, PYTHON,
# MAX_JOBS (16), SM80_TEST_TIMEOUT_S (300).
set -uo pipefail

OUT=${OUT:-/tmp/flash_ext_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELECTION=${1:-"test_forward_head_dims or test_gradients or test_softcap or test_forward_seqlens"}
REPORT="$OUT/sm80_ptx.txt"
COPY=$(mktemp -d)/flash_ext_sm80
mkdir -p "$COPY"
# The sources only: no build outputs of the checkout (its in-place extension is for another arch).
(cd "$REPO" && tar cf - --exclude='*.so' --exclude=__pycache__ setup.py pyproject.toml README.md csrc flash_ext tests) |
  (cd "$COPY" && tar xf -)

export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export FLASH_EXT_CUDA_ARCHS="80+ptx" MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
export CUDA_CACHE_PATH="$COPY/.nv_cache" CUDA_CACHE_MAXSIZE=4294967296  # the JIT's output, kept for the run
{
  echo "==== sm_80 code path via compute_80 PTX ($REPO, git $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null))"
  cd "$COPY" || exit 1
  start=$(date +%s)
  if ! "$PY" setup.py build_ext --inplace >"$COPY/build.log" 2>&1; then
    echo "build FAILED:"; grep -E "error" "$COPY/build.log" | head -n 20; exit 1
  fi
  echo "build ok in $(( $(date +%s) - start )) s"
  "$PY" -c 'import flash_ext; print(flash_ext.info())'
  echo "pytest -k \"$SELECTION\""
  start=$(date +%s)
  timeout "${SM80_TEST_TIMEOUT_S:-300}" "$PY" -m pytest tests -m cuda -q -p no:cacheprovider -k "$SELECTION" 2>&1 |
    grep -E "passed|failed|error|Error" | tail -n 15
  echo "tests took $(( $(date +%s) - start )) s (exit ${PIPESTATUS[0]})"
} 2>&1 | tee "$REPORT"

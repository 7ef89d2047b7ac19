#!/usr/bin/env bash
# Measure several versions of the kernels in one device call: the checkout itself ("main") and every
# git worktree under .exp/ (e.g. `git worktree add .exp/dq-before-dk next/bwd-dq-before-dk`, with
# `/.exp/` in .git/info/exclude and `.exp` in the device run's carry). Each is built in place for the
# local GPU and benchmarked with the same bench_attention.py arguments; with --tests, its CUDA tests run
# too (with --sanitize also scripts/sanitize.py under compute-sanitizer memcheck and racecheck); with
# --features, benchmarks/bench_features.py (varlen, window, softcap, ALiBi, dropout) runs after the
# table (--features=score_mods: only some of its groups, a comma list, see its --only); with --decode,
# benchmarks/bench_decode.py (BENCH ARGS are then its arguments) replaces bench_attention.py; with --decode-step,
# benchmarks/bench_decode_step.py (a generation step with its append; no arguments); with --probe,
# scripts/decode_probe.py (BENCH ARGS are then its arguments; no json). Versions measured in
# one call share the GPU's state (clocks, temperature), so their differences are more telling than numbers
# from separate calls. Two files per version come back: $OUT/<name>.txt (build status, ptxas summary, test
# line, tables) and $OUT/<name>.json (bench_attention.py's rows).
#
#   bash scripts/compare_variants.sh [--tests [--sanitize]] [--features[=GROUPS]] [--decode | --decode-step | --probe]
#                                    [-- BENCH ARGS]
#   default BENCH ARGS: --head-dims 64,128,256 --seqlens 8192 --ops fwd,bwd --impls flash_ext,sdpa_flash
#
# Every version is built (and tested) first; then the benchmark runs ROUNDS times (default 1), the versions
# taking turns within a round, so that a drift of the GPU's clocks over the call does not favour one of them
# (rounds after the first write <name>_r<k>.json). SKIP_BUILD=1 reuses the builds of an earlier run in the
# same (warm) call. At most 3 worktrees. Environment: OUT, PYTHON, MAX_JOBS (16),
# TEST_VARIANTS (with --tests: a comma list of the versions whose tests run; default all), TEST_PATHS (with
# --tests: the test files or directories, default tests: the whole CUDA suite takes ~4 min on an H200),
# TEST_TIMEOUT_S (default 240), SANITIZE_TOOLS (default "memcheck racecheck"), SANITIZE_ARGS (sanitize.py's, e.g.
# "--only forward"), SANITIZE_TIMEOUT_S (per tool, default 240; a failing tool's log comes back as
# $OUT/<name>_<tool>.log: a call returns at most 8 files),
# VARIANTS (a comma list of the .exp/ worktrees to measure beside the checkout;
# default all of them), FEATURE_ARGS (more bench_features.py arguments, e.g. "--head-dim 64").
set -uo pipefail

OUT=${OUT:-/tmp/flash_ext_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TESTS=0
SANITIZE=0
FEATURES=0
FEATURE_GROUPS=varlen,window,score_mods
JSON=1
BENCH_ARGS=(--head-dims 64,128,256 --seqlens 8192 --ops fwd,bwd --impls flash_ext,sdpa_flash)
BENCH=benchmarks/bench_attention.py
BENCH_LINES="^(op |-{8}|fwd |bwd |fwd_bwd |TFLOP)"
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) TESTS=1 ;;
    --sanitize) SANITIZE=1 ;;
    --features) FEATURES=1 ;;
    --features=*) FEATURES=1; FEATURE_GROUPS=${1#--features=} ;;
    --decode) BENCH=benchmarks/bench_decode.py; BENCH_ARGS=(); BENCH_LINES="." ;;
    --decode-step) BENCH=benchmarks/bench_decode_step.py; BENCH_ARGS=(); BENCH_LINES="." ;;
    --probe) BENCH=scripts/decode_probe.py; BENCH_ARGS=(); BENCH_LINES="."; JSON=0 ;;
    --) shift; BENCH_ARGS=("$@"); break ;;
    *) echo "compare_variants.sh: unknown argument $1" >&2; exit 64 ;;
  esac
  shift
done

export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$PATH"
export FLASH_EXT_CUDA_ARCHS=${FLASH_EXT_CUDA_ARCHS:-90a} MAX_JOBS=${MAX_JOBS:-16} FLASH_EXT_PTXAS_VERBOSE=1 PYTHONUNBUFFERED=1

# The worktrees to measure beside the checkout: name and directory, one pair per line.
versions() {
  echo "main $REPO"
  if [ -d "$REPO/.exp" ]; then
    for dir in "$REPO"/.exp/*/; do
      local name
      name=$(basename "$dir")
      if [ -n "${VARIANTS:-}" ] && [[ ",$VARIANTS," != *",$name,"* ]]; then continue; fi
      [ -f "$dir/setup.py" ] && echo "$name ${dir%/}"
    done
  fi
}

prepare() {  # name dir: build, ptxas summary, tests; a failed build leaves $OUT/<name>.failed
  local name=$1 dir=$2 report="$OUT/$1.txt"
  echo "==== $name ($dir)" | tee "$report"
  (
    cd "$dir" || exit 1
    if [ "${SKIP_BUILD:-0}" != 1 ]; then
      if ! "$PY" setup.py build_ext --inplace >"/tmp/build_$name.log" 2>&1; then
        echo "build FAILED:"; grep -E "error" "/tmp/build_$name.log" | head -n 20; touch "$OUT/$name.failed"; exit 1
      fi
      echo "build ok; ptxas: $(grep -c 'Used [0-9]* registers' "/tmp/build_$name.log") kernels," \
           "$(grep 'bytes spill stores' "/tmp/build_$name.log" | grep -vc ' 0 bytes spill stores, 0 bytes spill loads') with spills"
    fi
    if [ "$TESTS" = 1 ] && { [ -z "${TEST_VARIANTS:-}" ] || [[ ",$TEST_VARIANTS," == *",$name,"* ]]; }; then
      # shellcheck disable=SC2086  # TEST_PATHS: words
      timeout "${TEST_TIMEOUT_S:-240}" "$PY" -m pytest ${TEST_PATHS:-tests} -m cuda -q --maxfail=10 -p no:cacheprovider 2>&1 |
        grep -E "^(FAILED|ERROR)|passed|failed" | cut -c1-400 | tail -n 12
      if [ "$SANITIZE" = 1 ]; then
        for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
          # shellcheck disable=SC2086  # SANITIZE_ARGS: words
          PYTHONPATH="$PWD" timeout "${SANITIZE_TIMEOUT_S:-240}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
            "$PY" scripts/sanitize.py ${SANITIZE_ARGS:-} >"/tmp/sanitize_${name}_$tool.log" 2>&1
          local rc=$?
          echo "sanitize $tool: rc $rc ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "/tmp/sanitize_${name}_$tool.log" | tail -n 1))"
          [ "$rc" != 0 ] && head -c 200000 "/tmp/sanitize_${name}_$tool.log" >"$OUT/${name}_$tool.log"
        done
      fi
    fi
  ) 2>&1 | tee -a "$report"
}

bench() {  # name dir round
  local name=$1 dir=$2 round=$3 report="$OUT/$1.txt" json="$OUT/$1.json"
  [ -f "$OUT/$name.failed" ] && return
  [ "$round" -gt 1 ] && json="$OUT/${name}_r$round.json"
  (
    cd "$dir" || exit 1
    echo "-- $name, round $round"
    local json_args=()
    [ "$JSON" = 1 ] && json_args=(--json "$json")
    PYTHONPATH="$PWD" timeout 300 "$PY" "$BENCH" "${BENCH_ARGS[@]}" "${json_args[@]}" 2>&1 |
      grep -E "$BENCH_LINES"
    if [ "$FEATURES" = 1 ]; then
      # shellcheck disable=SC2086  # FEATURE_ARGS: words
      PYTHONPATH="$PWD" timeout 120 "$PY" benchmarks/bench_features.py --only "$FEATURE_GROUPS" ${FEATURE_ARGS:-} 2>&1 |
        grep -vE "^\s*$"
    fi
  ) 2>&1 | tee -a "$report"
}

while read -r name dir <&3; do prepare "$name" "$dir"; done 3< <(versions)
for round in $(seq 1 "${ROUNDS:-1}"); do
  while read -r name dir <&3; do bench "$name" "$dir" "$round"; done 3< <(versions)
done

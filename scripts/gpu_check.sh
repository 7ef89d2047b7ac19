#!/usr/bin/env bash
# The one command a GPU machine runs: build flash_ext in place for the local GPU, run the CUDA
# tests, benchmark against PyTorch SDPA, and leave everything in $OUT.
#
#   bash scripts/gpu_check.sh [--quick|--full] [--bench-anyway] [--skip-build] [--skip-tests]
#                             [--no-bench] [--sanitize] [--features] [-- EXTRA BENCH ARGS]
#
#   --full          (default) full benchmark sweep (hd 64/128/256 x causal x seqlen 512..16k)
#   --quick         benchmark hd128, seqlen 2k and 8k only
#   --bench-anyway  run the benchmark even when the CUDA tests failed (never after a failed build)
#   --skip-build    use the flash_ext/_C*.so already built in place (a warm machine)
#   --skip-tests    do not run pytest
#   --no-bench      build and test only
#   --sanitize      after the tests, run scripts/sanitize.py under compute-sanitizer memcheck and
#                   racecheck (sanitize.log; a finding counts as a test failure)
#   --features      after the benchmark, benchmarks/bench_features.py (varlen, window, softcap, ALiBi,
#                   dropout: features.json, features.txt)
#   -- ARGS         passed on to benchmarks/bench_attention.py (e.g. -- --ops fwd --head-dims 64)
#
# Environment: OUT (default /tmp/flash_ext_out), PYTHON (python3), MAX_JOBS (16),
# FLASH_EXT_CUDA_ARCHS (default: the local GPU's, e.g. 90a on an H100/H200), CUDA_HOME (found
# from nvcc), FLASH_EXT_COMMIT (recorded in bench.json), GPU_CHECK_DEADLINE_S (570: the script
# plans its phases to end by then; a device call is limited to 600 s), GPU_CHECK_BUILD_TIMEOUT_S (400).
#
# $OUT gets (7 files): gpu_check.log (all of the below), build.log (full compiler output),
# ptxas.txt (registers/spills per kernel), pytest_cuda.log, bench.json, bench.png, bench_table.txt;
# with --sanitize also sanitize.log, with --features features.json and features.txt.
# Exit status: 0 all good; 1 build failed; 2 CUDA tests failed; 3 benchmark failed or was cut short
# (a sticky CUDA error, a correctness check, the time budget: see the log).
set -euo pipefail

OUT=${OUT:-/tmp/flash_ext_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEADLINE=${GPU_CHECK_DEADLINE_S:-570}

MODE=full
BENCH_ANYWAY=0
SKIP_BUILD=0
SKIP_TESTS=0
NO_BENCH=0
SANITIZE=0
FEATURES=0
BENCH_EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) MODE=quick ;;
    --full) MODE=full ;;
    --bench-anyway) BENCH_ANYWAY=1 ;;
    --skip-build) SKIP_BUILD=1 ;;
    --skip-tests) SKIP_TESTS=1 ;;
    --no-bench) NO_BENCH=1 ;;
    --sanitize) SANITIZE=1 ;;
    --features) FEATURES=1 ;;
    --) shift; BENCH_EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (try --help)" >&2; exit 64 ;;
  esac
  shift
done

remaining() { echo $((DEADLINE - SECONDS)); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
section() { printf '\n==== %s  (t=%ss) ====\n' "$*" "$SECONDS"; }

find_cuda_home() {
  # CUDA_HOME if set; else the toolkit of the nvcc on PATH, following symlinks and wrapper scripts
  # (a /usr/local/bin/nvcc that execs /usr/local/cuda-X/bin/nvcc is not a toolkit root); else /usr/local/cuda.
  if [ -n "${CUDA_HOME:-}" ]; then echo "$CUDA_HOME"; return; fi
  local nvcc root top
  nvcc=$(command -v nvcc || true)
  if [ -n "$nvcc" ]; then
    root=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
    if [ -f "$root/include/cuda_runtime.h" ]; then echo "$root"; return; fi
    top=$("$nvcc" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1 || true)
    if [ -n "$top" ] && [ -f "$top/include/cuda_runtime.h" ]; then (cd "$top" && pwd -P); return; fi
  fi
  for root in /usr/local/cuda /usr/local/cuda-*; do
    if [ -x "$root/bin/nvcc" ]; then echo "$root"; return; fi
  done
  if [ -n "$nvcc" ]; then dirname "$(dirname "$nvcc")"; fi
}

main() {
  set -euo pipefail
  cd "$REPO"
  export PYTHONUNBUFFERED=1
  local build_status="skipped" build_s="-" test_status="skipped" test_line="-" bench_status="skipped"
  local build_rc=0 test_rc=0 bench_rc=0 rc=0

  section "environment"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)   mode: $MODE   out: $OUT   repo: $REPO"
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || true
  CUDA_HOME=$(find_cuda_home)
  export CUDA_HOME
  export PATH="$CUDA_HOME/bin:$PATH"
  echo "CUDA_HOME: $CUDA_HOME"
  echo "nvcc: $(nvcc --version 2>/dev/null | grep -i 'release' || echo 'not found')"
  echo "python: $("$PY" --version 2>&1) ($(command -v "$PY"))   cores: $(nproc)   mem: $(free -g 2>/dev/null | awk '/Mem:/{print $7 " GiB available"}')"
  "$PY" - <<'EOF' || true
import importlib, torch
print(f"torch {torch.__version__}  cuda {torch.version.cuda}  cudnn {torch.backends.cudnn.version()}  "
      f"gpu available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    print(f"gpu: {torch.cuda.get_device_name()}  capability {torch.cuda.get_device_capability()}")
for name in ("triton", "matplotlib", "pytest", "setuptools", "ninja"):
    try:
        print(f"{name} {getattr(importlib.import_module(name), '__version__', '?')}")
    except Exception as e:
        print(f"{name}: MISSING ({type(e).__name__})")
from torch.utils.cpp_extension import is_ninja_available
if not is_ninja_available():
    print("WARNING: ninja not found: the extension compiles one file at a time (MAX_JOBS is ignored); expect a long build")
EOF

  # ---------------------------------------------------------------- build
  section "build"
  if [ -z "${FLASH_EXT_CUDA_ARCHS:-}" ]; then
    local cap major minor
    cap=$("$PY" -c 'import torch; print("%d %d" % torch.cuda.get_device_capability())' 2>/dev/null || true)
    if [ -z "$cap" ]; then
      echo "cannot read the GPU's compute capability through torch; set FLASH_EXT_CUDA_ARCHS"
      FLASH_EXT_CUDA_ARCHS="80;90a"
    else
      read -r major minor <<<"$cap"
      FLASH_EXT_CUDA_ARCHS="${major}${minor}"
      if [ "$major" = 9 ] && [ "$minor" = 0 ]; then FLASH_EXT_CUDA_ARCHS=90a; fi
    fi
  fi
  export FLASH_EXT_CUDA_ARCHS
  export MAX_JOBS=${MAX_JOBS:-16}
  export FLASH_EXT_PTXAS_VERBOSE=1
  echo "FLASH_EXT_CUDA_ARCHS=$FLASH_EXT_CUDA_ARCHS MAX_JOBS=$MAX_JOBS FLASH_EXT_PTXAS_VERBOSE=1"
  if [ "$SKIP_BUILD" = 1 ]; then
    if ls flash_ext/_C*.so >/dev/null 2>&1; then
      build_status="skipped (--skip-build; using $(ls flash_ext/_C*.so | head -n 1))"
    else
      build_status="FAILED: --skip-build but no flash_ext/_C*.so"; build_rc=1
    fi
    echo "$build_status"
  else
    local t0=$SECONDS budget
    budget=$(min "${GPU_CHECK_BUILD_TIMEOUT_S:-400}" $(($(remaining) - 60)))
    echo "python setup.py build_ext --inplace  (output: $OUT/build.log; time limit ${budget}s)"
    set +e
    timeout -k 10 "$budget" "$PY" setup.py build_ext --inplace >"$OUT/build.log" 2>&1
    build_rc=$?
    set -e
    build_s=$((SECONDS - t0))
    grep -E "registers|spill|Compiling entry function" "$OUT/build.log" >"$OUT/ptxas.txt.raw" || true
    if command -v c++filt >/dev/null 2>&1; then c++filt <"$OUT/ptxas.txt.raw" >"$OUT/ptxas.txt"; else cp "$OUT/ptxas.txt.raw" "$OUT/ptxas.txt"; fi
    rm -f "$OUT/ptxas.txt.raw"
    grep -E "^flash_ext:" "$OUT/build.log" || true
    if [ "$build_rc" = 0 ]; then
      build_status="ok in ${build_s}s"
    else
      [ "$build_rc" = 124 ] && echo "build: TIMED OUT after ${budget}s"
      build_status="FAILED (rc $build_rc) after ${build_s}s: see build.log"
      echo "---- build errors (first 40) ----"
      grep -nE "error|Error|FAILED" "$OUT/build.log" | head -n 40 || true
      echo "---- build.log tail ----"
      tail -n 30 "$OUT/build.log"
    fi
    echo "build: $build_status"
  fi
  local ptxas_summary="-"
  if [ -s "$OUT/ptxas.txt" ]; then
    ptxas_summary=$(awk '
      /Used [0-9]+ registers/ { n++; for (i = 1; i <= NF; i++) if ($(i+1) == "registers," || $(i+1) == "registers") { r = $i + 0; if (r > max) max = r } }
      /bytes spill stores/ { for (i = 1; i <= NF; i++) if ($i == "spill" && ($(i+1) == "stores," || $(i+1) == "loads")) if ($(i-2) + 0 > 0) { s++; break } }
      END { printf "%d kernels, max %d registers, %d with spills", n, max, s }' "$OUT/ptxas.txt")
    echo "ptxas: $ptxas_summary (details: $OUT/ptxas.txt)"
  fi
  if [ "$build_rc" = 0 ]; then
    "$PY" -m flash_ext || echo "python -m flash_ext failed"
  fi

  # ---------------------------------------------------------------- tests
  if [ "$build_rc" != 0 ]; then
    test_status="not run (build failed)"
  elif [ "$SKIP_TESTS" = 1 ]; then
    test_status="skipped (--skip-tests)"
  else
    section "pytest -m cuda"
    local budget
    budget=$(min 180 $(($(remaining) - 60)))
    set +e
    timeout -k 10 "$budget" "$PY" -m pytest tests -m cuda -q -x -p no:cacheprovider 2>&1 | tee "$OUT/pytest_cuda.log"
    test_rc=${PIPESTATUS[0]}
    set -e
    test_line=$(grep -E "passed|failed|error|no tests ran|skipped|deselected" "$OUT/pytest_cuda.log" | tail -n 1 || true)
    case "$test_rc" in
      0) if grep -q "passed" <<<"$test_line"; then test_status="passed"; else test_status="passed, but no test ran: $test_line"; fi ;;
      5) test_status="no CUDA tests collected (pytest rc 5): counted as passed"; test_rc=0 ;;
      124) test_status="TIMED OUT after ${budget}s" ;;
      *) test_status="FAILED (rc $test_rc)" ;;
    esac
    echo "pytest: $test_status"
  fi

  # ---------------------------------------------------------------- compute-sanitizer
  local sanitize_status="skipped"
  if [ "$SANITIZE" = 1 ] && [ "$build_rc" = 0 ]; then
    section "compute-sanitizer (scripts/sanitize.py)"
    sanitize_status=""
    local tool tool_rc
    for tool in memcheck racecheck; do
      # racecheck tracks every shared-memory access: the cases take it ~150 s (memcheck ~15 s).
      local tool_budget=120
      [ "$tool" = racecheck ] && tool_budget=300
      set +e
      PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 "$(min $tool_budget $(($(remaining) - 60)))" compute-sanitizer --tool "$tool" --error-exitcode 9 \
        "$PY" scripts/sanitize.py >>"$OUT/sanitize.log" 2>&1
      tool_rc=$?
      set -e
      tail -n 3 "$OUT/sanitize.log"
      if [ "$tool_rc" = 0 ]; then sanitize_status+="$tool clean; "; else sanitize_status+="$tool FAILED (rc $tool_rc); "; test_rc=2; fi
    done
    echo "sanitize: $sanitize_status"
  fi

  # ---------------------------------------------------------------- benchmark
  if [ "$NO_BENCH" = 1 ]; then
    bench_status="skipped (--no-bench)"
  elif [ "$build_rc" != 0 ]; then
    bench_status="not run (build failed)"
  elif [ "$test_rc" != 0 ] && [ "$BENCH_ANYWAY" != 1 ]; then
    bench_status="not run (CUDA tests failed; --bench-anyway runs it regardless)"
  elif [ "$(remaining)" -lt 60 ]; then
    bench_status="not run (only $(remaining)s left before the ${DEADLINE}s deadline)"
  else
    section "benchmark ($MODE)"
    local args=(--json "$OUT/bench.json" --plot "$OUT/bench.png" --table "$OUT/bench_table.txt")
    [ "$MODE" = quick ] && args=(--quick "${args[@]}")
    local left
    left=$(remaining)
    args+=(--time-budget-s $((left - 45)))
    set +e
    timeout -k 10 $((left - 5)) "$PY" benchmarks/bench_attention.py "${args[@]}" ${BENCH_EXTRA[@]+"${BENCH_EXTRA[@]}"}
    bench_rc=$?
    set -e
    case "$bench_rc" in
      0) bench_status="ok" ;;
      3) bench_status="STOPPED by a sticky CUDA error (rc 3): partial results" ;;
      4) bench_status="CUT SHORT by the time budget (rc 4): partial results" ;;
      5) bench_status="flash_ext FAILED a correctness check (rc 5): it was not timed there" ;;
      124) bench_status="KILLED at the time limit (rc 124): partial bench.json, no table/plot" ;;
      *) bench_status="FAILED (rc $bench_rc)" ;;
    esac
  fi

  # ---------------------------------------------------------------- feature benchmark
  local features_status="skipped"
  if [ "$FEATURES" = 1 ] && [ "$build_rc" = 0 ]; then
    section "features (benchmarks/bench_features.py)"
    set +e
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 "$(min 240 $(($(remaining) - 20)))" \
      "$PY" benchmarks/bench_features.py --json "$OUT/features.json" >"$OUT/features.txt" 2>&1
    local features_rc=$?
    set -e
    cat "$OUT/features.txt"
    if [ "$features_rc" = 0 ]; then features_status="ok"; else features_status="FAILED (rc $features_rc)"; fi
  fi

  # ---------------------------------------------------------------- summary
  section "summary"
  echo "gpu:      $("$PY" -c 'import torch; print(torch.cuda.get_device_name())' 2>/dev/null || echo '?')  archs $FLASH_EXT_CUDA_ARCHS"
  echo "build:    $build_status"
  echo "ptxas:    $ptxas_summary"
  echo "pytest:   $test_status"
  echo "          $test_line"
  echo "sanitize: $sanitize_status"
  echo "features: $features_status"
  echo "bench:    $bench_status"
  if [ -s "$OUT/bench_table.txt" ]; then
    echo
    cat "$OUT/bench_table.txt"
  fi
  echo
  echo "files in $OUT:"
  ls -l "$OUT" | tail -n +2
  if [ "$build_rc" != 0 ]; then rc=1
  elif [ "$test_rc" != 0 ]; then rc=2
  elif [ "$bench_rc" != 0 ]; then rc=3
  fi
  echo "gpu_check: exit $rc after ${SECONDS}s"
  return "$rc"
}

set +e
main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"

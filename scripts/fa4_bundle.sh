#!/usr/bin/env bash
# FlashAttention-4 (PyPI flash-attn-4, CuTe DSL, JIT-compiled) for the device machine, which cannot reach
# PyPI: packed here into two archives small enough for a device call's carry (64 MiB), unpacked there.
#
#   bash scripts/fa4_bundle.sh pack              # here (network): .fa4/cu13.tar.xz and .fa4/rest.tar.xz
#   bash scripts/fa4_bundle.sh unpack cu13|rest  # on the device: into $FA4_DIR (default /tmp/fa4)
#   bash scripts/fa4_bundle.sh pythonpath        # the PYTHONPATH that imports flash_attn.cute from there
#
# The CUTLASS DSL's CUDA 13 library wheel is 92 MB (237 MB unpacked): alone in one call (carry
# .fa4/cu13.tar.xz, `unpack cu13`), then, before the warm machine is released (30 s idle), a second call
# carries .fa4/rest.tar.xz and runs `unpack rest` before the benchmark, e.g.
#   bash scripts/fa4_bundle.sh unpack rest && PYTHONPATH=$(bash scripts/fa4_bundle.sh pythonpath):$PWD \
#     python benchmarks/bench_attention.py --impls flash_ext,sdpa_cudnn,fa4 --ops fwd,bwd
# Versions: flash-attn-4 4.0.0b36 (the one issue 37's table measured) and what it needs, pinned below.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUNDLE=$REPO/.fa4
FA4_DIR=${FA4_DIR:-/tmp/fa4}
PY=${PYTHON:-python3}
WHEELS=(
  "flash-attn-4==4.0.0b36"
  "nvidia-cutlass-dsl==4.8.1"
  "nvidia-cutlass-dsl-libs-base==4.8.1"
  "nvidia-cutlass-dsl-libs-core==4.8.1"
  "cuda-bindings==13.0.3"
  "cuda-pathfinder==1.4.4"
  "protobuf==7.36.2"
  "quack-kernels==0.6.5"
  "apache-tvm-ffi==0.1.15.post2"
  "torch-c-dlpack-ext==0.1.5"
  "einops==0.8.2"
)
CU13_WHEEL="nvidia-cutlass-dsl-libs-cu13==4.8.1"

pack() {
  local work
  work=$(mktemp -d)
  mkdir -p "$BUNDLE"
  for spec in "${WHEELS[@]}" "$CU13_WHEEL"; do
    "$PY" -m pip download --quiet --no-deps "$spec" --python-version 3.12 --platform manylinux_2_28_x86_64 \
      --only-binary=:all: -d "$work/wheels"
  done
  mkdir -p "$work/cu13" "$work/rest"
  for wheel in "$work"/wheels/*.whl; do
    case "$(basename "$wheel")" in
      nvidia_cutlass_dsl_libs_cu13-*) unzip -q -o "$wheel" -d "$work/cu13" ;;
      *) unzip -q -o "$wheel" -d "$work/rest" ;;
    esac
  done
  tar -C "$work/cu13" -cf - . | xz -9 -T2 > "$BUNDLE/cu13.tar.xz"
  tar -C "$work/rest" -cf - . | xz -9 -T2 > "$BUNDLE/rest.tar.xz"
  rm -rf "$work"
  ls -l "$BUNDLE"
}

unpack() {
  local part=$1
  mkdir -p "$FA4_DIR"
  xz -dc -T0 "$BUNDLE/$part.tar.xz" | tar -C "$FA4_DIR" -xf -
  echo "fa4_bundle: $part unpacked into $FA4_DIR ($(du -sh "$FA4_DIR" | cut -f1))"
}

case "${1:-}" in
  pack) pack ;;
  unpack) unpack "${2:?unpack needs cu13 or rest}" ;;
  pythonpath) echo "$FA4_DIR/nvidia_cutlass_dsl/dsl_packages:$FA4_DIR" ;;
  *) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 64 ;;
esac

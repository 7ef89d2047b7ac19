"""Build flash_ext: one extension module, flash_ext._C, holding the op registrations, the CPU
implementation and (when torch has CUDA and nvcc is found) the CUDA kernels.

Environment:
  FLASH_EXT_CUDA_ARCHS   target architectures, ';'-separated (default "80;90a"); e.g. "90a" on an H100/H200.
  FLASH_EXT_FORCE_CPU=1  build the CPU path only, even where CUDA is available.
  FLASH_EXT_PTXAS_VERBOSE=1  print ptxas resource usage (registers, spills) for every kernel.
  MAX_JOBS               parallel compile jobs (default: from core count and free memory).
"""
import glob
import os
import re
import sys

from setuptools import setup

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit(
        "flash_ext: PyTorch must be installed before building flash_ext.\n"
        "  pip install torch\n"
        "  pip install --no-build-isolation .   (so the build sees that torch)"
    )

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "80;90a"


def read_version():
    with open(os.path.join(HERE, "flash_ext", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def cuda_archs():
    archs = [a.strip() for a in os.environ.get("FLASH_EXT_CUDA_ARCHS", DEFAULT_ARCHS).split(";") if a.strip()]
    for arch in archs:
        match = re.fullmatch(r"(\d{2,3})(a|\+ptx)?", arch)
        if not match or int(match.group(1)) < 80:
            sys.exit(
                f"flash_ext: FLASH_EXT_CUDA_ARCHS entry {arch!r} is not an architecture >= 80 like '80', '90a' or '80+ptx'"
            )
    return archs


def gencode_flag(arch):
    """'90a' -> machine code for sm_90a; '80+ptx' -> PTX for compute_80 only, which the driver compiles when
    the module loads, on any GPU from sm_80 on: how the sm_80 source path (`__CUDA_ARCH__` 800) can be run
    and tested on an H100/H200."""
    if arch.endswith("+ptx"):
        number = arch[: -len("+ptx")]
        return f"-gencode=arch=compute_{number},code=compute_{number}"
    return f"-gencode=arch=compute_{arch},code=sm_{arch}"


def default_max_jobs():
    """One nvcc job of these kernels peaks near 2 GiB; leave the rest of memory alone."""
    cores = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as f:
            avail_kib = int(re.search(r"MemAvailable:\s+(\d+)", f.read()).group(1))
        by_memory = max(1, avail_kib // (2 * 1024 * 1024))
    except (OSError, AttributeError):
        by_memory = cores
    return str(min(cores, by_memory))


def with_cuda():
    if os.environ.get("FLASH_EXT_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and CUDA_HOME is not None


def make_extension():
    # No -std: torch's cpp_extension adds the standard its headers need (C++17 or C++20).
    # -fopenmp: at::parallel_for (the CPU path) runs on one thread without it.
    cxx_flags = ["-O3", "-fopenmp"]
    link_flags = ["-fopenmp"]
    # The torch-facing layer (csrc/api/, the only sources that include torch), the CPU implementation and
    # the runtime settings; a CUDA build adds the torch-free dispatch and the kernel instantiations.
    sources = [path for path in sorted(glob.glob("csrc/api/*.cpp")) if not path.endswith("_cuda.cpp")]
    sources += sorted(glob.glob("csrc/cpu/*.cpp")) + ["csrc/host/runtime_settings.cpp"]
    if not with_cuda():
        reason = "FLASH_EXT_FORCE_CPU=1" if os.environ.get("FLASH_EXT_FORCE_CPU") == "1" else "no CUDA torch or no nvcc found"
        print(f"flash_ext: building the CPU path only ({reason})")
        return CppExtension(
            "flash_ext._C", sources, extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags
        )

    archs = cuda_archs()
    print(f"flash_ext: building CUDA kernels for {';'.join(archs)} with nvcc from {CUDA_HOME}")
    sources += sorted(glob.glob("csrc/api/*_cuda.cpp")) + ["csrc/dispatch.cpp", "csrc/host/device_info.cpp"] + sorted(glob.glob("csrc/instantiations/*.cu"))
    nvcc_flags = [
        "-O3",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "-DFLASH_EXT_WITH_CUDA",
        # Torch adds these to every nvcc line; they are harmless here (no torch in .cu files).
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ]
    nvcc_flags += [gencode_flag(arch) for arch in archs]
    if os.environ.get("FLASH_EXT_PTXAS_VERBOSE", "0") == "1":
        nvcc_flags.append("-Xptxas=-v")
    cxx_flags += ["-DFLASH_EXT_WITH_CUDA", f'-DFLASH_EXT_CUDA_ARCHS="{";".join(archs)}"']
    if os.environ.get("FLASH_EXT_DECODE_TRACE", "0") == "1":  # timelines of the decode kernels (decode_trace.cuh)
        nvcc_flags.append("-DFLASH_EXT_DECODE_TRACE")
        cxx_flags.append("-DFLASH_EXT_DECODE_TRACE")
    return CUDAExtension(
        "flash_ext._C",
        sources,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
    )


# (Our own -gencode flags stop torch's cpp_extension from adding arch flags of its own.)
os.environ.setdefault("MAX_JOBS", default_max_jobs())

setup(
    version=read_version(),
    packages=["flash_ext", "flash_ext.integrations"],
    ext_modules=[make_extension()],
    cmdclass={"build_ext": BuildExtension},
)

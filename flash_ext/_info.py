"""flash_ext.info() and kernel_path(): what was built, what device is here, which path a call takes."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

SUPPORTED_CUDA_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 224, 256)
SM90_FORWARD_HEAD_DIMS = (64, 128, 256)  # scripts/generate_instantiations.py, SM90_FWD_HEAD_DIMS
SM90_BACKWARD_HEAD_DIMS = (64, 128, 256)  # SM90_BWD_HEAD_DIMS there


def _build() -> Tuple[str, List[str]]:
    kind, _, archs = torch.ops.flash_ext.build_info().partition(";")
    return kind, [a for a in archs.split(";") if a]


def kernel_path(q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, *,
                causal: bool = False) -> str:
    """Describe the implementation flash_ext.attention would run for these inputs."""
    head_dim = q.shape[-1]
    if q.device.type == "cpu":
        return f"cpu: tiled online-softmax implementation (head_dim {head_dim}, {q.dtype})"
    if q.device.type != "cuda":
        return f"unsupported device {q.device}"
    kind, _ = _build()
    if kind != "cuda":
        return "none: this flash_ext build has no CUDA kernels (rebuild with nvcc available)"
    padded = next((d for d in SUPPORTED_CUDA_HEAD_DIMS if d >= head_dim), None)
    if padded is None:
        return f"none: head_dim {head_dim} > 256 is not supported"
    major, minor = torch.cuda.get_device_capability(q.device)
    pad = f", head_dim padded {head_dim}->{padded}" if padded != head_dim else ""
    forward = "sm90 wgmma + TMA" if sm90_forward_available(q.device, padded) else "sm80 mma.sync"
    if sm90_forward_available(q.device, padded) and padded in SM90_BACKWARD_HEAD_DIMS:
        # deterministic=True backward calls take the sm80 kernels (csrc/sm90/launch.h).
        backward = "sm90 wgmma + TMA dK/dV (sm80 with deterministic=True)"
    else:
        backward = "sm80 mma.sync"
    kernels = f"{forward} forward, {backward} backward"
    return f"cuda {kernels} (head_dim {padded}{pad}, {q.dtype}, causal={causal}) on sm_{major}{minor}"


def sm90_kernels_enabled() -> bool:
    """Whether the sm90 kernels may run (the setting of flash_ext.testing.sm90_kernels; at load, off when
    FLASH_EXT_DISABLE_SM90=1). The op that holds the setting only sets it (returning the previous value), so
    this sets it to False and back: for that moment calls take the sm80 kernels, which are always correct."""
    if hasattr(torch.ops.flash_ext, "set_sm90_enabled"):
        enabled = torch.ops.flash_ext.set_sm90_enabled(False)
        torch.ops.flash_ext.set_sm90_enabled(enabled)
        return enabled
    return os.environ.get("FLASH_EXT_DISABLE_SM90") != "1"  # a build without the op reads it on every call


def sm90_forward_available(device: Union[torch.device, str, int], padded_head_dim: int) -> bool:
    """Whether a CUDA forward at this (padded) head dim runs the sm90 kernel (csrc/sm90/dispatch.h)."""
    _, archs = _build()
    return (
        torch.cuda.get_device_capability(device) == (9, 0)
        and "90a" in archs
        and padded_head_dim in SM90_FORWARD_HEAD_DIMS
        and sm90_kernels_enabled()
    )


def info() -> Dict[str, Any]:
    """Version, build (CPU/CUDA, archs), torch and the visible device, as a dict."""
    from . import __version__

    kind, archs = _build()
    result = {
        "version": __version__,
        "build": kind,
        "cuda_archs": archs,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": "cpu",
    }
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        result["device"] = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    return result

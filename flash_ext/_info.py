"""flash_ext.info() and kernel_path(): what was built, what device is here, which path a call takes."""
from typing import Any, Dict, List, Optional, Tuple

import torch


def _build() -> Tuple[str, List[str]]:
    kind, _, archs = torch.ops.flash_ext.build_info().partition(";")
    return kind, [a for a in archs.split(";") if a]


def kernel_path(q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None, *,
                causal: bool = False, deterministic: bool = False) -> str:
    """Describe the implementation flash_ext.attention (forward and backward) would run for these inputs.

    On CUDA the answer comes from the same dispatch code a call runs (csrc/dispatch.cpp), so it accounts for
    the tensors' layout (the sm90 kernels need TMA-compatible strides) and for
    flash_ext.testing.sm90_kernels(False). k and v default to q's shape."""
    head_dim = q.shape[-1]
    if q.device.type == "cpu":
        return f"cpu: tiled online-softmax implementation (head_dim {head_dim}, {q.dtype})"
    if q.device.type != "cuda":
        return f"unsupported device {q.device}"
    kind, _ = _build()
    if kind != "cuda":
        return "none: this flash_ext build has no CUDA kernels (rebuild with nvcc available)"
    if not 1 <= head_dim <= 256:
        return f"none: head_dim {head_dim} is not in 1..256"
    k = q if k is None else k
    v = k if v is None else v
    return torch.ops.flash_ext.kernel_path(q, k, v, bool(causal), bool(deterministic))


def info() -> Dict[str, Any]:
    """Version, build (CPU/CUDA, archs), torch and the visible device, as a dict."""
    from . import __version__

    kind, archs = _build()
    result: Dict[str, Any] = {
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

"""flash_ext: exact FlashAttention (forward and backward) as a PyTorch C++/CUDA extension.

    out = flash_ext.attention(q, k, v, causal=True)

q is (batch, seqlen_q, heads_q, head_dim); k and v are (batch, seqlen_k, heads_kv, head_dim).
"""
__version__ = "0.1.0"

import torch  # noqa: F401  (loads libtorch before our extension)

from . import _C  # noqa: F401  (registers the torch.ops.flash_ext ops)
from . import _ops  # noqa: F401  (fake and autograd registrations)
from . import reference
from ._info import info, kernel_path
from .interface import attention

__all__ = ["attention", "info", "kernel_path", "reference", "__version__"]

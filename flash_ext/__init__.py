"""flash_ext: exact FlashAttention (forward and backward) as a PyTorch C++/CUDA extension.

    out = flash_ext.attention(q, k, v, causal=True)
    out = flash_ext.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out = flash_ext.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True)

q is (batch, seqlen_q, heads_q, head_dim); k and v are (batch, seqlen_k, heads_kv, head_dim); for
attention_varlen the sequences are packed: (total, heads, head_dim).
"""
__version__ = "0.1.0"

import torch  # noqa: F401  (loads libtorch before our extension)

from . import _C  # type: ignore[attr-defined]  # noqa: F401  (registers the torch.ops.flash_ext ops)
from . import _ops  # noqa: F401  (fake and autograd registrations)
from . import reference, testing
from ._info import info, kernel_path
from .interface import attention, attention_varlen, attention_with_kvcache
from .sdpa import scaled_dot_product_attention

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "info", "kernel_path", "reference", "testing", "scaled_dot_product_attention", "__version__"]

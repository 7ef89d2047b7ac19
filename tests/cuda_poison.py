"""CUDA forward checks on a poisoned allocator.

Outputs cannot be NaN-filled before the launch (the op allocates them), so `poison_allocator` fills
blocks of the sizes the op is about to allocate with 0xFF bytes (NaN in every float dtype) and frees
them: the caching allocator most likely hands them to the op, and any element the kernel fails to
write stays NaN. check_cuda_forward also asserts that there is no NaN and compares all elements.
"""
import torch

import flash_ext
from flash_ext.reference import attention_ref
from tolerance import FWD_FACTOR, assert_within_tolerance


def padded_head_dim(head_dim):
    return max(32, (head_dim + 31) // 32 * 32)


def poison_allocator(q, k):
    """Frees NaN-filled blocks of the sizes of the op's allocations (out, lse, padded q/k/v copies)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    element = q.element_size()
    padded = padded_head_dim(head_dim)
    sizes = [
        batch * seqlen_q * heads_q * padded * element,   # q copy / out (padded)
        batch * seqlen_q * heads_q * head_dim * element,  # out
        batch * seqlen_k * heads_kv * padded * element,  # k, v copies
        batch * heads_q * seqlen_q * 4,  # lse
    ]
    blocks = [torch.full((max(1, n),), 0xFF, dtype=torch.uint8, device=q.device) for n in sizes for _ in range(2)]
    del blocks


def run_poisoned(q, k, v, **kwargs):
    """flash_ext.attention(..., return_lse=True) after poison_allocator; on the CPU, plainly."""
    if not q.is_cuda:
        return flash_ext.attention(q, k, v, return_lse=True, **kwargs)
    poison_allocator(q, k)
    out, lse = flash_ext.attention(q, k, v, return_lse=True, **kwargs)
    torch.cuda.synchronize()
    return out, lse


def check_cuda_forward(q, k, v, *, causal, softmax_scale=None):
    """out and lse against the float64 reference, no NaN, and bit-identical on a second call."""
    with torch.no_grad():
        out64, lse64 = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale)
        out_lowp, lse_lowp = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale, upcast=False)
    out, lse = run_poisoned(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    assert not torch.isnan(out).any(), f"out has {torch.isnan(out).sum().item()} NaN (unwritten or bad) elements"
    assert not torch.isnan(lse).any(), f"lse has {torch.isnan(lse).sum().item()} NaN (unwritten or bad) elements"
    assert_within_tolerance("out", out, out_lowp, out64, FWD_FACTOR)
    assert_within_tolerance("lse", lse, lse_lowp, lse64, FWD_FACTOR)

    out_again, lse_again = run_poisoned(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert torch.equal(out, out_again), "out differs between two identical calls"
    assert torch.equal(lse, lse_again), "lse differs between two identical calls"
    return out, lse

"""Helpers for testing code that uses flash_ext's dropout: the exact keep mask of a call, so that a
plain-PyTorch reference (flash_ext.reference) can apply the same mask.

    out, lse, rng_state = flash_ext.testing.attention_with_rng_state(q, k, v, dropout_p=0.1)
    keep = flash_ext.testing.dropout_keep_mask(rng_state, batch, heads_q, seqlen_q, seqlen_k, 0.1)
    out_ref, lse_ref = flash_ext.reference.attention_ref(q, k, v, dropout_p=0.1, dropout_mask=keep)
"""
import torch

from .interface import _attention, _attention_varlen


def attention_with_rng_state(q, k, v, **kwargs):
    """flash_ext.attention(q, k, v, **kwargs) (without return_lse), returning (out, lse, rng_state):
    rng_state is int64 [seed, offset] of the dropout mask, zeros without dropout. Differentiable like
    flash_ext.attention."""
    return _attention(q, k, v, **kwargs)


def attention_varlen_with_rng_state(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
    """flash_ext.attention_varlen(...) returning (out, lse, rng_state), as attention_with_rng_state."""
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs)


def dropout_keep_mask(rng_state, batch, heads_q, seqlen_q, seqlen_k, dropout_p):
    """The keep mask (True = kept) of a call that returned rng_state: bool (batch, heads_q, seqlen_q,
    seqlen_k) on the CPU. rng_state is that int64 tensor [seed, offset], or a (seed, offset) pair of
    Python ints (seed in 0..2^64-1).

    Computed by the Philox function of csrc/common/philox.h, which the CPU path uses and the CUDA
    kernels are to use: element (b, h, i, j) depends only on (seed, offset, b * heads_q + h, i, j).
    For attention_varlen, batch is the number of sequences and seqlen_* the longest lengths;
    sequence b's mask is mask[b, :, :len_q(b), :len_k(b)]."""
    if not isinstance(rng_state, torch.Tensor):
        # int64 holds the 64 bits of the unsigned seed and offset.
        rng_state = torch.tensor([value - 2**64 if value >= 2**63 else value for value in rng_state],
                                 dtype=torch.int64)
    return torch.ops.flash_ext.dropout_keep_mask(rng_state.cpu(), batch, heads_q, seqlen_q, seqlen_k,
                                                 float(dropout_p))

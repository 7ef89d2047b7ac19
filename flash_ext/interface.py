"""The public entry point, flash_ext.attention."""
import math

import torch


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, deterministic=False):
    """Exact softmax attention, softmax(q·kᵀ·scale)·v, without materialising the score matrix.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16 (float32 on the CPU too).
        k, v: (batch, seqlen_k, heads_kv, head_dim), same dtype and device as q.
            heads_q must be a multiple of heads_kv (GQA/MQA: query head h uses kv head
            h // (heads_q // heads_kv); K and V are never repeated in memory).
            head_dim is any value in 1..256.
        causal: mask keys in the future of each query. With seqlen_q != seqlen_k the mask is
            aligned to the bottom-right corner: query i sees keys j <= i + seqlen_k - seqlen_q.
            For seqlen_q = 2, seqlen_k = 5 (1 = attend)::

                1 1 1 1 0
                1 1 1 1 1

            and for seqlen_q = 5, seqlen_k = 2::

                0 0
                0 0
                0 0
                1 0
                1 1

            A query row that sees no key outputs zeros, and its lse is -inf.
        softmax_scale: multiplies q·kᵀ before the softmax; default 1/sqrt(head_dim).
        return_lse: also return lse = logsumexp of each row's scaled scores, float32
            (batch, heads_q, seqlen_q). lse carries no gradient.
        deterministic: make the backward bit-reproducible run to run (may be slower on CUDA).

    Returns:
        out shaped like q (contiguous), or (out, lse) when return_lse.

    Inputs whose last dimension is contiguous are used in place, whatever their other strides.
    """
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] > 0 else 1.0
    out, lse = torch.ops.flash_ext.fwd(q, k, v, float(softmax_scale), bool(causal), bool(deterministic))
    return (out, lse) if return_lse else out

"""Plain-PyTorch attention with flash_ext's exact semantics, for tests and for debugging.

It materialises the (seqlen_q, seqlen_k) score matrix, so use it on small problems only.
"""
import math

import torch


def causal_mask(seqlen_q, seqlen_k, device=None):
    """Boolean (seqlen_q, seqlen_k) mask, True where query i may see key j (bottom-right aligned)."""
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    return cols <= rows + (seqlen_k - seqlen_q)


def attention_ref(q, k, v, *, causal=False, softmax_scale=None, upcast=True):
    """Returns (out, lse) like flash_ext.attention(..., return_lse=True).

    upcast=True computes in float64 (the reference the kernels are measured against);
    upcast=False computes in the inputs' dtype, the error budget the tolerance rule scales.
    out has q's dtype in both cases when upcast=False, float64 when upcast=True.
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    group = heads_q // heads_kv
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)

    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if causal:
        scores = scores.masked_fill(~causal_mask(seqlen_q, seqlen_k, q.device), float("-inf"))
    lse = torch.logsumexp(scores.float() if not upcast else scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    # Rows that see no key: softmax gives NaN; flash_ext defines their output as 0.
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse.float() if not upcast else lse

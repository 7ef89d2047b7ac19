"""The public entry points, flash_ext.attention and flash_ext.attention_varlen."""
import math

import torch


def _default_scale(head_dim):
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


def _options(q, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic):
    """The ops' option arguments (see FLASH_EXT_OPTIONS_SCHEMA in csrc/flash_api.cpp), in order."""
    if softmax_scale is None:
        softmax_scale = _default_scale(q.shape[-1])
    try:
        window_left, window_right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"flash_ext: window_size must be a pair (left, right), got {window_size!r}") from None
    return (float(softmax_scale), bool(causal), bool(deterministic), int(window_left), int(window_right),
            float(softcap), alibi_slopes, float(dropout_p))


def _attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
               dropout_p=0.0, deterministic=False):
    """flash_ext.attention's work: (out, lse, rng_state)."""
    options = _options(q, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic)
    return torch.ops.flash_ext.fwd(q, k, v, *options)


def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                      softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                      deterministic=False):
    """flash_ext.attention_varlen's work: (out, lse, rng_state)."""
    options = _options(q, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic)
    return torch.ops.flash_ext.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options)


_FEATURES_DOC = """
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
        window_size: (left, right), sliding-window (local) attention: query i sees the keys j with
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 leaves that
            side unbounded. (-1, -1), the default, is full attention; (-1, 0) is causal; causal=True
            with a window clamps right to 0. Tiles outside the band are skipped, so the cost grows
            with the window, not with seqlen_q * seqlen_k.
        softcap: > 0 replaces each scaled score s = softmax_scale·q·k by softcap·tanh(s / softcap)
            before the softmax (Gemma 2, Grok); 0 (default) is off.
        alibi_slopes: float32 (heads_q,) or (batch, heads_q): adds -slope·|i + seqlen_k - seqlen_q - j|
            to the scores (after softcap). None (default) is off.
        dropout_p: probability of dropping each attention probability; kept ones are scaled by
            1 / (1 - dropout_p). 0 by default: dropout is never on unless asked for (pass
            `dropout_p if self.training else 0.0`). The mask comes from a counter-based Philox
            generator seeded from torch's generator of the device, so torch.manual_seed reproduces
            it; the backward regenerates it, nothing of size seqlen_q x seqlen_k is stored. lse is
            that of the undropped softmax.
        deterministic: make the backward bit-reproducible run to run (may be slower on CUDA).
        return_lse: also return lse = logsumexp of each row's scores (after softcap and ALiBi),
            float32. lse carries no gradient.

    Every option above runs in the CUDA kernels (compute capability 8.0 and newer, float16 /
    bfloat16), forward and backward, in any combination; float32 inputs run on the CPU only.
"""


def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              dropout_p=0.0, deterministic=False, return_lse=False):
    out, lse, _ = _attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                             softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                             deterministic=deterministic)
    return (out, lse) if return_lse else out


attention.__doc__ = """Exact softmax attention, softmax(q·kᵀ·scale)·v, without materialising the score matrix.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16 (float32 on the CPU too).
        k, v: (batch, seqlen_k, heads_kv, head_dim), same dtype and device as q.
            heads_q must be a multiple of heads_kv (GQA/MQA: query head h uses kv head
            h // (heads_q // heads_kv); K and V are never repeated in memory).
            head_dim is any value in 1..256.""" + _FEATURES_DOC + """
    Returns:
        out shaped like q (contiguous), or (out, lse) when return_lse, lse (batch, heads_q, seqlen_q).

    Inputs whose last dimension is contiguous are used in place, whatever their other strides.
    """


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0,
                     deterministic=False, return_lse=False):
    out, lse, _ = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                    softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                    alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic)
    return (out, lse) if return_lse else out


attention_varlen.__doc__ = """Attention over a batch of sequences of different lengths, packed without padding.

    Sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1 of q and rows
    cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1 of k and v; each sequence is its own attention problem
    (masks, windows and ALiBi distances use its own lengths, causal is bottom-right aligned within
    it). Sequences of length 0 are allowed.

    Args:
        q: (total_q, heads_q, head_dim); k, v: (total_k, heads_kv, head_dim); dtypes, heads and
            head_dim as for flash_ext.attention.
        cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,) on q's device: 0, then the running sums of
            the lengths, ending at total_q (total_k).
        max_seqlen_q, max_seqlen_k: the longest query (key) sequence; at least the true maximum.
            The CPU path checks cu_seqlens' values; a GPU path cannot without a device-to-host sync,
            so there they are the caller's contract.
        Below, seqlen_q and seqlen_k are the lengths of the query's own sequence, and batch is the
        number of sequences.""" + _FEATURES_DOC + """
    Returns:
        out (total_q, heads_q, head_dim), or (out, lse) when return_lse, lse (heads_q, total_q).
    """

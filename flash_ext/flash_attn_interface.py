"""flash-attn 2.8's public attention functions, computed by flash_ext.

Code written for flash-attn runs unchanged after one import line changes:

    from flash_ext.flash_attn_interface import flash_attn_func, flash_attn_varlen_func
    import flash_ext.flash_attn_interface as flash_attn_interface

Every function has flash-attn 2.8's name, parameter names, positional order and defaults, and returns
what flash-attn returns (out; (out, softmax_lse, S_dmask) with return_attn_probs=True; out or
(out, softmax_lse) from flash_attn_with_kvcache), in the same shapes. They call flash_ext.attention,
flash_ext.attention_varlen and flash_ext.attention_with_kvcache, whose docstrings give the semantics
of every option (bottom-right aligned causal masks and windows, softcap, ALiBi, dropout, GQA / MQA).

flash-attn's conventions that flash_ext's own functions spell differently are translated here:

- window_size: any negative side is unbounded (flash_ext itself takes -1 only).
- softcap: a value <= 0 turns it off (flash_ext itself takes 0 only).
- alibi_slopes get no gradient, as in flash-attn (which returns none for them); flash_ext's own
  functions reject slopes that require grad instead.
- flash_attn_with_kvcache has no backward, and its output carries no gradient, as in flash-attn
  (flash_ext.attention_with_kvcache rejects inputs that require grad instead).
- The packed variants split qkv / kv into views; autograd gives the packed tensor its gradient.

Where flash_ext cannot return what flash-attn returns, it says so:

- return_attn_probs=True returns (out, softmax_lse, S_dmask). flash-attn's kernels write S_dmask (the
  attention probabilities with the dropout pattern in their sign bits, a test aid) only when
  dropout_p > 0; with dropout_p == 0 it is an empty tensor, and so it is here. flash_ext never
  materialises the probabilities, so return_attn_probs=True with dropout_p > 0 is an error
  (flash_ext.testing.dropout_keep_mask and flash_ext.reference.attention_ref give the keep mask and
  the probabilities of a call for tests).

Known differences in values, where flash-attn's kernels depart from its documented formulas:

- A query row that sees no key (causal with seqlen_q > seqlen_k, windows, empty sequences) has
  softmax_lse -inf here (the log of an empty sum); flash-attn's kernels write +inf there.
- With causal=True, an unbounded left side and alibi_slopes, flash-attn's kernels add slope * j instead of
  -slope * |i + seqlen_k - seqlen_q - j| (the same softmax, so the same out), which makes its
  softmax_lse larger by slope * (i + seqlen_k - seqlen_q); the lse here is that of the documented bias.
- With a bounded left side (0 <= left < seqlen_k) and a right side that is negative or > seqlen_k,
  flash-attn's C++ replaces right by seqlen_k (max_seqlen_k for varlen, the cache's capacity with a
  KV cache), which hides keys from the rows i < seqlen_q - seqlen_k - 1; here right means what the
  formula says (negative: unbounded). Results differ only where seqlen_q > seqlen_k + 1.
- Dropout draws its own random numbers (flash_ext's Philox mapping): the same rate, not flash-attn's
  pattern.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .interface import (_as_bool, _as_real, _attention, _attention_varlen, _check_tensor, _window,
                        attention_with_kvcache)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache"]

_Window = Union[Tuple[int, int], Sequence[int]]


# ---- flash-attn's conventions, translated ----------------------------------------------------------


def _flash_attn_window(window_size: Any) -> Tuple[int, int]:
    """flash-attn treats every negative side as unbounded; flash_ext's ops take -1 for that."""
    left, right = _window(window_size)
    return (left if left >= 0 else -1), (right if right >= 0 else -1)


def _flash_attn_softcap(softcap: Any) -> float:
    """flash-attn turns softcap off for any value <= 0; flash_ext's ops take 0 for off (a NaN stays,
    for the op's own error)."""
    softcap = _as_real("softcap", softcap)
    return 0.0 if softcap < 0 else softcap


def _flash_attn_slopes(alibi_slopes: Any) -> Any:
    """flash-attn's backward returns no gradient for the slopes, so they are used detached."""
    return alibi_slopes.detach() if isinstance(alibi_slopes, Tensor) else alibi_slopes


def _options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic):
    """flash_ext's keyword arguments for flash-attn's options."""
    return dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                window_size=_flash_attn_window(window_size), softcap=_flash_attn_softcap(softcap),
                alibi_slopes=_flash_attn_slopes(alibi_slopes), deterministic=deterministic)


def _wants_probs(return_attn_probs: Any, dropout_p: Any, function: str) -> bool:
    """return_attn_probs as a bool; an error where flash-attn would return the probabilities
    (dropout_p > 0), which flash_ext does not materialise."""
    return_attn_probs = _as_bool("return_attn_probs", return_attn_probs)
    if return_attn_probs and _as_real("dropout_p", dropout_p) > 0:
        raise NotImplementedError(
            f"flash_ext.flash_attn_interface.{function}: return_attn_probs=True with dropout_p > 0 asks for S_dmask, "
            "the attention probabilities with the dropout pattern, which flash_ext never materialises. Pass "
            "return_attn_probs=False, or dropout_p=0.0 to get (out, softmax_lse, empty S_dmask); for tests, "
            "flash_ext.testing.attention_with_rng_state and dropout_keep_mask give a call's keep mask and "
            "flash_ext.reference.attention_ref its probabilities")
    return return_attn_probs


def _empty_probs(q: Tensor) -> Tensor:
    """flash-attn's S_dmask when dropout_p == 0: an empty tensor in q's dtype, on q's device."""
    return torch.empty((0,), dtype=q.dtype, device=q.device)


def _unpack(name: str, packed: Any, ndim: int, dim: int, count: int, layout: str) -> Tuple[Tensor, ...]:
    """Views of the count tensors stacked along dim (autograd gives the packed tensor their gradients)."""
    _check_tensor(name, packed)
    if packed.dim() != ndim or packed.shape[dim] != count:
        raise ValueError(f"flash_ext: {name} must have shape {layout}, got {tuple(packed.shape)}")
    return packed.unbind(dim)


def _dense(function, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs):
    probs = _wants_probs(return_attn_probs, dropout_p, function)
    out, lse, _ = _attention(q, k, v, **_options(dropout_p, softmax_scale, causal, window_size, softcap,
                                                 alibi_slopes, deterministic))
    return (out, lse, _empty_probs(q)) if probs else out


def _varlen(function, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
            causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs, block_table=None):
    probs = _wants_probs(return_attn_probs, dropout_p, function)
    out, lse, _ = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    block_table=block_table, **_options(dropout_p, softmax_scale, causal, window_size,
                                                                        softcap, alibi_slopes, deterministic))
    return (out, lse, _empty_probs(q)) if probs else out


_OPTIONS_DOC = """
        dropout_p: probability of dropping an attention probability (kept ones scaled by
            1 / (1 - dropout_p)); pass 0.0 in evaluation.
        softmax_scale: multiplies q·kᵀ; None is 1 / sqrt(headdim).
        causal: mask the keys after each query's diagonal (bottom-right aligned:
            query i sees keys j <= i + seqlen_k - seqlen_q).
        window_size: (left, right): query i sees keys i + seqlen_k - seqlen_q - left through
            i + seqlen_k - seqlen_q + right; a negative side is unbounded; (-1, -1) is off.
        softcap: > 0 bends each scaled score s into softcap * tanh(s / softcap); <= 0 is off.
        alibi_slopes: None or float32 (nheads,) / (batch_size, nheads): adds
            -slope * |i + seqlen_k - seqlen_q - j| to the scores. The slopes get no gradient.
        deterministic: a bitwise-repeatable backward (on CUDA; the CPU always is).
        return_attn_probs: also return softmax_lse (float32, no gradient) and S_dmask. S_dmask
            is an empty tensor (flash-attn's own value at dropout_p == 0); dropout_p > 0 with
            return_attn_probs=True is an error, because flash_ext never materialises the
            attention probabilities (see the module docstring)."""

_NOTES_DOC = """
    Rows that see no key get out 0 and softmax_lse -inf. Semantics and supported shapes, dtypes and
    devices are flash_ext's (flash_ext.attention's docstring); the module docstring lists where
    flash-attn's kernels differ.
    """


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: _Window = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor, Tensor]]:
    return _dense("flash_attn_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs)


flash_attn_func.__doc__ = """flash-attn's flash_attn_func: flash_ext.attention with flash-attn's signature.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim).
        k, v: (batch_size, seqlen_k, nheads_k, headdim); nheads a multiple of nheads_k (GQA / MQA:
            query head h uses kv head h // (nheads // nheads_k)).""" + _OPTIONS_DOC + """

    Returns:
        out (batch_size, seqlen_q, nheads, headdim); with return_attn_probs,
        (out, softmax_lse (batch_size, nheads, seqlen_q), S_dmask).
""" + _NOTES_DOC


def flash_attn_kvpacked_func(q: Tensor, kv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                             causal: bool = False, window_size: _Window = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                             return_attn_probs: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor, Tensor]]:
    k, v = _unpack("kv", kv, 5, 2, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    return _dense("flash_attn_kvpacked_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs)


flash_attn_kvpacked_func.__doc__ = """flash-attn's flash_attn_kvpacked_func: flash_attn_func with k and v stacked.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim).
        kv: (batch_size, seqlen_k, 2, nheads_k, headdim): kv[:, :, 0] is k, kv[:, :, 1] is v (views,
            read in place; the backward gives kv one gradient holding dk and dv).""" + _OPTIONS_DOC + """

    Returns:
        as flash_attn_func.
""" + _NOTES_DOC


def flash_attn_qkvpacked_func(qkv: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                              causal: bool = False, window_size: _Window = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                              return_attn_probs: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor, Tensor]]:
    q, k, v = _unpack("qkv", qkv, 5, 2, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    return _dense("flash_attn_qkvpacked_func", q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, return_attn_probs)


flash_attn_qkvpacked_func.__doc__ = """flash-attn's flash_attn_qkvpacked_func: flash_attn_func with q, k and v stacked.

    Args:
        qkv: (batch_size, seqlen, 3, nheads, headdim): q, k, v along dim 2 (views, read in place; the
            backward gives qkv one gradient holding dq, dk and dv). One head count for all three (for
            GQA, use the kvpacked or unpacked form).""" + _OPTIONS_DOC + """

    Returns:
        as flash_attn_func, with seqlen_q = seqlen_k = seqlen.
""" + _NOTES_DOC


_VARLEN_DOC = """
        cu_seqlens_q, cu_seqlens_k: int32 (batch_size + 1,) on q's device: 0, then the running sums
            of the sequence lengths. Sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 of q
            (likewise of k and v); masks, windows and ALiBi use each sequence's own lengths.
        max_seqlen_q, max_seqlen_k: ints, the longest query / key sequence."""


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: _Window = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False,
                           block_table: Optional[Tensor] = None) -> Union[Tensor, Tuple[Tensor, Tensor, Tensor]]:
    return _varlen("flash_attn_varlen_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, block_table)


flash_attn_varlen_func.__doc__ = """flash-attn's flash_attn_varlen_func: flash_ext.attention_varlen, its signature.

    Args:
        q: (total_q, nheads, headdim); k, v: (total_k, nheads_k, headdim), the sequences packed one
            after another.""" + _VARLEN_DOC + _OPTIONS_DOC + """
        block_table: None, or int32 (batch_size, max_num_blocks_per_seq): k and v are then page pools
            (num_blocks, page_block_size, nheads_k, headdim) (any page size here) and key j of
            sequence b is slot j % page_block_size of page block_table[b, j // page_block_size].
            Forward only: q, k or v requiring grad (in grad mode) is an error.

    Returns:
        out (total_q, nheads, headdim); with return_attn_probs, (out, softmax_lse (nheads, total_q),
        S_dmask).
""" + _NOTES_DOC


def flash_attn_varlen_kvpacked_func(q: Tensor, kv: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                    max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                                    softmax_scale: Optional[float] = None, causal: bool = False,
                                    window_size: _Window = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                    return_attn_probs: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor, Tensor]]:
    k, v = _unpack("kv", kv, 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    return _varlen("flash_attn_varlen_kvpacked_func", q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


flash_attn_varlen_kvpacked_func.__doc__ = """flash-attn's flash_attn_varlen_kvpacked_func: k and v stacked.

    Args:
        q: (total_q, nheads, headdim).
        kv: (total_k, 2, nheads_k, headdim): kv[:, 0] is k, kv[:, 1] is v (views, read in place; the
            backward gives kv one gradient holding dk and dv).""" + _VARLEN_DOC + _OPTIONS_DOC + """

    Returns:
        as flash_attn_varlen_func.
""" + _NOTES_DOC


def flash_attn_varlen_qkvpacked_func(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: Optional[float] = None, causal: bool = False,
                                     window_size: _Window = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                                     return_attn_probs: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor, Tensor]]:
    q, k, v = _unpack("qkv", qkv, 4, 1, 3, "(total, 3, nheads, headdim)")
    return _varlen("flash_attn_varlen_qkvpacked_func", q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


flash_attn_varlen_qkvpacked_func.__doc__ = """flash-attn's flash_attn_varlen_qkvpacked_func: q, k and v stacked.

    Args:
        qkv: (total, 3, nheads, headdim): q, k, v along dim 1 (views, read in place; the
            backward gives qkv one gradient holding dq, dk and dv).
        cu_seqlens: int32 (batch_size + 1,), the running sums of the lengths, for queries and keys alike.
        max_seqlen: int, the longest sequence.""" + _OPTIONS_DOC + """

    Returns:
        as flash_attn_varlen_func.
""" + _NOTES_DOC


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None, cache_seqlens: Union[int, Tensor, None] = None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: _Window = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Tensor] = None,
                            num_splits: int = 0,
                            return_softmax_lse: bool = False) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """flash-attn's flash_attn_with_kvcache: flash_ext.attention_with_kvcache with flash-attn's signature.

    k and v, when given, are written into k_cache / v_cache IN PLACE at positions cache_seqlens[b] ...
    (optionally rotary-embedded), then q attends to each sequence's cached keys. Inference only: the
    output carries no gradient (as in flash-attn), whatever requires grad.

    Args:
        q: (batch_size, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), or with block_table page
            pools (num_blocks, page_block_size, nheads_k, headdim) (any page size here).
        k, v: None, or the new keys and values (batch_size, seqlen_new, nheads_k, headdim).
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2): rotate the first rotary_dim
            channels of k at positions cache_seqlens[b] + i, and of q at the same positions when causal
            or windowed, else at cache_seqlens[b]. Need k and v.
        cache_seqlens: int or int32 (batch_size,): the keys already in each sequence's cache.
        cache_batch_idx: None or int32 (batch_size,): the cache row of each sequence.
        cache_leftpad: None or int32 (batch_size,): where each sequence starts in its cache row.
        block_table: None or int32 (batch_size, max_num_blocks_per_seq): the pages of each sequence.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as in flash_attn_func, over the
            keys cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1 of sequence b.
        rotary_interleaved: True rotates channel pairs (2i, 2i + 1), False (i, i + rotary_dim / 2).
        num_splits: 0 (automatic) or the number of key splits of the CUDA decode kernel; it changes no
            result beyond rounding.
        return_softmax_lse: also return softmax_lse (batch_size, nheads, seqlen_q), float32.

    Returns:
        out (batch_size, seqlen_q, nheads, headdim), or (out, softmax_lse) with return_softmax_lse.
        flash_ext.attention_with_kvcache's docstring gives the details (what CUDA leaves unchecked).
    """
    return_softmax_lse = _as_bool("return_softmax_lse", return_softmax_lse)
    # flash-attn's kernel sits outside autograd: its output has no grad_fn whatever requires grad.
    with torch.no_grad():
        return attention_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                      rotary_interleaved=rotary_interleaved, cache_seqlens=cache_seqlens,
                                      cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                                      block_table=block_table, causal=causal, softmax_scale=softmax_scale,
                                      window_size=_flash_attn_window(window_size),
                                      softcap=_flash_attn_softcap(softcap), alibi_slopes=alibi_slopes,
                                      num_splits=num_splits, return_lse=return_softmax_lse)

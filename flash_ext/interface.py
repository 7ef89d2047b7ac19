"""The public entry points, flash_ext.attention and flash_ext.attention_varlen.

The Python-type contract of the arguments is checked here, once, before the op: flags are bools,
window sides and max_seqlen_* are ints, softmax_scale / softcap / dropout_p are real numbers,
alibi_slopes is None or a tensor. What can be checked on tensors (dtypes, shapes, devices, value
ranges) is checked by the op: by csrc/api/checks.cpp and, for meta tensors and tracing, by the fakes
of flash_ext/_ops.py, with the same messages.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Literal, Optional, Tuple, Union, overload

import torch
from torch import Tensor


def _default_scale(head_dim):
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


# ---- Python-type checks --------------------------------------------------------------------------
# TypeError where an argument has the wrong Python type, ValueError where its value is unusable.
# bool is rejected wherever an int or a real number is expected (True is an int in Python, but
# `window_size=(True, 0)` or `softcap=True` is a mistake, not a number).


def _describe(value: Any) -> str:
    """A short description of a value for an error message: its repr (cut at 60 characters) and type."""
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} of type {type(value).__name__}"


def _is_numpy_bool(value: Any) -> bool:
    cls = type(value)
    return cls.__module__ == "numpy" and cls.__name__ in ("bool_", "bool")


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if _is_numpy_bool(value):
        return bool(value)
    raise TypeError(f"flash_ext: {name} must be a bool (True or False), got {_describe(value)}")


def _as_int(name: str, value: Any) -> Union[int, torch.SymInt]:
    """A Python int, or an integer-like object (operator.index); not a bool, not a float."""
    if type(value) is int or isinstance(value, torch.SymInt):
        return value
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"flash_ext: {name} must be an int, got {_describe(value)}")


def _as_real(name: str, value: Any) -> float:
    """A Python float or int, or another real number (numbers.Real: numpy floats); not a bool, not a tensor."""
    if type(value) is float or type(value) is int or isinstance(value, (torch.SymFloat, torch.SymInt)):
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and not _is_numpy_bool(value):
        return float(value)
    hint = " (pass a Python number, e.g. tensor.item())" if isinstance(value, Tensor) else ""
    raise TypeError(f"flash_ext: {name} must be a real number (a float or an int), got {_describe(value)}{hint}")


def _check_tensor(name: str, value: Any) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(f"flash_ext: {name} must be a torch.Tensor, got {_describe(value)}")


def _optional_tensor(name: str, value: Any) -> None:
    if value is not None:
        _check_tensor(name, value)


def _window(window_size: Any) -> Tuple[Union[int, torch.SymInt], Union[int, torch.SymInt]]:
    if isinstance(window_size, (str, bytes, Tensor)) or not hasattr(window_size, "__iter__"):
        raise ValueError(f"flash_ext: window_size must be a pair (left, right) of ints, got {_describe(window_size)}")
    sides = tuple(window_size)
    if len(sides) != 2:
        raise ValueError(f"flash_ext: window_size must be a pair (left, right) of ints, got {_describe(window_size)}")
    return _as_int("window_size[0]", sides[0]), _as_int("window_size[1]", sides[1])


def _check_alibi_slopes(alibi_slopes: Any) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, Tensor):
        raise TypeError("flash_ext: alibi_slopes must be None or a float32 torch.Tensor of shape (heads_q,) or "
                        f"(batch, heads_q), got {_describe(alibi_slopes)}")
    if alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError("flash_ext: alibi_slopes requires grad, but flash_ext does not compute the gradient of the "
                         "ALiBi slopes; pass alibi_slopes.detach() (or fixed slopes that do not require grad)")


def _options(q, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic):
    """The ops' option arguments (see FLASH_EXT_OPTIONS_SCHEMA in csrc/api/registration.cpp), in order,
    after the Python-type checks."""
    causal = _as_bool("causal", causal)
    deterministic = _as_bool("deterministic", deterministic)
    if softmax_scale is None:
        softmax_scale = float(_default_scale(q.shape[-1]))
    else:
        softmax_scale = _as_real("softmax_scale", softmax_scale)
    window_left, window_right = _window(window_size)
    softcap = _as_real("softcap", softcap)
    _check_alibi_slopes(alibi_slopes)
    dropout_p = _as_real("dropout_p", dropout_p)
    return (softmax_scale, causal, deterministic, window_left, window_right, softcap, alibi_slopes, dropout_p)


def _attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
               window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
               dropout_p: float = 0.0, deterministic: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """flash_ext.attention's work: (out, lse, rng_state)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    options = _options(q, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic)
    return torch.ops.flash_ext.fwd(q, k, v, *options)


def _attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                      max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                      softmax_scale: Optional[float] = None, window_size: Tuple[int, int] = (-1, -1),
                      softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0,
                      deterministic: bool = False, block_table: Optional[Tensor] = None,
                      seqused_k: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """flash_ext.attention_varlen's work: (out, lse, rng_state)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        _check_tensor(name, t)
    _optional_tensor("block_table", block_table)
    _optional_tensor("seqused_k", seqused_k)
    max_seqlens = _as_int("max_seqlen_q", max_seqlen_q), _as_int("max_seqlen_k", max_seqlen_k)
    options = _options(q, causal, softmax_scale, window_size, softcap, alibi_slopes, dropout_p, deterministic)
    if block_table is None and seqused_k is None:
        return torch.ops.flash_ext.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *max_seqlens, *options)
    # Paged keys or a used prefix of them: forward only, as flash-attn's paged path (the op has no backward).
    argument = "block_table" if block_table is not None else "seqused_k"
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.requires_grad:
                raise RuntimeError(f"flash_ext.attention_varlen with {argument} is forward only (no backward), but "
                                   f"{name} requires grad; call it under torch.no_grad() / torch.inference_mode(), "
                                   "or detach the inputs")
    return torch.ops.flash_ext.varlen_paged_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *max_seqlens, block_table,
                                                seqused_k, *options)


_FEATURES_DOC = """
        causal: a bool; True masks keys in the future of each query. With seqlen_q != seqlen_k
            the mask is aligned to the bottom-right corner: query i sees keys
            j <= i + seqlen_k - seqlen_q. For seqlen_q = 2, seqlen_k = 5 (1 = attend)::

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
            with the window, not with seqlen_q * seqlen_k. left and right are ints: Python ints or
            integer-like objects (operator.index, e.g. numpy integers); a float or a bool is
            rejected, not rounded.
        softcap: > 0 replaces each scaled score s = softmax_scale·q·k by softcap·tanh(s / softcap)
            before the softmax (Gemma 2, Grok); 0 (default) is off.
        alibi_slopes: a float32 tensor (heads_q,) or (batch, heads_q) on q's device: adds
            -slope·|i + seqlen_k - seqlen_q - j| to the scores (after softcap). None (default) is
            off. The slopes get no gradient: slopes that require grad (with grad mode on) are
            rejected; pass alibi_slopes.detach().
        dropout_p: probability of dropping each attention probability; kept ones are scaled by
            1 / (1 - dropout_p). 0 by default: dropout is never on unless asked for (pass
            `dropout_p if self.training else 0.0`). The mask comes from a counter-based Philox
            generator seeded from torch's generator of the device, so torch.manual_seed reproduces
            it; the backward regenerates it, nothing of size seqlen_q x seqlen_k is stored. lse is
            that of the undropped softmax.
        deterministic: a bool; True makes the backward bit-reproducible run to run (may be slower
            on CUDA).
        return_lse: a bool; True also returns lse = logsumexp of each row's scores (after softcap
            and ALiBi), float32. lse carries no gradient.

    softmax_scale, softcap and dropout_p are real numbers (Python floats or ints, or numpy floats;
    not bools, not tensors). A NaN or inf in q, k or v propagates into out, lse and the gradients
    as in plain softmax attention (scaled_dot_product_attention's math backend): a query row whose
    scores hold a NaN gets out and lse NaN, not the zeros of a row that sees no key.

    Every option above runs in the CUDA kernels (compute capability 8.0 and newer, float16 /
    bfloat16), forward and backward, in any combination; float32 inputs run on the CPU only.
"""


_Lse = Tuple[Tensor, Tensor]


@overload
def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = ..., softmax_scale: Optional[float] = ...,
              window_size: Tuple[int, int] = ..., softcap: float = ..., alibi_slopes: Optional[Tensor] = ...,
              dropout_p: float = ..., deterministic: bool = ..., return_lse: Literal[False] = ...) -> Tensor: ...


@overload
def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = ..., softmax_scale: Optional[float] = ...,
              window_size: Tuple[int, int] = ..., softcap: float = ..., alibi_slopes: Optional[Tensor] = ...,
              dropout_p: float = ..., deterministic: bool = ..., return_lse: Literal[True]) -> _Lse: ...


@overload
def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = ..., softmax_scale: Optional[float] = ...,
              window_size: Tuple[int, int] = ..., softcap: float = ..., alibi_slopes: Optional[Tensor] = ...,
              dropout_p: float = ..., deterministic: bool = ..., return_lse: bool) -> Union[Tensor, _Lse]: ...


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
              window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
              dropout_p: float = 0.0, deterministic: bool = False, return_lse: bool = False) -> Union[Tensor, _Lse]:
    return_lse = _as_bool("return_lse", return_lse)
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
            head_dim is any value in 1..256. heads_q = heads_kv = 0 is allowed (empty results);
            heads_kv = 0 with heads_q > 0 is an error.""" + _FEATURES_DOC + """
    Returns:
        out shaped like q (contiguous), or (out, lse) when return_lse, lse (batch, heads_q, seqlen_q).

    Inputs whose last dimension is contiguous are used in place, whatever their other strides.
    """


@overload
def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = ..., softmax_scale: Optional[float] = ...,
                     window_size: Tuple[int, int] = ..., softcap: float = ..., alibi_slopes: Optional[Tensor] = ...,
                     dropout_p: float = ..., deterministic: bool = ..., return_lse: Literal[False] = ...,
                     block_table: Optional[Tensor] = ..., seqused_k: Optional[Tensor] = ...) -> Tensor: ...


@overload
def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = ..., softmax_scale: Optional[float] = ...,
                     window_size: Tuple[int, int] = ..., softcap: float = ..., alibi_slopes: Optional[Tensor] = ...,
                     dropout_p: float = ..., deterministic: bool = ..., return_lse: Literal[True],
                     block_table: Optional[Tensor] = ..., seqused_k: Optional[Tensor] = ...) -> _Lse: ...


@overload
def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = ..., softmax_scale: Optional[float] = ...,
                     window_size: Tuple[int, int] = ..., softcap: float = ..., alibi_slopes: Optional[Tensor] = ...,
                     dropout_p: float = ..., deterministic: bool = ..., return_lse: bool,
                     block_table: Optional[Tensor] = ...,
                     seqused_k: Optional[Tensor] = ...) -> Union[Tensor, _Lse]: ...


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False, softmax_scale: Optional[float] = None,
                     window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     alibi_slopes: Optional[Tensor] = None, dropout_p: float = 0.0, deterministic: bool = False,
                     return_lse: bool = False, block_table: Optional[Tensor] = None,
                     seqused_k: Optional[Tensor] = None) -> Union[Tensor, _Lse]:
    return_lse = _as_bool("return_lse", return_lse)
    out, lse, _ = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                    softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                                    alibi_slopes=alibi_slopes, dropout_p=dropout_p, deterministic=deterministic,
                                    block_table=block_table, seqused_k=seqused_k)
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
        max_seqlen_q, max_seqlen_k: ints, the longest query (key) sequence; at least the true maximum.
            The CPU path checks cu_seqlens' values; a GPU path cannot without a device-to-host sync,
            so there they are the caller's contract.
        block_table: None, or int32 (batch, max_blocks) on q's device: the keys are paged (the
            chunked-prefill path of serving engines; flash-attn 2.8's flash_attn_varlen_func with
            block_table). k and v are then page pools (num_blocks, page_size, heads_kv, head_dim), any
            page_size >= 1, of one shape, and key j of sequence b is slot j % page_size of page
            block_table[b, j // page_size]. cu_seqlens_k still gives each sequence's number of keys,
            seqlen_k = cu_seqlens_k[b+1] - cu_seqlens_k[b] (cu_seqlens_k[-1] is not tied to k's shape).
            Only the entries of the pages a sequence uses are read: later entries of its row may hold
            anything (e.g. -1), and unused blocks of the pool are never read.
        seqused_k: None, or int32 (batch,) on q's device: sequence b uses only its first
            seqused_k[b] keys, and seqlen_k = seqused_k[b] overrides the length from cu_seqlens_k.
            With block_table these are its first seqused_k[b] paged keys (up to max_blocks *
            page_size); without, rows cu_seqlens_k[b] .. cu_seqlens_k[b] + seqused_k[b] - 1 of k and v
            (seqused_k[b] <= cu_seqlens_k[b+1] - cu_seqlens_k[b]; cu_seqlens_k[-1] = total_k as usual).
        Below, seqlen_q and seqlen_k are the lengths of the query's own sequence, and batch is the
        number of sequences.""" + _FEATURES_DOC + """
    block_table and seqused_k make the call forward only (inference, as flash-attn's paged path): q, k
    or v requiring grad, with grad mode on, is an error that names the argument. max_seqlen_k must be
    at least the longest seqlen_k used. The CPU path checks the index values (cu_seqlens, seqused_k,
    the used entries of block_table); on CUDA they are the caller's contract (a count past
    max_seqlen_k or past the sequence's pages or span is cut there: wrong output, no error). On an sm90
    GPU, pages of a multiple of 128 keys (64 at hd256) are read in place by the forward; otherwise the
    call gathers the keys each sequence uses into a packed batch of batch * min(max_seqlen_k,
    max_blocks * page_size) rows (at most total_k without block_table) by device-side index ops (no
    host sync; CUDA-graph capturable), then runs the varlen kernels.

    Returns:
        out (total_q, heads_q, head_dim), or (out, lse) when return_lse, lse (heads_q, total_q).
    """


# ---- KV cache ------------------------------------------------------------------------------------

def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                           v: Optional[Tensor] = None, *, rotary_cos: Optional[Tensor] = None,
                           rotary_sin: Optional[Tensor] = None, rotary_interleaved: bool = True,
                           cache_seqlens: Union[int, Tensor, None] = None, cache_batch_idx: Optional[Tensor] = None,
                           cache_leftpad: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
                           causal: bool = False, softmax_scale: Optional[float] = None,
                           window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, num_splits: int = 0,
                           return_lse: bool = False) -> Union[Tensor, _Lse]:
    """Attention of q over a KV cache, after appending new keys and values to it in place (inference).

    CPU and CUDA. On CUDA: CUDA-graph capturable; one kernel appends k / v (and applies rotary); at head
    dims 64 / 128 / 256 decode runs the split-KV decode kernel and prefill the sm90 forward, both reading the
    cache in place (prefill: contiguous caches, and pages of a multiple of 128 keys, 64 at hd256, without
    cache_leftpad); otherwise the keys are gathered for the varlen kernels. Index values (cache_seqlens,
    cache_batch_idx, cache_leftpad, block_table) are not checked on CUDA: out-of-range values are the
    caller's error, as cu_seqlens in attention_varlen (the CPU checks them); the append writes nowhere
    outside the caches. Forward only: inputs that require grad (with grad
    mode on) are rejected. The semantics are those of flash-attn 2.8's flash_attn_with_kvcache.

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), any seqlen_q; dtypes as for flash_ext.attention.
        k_cache, v_cache: (batch_cache, seqlen_cache, heads_kv, head_dim), or, with block_table, pages
            (num_blocks, page_size, heads_kv, head_dim); q's dtype and device. GQA/MQA as in attention.
        k, v: None, or the new keys and values (batch, seqlen_new, heads_kv, head_dim): written into the
            caches IN PLACE at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of sequence
            b (through block_table when paged), then attended to. The cache must hold them.
        rotary_cos, rotary_sin: None, or (seqlen_ro, rotary_dim / 2) in q's dtype, rotary_dim <= head_dim,
            seqlen_ro >= the cache's length per sequence; need k and v. The rotary embedding rotates the
            first rotary_dim channels of the new keys at positions cache_seqlens[b] + i, and of q at
            cache_seqlens[b] + i when causal or windowed (window_size != (-1, -1)), else every query at
            cache_seqlens[b]. Positions are cache positions: cache_leftpad does not shift them.
        rotary_interleaved: True rotates channel pairs (2i, 2i + 1) (GPT-J); False pairs (i, i + rotary_dim / 2)
            (GPT-NeoX).
        cache_seqlens: an int or int32 (batch,): the keys already in each sequence's cache (counted from the
            cache's start, cache_leftpad included). None: the whole cache, seqlen_cache keys (max_blocks *
            page_size when paged), with no room left to append.
        cache_batch_idx: None or int32 (batch,): the cache row of each sequence (default: row b); not with
            block_table; rows must differ when k and v are appended.
        cache_leftpad: None or int32 (batch,): where each sequence starts in its cache; keys before it are
            ignored. 0 <= cache_leftpad[b] <= cache_seqlens[b].
        block_table: None or int32 (batch, max_blocks): the pages of each sequence; position p of sequence b
            is row p % page_size of page block_table[b][p // page_size].

    Sequence b attends to the keys cache_leftpad[b] .. cache_seqlens[b] + seqlen_new - 1; call their number
    seqlen_k. causal, window_size, softcap and alibi_slopes are those of flash_ext.attention with these
    seqlen_k keys (bottom-right aligned: query i sees keys j <= seqlen_k - seqlen_q + i, counted from
    cache_leftpad[b]). num_splits: 0 (automatic) or the number of key splits a GPU kernel would use; on the
    CPU the result does not depend on it. return_lse: also return lse (batch, heads_q, seqlen_q), float32.

    Returns:
        out shaped like q, or (out, lse) when return_lse.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t)
    optional = (("k", k), ("v", v), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad), ("block_table", block_table))
    for name, t in optional:
        _optional_tensor(name, t)
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)) + optional + (
                ("alibi_slopes", alibi_slopes),):
            if isinstance(t, Tensor) and t.requires_grad:
                raise RuntimeError(f"flash_ext.attention_with_kvcache is forward only (inference), but {name} "
                                   "requires grad; call it under torch.no_grad() / torch.inference_mode(), or detach "
                                   "the inputs")
    rotary_interleaved = _as_bool("rotary_interleaved", rotary_interleaved)
    return_lse = _as_bool("return_lse", return_lse)
    num_splits = _as_int("num_splits", num_splits)
    if cache_seqlens is not None and not isinstance(cache_seqlens, Tensor):
        cache_seqlens = torch.full((q.shape[0],), _as_int("cache_seqlens", cache_seqlens), dtype=torch.int32,
                                   device=q.device)
    softmax_scale, causal, _, window_left, window_right, softcap, alibi_slopes, _ = _options(
        q, causal, softmax_scale, window_size, softcap, alibi_slopes, 0.0, False)
    out, lse = torch.ops.flash_ext.kvcache_fwd(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, rotary_interleaved,
                                               cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                                               softmax_scale, causal, window_left, window_right, softcap,
                                               alibi_slopes, num_splits)
    return (out, lse) if return_lse else out

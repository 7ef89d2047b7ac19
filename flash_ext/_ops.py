"""Python-side registrations for the ops defined in csrc/api/checks.cpp: fake (meta)
implementations, so torch.compile can trace them, and autograd, whose backwards are the
`flash_ext::bwd` and `flash_ext::varlen_bwd` ops."""
import math

import torch

# ---- Checks ------------------------------------------------------------------------------------
# The checks of csrc/api/checks.cpp, for calls that reach the fakes: tracing (torch.compile) and any
# call with a tensor on the meta device, which would otherwise return uninitialised memory instead
# of an error. They are written in Python (not called from C++) because they must work on
# symbolic shapes. Each one mirrors its C++ counterpart: the same conditions in the same order,
# the same messages, formatted as csrc/error_message.h formats them (dtypes as
# c10::toString, shapes as [a, b], doubles as %g), so that a bad call fails alike on a real and on
# a fake tensor (tests/test_check_parity.py). Checks of cu_seqlens' values need the values and stay
# in C++.

_INT32_MAX = 2**31 - 1

# c10::toString(ScalarType) of the dtypes a message may name.
_DTYPE_NAMES = {
    torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
    torch.float8_e4m3fn: "Float8_e4m3fn", torch.float8_e5m2: "Float8_e5m2",
}


def _dtype(dtype):
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _sizes(shape):
    return "[" + ", ".join(str(size) for size in shape) + "]"


def _number(value):
    try:
        return format(value, "g")
    except (TypeError, ValueError):
        return str(value)


def _check_qkv_common(q, k, v):
    is_cuda = q.device.type == "cuda"
    torch._check(q.dtype in (torch.float16, torch.bfloat16) or (q.dtype == torch.float32 and not is_cuda),
                 lambda: f"flash_ext: q has dtype {_dtype(q.dtype)}; expected float16 or bfloat16"
                         + (" on CUDA" if is_cuda else " (or float32 on the CPU)"))
    for name, t in (("k", k), ("v", v)):
        torch._check(t.dtype == q.dtype, lambda: f"flash_ext: {name} has dtype {_dtype(t.dtype)} but q has "
                                                 f"{_dtype(q.dtype)}; q, k and v must share one dtype")
    for name, t in (("k", k), ("v", v)):
        torch._check(t.device == q.device, lambda: f"flash_ext: {name} is on {t.device} but q is on {q.device}; "
                                                   "q, k and v must be on one device")
    torch._check(k.shape == v.shape, lambda: f"flash_ext: k and v must have the same shape, got k {_sizes(k.shape)} "
                                             f"and v {_sizes(v.shape)}")
    torch._check(k.shape[-1] == q.shape[-1], lambda: f"flash_ext: k has head_dim {k.shape[-1]} but q has head_dim "
                                                     f"{q.shape[-1]}; q, k and v must share head_dim")
    head_dim = q.shape[-1]
    torch._check(1 <= head_dim <= 256,
                 lambda: f"flash_ext: head_dim (last dimension of q) must be in 1..256, got {head_dim}")
    # heads_q = heads_kv = 0 is an empty problem (empty results); heads_kv = 0 with heads_q > 0 is an error.
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    torch._check(heads_kv >= 1 or heads_q == 0,
                 lambda: f"flash_ext: k and v have 0 heads (k.size({k.dim() - 2})) but q has {heads_q}; "
                         "heads_kv must be >= 1")
    torch._check(heads_kv == 0 or heads_q % heads_kv == 0,
                 lambda: f"flash_ext: heads_q (q.size({q.dim() - 2}) = {heads_q}) must be a multiple of heads_kv "
                         f"(k.size({k.dim() - 2}) = {heads_kv})")


def _check_dense(q, k, v):
    for name, t, dims in (("q", q, "(batch, seqlen_q, heads_q, head_dim)"),
                          ("k", k, "(batch, seqlen_k, heads_kv, head_dim)"),
                          ("v", v, "(batch, seqlen_k, heads_kv, head_dim)")):
        torch._check(t.dim() == 4, lambda: f"flash_ext: {name} must have 4 dimensions {dims}, got {t.dim()} "
                                           f"(shape {_sizes(t.shape)})")
    _check_qkv_common(q, k, v)
    torch._check(k.shape[0] == q.shape[0], lambda: f"flash_ext: k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    if q.device.type == "cuda":
        torch._check(q.shape[0] * max(1, q.shape[2]) <= _INT32_MAX and q.shape[1] <= _INT32_MAX
                     and k.shape[1] <= _INT32_MAX,
                     lambda: "flash_ext: batch * heads and seqlens must each fit in int32")


def _varlen_batch(cu_seqlens_q):
    torch._check(cu_seqlens_q.dim() == 1 and cu_seqlens_q.shape[0] >= 1,
                 lambda: f"flash_ext: cu_seqlens_q must be 1-D with batch + 1 entries, got shape "
                         f"{_sizes(cu_seqlens_q.shape)}")
    return cu_seqlens_q.shape[0] - 1


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    for name, t, dims in (("q", q, "(total_q, heads_q, head_dim)"), ("k", k, "(total_k, heads_kv, head_dim)"),
                          ("v", v, "(total_k, heads_kv, head_dim)")):
        torch._check(t.dim() == 3, lambda: f"flash_ext: {name} must have 3 dimensions {dims} for attention_varlen, "
                                           f"got {t.dim()} (shape {_sizes(t.shape)})")
    _check_qkv_common(q, k, v)
    torch._check(q.shape[0] <= _INT32_MAX and k.shape[0] <= _INT32_MAX,
                 lambda: f"flash_ext: total_q and total_k must fit in int32 (cu_seqlens are int32), got {q.shape[0]} "
                         f"and {k.shape[0]}")
    return _check_varlen_layout(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _check_varlen_layout(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    batch = _varlen_batch(cu_seqlens_q)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        torch._check(cu.dtype == torch.int32, lambda: f"flash_ext: {name} must be int32, got {_dtype(cu.dtype)}")
        torch._check(cu.dim() == 1 and cu.shape[0] >= 1,
                     lambda: f"flash_ext: {name} must be 1-D with batch + 1 entries, got shape {_sizes(cu.shape)}")
        torch._check(cu.shape[0] == batch + 1,
                     lambda: f"flash_ext: {name} has {cu.shape[0]} entries but cu_seqlens_q has {batch + 1}; both must "
                             "have batch + 1 entries")
        torch._check(cu.device == q.device, lambda: f"flash_ext: {name} is on {cu.device} but q is on {q.device}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        torch._check(0 <= value <= _INT32_MAX, lambda: f"flash_ext: {name} must be in 0..2^31-1, got {value}")
    return batch


def _check_block_table(block_table, batch, q, pool, pool_name):
    """check_block_table of csrc/api/checks.cpp."""
    torch._check(block_table.dtype == torch.int32,
                 lambda: f"flash_ext: block_table must be int32, got {_dtype(block_table.dtype)}")
    torch._check(block_table.dim() == 2 and block_table.shape[0] == batch,
                 lambda: f"flash_ext: block_table must have shape (batch, max_blocks) with batch = {batch}, got "
                         f"{_sizes(block_table.shape)}")
    torch._check(block_table.device == q.device,
                 lambda: f"flash_ext: block_table is on {block_table.device} but q is on {q.device}")
    torch._check(pool.shape[1] >= 1,
                 lambda: f"flash_ext: with block_table, {pool_name}.size(1) is the page size and must be >= 1, got "
                         f"{pool.shape[1]}")


def _check_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k):
    """check_varlen_paged_inputs of csrc/api/checks.cpp."""
    if block_table is None:
        batch = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    else:
        torch._check(q.dim() == 3, lambda: "flash_ext: q must have 3 dimensions (total_q, heads_q, head_dim) for "
                                           f"attention_varlen, got {q.dim()} (shape {_sizes(q.shape)})")
        for name, t in (("k", k), ("v", v)):
            torch._check(t.dim() == 4,
                         lambda: f"flash_ext: with block_table, {name} must be a page pool of 4 dimensions "
                                 f"(num_blocks, page_size, heads_kv, head_dim), got {t.dim()} (shape "
                                 f"{_sizes(t.shape)})")
        _check_qkv_common(q, k, v)
        torch._check(q.shape[0] <= _INT32_MAX,
                     lambda: f"flash_ext: total_q must fit in int32 (cu_seqlens are int32), got {q.shape[0]}")
        batch = _check_varlen_layout(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        _check_block_table(block_table, batch, q, k, "k")
        if q.device.type == "cuda":
            per_sequence = torch.sym_min(max_seqlen_k, block_table.shape[1] * k.shape[1])
            torch._check(batch * per_sequence <= _INT32_MAX,
                         lambda: "flash_ext: batch * min(max_seqlen_k, max_blocks * page_size) (the keys the CUDA "
                                 f"path gathers) must fit in int32, got {batch} * {per_sequence}")
    _check_int32_per_sequence(seqused_k, "seqused_k", batch, q)
    return batch


def _check_softmax_scale(softmax_scale):
    torch._check(math.isfinite(softmax_scale) and softmax_scale > 0,
                 lambda: f"flash_ext: softmax_scale must be a finite positive number, got {_number(softmax_scale)}")


def _check_options(q, batch, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p):
    _check_softmax_scale(softmax_scale)
    torch._check(-1 <= window_left <= _INT32_MAX,
                 lambda: "flash_ext: window_size[0] (keys left of the diagonal) must be -1 (unbounded) or >= 0, got "
                         f"{window_left}")
    torch._check(-1 <= window_right <= _INT32_MAX,
                 lambda: "flash_ext: window_size[1] (keys right of the diagonal) must be -1 (unbounded) or >= 0, got "
                         f"{window_right}")
    torch._check(math.isfinite(softcap) and softcap >= 0,
                 lambda: f"flash_ext: softcap must be 0 (off) or a finite positive number, got {_number(softcap)}")
    torch._check(0 <= dropout_p < 1, lambda: f"flash_ext: dropout_p must be in [0, 1), got {_number(dropout_p)}")
    if alibi_slopes is not None:
        heads_q = q.shape[-2]
        torch._check(alibi_slopes.dtype == torch.float32,
                     lambda: f"flash_ext: alibi_slopes must be float32, got {_dtype(alibi_slopes.dtype)}")
        torch._check(alibi_slopes.device == q.device,
                     lambda: f"flash_ext: alibi_slopes is on {alibi_slopes.device} but q is on {q.device}")
        torch._check(tuple(alibi_slopes.shape) in ((heads_q,), (batch, heads_q)),
                     lambda: f"flash_ext: alibi_slopes must have shape (heads_q,) = ({heads_q},) or (batch, heads_q) = "
                             f"({batch}, {heads_q}), got {_sizes(alibi_slopes.shape)}")


def _check_bwd_tensors(dout, q, out, lse, lse_shape, lse_layout):
    for name, t in (("dout", dout), ("out", out)):
        torch._check(t.shape == q.shape and t.dtype == q.dtype and t.device == q.device,
                     lambda: f"flash_ext: {name} must match q in shape, dtype and device, got {_sizes(t.shape)} "
                             f"{_dtype(t.dtype)} on {t.device}")
    torch._check(lse.dtype == torch.float32 and lse.device == q.device and tuple(lse.shape) == tuple(lse_shape),
                 lambda: f"flash_ext: lse must be float32 of shape {lse_layout} on q's device, got {_sizes(lse.shape)} "
                         f"{_dtype(lse.dtype)} on {lse.device}")


def _check_rng_state(rng_state, dropout_p):
    """The backward's rng_state: required when dropout is on, ignored otherwise."""
    if dropout_p == 0:
        return
    torch._check(rng_state is not None,
                 lambda: "flash_ext: the backward with dropout_p > 0 needs rng_state, the forward's third output")
    _check_rng_state_values(rng_state)


def _check_rng_state_values(rng_state):
    torch._check(rng_state.dtype == torch.int64 and rng_state.numel() == 2,
                 lambda: f"flash_ext: rng_state must be int64 [seed, offset] (2 elements), got "
                         f"{_dtype(rng_state.dtype)} of shape {_sizes(rng_state.shape)}")


# ---- Fakes -------------------------------------------------------------------------------------


def _rng_state_like(q):
    return q.new_empty((2,), dtype=torch.int64)


@torch.library.register_fake("flash_ext::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
              alibi_slopes=None, dropout_p=0.0):
    _check_dense(q, k, v)
    _check_options(q, q.shape[0], softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p)
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty(q.shape)
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse, _rng_state_like(q)


@torch.library.register_fake("flash_ext::bwd")
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1,
              softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
    _check_dense(q, k, v)
    _check_softmax_scale(softmax_scale)
    _check_bwd_tensors(dout, q, out, lse, (q.shape[0], q.shape[2], q.shape[1]), "(batch, heads_q, seqlen_q)")
    _check_options(q, q.shape[0], softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p)
    _check_rng_state(rng_state, dropout_p)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("flash_ext::varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                     deterministic=False, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                     dropout_p=0.0):
    batch = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_options(q, batch, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p)
    total_q, heads_q, _ = q.shape
    out = q.new_empty(q.shape)
    lse = q.new_empty((heads_q, total_q), dtype=torch.float32)
    return out, lse, _rng_state_like(q)


@torch.library.register_fake("flash_ext::varlen_paged_fwd")
def _varlen_paged_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k,
                           softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
                           alibi_slopes=None, dropout_p=0.0):
    batch = _check_varlen_paged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table,
                                seqused_k)
    _check_options(q, batch, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p)
    total_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((heads_q, total_q), dtype=torch.float32), _rng_state_like(q)


@torch.library.register_fake("flash_ext::varlen_bwd")
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, deterministic=False, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                     dropout_p=0.0, rng_state=None):
    batch = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_bwd_tensors(dout, q, out, lse, (q.shape[1], q.shape[0]), "(heads_q, total_q)")
    _check_options(q, batch, softmax_scale, window_left, window_right, softcap, alibi_slopes, dropout_p)
    _check_rng_state(rng_state, dropout_p)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("flash_ext::dropout_keep_mask")
def _dropout_keep_mask_fake(rng_state, batch, heads, seqlen_q, seqlen_k, dropout_p):
    torch._check(batch >= 0 and heads >= 0 and seqlen_q >= 0 and seqlen_k >= 0,
                 lambda: f"flash_ext: dropout_keep_mask sizes must be >= 0, got {batch}, {heads}, {seqlen_q}, "
                         f"{seqlen_k}")
    torch._check(0 <= dropout_p < 1, lambda: f"flash_ext: dropout_p must be in [0, 1), got {_number(dropout_p)}")
    _check_rng_state_values(rng_state)
    return rng_state.new_empty((batch, heads, seqlen_q, seqlen_k), dtype=torch.bool)


def _check_int32_per_sequence(t, name, batch, q):
    if t is None:
        return
    torch._check(t.dtype == torch.int32, lambda: f"flash_ext: {name} must be int32, got {_dtype(t.dtype)}")
    torch._check(t.dim() == 1 and t.shape[0] == batch,
                 lambda: f"flash_ext: {name} must have shape (batch,) = ({batch},), got {_sizes(t.shape)}")
    torch._check(t.device == q.device, lambda: f"flash_ext: {name} is on {t.device} but q is on {q.device}")


def _check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table, num_splits):
    """check_kvcache_inputs of csrc/api/ops_kvcache_cpu.cpp."""
    torch._check(q.dim() == 4, lambda: f"flash_ext: q must have 4 dimensions (batch, seqlen_q, heads_q, head_dim), "
                                       f"got {q.dim()} (shape {_sizes(q.shape)})")
    torch._check(k_cache.dim() == 4,
                 lambda: "flash_ext: k_cache must have 4 dimensions (batch_cache, seqlen_cache, heads_kv, head_dim) or "
                         f"(num_blocks, page_size, heads_kv, head_dim), got {k_cache.dim()} (shape "
                         f"{_sizes(k_cache.shape)})")
    torch._check(v_cache.shape == k_cache.shape,
                 lambda: f"flash_ext: k_cache and v_cache must have the same shape, got {_sizes(k_cache.shape)} and "
                         f"{_sizes(v_cache.shape)}")
    is_cuda = q.device.type == "cuda"
    torch._check(q.dtype in (torch.float16, torch.bfloat16) or (q.dtype == torch.float32 and not is_cuda),
                 lambda: f"flash_ext: q has dtype {_dtype(q.dtype)}; expected float16 or bfloat16"
                         + (" on CUDA" if is_cuda else " (or float32 on the CPU)"))
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        torch._check(t.dtype == q.dtype, lambda: f"flash_ext: {name} has dtype {_dtype(t.dtype)} but q has "
                                                 f"{_dtype(q.dtype)}; q and the caches must share one dtype")
        torch._check(t.device == q.device, lambda: f"flash_ext: {name} is on {t.device} but q is on {q.device}")
    batch, _, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    torch._check(k_cache.shape[3] == head_dim,
                 lambda: f"flash_ext: k_cache has head_dim {k_cache.shape[3]} but q has head_dim {head_dim}; q and the "
                         "caches must share head_dim")
    torch._check(1 <= head_dim <= 256,
                 lambda: f"flash_ext: head_dim (last dimension of q) must be in 1..256, got {head_dim}")
    torch._check(heads_kv >= 1, lambda: "flash_ext: k_cache has 0 heads (k_cache.size(2)); heads_kv must be >= 1")
    torch._check(heads_q % heads_kv == 0,
                 lambda: f"flash_ext: heads_q (q.size(2) = {heads_q}) must be a multiple of heads_kv "
                         f"(k_cache.size(2) = {heads_kv})")
    capacity = k_cache.shape[1]
    if block_table is not None:
        _check_block_table(block_table, batch, q, k_cache, "k_cache")
        torch._check(cache_batch_idx is None,
                     lambda: "flash_ext: cache_batch_idx cannot be used with block_table (the block table already "
                             "picks each sequence's pages)")
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        torch._check(cache_batch_idx is not None or k_cache.shape[0] == batch,
                     lambda: f"flash_ext: k_cache has batch {k_cache.shape[0]} but q has batch {batch}; without "
                             "block_table they must match (or pass cache_batch_idx to pick cache rows)")
    torch._check((k is None) == (v is None),
                 lambda: "flash_ext: k and v (the new keys and values) must be given together, got "
                         + ("k without v" if k is not None else "v without k"))
    if k is not None:
        for name, t in (("k", k), ("v", v)):
            torch._check(t.dim() == 4 and t.shape[0] == batch and t.shape[2] == heads_kv and t.shape[3] == head_dim,
                         lambda: f"flash_ext: {name} must have shape (batch, seqlen_new, heads_kv, head_dim) = "
                                 f"({batch}, seqlen_new, {heads_kv}, {head_dim}), got {_sizes(t.shape)}")
            torch._check(t.dtype == q.dtype,
                         lambda: f"flash_ext: {name} has dtype {_dtype(t.dtype)} but q has {_dtype(q.dtype)}")
            torch._check(t.device == q.device, lambda: f"flash_ext: {name} is on {t.device} but q is on {q.device}")
        torch._check(k.shape[1] == v.shape[1], lambda: f"flash_ext: k and v must have the same shape, got "
                                                       f"{_sizes(k.shape)} and {_sizes(v.shape)}")
        torch._check(k.shape[1] <= capacity,
                     lambda: f"flash_ext: the cache is too short: k has seqlen_new = {k.shape[1]} but a sequence of "
                             f"the cache holds at most {capacity} keys")
    _check_int32_per_sequence(cache_seqlens, "cache_seqlens", batch, q)
    _check_int32_per_sequence(cache_batch_idx, "cache_batch_idx", batch, q)
    _check_int32_per_sequence(cache_leftpad, "cache_leftpad", batch, q)
    torch._check((rotary_cos is None) == (rotary_sin is None),
                 lambda: "flash_ext: rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        torch._check(k is not None,
                     lambda: "flash_ext: rotary_cos / rotary_sin need k and v: the rotary embedding is applied to the "
                             "new keys appended to the cache (and to q)")
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            torch._check(t.dim() == 2 and t.shape[1] >= 1 and 2 * t.shape[1] <= head_dim,
                         lambda: f"flash_ext: {name} must have shape (seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim "
                                 f"<= head_dim = {head_dim}, got {_sizes(t.shape)}")
            torch._check(t.dtype == q.dtype,
                         lambda: f"flash_ext: {name} has dtype {_dtype(t.dtype)} but q has {_dtype(q.dtype)}")
            torch._check(t.device == q.device, lambda: f"flash_ext: {name} is on {t.device} but q is on {q.device}")
        torch._check(rotary_sin.shape == rotary_cos.shape,
                     lambda: f"flash_ext: rotary_cos and rotary_sin must have the same shape, got "
                             f"{_sizes(rotary_cos.shape)} and {_sizes(rotary_sin.shape)}")
        torch._check(rotary_cos.shape[0] >= capacity,
                     lambda: f"flash_ext: rotary_cos has {rotary_cos.shape[0]} rows (seqlen_ro) but a sequence of the "
                             f"cache holds up to {capacity} keys; seqlen_ro must be at least that")
    torch._check(num_splits >= 0, lambda: f"flash_ext: num_splits must be 0 (automatic) or >= 1, got {num_splits}")


@torch.library.register_fake("flash_ext::kvcache_fwd")
def _kvcache_fwd_fake(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                      cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                      softmax_scale=1.0, causal=False, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,
                      num_splits=0):
    _check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
                   block_table, num_splits)
    _check_options(q, q.shape[0], softmax_scale, window_left, window_right, softcap, alibi_slopes, 0.0)
    batch, seqlen_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)


# ---- Autograd ----------------------------------------------------------------------------------
# setup_context receives every schema argument, defaults filled in. The forward ops' options
# (everything after q, k, v and, for varlen, the sequence layout) go to the backward ops unchanged;
# rng_state lets the backward regenerate the forward's dropout mask. lse and rng_state are outputs
# for inspection (lse e.g. to merge partial attentions); no gradient flows through them, as in
# flash-attn.


def _setup_context(ctx, inputs, output):
    q, k, v, *options = inputs
    *plain_options, alibi_slopes, dropout_p = options
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, alibi_slopes)
    ctx.options = plain_options  # softmax_scale, causal, deterministic, window_left, window_right, softcap
    ctx.dropout_p = dropout_p
    ctx.num_inputs = len(inputs)
    ctx.mark_non_differentiable(lse, rng_state)
    _skip_zero_grads(ctx)


def _skip_zero_grads(ctx):
    # Without this, autograd fills a zero tensor for the gradients of lse and rng_state (which the
    # backward ignores) on every backward: two fill kernels and ~80 us of host time per call (H200 host,
    # 1 x 128 x 16 x 128, torch.profiler), where the whole backward took ~170 us.
    ctx.set_materialize_grads(False)


def _no_grads(ctx):
    return (None,) * ctx.num_inputs


def _backward(ctx, dout, _dlse, _drng_state):
    if dout is None:  # only lse or rng_state were used: no gradient reaches q, k or v
        return _no_grads(ctx)
    q, k, v, out, lse, rng_state, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = torch.ops.flash_ext.bwd(dout, q, k, v, out, lse, *ctx.options, alibi_slopes, ctx.dropout_p, rng_state)
    return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)


def _varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options = inputs
    *plain_options, alibi_slopes, dropout_p = options
    out, lse, rng_state = output
    ctx.save_for_backward(q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.max_seqlens = (max_seqlen_q, max_seqlen_k)
    ctx.options = plain_options
    ctx.dropout_p = dropout_p
    ctx.num_inputs = len(inputs)
    ctx.mark_non_differentiable(lse, rng_state)
    _skip_zero_grads(ctx)


def _varlen_backward(ctx, dout, _dlse, _drng_state):
    if dout is None:
        return _no_grads(ctx)
    q, k, v, out, lse, rng_state, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = torch.ops.flash_ext.varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.max_seqlens,
                                                *ctx.options, alibi_slopes, ctx.dropout_p, rng_state)
    return (dq, dk, dv) + (None,) * (ctx.num_inputs - 3)


torch.library.register_autograd("flash_ext::fwd", _backward, setup_context=_setup_context)
torch.library.register_autograd("flash_ext::varlen_fwd", _varlen_backward, setup_context=_varlen_setup_context)

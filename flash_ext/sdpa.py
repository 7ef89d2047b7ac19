"""flash_ext.scaled_dot_product_attention: torch.nn.functional.scaled_dot_product_attention's interface
and semantics on flash_ext's kernels.

SDPA's layout is (batch..., heads, seqlen, head_dim); flash_ext's is (batch, seqlen, heads, head_dim). The
one is a transposed view of the other, so inputs made as (b, s, h, d).transpose(1, 2) reach the kernels
without a copy, and the output is returned as such a view.

Masks are not materialised by the kernels: a boolean or additive attn_mask is read (on the host) and
described as one band per batch row, key range [start, end) and a sliding window (left, right) along the
bottom-right diagonal of that range, which the dense kernels (one range for all batch rows) or the varlen
kernels (a range per batch row, the keys and queries left out made sequences without queries or keys) run.
How a mask is read is _mask_rows; what it becomes is _plan; how a band runs is _run_band.
"""
from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .interface import (_as_bool, _as_real, _check_tensor, _describe, attention, attention_varlen,
                        attention_with_kvcache)

__all__ = ["scaled_dot_product_attention"]

_NAME = "flash_ext.scaled_dot_product_attention"


# ---- Shapes: SDPA's (batch..., heads, seqlen, head_dim) to flash_ext's (batch, seqlen, heads, head_dim) --


class _Layout(NamedTuple):
    q: Tensor                 # (batch, seqlen_q, heads_q, head_dim), a view of query where strides allow
    k: Tensor                 # (batch, seqlen_k, heads_kv, head_dim)
    v: Tensor
    batch_shape: Tuple[int, ...]   # the broadcast batch dims, flattened into q's first dim
    heads: int                # heads_q of the output
    out_shape: Tuple[int, ...]     # the shape of SDPA's result


def _check_dtypes_and_devices(query: Tensor, key: Tensor, value: Tensor) -> None:
    for name, t in (("key", key), ("value", value)):
        if t.dtype != query.dtype:
            raise ValueError(f"{_NAME}: query, key and value must have one dtype, got query {query.dtype} and "
                             f"{name} {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{_NAME}: query, key and value must be on one device, got query on {query.device} "
                             f"and {name} on {t.device}")
    on_cuda = query.device.type == "cuda"
    allowed = (torch.float16, torch.bfloat16) if on_cuda else (torch.float16, torch.bfloat16, torch.float32)
    if query.dtype not in allowed:
        hint = (" (flash_ext's CUDA kernels are 16-bit: cast to float16 / bfloat16, or use "
                "torch.nn.functional.scaled_dot_product_attention)" if on_cuda and query.dtype == torch.float32
                else "")
        expected = "float16 or bfloat16" + ("" if on_cuda else " (or float32 on the CPU)")
        raise ValueError(f"{_NAME}: query has dtype {query.dtype} on {query.device.type}; expected {expected}{hint}")


def _layout(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> _Layout:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() < 2:
            raise ValueError(f"{_NAME}: {name} must have at least 2 dimensions (..., seqlen, head_dim), got shape "
                             f"{tuple(t.shape)}")
    head_dim = query.shape[-1]
    if key.shape[-1] != head_dim:
        raise ValueError(f"{_NAME}: key's last dimension ({key.shape[-1]}) must equal query's ({head_dim})")
    if value.shape[-1] != head_dim:
        raise ValueError(f"{_NAME}: value's last dimension ({value.shape[-1]}) must equal query's ({head_dim}): "
                         "flash_ext's kernels take one head_dim for q, k and v (SDPA allows a different one for v)")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"{_NAME}: key and value must have the same sequence length (dimension -2), got "
                         f"{key.shape[-2]} and {value.shape[-2]}")
    # Dimensions align from the right, as in SDPA's broadcasting; missing leading ones are 1. Dimension -3 is
    # the heads (also for 3-D inputs, as SDPA's enable_gqa takes it), the ones before it the batch.
    rank = max(3, query.dim(), key.dim(), value.dim())
    q, k, v = (t[(None,) * (rank - t.dim())] for t in (query, key, value))
    try:
        batch_shape = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    except RuntimeError:
        raise ValueError(f"{_NAME}: the batch dimensions (before dimension -3) of query {tuple(query.shape)}, key "
                         f"{tuple(key.shape)} and value {tuple(value.shape)} do not broadcast") from None
    heads_q, heads_k, heads_v = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa:
        if heads_k != heads_v:
            raise ValueError(f"{_NAME}: with enable_gqa, key and value must have the same number of heads "
                             f"(dimension -3) for flash_ext, got {heads_k} and {heads_v}")
        if heads_k == 0 or heads_q % heads_k:
            raise ValueError(f"{_NAME}: with enable_gqa, query's heads ({heads_q}, dimension -3) must be a multiple "
                             f"of key's and value's ({heads_k})")
        heads, heads_kv = heads_q, heads_k
    else:
        try:
            heads = torch.broadcast_shapes((heads_q,), (heads_k,), (heads_v,))[0]
        except RuntimeError:
            raise ValueError(f"{_NAME}: query, key and value have {heads_q}, {heads_k} and {heads_v} heads "
                             "(dimension -3); without enable_gqa they must be equal or 1 (broadcast), as in SDPA; "
                             "pass enable_gqa=True for grouped-query attention") from None
        # key and value with one head serve every query head (MQA) without being expanded.
        heads_kv = heads_k if heads_k == heads_v else heads
    batch = math.prod(batch_shape)

    def flash_view(t: Tensor, t_heads: int) -> Tensor:
        t = t.expand(*batch_shape, t_heads, *t.shape[-2:])
        return t.reshape(batch, t_heads, *t.shape[-2:]).transpose(1, 2)

    # SDPA's result has the broadcast leading dims of its inputs (none for 2-D inputs).
    lead_shape = batch_shape + (heads,) if max(query.dim(), key.dim(), value.dim()) > 2 else ()
    out_shape = lead_shape + (query.shape[-2], head_dim)
    return _Layout(flash_view(q, heads), flash_view(k, heads_kv), flash_view(v, heads_kv), batch_shape, heads,
                   out_shape)


# ---- Masks ---------------------------------------------------------------------------------------

_SUPPORTED_MASKS = (
    "supported attn_mask forms: boolean (True = attend) or additive float (0 = attend, -inf or "
    "torch.finfo(attn_mask.dtype).min = masked), the same for every head, where each query row attends to one "
    "contiguous range of keys and the ranges follow one band: a key-padding mask (left or right padding), a "
    "causal mask (top-left or bottom-right), a sliding window, or causal combined with left padding; causal "
    "with right padding also works (the rows past a sequence's end become a second call). Other masks "
    "(arbitrary patterns, additive biases, per-head masks, block-diagonal masks of packed documents) are not "
    "supported: use torch.nn.functional.scaled_dot_product_attention, or flash_ext.attention_varlen for packed "
    "documents")

# Why a row of the mask is not supported (_mask_rows).
_ROW_OK, _ROW_BAD_VALUE, _ROW_NOT_A_RANGE, _ROW_FINITE_ONLY = 0, 1, 2, 3


class _Rows(NamedTuple):
    """Each query row's visible keys, on the host: (batch, seqlen_q) int64 tensors; a row whose count is 0
    sees no key, otherwise it sees keys [start, end) (count = end - start)."""
    start: Tensor
    end: Tensor
    count: Tensor


def _check_mask(attn_mask: Tensor, layout: _Layout) -> None:
    """What can be checked without reading the mask's values."""
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(f"{_NAME}: attn_mask must be a bool or floating-point tensor, got dtype {attn_mask.dtype}")
    if attn_mask.device != layout.q.device:
        raise ValueError(f"{_NAME}: attn_mask is on {attn_mask.device} but query is on {layout.q.device}")
    if attn_mask.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{_NAME}: attn_mask requires grad, but flash_ext computes no gradient for attn_mask (an "
                         "additive bias); pass attn_mask.detach() or a boolean mask")
    full_shape = layout.batch_shape + (layout.heads, layout.q.shape[1], layout.k.shape[1])
    try:
        broadcast = tuple(torch.broadcast_shapes(attn_mask.shape, full_shape))
    except RuntimeError:
        broadcast = None
    if broadcast != full_shape:
        raise ValueError(f"{_NAME}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the "
                         f"attention's shape (batch..., heads, seqlen_q, seqlen_k) = {full_shape}")


def _mask_rows(attn_mask: Tensor, layout: _Layout) -> _Rows:
    """Reads the mask (a device-to-host copy on CUDA) into per-row key ranges; raises where the mask is not a
    range per row, or differs between heads, or holds unsupported values."""
    batch_shape, heads = layout.batch_shape, layout.heads
    batch, seqlen_q, seqlen_k = layout.q.shape[0], layout.q.shape[1], layout.k.shape[1]
    full_shape = batch_shape + (heads, seqlen_q, seqlen_k)
    mask = attn_mask[(None,) * (len(full_shape) - attn_mask.dim())]
    if mask.shape[-3] > 1:
        if not torch.equal(mask, mask[..., :1, :, :].expand(mask.shape)):
            raise ValueError(f"{_NAME}: attn_mask differs between heads (dimension -3); flash_ext takes one mask for "
                             f"all heads. {_SUPPORTED_MASKS}")
    mask = mask[..., 0, :, :]
    # Rows and batch entries the mask broadcasts over are read once.
    mask_rows = mask.shape[-2]
    mask = mask.expand(*mask.shape[:-1], seqlen_k)
    if all(size == 1 for size in mask.shape[:-2]):
        mask = mask.reshape(1, mask_rows, seqlen_k)
    else:
        mask = mask.expand(*batch_shape, mask_rows, seqlen_k).reshape(batch, mask_rows, seqlen_k)

    if mask.dtype == torch.bool:
        visible = mask
        reason = torch.zeros(mask.shape[:-1], dtype=torch.int64, device=mask.device)
    else:
        visible = mask == 0
        finite_masked = mask == torch.finfo(mask.dtype).min
        bad_value = ~(visible | finite_masked | torch.isneginf(mask))
        # A row masked only by finite values is SDPA's softmax of those values (an average of the values),
        # not the zeros flash_ext gives a row that sees no key.
        finite_only = ~visible.any(-1) & finite_masked.any(-1)
        reason = torch.where(bad_value.any(-1), _ROW_BAD_VALUE, torch.where(finite_only, _ROW_FINITE_ONLY, _ROW_OK))
    as_bytes = visible.view(torch.uint8)  # argmax takes no bool; the same bytes, no copy
    start = as_bytes.argmax(-1)  # the first visible key (the first maximum)
    end = seqlen_k - as_bytes.flip(-1).argmax(-1)
    count = as_bytes.sum(-1, dtype=torch.int64)
    is_range = (count == 0) | (end - start == count)
    reason = torch.where((reason == _ROW_OK) & ~is_range, _ROW_NOT_A_RANGE, reason)
    # One device-to-host copy (a sync on CUDA): the kernels' arguments depend on these values.
    rows = torch.stack([start, end, count, reason]).cpu()
    start, end, count, reason = rows.expand(4, batch, seqlen_q)
    bad = (reason != _ROW_OK).nonzero()
    if bad.numel():
        b, i = (int(x) for x in bad[0])
        what = {_ROW_BAD_VALUE: "holds values other than 0, -inf and torch.finfo(attn_mask.dtype).min (an additive "
                                "bias)",
                _ROW_NOT_A_RANGE: "is not one contiguous range of keys",
                _ROW_FINITE_ONLY: "masks every key by the finite value torch.finfo(attn_mask.dtype).min, where SDPA "
                                  "averages over all keys and flash_ext returns 0 (use -inf or a boolean mask)"}
        raise ValueError(f"{_NAME}: attn_mask's row for batch {b}, query {i} {what[int(reason[b, i])]}. "
                         f"{_SUPPORTED_MASKS}")
    return _Rows(start, end, count)


class _Band(NamedTuple):
    """Per batch row b, the queries [row_start[b], row_end[b]) attend to the keys [key_start[b], key_end[b])
    through the window (left, right) (-1 = unbounded) along their bottom-right diagonal, flash_ext's
    convention: query i (counted from row_start) sees key j (counted from key_start) when
    i + n_k - n_q - left <= j <= i + n_k - n_q + right."""
    row_start: Tensor
    row_end: Tensor
    key_start: Tensor
    key_end: Tensor
    left: int
    right: int


def _fit_band(rows: _Rows, row_start: Tensor, row_end: Tensor) -> Optional[_Band]:
    """The band whose key ranges are exactly those of rows for the query rows [row_start, row_end) of each batch
    row, or None. Its key range is the union of the rows' ranges; the window sides are read off the rows the
    range's ends do not bound (they must agree), and the result is checked against every row."""
    batch, seqlen_q = rows.count.shape
    i = torch.arange(seqlen_q)[None, :]
    used = (i >= row_start[:, None]) & (i < row_end[:, None])
    seen = used & (rows.count > 0)
    has_keys = seen.any(1)
    # A batch row whose rows see no key gets the empty range [0, 0).
    key_end = torch.where(seen, rows.end, 0).amax(1)
    key_start = torch.where(has_keys, torch.where(seen, rows.start, key_end[:, None]).amin(1), 0)
    n_q = (row_end - row_start)[:, None]
    diagonal = (i - row_start[:, None]) + key_end[:, None] - n_q  # key index of each row's diagonal

    def candidates(values: Tensor, fallback: Tensor) -> List[int]:
        if values.numel():
            first = int(values[0])
            return [first] if first >= 0 and bool((values == first).all()) else []
        # No row pins this side: unbounded, or the tightest bound that still covers every row (it may empty
        # the rows before the band, as causal does).
        tightest = int(fallback.amax()) if fallback.numel() else 0
        return [-1, max(tightest, 0)]

    rights = candidates((rows.end - 1 - diagonal)[seen & (rows.end < key_end[:, None])],
                        (key_end[:, None] - 1 - diagonal)[seen])
    lefts = candidates((diagonal - rows.start)[seen & (rows.start > key_start[:, None])],
                       (diagonal - key_start[:, None])[seen])
    for right in rights:
        for left in lefts:
            start = key_start[:, None] if left < 0 else torch.maximum(key_start[:, None], diagonal - left)
            end = key_end[:, None] if right < 0 else torch.minimum(key_end[:, None], diagonal + right + 1)
            empty = end <= start
            match = torch.where(rows.count > 0, ~empty & (rows.start == start) & (rows.end == end), empty)
            if bool(match[used].all()):
                return _Band(row_start, row_end, key_start, key_end, left, right)
    return None


def _plan(rows: _Rows) -> Optional[List[_Band]]:
    """One band over all rows; else a band over the first rows of each batch row plus a band of the last rows
    that see the same keys as the last row (causal with right padding: the padded queries see every key of
    their sequence); else None."""
    batch, seqlen_q = rows.count.shape
    zeros, full = torch.zeros(batch, dtype=torch.int64), torch.full((batch,), seqlen_q, dtype=torch.int64)
    band = _fit_band(rows, zeros, full)
    if band is not None:
        return [band]
    last = [t[:, -1:] for t in rows]
    same = (rows.count == last[2]) & ((rows.count == 0) | ((rows.start == last[0]) & (rows.end == last[1])))
    split = seqlen_q - same.flip(1).to(torch.int64).cumprod(1).sum(1)
    head = _fit_band(rows, zeros, split)
    tail = _fit_band(rows, split, full)
    if head is None or tail is None:
        return None
    # Last rows that see no key need no call: outside its rows a band's output is 0.
    return [head] if bool((tail.key_end == tail.key_start).all()) else [head, tail]


# ---- Running a band ------------------------------------------------------------------------------


def _dense_band(band: _Band, seqlen_q: int) -> Optional[Tuple[int, int]]:
    """(key_start, key_end) when the band is the same for every batch row and covers every query row (so the
    dense kernels run it on a slice of the keys), else None."""
    key_start, key_end = band.key_start, band.key_end
    if not (bool((band.row_start == 0).all()) and bool((band.row_end == seqlen_q).all())):
        return None
    if key_start.numel() and not (bool((key_start == key_start[0]).all()) and bool((key_end == key_end[0]).all())):
        return None
    return (int(key_start[0]), int(key_end[0])) if key_start.numel() else (0, 0)


def _window_options(band: _Band) -> dict:
    causal = band.right == 0
    return dict(causal=causal, window_size=(band.left, -1 if causal else band.right))


def _run_band(layout: _Layout, band: _Band, scale: Optional[float], dropout_p: float) -> Tensor:
    """flash_ext's output (batch, seqlen_q, heads, head_dim) of the band; rows outside it are 0."""
    q, k, v = layout.q, layout.k, layout.v
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    options = dict(_window_options(band), softmax_scale=scale, dropout_p=dropout_p)
    keys = _dense_band(band, seqlen_q)
    if keys is not None:
        start, end = keys
        if (start, end) != (0, seqlen_k):
            k, v = k[:, start:end], v[:, start:end]
        return attention(q, k, v, **options)
    row_start, row_end, key_start, key_end = band.row_start, band.row_end, band.key_start, band.key_end
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if not needs_grad and dropout_p == 0 and bool((row_start == 0).all()) and bool((row_end == seqlen_q).all()):
        # Inference (forward only, no dropout): the KV-cache op reads each batch row's keys
        # [key_start, key_end) where they are, with the same bottom-right band (no copy of the keys; on CUDA
        # the decode kernel, for head dims 64 / 128 / 256 and up to 128 query rows per kv head).
        return attention_with_kvcache(q, k, v, cache_seqlens=key_end.to(device=q.device, dtype=torch.int32),
                                      cache_leftpad=key_start.to(device=q.device, dtype=torch.int32),
                                      causal=options["causal"], window_size=options["window_size"],
                                      softmax_scale=scale)
    # Varlen over the flattened batch: per batch row, the keys before its range (a sequence with no query),
    # the queries before its rows (no key), the band itself, the queries after its rows (no key); then the
    # keys after the last range. Empty sequences are dropped.
    previous_key_end = torch.cat([torch.zeros(1, dtype=torch.int64), key_end[:-1] - seqlen_k])
    zero = torch.zeros(batch, dtype=torch.int64)
    queries = torch.stack([zero, row_start, row_end - row_start, seqlen_q - row_end], 1).flatten()
    keys = torch.stack([key_start - previous_key_end, zero, key_end - key_start, zero], 1).flatten()
    tail = seqlen_k - key_end[-1:] if batch else zero[:0]
    queries = torch.cat([queries, torch.zeros_like(tail)])
    keys = torch.cat([keys, tail])
    kept = (queries > 0) | (keys > 0)
    queries, keys = queries[kept], keys[kept]
    cu_q = torch.cat([zero[:1], queries.cumsum(0)]).to(device=q.device, dtype=torch.int32)
    cu_k = torch.cat([zero[:1], keys.cumsum(0)]).to(device=q.device, dtype=torch.int32)
    max_q = int(queries.max()) if queries.numel() else 0
    max_k = int(keys.max()) if keys.numel() else 0
    heads_q, heads_kv, head_dim = q.shape[2], k.shape[2], q.shape[3]
    out = attention_varlen(q.reshape(batch * seqlen_q, heads_q, head_dim),
                           k.reshape(batch * seqlen_k, heads_kv, head_dim),
                           v.reshape(batch * seqlen_k, heads_kv, head_dim), cu_q, cu_k, max_q, max_k, **options)
    return out.view(batch, seqlen_q, heads_q, head_dim)


def _top_left_causal(layout: _Layout, scale: Optional[float], dropout_p: float) -> Tensor:
    """SDPA's is_causal, query i sees keys j <= i, in flash_ext's bottom-right convention (query i sees keys
    j <= i + seqlen_k - seqlen_q + right). With seqlen_q <= seqlen_k no query sees a key past seqlen_q - 1: on
    those first keys the two conventions agree. With seqlen_q > seqlen_k the window's right side
    seqlen_q - seqlen_k moves the diagonal up to the top-left corner (rows i >= seqlen_k see every key)."""
    q, k, v = layout.q, layout.k, layout.v
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    if seqlen_q <= seqlen_k:
        return attention(q, k[:, :seqlen_q], v[:, :seqlen_q], causal=True, softmax_scale=scale, dropout_p=dropout_p)
    return attention(q, k, v, window_size=(-1, seqlen_q - seqlen_k), softmax_scale=scale, dropout_p=dropout_p)


# ---- The entry point -----------------------------------------------------------------------------


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t)
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        raise TypeError(f"{_NAME}: attn_mask must be None or a torch.Tensor, got {_describe(attn_mask)}")
    is_causal = _as_bool("is_causal", is_causal)
    enable_gqa = _as_bool("enable_gqa", enable_gqa)
    dropout_p = _as_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{_NAME}: dropout_p must be in [0, 1), got {dropout_p} (SDPA's dropout_p = 1, an all-zero "
                         "result, is not supported)")
    if scale is not None:
        scale = _as_real("scale", scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{_NAME}: scale must be None (1/sqrt(head_dim)) or a finite positive number, got "
                             f"{scale} (flash_ext's kernels take no zero or negative scale)")
    if attn_mask is not None and is_causal:
        raise ValueError(f"{_NAME}: pass either attn_mask or is_causal=True, not both (as SDPA)")
    _check_dtypes_and_devices(query, key, value)
    layout = _layout(query, key, value, enable_gqa)
    if attn_mask is not None:
        _check_mask(attn_mask, layout)

    if is_causal:
        out = _top_left_causal(layout, scale, dropout_p)
    elif attn_mask is None or layout.q.numel() == 0 or layout.k.numel() == 0:
        # Without a mask, or with nothing to mask (no query, or no key: every row's result is 0).
        out = attention(layout.q, layout.k, layout.v, softmax_scale=scale, dropout_p=dropout_p)
    else:
        bands = _plan(_mask_rows(attn_mask, layout))
        if bands is None:
            raise ValueError(f"{_NAME}: every row of attn_mask is one range of keys, but the ranges follow no band "
                             f"that flash_ext's kernels run. {_SUPPORTED_MASKS}")
        out = _run_band(layout, bands[0], scale, dropout_p)
        for band in bands[1:]:
            # A band's output is 0 outside its rows (they are sequences without keys there), so the sum is exact.
            out = out + _run_band(layout, band, scale, dropout_p)
    return out.transpose(1, 2).reshape(layout.out_shape)


scaled_dot_product_attention.__doc__ = """torch.nn.functional.scaled_dot_product_attention on flash_ext's kernels:
    the same arguments, layout and results, softmax(query·keyᵀ·scale + mask)·value, with autograd.

    Args:
        query: (..., heads_q, seqlen_q, head_dim); key, value: (..., heads_kv, seqlen_k, head_dim). As in SDPA,
            dimension -3 is the heads (also for 3-D inputs), the dimensions before it the batch, and leading
            dimensions broadcast between query, key and value (2-D inputs are one head of one sequence).
            value's head_dim must equal query's (SDPA allows another one). dtypes: float16 or bfloat16, and
            float32 on the CPU (flash_ext's CUDA kernels are 16-bit); one dtype and device for all three.
        attn_mask: None, or a mask broadcastable to (batch..., heads_q, seqlen_q, seqlen_k): bool (True =
            attend) or floating point, added to the scores, whose values must be 0 (attend), -inf or
            torch.finfo(attn_mask.dtype).min (masked). flash_ext's kernels take no mask matrix, so the mask's
            values are read (on CUDA a device-to-host copy, a sync: not CUDA-graph capturable, a graph break
            under torch.compile) and must be one of these forms, the same for every head:
              - each query row attends to one contiguous range of keys, and the ranges follow one band:
                key-padding masks (batch, 1, 1, seqlen_k) or (batch, 1, seqlen_q, seqlen_k), left or right
                padded; causal masks, top-left (SDPA's is_causal) or bottom-right (a KV cache), also as
                nn.Transformer's additive (seqlen, seqlen) mask; sliding windows; causal with left padding
                (transformers' generation masks, also with a static cache);
              - causal with right padding (transformers' training masks): the rows past a sequence's end,
                which see all of its keys, run as a second call whose output is added.
            A mask whose rows all see the same keys runs the dense kernels on those keys. Otherwise, in
            inference (grad mode off or no input requiring grad) without dropout, a key range per batch row
            shared by all its rows (padding; causal with left padding) runs flash_ext.attention_with_kvcache
            with cache_leftpad / cache_seqlens = the range (on CUDA its decode kernel reads key and value in
            place: head dims 64 / 128 / 256, up to 128 query rows per kv head; else it gathers the keys in the
            ranges); every other
            case runs the varlen kernels over the flattened batch, the masked-out keys and rows becoming
            sequences without queries or keys (query, key and value are reshaped to (batch * seqlen, heads,
            head_dim): a copy unless their strides allow a view). Other masks (arbitrary patterns, additive
            biases, per-head masks, block-diagonal masks of packed documents) raise a ValueError that lists
            these forms (use flash_ext.attention_varlen for packed documents). A row that sees no key returns
            0 with zero gradients, as SDPA's math backend (torch >= 2.5); a row masked only by finfo.min (where
            SDPA returns an average over all keys) is an error. attn_mask gets no gradient (one that requires grad is
            rejected).
        dropout_p: in [0, 1): drops attention probabilities with flash_ext's dropout (Philox, seeded from
            torch's generator of the device, so torch.manual_seed reproduces it). Applied whenever > 0, as in
            SDPA (pass `p if self.training else 0.0`). The elements dropped differ from torch's, the
            distribution is the same. SDPA's dropout_p = 1 (all zeros) is rejected.
        is_causal: SDPA's top-left causal mask, query i sees keys j <= i (flash_ext.attention's causal is
            bottom-right aligned; this maps it). With seqlen_q > seqlen_k the rows i >= seqlen_k - 1 see every
            key; no row is empty unless seqlen_k = 0 (then every row is 0, as in SDPA). Not with attn_mask (as SDPA).
        scale: multiplies query·keyᵀ; None is 1/sqrt(head_dim). Must be finite and > 0 (SDPA also takes zero
            or negative scales).
        enable_gqa: as SDPA: heads_q a multiple of heads_kv, query head h uses key/value head
            h // (heads_q // heads_kv) (key and value are not repeated in memory); key and value must then have
            the same number of heads. Without it, heads_q, heads_kv must be equal or 1 (broadcast; key and value
            with one head run as MQA, without being expanded).

    Returns:
        SDPA's result, (..., heads_q, seqlen_q, head_dim), in query's dtype. It is the transpose(-3, -2) view of
        a contiguous (..., seqlen_q, heads_q, head_dim) tensor, as torch's flash backend returns it (so
        out.transpose(1, 2).reshape(batch, seqlen_q, -1) is free).

    Inputs are used in place where their last dimension is contiguous: query made as
    x.view(batch, seqlen, heads, head_dim).transpose(1, 2) (the usual projection layout) and SDPA's
    contiguous (batch, heads, seqlen, head_dim) layout alike reach the kernels without a copy (on the dense
    paths: no mask, is_causal, or a mask the same for every batch row). Differences from SDPA that remain
    are errors, never a silent change: float64 inputs, float32 on CUDA, value's head_dim != query's, head
    dims outside 1..256, key and value with different head counts under enable_gqa, scale <= 0,
    dropout_p = 1, a mask outside the forms above, an attn_mask that requires grad.
    """

"""Plain-PyTorch attention with flash_ext's exact semantics, for tests and for debugging.

It materialises the (seqlen_q, seqlen_k) score matrix, so use it on small problems only.
Every feature uses the coordinates of csrc/params.h: query row i, key column j and the diagonal
j = i + seqlen_k - seqlen_q (bottom-right aligned).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor

_Device = Union[torch.device, str, int, None]


def causal_mask(seqlen_q: int, seqlen_k: int, device: _Device = None) -> Tensor:
    """Boolean (seqlen_q, seqlen_k) mask, True where query i may see key j (bottom-right aligned)."""
    return window_mask(seqlen_q, seqlen_k, (-1, 0), device=device)


def window_mask(seqlen_q: int, seqlen_k: int, window_size: Tuple[int, int] = (-1, -1), causal: bool = False,
                device: _Device = None) -> Tensor:
    """Boolean (seqlen_q, seqlen_k) mask, True where query i sees key j:
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right, a side being unbounded
    when it is -1; causal=True clamps right to 0."""
    left, right = window_size
    if causal:
        right = 0
    rows = torch.arange(seqlen_q, device=device)[:, None]
    cols = torch.arange(seqlen_k, device=device)[None, :]
    diagonal = rows + (seqlen_k - seqlen_q)
    mask = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= cols >= diagonal - left
    if right >= 0:
        mask &= cols <= diagonal + right
    return mask


def alibi_bias(alibi_slopes: Tensor, seqlen_q: int, seqlen_k: int) -> Tensor:
    """-slope·|i + seqlen_k - seqlen_q - j| as (batch or 1, heads, seqlen_q, seqlen_k), in the slopes' dtype."""
    slopes = alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes[None]
    rows = torch.arange(seqlen_q, device=slopes.device)[:, None]
    cols = torch.arange(seqlen_k, device=slopes.device)[None, :]
    distance = (rows + (seqlen_k - seqlen_q) - cols).abs().to(slopes.dtype)
    return -slopes[:, :, None, None] * distance


def attention_ref(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, softmax_scale: Optional[float] = None,
                  window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                  dropout_p: float = 0.0, dropout_mask: Optional[Tensor] = None,
                  upcast: bool = True) -> Tuple[Tensor, Tensor]:
    """Returns (out, lse) like flash_ext.attention(..., return_lse=True).

    Scores: s = softmax_scale·q·k, then softcap·tanh(s / softcap) when softcap > 0, then the ALiBi
    bias, then the causal / window mask. lse is of these scores. Dropout needs the keep mask
    (bool (batch, heads_q, seqlen_q, seqlen_k), True = kept; flash_ext.testing.dropout_keep_mask gives
    the one a flash_ext call used): kept probabilities are scaled by 1 / (1 - dropout_p). A row that
    sees no key has out 0 and lse -inf; a NaN in the inputs propagates into out and lse (and through
    autograd into the gradients), except from keys the mask hides.

    upcast=True computes in float64 (the reference the kernels are measured against);
    upcast=False computes in the inputs' dtype, the error budget the tolerance rule scales.
    out has q's dtype when upcast=False, float64 when upcast=True.
    """
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    if dropout_p > 0 and dropout_mask is None:
        raise ValueError("attention_ref: dropout_p > 0 needs dropout_mask (the reference draws no random numbers)")
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    group = heads_q // heads_kv
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)

    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(scores.dtype), seqlen_q, seqlen_k)
    if causal or tuple(window_size) != (-1, -1):
        visible = window_mask(seqlen_q, seqlen_k, window_size, causal, q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores.float() if not upcast else scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    # Rows that see no key (every score -inf): softmax gives NaN; flash_ext defines their output as 0.
    # A NaN that comes from the inputs stays NaN.
    sees_no_key = torch.isneginf(scores).all(dim=-1, keepdim=True)
    probs = probs.masked_fill(sees_no_key, 0.0)
    if dropout_mask is not None:
        probs = probs.masked_fill(~dropout_mask.to(probs.device), 0.0) / (1 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse.float() if not upcast else lse


def gather_varlen_keys(k: Tensor, v: Tensor, cu_seqlens_k: Tensor, *, block_table: Optional[Tensor] = None,
                       seqused_k: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The keys and values each sequence of flash_ext.attention_varlen(..., block_table=, seqused_k=) uses,
    packed: (k_packed, v_packed, cu_seqlens_k_packed), for attention_varlen_ref.

    Sequence b has n_b = seqused_k[b] keys when seqused_k is given, else cu_seqlens_k[b + 1] - cu_seqlens_k[b].
    With block_table, k and v are page pools (num_blocks, page_size, heads_kv, head_dim) and its key j is slot
    j % page_size of page block_table[b, j // page_size]; without, it is row cu_seqlens_k[b] + j of k and v."""
    cu = [int(c) for c in cu_seqlens_k.tolist()]
    batch = len(cu) - 1
    lengths = [cu[b + 1] - cu[b] for b in range(batch)] if seqused_k is None else [int(n) for n in seqused_k.tolist()]
    k_runs, v_runs = [], []
    for b, n in enumerate(lengths):
        positions = torch.arange(n)
        if block_table is None:
            rows = (cu[b] + positions,)
        else:
            page_size = k.shape[1]
            rows = (block_table[b].long().cpu()[positions // page_size], positions % page_size)
        k_runs.append(k[tuple(r.to(k.device) for r in rows)])
        v_runs.append(v[tuple(r.to(v.device) for r in rows)])
    packed_cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    if not k_runs:
        return k.new_zeros((0, *k.shape[-2:])), v.new_zeros((0, *v.shape[-2:])), packed_cu
    return torch.cat(k_runs), torch.cat(v_runs), packed_cu


def attention_varlen_ref(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, *,
                         alibi_slopes: Optional[Tensor] = None, dropout_mask: Optional[Tensor] = None,
                         block_table: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
                         **kwargs: Any) -> Tuple[Tensor, Tensor]:
    """Returns (out, lse) like flash_ext.attention_varlen(..., return_lse=True): attention_ref on each
    sequence, out (total_q, heads_q, head_dim), lse (heads_q, total_q). dropout_mask is
    (batch, heads_q, max_seqlen_q, max_seqlen_k), sequence b using its top-left corner; a
    (batch, heads_q) alibi_slopes gives row b to sequence b. block_table / seqused_k select each sequence's
    keys as attention_varlen does (gather_varlen_keys). Other keyword arguments are attention_ref's.
    Differentiable with respect to q, k and v."""
    if block_table is not None or seqused_k is not None:
        k, v, cu_seqlens_k = gather_varlen_keys(k, v, cu_seqlens_k, block_table=block_table, seqused_k=seqused_k)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        q_b = q[cu_q[b]:cu_q[b + 1]][None]
        k_b = k[cu_k[b]:cu_k[b + 1]][None]
        v_b = v[cu_k[b]:cu_k[b + 1]][None]
        slopes_b = None
        if alibi_slopes is not None:
            slopes_b = alibi_slopes[b:b + 1] if alibi_slopes.dim() == 2 else alibi_slopes
        mask_b = None
        if dropout_mask is not None:
            mask_b = dropout_mask[b:b + 1, :, :q_b.shape[1], :k_b.shape[1]]
        out_b, lse_b = attention_ref(q_b, k_b, v_b, alibi_slopes=slopes_b, dropout_mask=mask_b, **kwargs)
        outs.append(out_b[0])
        lses.append(lse_b[0])
    if not outs:  # batch 0: no sequence, so no rows either
        upcast = kwargs.get("upcast", True)
        return (q.new_zeros(q.shape, dtype=torch.float64 if upcast else q.dtype),
                q.new_zeros((q.shape[1], 0), dtype=torch.float64 if upcast else torch.float32))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def apply_rotary_ref(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding of x (batch, seqlen, heads, head_dim) at positions (batch, seqlen), in x's dtype:
    cos / sin (seqlen_ro, rotary_dim / 2) rotate the first rotary_dim channels, as pairs (2i, 2i + 1) when
    interleaved (GPT-J) or (i, i + rotary_dim / 2) otherwise (GPT-NeoX); the other channels are unchanged."""
    half = cos.shape[1]
    c = cos.to(x.dtype)[positions][:, :, None, :]
    s = sin.to(x.dtype)[positions][:, :, None, :]
    if interleaved:
        x0, x1 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        rotated = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = x[..., :half], x[..., half:2 * half]
        rotated = torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return torch.cat((rotated, x[..., 2 * half:]), dim=-1)


def attention_with_kvcache_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                               v: Optional[Tensor] = None, *, rotary_cos: Optional[Tensor] = None,
                               rotary_sin: Optional[Tensor] = None, rotary_interleaved: bool = True,
                               cache_seqlens: Union[int, Tensor, None] = None, cache_batch_idx: Optional[Tensor] = None,
                               cache_leftpad: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
                               causal: bool = False, softmax_scale: Optional[float] = None,
                               window_size: Tuple[int, int] = (-1, -1), softcap: float = 0.0,
                               alibi_slopes: Optional[Tensor] = None, num_splits: int = 0,
                               upcast: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (out, lse, k_cache_updated, v_cache_updated) like flash_ext.attention_with_kvcache (whose
    docstring gives the semantics), without modifying its inputs (the caches are cloned).

    Sequence b appends k[b], v[b] (rotated first, when rotary_cos is given) at cache positions
    cache_seqlens[b] ... (through block_table when paged) and attends q[b] (rotated at cache_seqlens[b] + i
    when causal or windowed, else at cache_seqlens[b]) to the cache's keys cache_leftpad[b] ..
    cache_seqlens[b] + seqlen_new - 1 with attention_ref. The keys are read back from the updated caches, so
    they are in the caches' dtype. upcast=True computes the rotary embedding of q and the attention in
    float64 (out and lse float64); upcast=False in the inputs' dtype (out in q's dtype, lse float32).
    The updated caches keep their dtype. num_splits is accepted and ignored (it changes no result)."""
    batch, seqlen_q = q.shape[:2]
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    paged = block_table is not None
    page_size = k_cache.shape[1]
    if cache_seqlens is None:  # every key of the cache: a row, or every page of the block table
        seqlens = [page_size * (block_table.shape[1] if paged else 1)] * batch
    elif isinstance(cache_seqlens, int):
        seqlens = [cache_seqlens] * batch
    else:
        seqlens = [int(s) for s in cache_seqlens.tolist()]
    leftpad = [0] * batch if cache_leftpad is None else [int(s) for s in cache_leftpad.tolist()]
    rows = list(range(batch)) if cache_batch_idx is None else [int(i) for i in cache_batch_idx.tolist()]
    seqlen_new = 0 if k is None else k.shape[1]
    compute = torch.float64 if upcast else q.dtype

    def cache_index(b, positions):
        """(cache rows, positions within them) of sequence b's positions."""
        positions = torch.as_tensor(positions, dtype=torch.long)
        if not paged:
            return torch.full_like(positions, rows[b]), positions
        return block_table[b].long()[positions // page_size], positions % page_size

    q_used = q.to(compute)
    if rotary_cos is not None:
        local = causal or tuple(window_size) != (-1, -1)
        offsets = torch.tensor(seqlens)[:, None]
        q_positions = offsets + (torch.arange(seqlen_q)[None] if local else 0) + torch.zeros(1, seqlen_q,
                                                                                             dtype=torch.long)
        k_positions = offsets + torch.arange(seqlen_new)[None]
        q_used = apply_rotary_ref(q_used, rotary_cos, rotary_sin, q_positions, rotary_interleaved)
        k = apply_rotary_ref(k.to(compute), rotary_cos, rotary_sin, k_positions, rotary_interleaved)
    outs, lses = [], []
    for b in range(batch):
        if seqlen_new:
            where = cache_index(b, range(seqlens[b], seqlens[b] + seqlen_new))
            k_cache[where] = k[b].to(k_cache.dtype)
            v_cache[where] = v[b].to(v_cache.dtype)
        where = cache_index(b, range(leftpad[b], seqlens[b] + seqlen_new))
        slopes_b = None
        if alibi_slopes is not None:
            slopes_b = alibi_slopes[b:b + 1] if alibi_slopes.dim() == 2 else alibi_slopes
        out_b, lse_b = attention_ref(q_used[b:b + 1], k_cache[where][None].to(compute),
                                     v_cache[where][None].to(compute), causal=causal, softmax_scale=softmax_scale,
                                     window_size=window_size, softcap=softcap, alibi_slopes=slopes_b, upcast=upcast)
        outs.append(out_b)
        lses.append(lse_b)
    if batch == 0:
        return (q.new_zeros(q.shape, dtype=compute), q.new_zeros((0, q.shape[2], seqlen_q),
                dtype=torch.float64 if upcast else torch.float32), k_cache, v_cache)
    return torch.cat(outs), torch.cat(lses), k_cache, v_cache

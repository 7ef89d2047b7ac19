"""Context parallelism: exact attention over a sequence sharded across the ranks of a process group.

    from flash_ext.distributed import context_parallel_attention, shard, unshard
    q_local, k_local, v_local = (shard(t, group, "zigzag") for t in (q, k, v))
    out_local = context_parallel_attention(q_local, k_local, v_local, group=group, causal=True)
    out = unshard(out_local, group, "zigzag")   # == flash_ext.attention(q, k, v, causal=True)

Each rank keeps its queries; key/value blocks travel around the ring of ranks (torch.distributed
P2P), and each rank merges the partial (out, lse) of every block it sees. The backward passes the
key/value blocks around again, together with their dK/dV accumulators, and calls flash_ext's backward
op per block with the global out and lse, which gives each block's exact share of the gradients.

The per-step work (which chunk pairs a block computes, the merge, the backward of a block) is kept
apart from the communication, so that one process can run the same steps for every rank in turn
(_local_part, _block_pairs, _forward_block, _backward_block, _reassemble; see
tests/test_context_parallel.py).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from .interface import _as_bool, _as_real, _check_tensor, _default_scale, _window

_LAYOUTS = ("zigzag", "contiguous")
_KV_TAG, _GRAD_TAG = 0, 1


# ---- Layouts -------------------------------------------------------------------------------------
# The global sequence is cut into equal chunks: W chunks for "contiguous" (rank r holds chunk r),
# 2W chunks for "zigzag" (rank r holds chunks r and 2W-1-r, so that under a causal mask every rank
# has the same amount of work: an early chunk with few keys and a late one with many).


def _check_layout(layout) -> str:
    if layout not in _LAYOUTS:
        raise ValueError(f"flash_ext: layout must be 'zigzag' or 'contiguous', got {layout!r}")
    return layout


def _chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def _rank_chunks(rank: int, world: int, layout: str) -> Tuple[int, ...]:
    """The global chunk indices rank holds, in the order they sit in its shard."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def _group_rank_and_size(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flash_ext: context parallelism needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """This rank's part of the full tensor x along dim (the sequence dimension, 1 for (batch, seqlen, heads, d)).

    "contiguous": chunk r of W; "zigzag": chunks r and 2W-1-r of 2W, concatenated. x.size(dim) must be a
    multiple of W (contiguous) or 2W (zigzag). Returns a contiguous copy.
    """
    _check_tensor("x", x)
    layout = _check_layout(layout)
    rank, world = _group_rank_and_size(group)
    parts = world * _chunks_per_rank(layout)
    if x.size(dim) % parts != 0:
        raise ValueError(f"flash_ext: x.size({dim}) = {x.size(dim)} must be a multiple of {parts} (the number of "
                         f"chunks of the {layout!r} layout over {world} ranks)")
    return _local_part(x, rank, world, layout, dim)


def _local_part(x: Tensor, rank: int, world: int, layout: str, dim: int = 1) -> Tensor:
    """shard's work, for a given rank (the tests call it for every rank in one process)."""
    chunks = x.chunk(world * _chunks_per_rank(layout), dim=dim)
    return torch.cat([chunks[c] for c in _rank_chunks(rank, world, layout)], dim=dim).contiguous()


def _reassemble(parts: List[Tensor], layout: str, dim: int = 1) -> Tensor:
    """The full tensor from every rank's shard, parts[r] being rank r's."""
    world, per_rank = len(parts), _chunks_per_rank(layout)
    ordered: List[Optional[Tensor]] = [None] * (world * per_rank)
    for rank, part in enumerate(parts):
        for chunk_index, chunk in zip(_rank_chunks(rank, world, layout), part.chunk(per_rank, dim=dim)):
            ordered[chunk_index] = chunk
    return torch.cat(ordered, dim=dim)


def unshard(x_local: Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The full tensor from every rank's shard (all_gather, then the chunks put back in sequence order).

    The inverse of shard; every rank gets the whole tensor. Not differentiable (no autograd graph).
    """
    _check_tensor("x_local", x_local)
    layout = _check_layout(layout)
    _, world = _group_rank_and_size(group)
    per_rank = _chunks_per_rank(layout)
    if x_local.size(dim) % per_rank != 0:
        raise ValueError(f"flash_ext: x_local.size({dim}) = {x_local.size(dim)} must be even for the 'zigzag' layout "
                         "(two chunks per rank)")
    x_local = x_local.detach().contiguous()
    gathered = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(gathered, x_local, group=group)
    return _reassemble(gathered, layout, dim)


# ---- Per-block work ------------------------------------------------------------------------------


_FULL = (-1, -1)


def _block_pairs(rank: int, src: int, world: int, layout: str, chunk_len: int, causal: bool, window=_FULL):
    """The (q rows, kv rows, causal, (window_left, window_right)) kernel calls that rank's queries make
    against src's keys: slices of the local shard / the block, and the kernel's mask options.

    Chunk pair (i, j) of the global sequence, its keys starting D = (j - i)·chunk_len after its queries:
    local query a (global p = i·chunk_len + a) sees local key b when the global band allows
    -left <= (b + D) - a <= right (causal: right = 0). Without a window that is: full attention if
    j < i, the kernel's causal mask if i == j (equal chunks, so its bottom-right diagonal is the global
    one), nothing if j > i. With a window the band b - a in [lo, hi] = [-left - D, right - D] becomes a
    kernel window; where the band lies wholly above or below the block's diagonal, the rows (lo > 0) or
    keys (hi < 0) that the band never reaches are cut off, which moves the kernel's bottom-right diagonal
    onto the band's edge, so both window sides stay >= 0.
    """
    left, right = window
    if causal:
        right = 0
    c = chunk_len
    pairs = []
    for qi, q_chunk in enumerate(_rank_chunks(rank, world, layout)):
        for ki, k_chunk in enumerate(_rank_chunks(src, world, layout)):
            offset = (k_chunk - q_chunk) * c
            lo = None if left < 0 else -left - offset  # None: unbounded
            hi = None if right < 0 else right - offset
            if (lo is not None and lo > c - 1) or (hi is not None and hi < -(c - 1)):
                continue  # the band misses this block
            rows, keys = c, c
            if lo is not None and lo > 0:
                rows = c - lo  # later queries' bands start past the block's last key
            if hi is not None and hi < 0:
                keys = c + hi  # later keys lie past every query's band
            shift = keys - rows  # the kernel's diagonal: query a meets key a + shift
            wl = -1 if lo is None or shift - lo >= shift + rows - 1 else shift - lo
            wr = -1 if hi is None or hi - shift >= keys - 1 - shift else hi - shift
            q_rows = slice(qi * c, qi * c + rows)
            kv_rows = slice(ki * c, ki * c + keys)
            if wr == 0 and wl == -1:
                pairs.append((q_rows, kv_rows, True, _FULL))
            else:
                pairs.append((q_rows, kv_rows, False, (wl, wr)))
    return _coalesce(pairs)


def _coalesce(pairs):
    """Joins full-attention sub-blocks that share their kv rows and have adjacent q rows, or the other way
    round, so that one kernel call does them (zigzag: one call per off-diagonal step, not two or four)."""
    pairs = list(pairs)
    joined = True
    while joined:
        joined = False
        for a in range(len(pairs)):
            for b in range(len(pairs)):
                (qa, ka, ca, wa), (qb, kb, cb, wb) = pairs[a], pairs[b]
                if a == b or ca or cb or wa != _FULL or wb != _FULL:
                    continue
                if ka == kb and qa.stop == qb.start:
                    merged = (slice(qa.start, qb.stop), ka, False, _FULL)
                elif qa == qb and ka.stop == kb.start:
                    merged = (qa, slice(ka.start, kb.stop), False, _FULL)
                else:
                    continue
                pairs = [p for i, p in enumerate(pairs) if i not in (a, b)] + [merged]
                joined = True
                break
            if joined:
                break
    return pairs


def _merge(acc_out: Tensor, acc_lse: Tensor, out: Tensor, lse: Tensor) -> None:
    """acc <- the exact softmax merge of acc and (out, lse), in place, in float32.

    acc_out (batch, rows, heads, d) float32, acc_lse (batch, heads, rows) float32. A row with no key
    on either side (lse -inf on both) stays at out 0, lse -inf.
    """
    new_lse = torch.logaddexp(acc_lse, lse)
    empty = torch.isneginf(new_lse)
    safe = torch.where(empty, torch.zeros_like(new_lse), new_lse)
    w_acc = torch.where(empty, 0.0, torch.exp(acc_lse - safe)).transpose(1, 2).unsqueeze(-1)
    w_new = torch.where(empty, 0.0, torch.exp(lse - safe)).transpose(1, 2).unsqueeze(-1)
    acc_out.mul_(w_acc).add_(out.float() * w_new)
    acc_lse.copy_(new_lse)


def _forward_block(q, k_blk, v_blk, pairs, acc_out, acc_lse, scale, softcap):
    """Merges the partial attention of q against one key/value block into (acc_out, acc_lse)."""
    for q_rows, kv_rows, causal, (wl, wr) in pairs:
        out, lse, _ = torch.ops.flash_ext.fwd(q[:, q_rows], k_blk[:, kv_rows], v_blk[:, kv_rows], scale, causal,
                                              False, wl, wr, softcap, None, 0.0)
        _merge(acc_out[:, q_rows], acc_lse[:, :, q_rows], out, lse)


def _backward_block(dout, q, k_blk, v_blk, out, lse, pairs, dq_acc, dk_acc, dv_acc, scale, softcap, deterministic):
    """Adds one key/value block's share of the gradients into dq_acc (local) and dk_acc / dv_acc (the block's).

    The backward op with the global out and lse computes P = exp(S - lse_global) and
    D = rowsum(dout * out_global): the block's exact part of the full attention's backward.
    """
    for q_rows, kv_rows, causal, (wl, wr) in pairs:
        dq, dk, dv = torch.ops.flash_ext.bwd(
            dout[:, q_rows], q[:, q_rows], k_blk[:, kv_rows], v_blk[:, kv_rows], out[:, q_rows],
            lse[:, :, q_rows].contiguous(), scale, causal, deterministic, wl, wr, softcap, None, 0.0, None)
        dq_acc[:, q_rows] += dq
        dk_acc[:, kv_rows] += dk
        dv_acc[:, kv_rows] += dv


# ---- The ring --------------------------------------------------------------------------------------


class _Ring:
    """Sends to the next rank of the group and receives from the previous one, asynchronously."""

    def __init__(self, group, rank: int, world: int):
        self.group = group
        self.next = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
        self.prev = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world

    def start(self, tensors: List[Tensor], tag: int):
        """Posts the sends of tensors and the receives into fresh buffers like them; returns (requests, buffers).

        The tag keeps the K/V transfer and the gradient transfer, in flight together in the backward,
        apart where the backend matches messages by tag (gloo; NCCL ignores tags and keeps the order).
        """
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group, tag) for t in received]
        return dist.batch_isend_irecv(ops), received

    @staticmethod
    def wait(requests) -> None:
        for request in requests:
            request.wait()


def _ring_forward(q, k, v, group, rank, world, layout, causal, window, scale, softcap):
    batch, rows, heads_q, _ = q.shape
    chunk_len = rows // _chunks_per_rank(layout)
    acc_out = torch.zeros(q.shape[:3] + v.shape[3:], dtype=torch.float32, device=q.device)
    acc_lse = torch.full((batch, heads_q, rows), float("-inf"), dtype=torch.float32, device=q.device)
    ring = _Ring(group, rank, world) if world > 1 else None
    k_blk, v_blk = k, v
    for step in range(world):
        src = (rank - step) % world
        pending = None
        if step + 1 < world:  # the next block's transfer runs while this block is computed
            pending = ring.start([k_blk, v_blk], tag=_KV_TAG)
        pairs = _block_pairs(rank, src, world, layout, chunk_len, causal, window)
        _forward_block(q, k_blk, v_blk, pairs, acc_out, acc_lse, scale, softcap)
        if pending is not None:
            requests, (k_blk, v_blk) = pending
            _Ring.wait(requests)
    return acc_out.to(q.dtype), acc_lse


def _ring_backward(dout, q, k, v, out, lse, group, rank, world, layout, causal, window, scale, softcap,
                   deterministic):
    chunk_len = q.shape[1] // _chunks_per_rank(layout)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    ring = _Ring(group, rank, world) if world > 1 else None
    k_blk, v_blk = k, v
    grads_in_flight = None
    for step in range(world):
        src = (rank - step) % world
        pending = None
        if step + 1 < world:  # the next K/V block travels while this one is computed
            pending = ring.start([k_blk, v_blk], tag=_KV_TAG)
        # This block's share goes into fresh buffers, so the block's running dK/dV accumulators (sent by
        # the previous rank) can still be in flight during the compute; they are added afterwards.
        dk_part = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv_part = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        pairs = _block_pairs(rank, src, world, layout, chunk_len, causal, window)
        _backward_block(dout, q, k_blk, v_blk, out, lse, pairs, dq_acc, dk_part, dv_part, scale, softcap,
                        deterministic)
        if grads_in_flight is not None:
            requests, (dk_in, dv_in) = grads_in_flight
            _Ring.wait(requests)
            dk_part += dk_in
            dv_part += dv_in
        if world > 1:
            # After W hops a block's accumulators are back at its owner, holding every rank's share.
            grads_in_flight = ring.start([dk_part, dv_part], tag=_GRAD_TAG)
        if pending is not None:
            requests, (k_blk, v_blk) = pending
            _Ring.wait(requests)
    if grads_in_flight is not None:
        requests, (dk_part, dv_part) = grads_in_flight
        _Ring.wait(requests)
    return dq_acc.to(q.dtype), dk_part.to(k.dtype), dv_part.to(v.dtype)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, rank, world, layout, causal, window, scale, softcap, deterministic):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _ring_forward(q, k, v, group, rank, world, layout, causal, window, scale, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (group, rank, world, layout, causal, window, scale, softcap, deterministic)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:
            # Every rank must still take part in the ring; a zero dout gives zero gradients.
            dout = torch.zeros_like(out)
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.config)
        return (dq, dk, dv) + (None,) * 9


def context_parallel_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool = False,
                               softmax_scale: Optional[float] = None, layout: str = "zigzag", softcap: float = 0.0,
                               window_size: Tuple[int, int] = (-1, -1), dropout_p: float = 0.0,
                               deterministic: bool = False, return_lse: bool = False):
    """Exact attention over a sequence sharded across the ranks of group (ring attention).

    Args:
        q: this rank's shard (batch, shard_len, heads_q, head_dim); k, v: (batch, shard_len, heads_kv,
            head_dim), sharded the same way (see shard). Every rank passes the same shapes.
        group: the torch.distributed process group (None: the default group).
        causal: the causal mask over the global sequence (query at global position p sees keys <= p).
        softmax_scale: default 1/sqrt(head_dim). softcap: as flash_ext.attention.
        layout: "zigzag" (rank r holds chunks r and 2W-1-r of 2W; shard_len must be even) or
            "contiguous" (rank r holds chunk r of W).
        window_size: (left, right), a sliding window over the global sequence, as flash_ext.attention's
            (global position p sees keys p - left .. p + right; -1 unbounded; causal clamps right to 0).
            Blocks the band misses are skipped.
        dropout_p: only 0.0; other values raise.
        deterministic: the backward of each block as flash_ext.attention's deterministic flag.
        return_lse: also return lse (batch, heads_q, shard_len), float32, of the global softmax.

    Returns:
        out (batch, shard_len, heads_q, head_dim): this rank's rows of attention over the whole
        sequence; (out, lse) when return_lse. Differentiable in q, k, v; every rank of the group must
        call it, and its backward, together.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    causal = _as_bool("causal", causal)
    deterministic = _as_bool("deterministic", deterministic)
    return_lse = _as_bool("return_lse", return_lse)
    layout = _check_layout(layout)
    scale = float(_default_scale(q.shape[-1])) if softmax_scale is None else _as_real("softmax_scale", softmax_scale)
    softcap = _as_real("softcap", softcap)
    window = _window(window_size)
    for side, value in zip(("window_size[0]", "window_size[1]"), window):
        if value < -1:
            raise ValueError(f"flash_ext: {side} must be -1 (unbounded) or >= 0, got {value}")
    if _as_real("dropout_p", dropout_p) != 0.0:
        raise ValueError(f"flash_ext: context_parallel_attention does not support dropout (got dropout_p={dropout_p}); "
                         "pass dropout_p=0.0")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"flash_ext: {name} must have 4 dimensions (batch, shard_len, heads, head_dim), got "
                             f"shape {tuple(t.shape)}")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"flash_ext: q, k and v must hold the same sequence shard, got shard lengths {q.shape[1]}, "
                         f"{k.shape[1]} and {v.shape[1]}")
    if layout == "zigzag" and q.shape[1] % 2 != 0:
        raise ValueError(f"flash_ext: with layout='zigzag' the shard length (q.size(1) = {q.shape[1]}) must be even: "
                         "each rank holds two chunks of equal length")
    rank, world = _group_rank_and_size(group)
    out, lse = _ContextParallelAttention.apply(q, k, v, group, rank, world, layout, causal, window, scale, softcap,
                                               deterministic)
    return (out, lse) if return_lse else out

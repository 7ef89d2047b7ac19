"""flash_ext.distributed: ring attention over a sharded sequence, against attention over the whole one.

Two kinds of tests:
- the ring's steps run in one process for every simulated rank in turn (the per-block forward,
  merge and backward, no communication): CPU float32, and on CUDA float16 / bfloat16 (the CUDA
  per-block path);
- real process groups (gloo, CPU, world sizes 1 to 4, spawned processes; and NCCL over two GPUs where the
  machine has them): context_parallel_attention with its P2P ring, its autograd, and shard / unshard. Each
  spawned world runs many cases, since starting processes costs seconds.

Results are checked with the project's tolerance rule against the float64 reference on the gathered
sequence.
"""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flash_ext
from devices import parametrize_devices
from flash_ext.distributed import (_backward_block, _block_pairs, _chunks_per_rank, _forward_block, _local_part,
                                   _reassemble, context_parallel_attention, shard, unshard)
from flash_ext.reference import attention_ref
from tolerance import assert_forward_within_tolerance, assert_gradients_within_tolerance

# (layout, causal, heads_q, heads_kv, chunk_len): GQA and odd chunk lengths throughout.
CASES = [
    ("zigzag", True, 4, 2, 5),
    ("zigzag", False, 2, 1, 7),
    ("contiguous", True, 2, 2, 7),
    ("contiguous", False, 4, 2, 5),
]


def _inputs(world, layout, heads_q, heads_kv, chunk_len, dtype, device, seed, head_dim=16, batch=2):
    generator = torch.Generator().manual_seed(seed)
    seqlen = world * _chunks_per_rank(layout) * chunk_len

    def make(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    q = make(batch, seqlen, heads_q, head_dim)
    k, v = make(batch, seqlen, heads_kv, head_dim), make(batch, seqlen, heads_kv, head_dim)
    return q, k, v, make(batch, seqlen, heads_q, head_dim)


def _simulated_ring(q, k, v, dout, world, layout, causal, scale, softcap=0.0, window=(-1, -1)):
    """The ring's steps for every rank in one process: (out, lse, dq, dk, dv) of the whole sequence."""
    parts = [[_local_part(t, r, world, layout) for r in range(world)] for t in (q, k, v, dout)]
    qs, ks, vs, douts = parts
    chunk_len = qs[0].shape[1] // _chunks_per_rank(layout)
    outs, lses = [], []
    for r in range(world):
        acc_out = torch.zeros(qs[r].shape[:3] + vs[r].shape[3:], dtype=torch.float32, device=q.device)
        acc_lse = torch.full(qs[r].shape[:1] + qs[r].shape[2:3] + qs[r].shape[1:2], float("-inf"), device=q.device)
        for step in range(world):
            src = (r - step) % world  # the block rank r holds at this step of the ring
            pairs = _block_pairs(r, src, world, layout, chunk_len, causal, window)
            _forward_block(qs[r], ks[src], vs[src], pairs, acc_out, acc_lse, scale, softcap)
        outs.append(acc_out.to(q.dtype))
        lses.append(acc_lse)
    dqs = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in qs]
    dks = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in ks]
    dvs = [torch.zeros(t.shape, dtype=torch.float32, device=q.device) for t in vs]
    for r in range(world):
        for step in range(world):
            src = (r - step) % world
            _backward_block(douts[r], qs[r], ks[src], vs[src], outs[r], lses[r],
                            _block_pairs(r, src, world, layout, chunk_len, causal, window), dqs[r], dks[src], dvs[src],
                            scale, softcap, False)
    out = _reassemble(outs, layout)
    lse = _reassemble(lses, layout, dim=2)
    grads = [_reassemble([g.to(q.dtype) for g in gs], layout) for gs in (dqs, dks, dvs)]
    return out, lse, grads


@parametrize_devices(cpu=dict(dtype=[torch.float32]), cuda=dict(dtype=[torch.float16, torch.bfloat16]))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_simulated_ring_matches_full_attention(device, dtype, world):
    for index, (layout, causal, heads_q, heads_kv, chunk_len) in enumerate(CASES):
        if device == "cuda":
            chunk_len *= 16  # several kernel tiles per block, still odd-sized edges
        q, k, v, dout = _inputs(world, layout, heads_q, heads_kv, chunk_len, dtype, device, seed=index,
                                head_dim=16 if device == "cpu" else 64)
        softcap = 5.0 if index == 0 else 0.0  # the merge is exact with softcap too
        scale = q.shape[-1] ** -0.5
        out, lse, grads = _simulated_ring(q, k, v, dout, world, layout, causal, scale, softcap)
        assert_forward_within_tolerance(out, lse, attention_ref, q, k, v, causal=causal, softcap=softcap)
        assert_gradients_within_tolerance(grads, dout, attention_ref, (q, k, v), causal=causal, softcap=softcap)


# Windows narrower and wider than a chunk, one-sided and two-sided, with and without the causal mask.
WINDOWS = [((3, 0), True), ((4, 2), False), ((-1, 6), False), ((11, -1), False), ((9, 9), True), ((0, 0), False)]


@parametrize_devices(cpu=dict(dtype=[torch.float32]), cuda=dict(dtype=[torch.float16, torch.bfloat16]))
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_simulated_ring_with_a_sliding_window(device, dtype, layout):
    for index, (window, causal) in enumerate(WINDOWS):
        world, chunk_len = 3, 5
        if device == "cuda":
            chunk_len, window = chunk_len * 16, tuple(w * 16 if w > 0 else w for w in window)
        q, k, v, dout = _inputs(world, layout, 4, 2, chunk_len, dtype, device, seed=50 + index,
                                head_dim=16 if device == "cpu" else 64)
        out, lse, grads = _simulated_ring(q, k, v, dout, world, layout, causal, q.shape[-1] ** -0.5, window=window)
        assert_forward_within_tolerance(out, lse, attention_ref, q, k, v, causal=causal, window_size=window)
        assert_gradients_within_tolerance(grads, dout, attention_ref, (q, k, v), causal=causal, window_size=window)


def _work(pairs):
    """Score-matrix entries a list of sub-blocks computes (a diagonal block counts half)."""
    return sum((q.stop - q.start) * (k.stop - k.start) * (0.5 if causal else 1.0) for q, k, causal, _ in pairs)


def test_block_pairs_skip_the_future_and_balance_zigzag():
    world, chunk_len = 4, 3
    # contiguous, causal: rank 2 sees ranks 0 and 1 fully, itself on the diagonal, rank 3 not at all
    assert [_work(_block_pairs(2, s, world, "contiguous", chunk_len, True)) for s in range(world)] == [9, 9, 4.5, 0]
    assert _block_pairs(2, 2, world, "contiguous", chunk_len, True)[0][2] is True
    # zigzag, causal: every rank does the same work, 2W + 1 chunk pairs, two of them diagonal (half)
    for rank in range(world):
        steps = [_block_pairs(rank, s, world, "zigzag", chunk_len, True) for s in range(world)]
        assert sum(_work(p) for p in steps) == 2 * world * chunk_len ** 2
        # off the diagonal step, one kernel call per step: half of a full block
        for s in range(world):
            if s != rank:
                assert len(steps[s]) == 1 and _work(steps[s]) == 2 * chunk_len ** 2
        assert sorted(p[2] for p in steps[rank]) == [False, True, True]
    # without a mask, one full call per step
    assert _block_pairs(1, 3, world, "zigzag", chunk_len, False) == [(slice(0, 6), slice(0, 6), False, (-1, -1))]


# ---- Real process groups ----------------------------------------------------------------------------


def _check_case(world, layout, causal, heads_q, heads_kv, chunk_len, seed, group=None, window=(-1, -1),
                dtype=torch.float32, device="cpu", head_dim=16):
    q, k, v, dout = _inputs(world, layout, heads_q, heads_kv, chunk_len, dtype, device, seed, head_dim=head_dim)
    local = [shard(t, group, layout).requires_grad_() for t in (q, k, v)]
    for full, part in zip((q, k, v), local):
        assert torch.equal(unshard(part, group, layout), full)  # shard / unshard round trip
    out_local, lse_local = context_parallel_attention(*local, group=group, causal=causal, layout=layout,
                                                      window_size=window, return_lse=True)
    assert out_local.shape == local[0].shape and out_local.dtype == dtype
    out_local.backward(shard(dout, group, layout))
    out = unshard(out_local, group, layout)
    lse = unshard(lse_local, group, layout, dim=2)
    grads = [unshard(t.grad, group, layout) for t in local]
    assert_forward_within_tolerance(out, lse, attention_ref, q, k, v, causal=causal, window_size=window)
    assert_gradients_within_tolerance(grads, dout, attention_ref, (q, k, v), causal=causal, window_size=window)
    # and against flash_ext.attention on the gathered sequence, directly (16-bit: the merge of per-block
    # results rounds differently from one pass, within a unit in the last place of the output's magnitude)
    expected = flash_ext.attention(q, k, v, causal=causal, window_size=window)
    atol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * expected.float().abs().max().item()
    torch.testing.assert_close(out, expected, rtol=0, atol=atol)


def _worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for index, case in enumerate(CASES):
            _check_case(world, *case, seed=100 + index)
        _check_case(world, "zigzag", True, 2, 1, 5, seed=150, window=(6, 0))
        _check_case(world, "contiguous", False, 2, 2, 5, seed=151, window=(3, 8))
        if world >= 3:
            # a group that is not the default one: ring neighbours are group ranks, P2P takes global ones
            subgroup = dist.new_group(list(range(1, world)))
            if rank >= 1:
                _check_case(world - 1, "zigzag", True, 2, 1, 3, seed=200, group=subgroup)
        with pytest.raises(ValueError, match=r"window_size\[0\]"):
            context_parallel_attention(*(torch.zeros(1, 4, 1, 8) for _ in range(3)), window_size=(-2, 0))
        with pytest.raises(ValueError, match="dropout"):
            context_parallel_attention(*(torch.zeros(1, 4, 1, 8) for _ in range(3)), dropout_p=0.1)
        with pytest.raises(ValueError, match="even"):
            context_parallel_attention(*(torch.zeros(1, 3, 1, 8) for _ in range(3)))
        with pytest.raises(ValueError, match="layout"):
            shard(torch.zeros(1, 4 * world), None, "striped")
        with pytest.raises(ValueError, match=f"multiple of {2 * world}"):
            shard(torch.zeros(1, 2 * world + 1), None, "zigzag")
    finally:
        dist.destroy_process_group()


def test_without_a_process_group_the_error_says_so():
    assert not dist.is_initialized()
    x = torch.zeros(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(x, x, x)
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard(x)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_context_parallel_attention_on_gloo(world):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store")), nprocs=world, join=True)


def _nccl_worker(rank, world, init_file):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        for index, (layout, causal, heads_q, heads_kv, chunk_len) in enumerate(CASES):
            for dtype in (torch.bfloat16, torch.float16):
                # chunks of 128 + 5 rows: several key blocks per ring step, and a ragged one
                _check_case(world, layout, causal, heads_q, heads_kv, 128 + chunk_len, seed=300 + index,
                            dtype=dtype, device=f"cuda:{rank}", head_dim=128)
        _check_case(world, "zigzag", True, 4, 2, 200, seed=350, window=(150, 0), dtype=torch.bfloat16,
                    device=f"cuda:{rank}", head_dim=64)
    finally:
        dist.destroy_process_group()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
                    reason="needs two CUDA GPUs and NCCL")
def test_context_parallel_attention_on_nccl():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_nccl_worker, args=(2, os.path.join(tmp, "store")), nprocs=2, join=True)

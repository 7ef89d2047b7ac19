"""Forward (out and lse) and gradients against the float64 reference, on the CPU and on CUDA.

On the CPU every case checks the forward and the gradients. On CUDA these tests check the forward, on
a poisoned allocator and twice (tests/cuda_poison.py, check_cuda_forward); the CUDA gradients over head
dims, seqlens and both dQ paths are test_cuda.py's test_gradients*.

The CPU grid is not a cartesian product (CI has 2 cores): each factor is crossed with its neighbours.
  head dim x dtype x causal         at a small problem that spans two 64-row tiles each way
  seqlen pair x causal x dtype      at head_dim 64
  MHA/GQA/MQA x causal x dtype      at two seqlen pairs, one with rows that see no key
  long sequences (1000)             a few cases with batch 1, heads 2
  layouts, dout layout, softmax_scale, large scores, rows without keys, determinism
"""
import pytest
import torch

import flash_ext
from cuda_poison import check_cuda_forward, run_poisoned
from devices import CAUSAL, named, parametrize_devices
from make_inputs import LAYOUTS, make_qkv
from tolerance import check_forward, check_gradients

CPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CUDA_DTYPES = [torch.float16, torch.bfloat16]


def check(q, k, v, *, causal, softmax_scale=None, gradients):
    """The forward against the reference (on CUDA poisoned and twice: check_cuda_forward) and, when
    `gradients`, the gradients; returns (out, lse, (dq, dk, dv) or None)."""
    forward = check_cuda_forward if q.is_cuda else check_forward
    out, lse = forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    grads = check_gradients(q, k, v, causal=causal, softmax_scale=softmax_scale) if gradients else None
    return out, lse, grads


@parametrize_devices(
    cpu=dict(head_dim=[1, 16, 59, 64, 128, 255, 256], dtype=CPU_DTYPES, causal=CAUSAL,
             shape=[(2, 70, 90, 4, 2)], gradients=[True]),
    cuda=dict(head_dim=[32, 64, 96, 128, 160, 192, 224, 256, 59], dtype=CUDA_DTYPES, causal=CAUSAL,
              shape=[(2, 113, 203, 9, 9)], gradients=[False]),
)
def test_head_dims(device, head_dim, dtype, causal, shape, gradients):
    q, k, v = make_qkv(*shape, head_dim, dtype, device=device)
    check(q, k, v, causal=causal, gradients=gradients)


CPU_SEQLEN_PAIRS = [(1, 1), (17, 17), (127, 127), (128, 128), (129, 129),
                    (17, 128), (129, 17), (1, 127), (127, 1), (128, 129), (129, 128)]
CUDA_SEQLEN_PAIRS = [(1, 1), (1, 239), (17, 17), (113, 203), (128, 217), (127, 512), (512, 256), (1023, 1024),
                     (2048, 2048)]


@parametrize_devices(
    cpu=dict(seqlens=CPU_SEQLEN_PAIRS, causal=CAUSAL, head_dim_dtype=[named((64, d), i) for d, i in
                                                                       zip(CPU_DTYPES, ("fp32", "bf16", "fp16"))],
             heads=[(2, 2)], gradients=[True]),
    cuda=dict(seqlens=CUDA_SEQLEN_PAIRS, causal=CAUSAL,
              head_dim_dtype=[named((128, torch.bfloat16), "hd128-bf16"), named((64, torch.float16), "hd64-fp16")],
              heads=[(9, 9)], gradients=[False]),
)
def test_seqlen_pairs(device, seqlens, causal, head_dim_dtype, heads, gradients):
    head_dim, dtype = head_dim_dtype
    q, k, v = make_qkv(2, *seqlens, *heads, head_dim, dtype, device=device)
    check(q, k, v, causal=causal, gradients=gradients)


@parametrize_devices(
    cpu=dict(heads=[named((4, 4), "mha"), named((4, 2), "gqa"), named((4, 1), "mqa")], causal=CAUSAL,
             dtype=[torch.float32, torch.float16], seqlens=[(70, 70), (130, 40)], head_dim=[32], gradients=[True]),
    cuda=dict(heads=[named((9, 3), "gqa"), named((9, 1), "mqa")], causal=CAUSAL, dtype=CUDA_DTYPES,
              seqlens=[(512, 256)], head_dim=[59, 64, 128], gradients=[False]),
)
def test_mha_gqa_mqa(device, heads, causal, dtype, seqlens, head_dim, gradients):
    q, k, v = make_qkv(2, *seqlens, *heads, head_dim, dtype, device=device)
    check(q, k, v, causal=causal, gradients=gradients)


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,causal,dtype",
    [
        (1000, 1000, True, torch.bfloat16),
        (1000, 1000, False, torch.float32),
        (1000, 127, True, torch.float16),
        (127, 1000, False, torch.bfloat16),
    ],
    ids=["1000x1000-causal-bf16", "1000x1000-full-fp32", "1000x127-causal-fp16", "127x1000-full-bf16"],
)
def test_long_sequences(seqlen_q, seqlen_k, causal, dtype):
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 2, 64, dtype)
    check(q, k, v, causal=causal, gradients=True)


@parametrize_devices(
    cpu=dict(dtype=CPU_DTYPES, seqlens=[(5, 2), (129, 17), (200, 64)], head_dim=[48], gradients=[True]),
    cuda=dict(dtype=CUDA_DTYPES, seqlens=[(300, 100)], head_dim=[64], gradients=[False]),
)
def test_rows_without_visible_keys(device, dtype, seqlens, head_dim, gradients):
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k query rows see no key
    (bottom-right alignment). Their out is exactly 0, lse -inf, dq exactly 0; nothing is NaN."""
    seqlen_q, seqlen_k = seqlens
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, dtype, device=device)
    empty_rows = seqlen_q - seqlen_k
    out, lse, grads = check(q, k, v, causal=True, gradients=gradients)
    assert torch.equal(out[:, :empty_rows], torch.zeros_like(out[:, :empty_rows]))
    assert torch.isneginf(lse[:, :, :empty_rows]).all()
    assert torch.isfinite(lse[:, :, empty_rows:]).all()
    assert out[:, empty_rows:].abs().amax() > 0
    if grads is not None:
        dq, dk, dv = grads
        for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
            assert torch.isfinite(grad).all(), f"{name} has non-finite values"
        assert torch.equal(dq[:, :empty_rows], torch.zeros_like(dq[:, :empty_rows]))
        assert dq[:, empty_rows:].abs().amax() > 0


def run_forward_backward(q, k, v, dout, *, causal, deterministic=False):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_ext.attention(*leaves, causal=causal, return_lse=True, deterministic=deterministic)
    grads = torch.autograd.grad(out, leaves, dout)
    return (out.detach(), lse, *grads)


@parametrize_devices(
    cpu=dict(layout=[layout for layout in LAYOUTS if layout != "contiguous"], dtype=[torch.float32, torch.bfloat16],
             head_dim=[40], shape=[(2, 75, 90, 4, 2)], gradients=[True]),
    cuda=dict(layout=[layout for layout in LAYOUTS if layout != "contiguous"], dtype=CUDA_DTYPES, head_dim=[128, 59],
              shape=[(2, 177, 250, 8, 2)], gradients=[False]),
)
def test_input_layouts(device, layout, dtype, head_dim, shape, gradients):
    """Strided views and storage offsets give the reference's results, and bit for bit those of contiguous
    copies (out and lse; on the CPU the gradients too)."""
    q, k, v = make_qkv(*shape, head_dim, dtype, device=device, layout=layout)
    assert not (q.is_contiguous() and q.storage_offset() == 0)
    out, lse, _ = check(q, k, v, causal=True, gradients=gradients)
    contiguous = [t.contiguous() for t in (q, k, v)]
    out_contiguous, lse_contiguous = run_poisoned(*contiguous, causal=True)
    assert torch.equal(out, out_contiguous), f"out differs between {layout} and contiguous inputs"
    assert torch.equal(lse, lse_contiguous), f"lse differs between {layout} and contiguous inputs"
    if gradients:
        dout = torch.randn(q.shape, dtype=dtype, device=device)
        strided_results = run_forward_backward(q, k, v, dout, causal=True)
        contiguous_results = run_forward_backward(*contiguous, dout, causal=True)
        for name, strided, contiguous in zip(("dq", "dk", "dv"), strided_results[2:], contiguous_results[2:]):
            assert torch.equal(strided, contiguous), f"{name} differs between {layout} and contiguous inputs"


def test_mixed_input_layouts():
    q, _, _ = make_qkv(2, 66, 66, 4, 2, 64, torch.float32, layout="transposed")
    _, k, _ = make_qkv(2, 66, 66, 4, 2, 64, torch.float32, layout="last_dim_strided")
    _, _, v = make_qkv(2, 66, 66, 4, 2, 64, torch.float32, layout="offset_by_3")
    check(q, k, v, causal=False, gradients=True)


@parametrize_devices(
    cpu=dict(dout_layout=["transposed", "expanded"], dtype=[torch.float32, torch.float16],
             setup=[dict(shape=(2, 70, 70, 4, 4, 32), layout="contiguous", bitwise=True)]),
    # Strided q, k, v too. Not bit for bit: the default CUDA backward sums dQ with atomics, in no fixed order.
    cuda=dict(dout_layout=["transposed"], dtype=[torch.float16],
              setup=[dict(shape=(2, 177, 250, 8, 2, 64), layout="transposed", bitwise=False)]),
)
def test_noncontiguous_dout(device, dout_layout, dtype, setup):
    """dout as autograd hands it over: a transposed view, or (from out.sum()) a stride-0 expansion."""
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim = setup["shape"]
    q, k, v = make_qkv(*setup["shape"], dtype, device=device, layout=setup["layout"])
    if dout_layout == "transposed":
        dout = torch.randn(batch, heads_q, seqlen_q, head_dim, dtype=dtype, device=device).transpose(1, 2)
    else:
        dout = torch.tensor(0.75, dtype=dtype, device=device).expand(q.shape)
    assert not dout.is_contiguous()
    check_gradients(q, k, v, causal=True, dout=dout)
    if setup["bitwise"]:
        strided_results = run_forward_backward(q, k, v, dout, causal=True)
        contiguous_results = run_forward_backward(q, k, v, dout.contiguous(), causal=True)
        for name, strided, contiguous in zip(("out", "lse", "dq", "dk", "dv"), strided_results, contiguous_results):
            assert torch.equal(strided, contiguous), f"{name} differs between a {dout_layout} and a contiguous dout"


@parametrize_devices(
    cpu=dict(softmax_scale=[0.05, 0.3, 2.0], causal=CAUSAL, dtype=[torch.float32], shape=[(2, 80, 100, 2, 1)],
             gradients=[True]),
    cuda=dict(softmax_scale=[0.05, 1.0], causal=[True], dtype=[torch.bfloat16], shape=[(2, 200, 300, 4, 2)],
              gradients=[False]),
)
def test_explicit_softmax_scale(device, softmax_scale, causal, dtype, shape, gradients):
    q, k, v = make_qkv(*shape, 64, dtype, device=device)
    check(q, k, v, causal=causal, softmax_scale=softmax_scale, gradients=gradients)


@parametrize_devices(
    cpu=dict(dtype=CPU_DTYPES, shape=[(2, 100, 150, 2, 2)], gradients=[True]),
    cuda=dict(dtype=CUDA_DTYPES, shape=[(2, 300, 300, 4, 4)], gradients=[False]),
)
def test_large_scores(device, dtype, shape, gradients):
    """Scores with a spread of about +-100 overflow exp() unless the row max is subtracted."""
    q, k, v = make_qkv(*shape, 64, dtype, device=device)
    check(q * 12, k, v, causal=True, gradients=gradients)


@parametrize_devices(
    # The CPU backward is deterministic either way.
    cpu=dict(deterministic=[False, True], shape=[(2, 150, 150, 4, 2, 64)], runs=[2]),
    # deterministic=True uses no atomics. (With the default, dQ is summed by fp32 atomics in whatever order the
    # CTAs reach them, and so are dK and dV of split tail walks: test_cuda.py, test_gradients_with_split_tail_walks.)
    cuda=dict(deterministic=[named(True, "deterministic")], shape=[(2, 300, 280, 6, 2, 96)], runs=[20]),
)
def test_repeated_runs_are_bitwise_identical(device, deterministic, shape, runs):
    q, k, v = make_qkv(*shape, torch.bfloat16, device=device)
    dout = torch.randn(q.shape, dtype=q.dtype, device=device)
    first = run_forward_backward(q, k, v, dout, causal=True, deterministic=deterministic)
    for _ in range(runs - 1):
        again = run_forward_backward(q, k, v, dout, causal=True, deterministic=deterministic)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} differs between two identical calls"

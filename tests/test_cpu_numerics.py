"""The CPU path against the float64 reference: forward (out and lse) and gradients.

The grid is not a cartesian product (CI has 2 cores): each factor is crossed with its neighbours.
  head dim x dtype x causal         at a small problem that spans two 64-row tiles each way
  seqlen pair x causal x dtype      at head_dim 64
  MHA/GQA/MQA x causal x dtype      at two seqlen pairs, one with rows that see no key
  long sequences (1000)             a few cases with batch 1, heads 2
  layouts, dout layout, softmax_scale, large scores, rows without keys, determinism
"""
import pytest
import torch

import flash_ext
from make_inputs import LAYOUTS, make_qkv
from tolerance import check_forward, check_gradients

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def check_forward_and_gradients(q, k, v, *, causal, softmax_scale=None):
    check_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    check_gradients(q, k, v, causal=causal, softmax_scale=softmax_scale)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [1, 16, 59, 64, 128, 255, 256])
def test_head_dim_by_dtype(head_dim, dtype, causal):
    q, k, v = make_qkv(2, 70, 90, 4, 2, head_dim, dtype)
    check_forward_and_gradients(q, k, v, causal=causal)


SEQLEN_PAIRS = [(1, 1), (17, 17), (127, 127), (128, 128), (129, 129),
                (17, 128), (129, 17), (1, 127), (127, 1), (128, 129), (129, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLEN_PAIRS)
def test_seqlen_pairs(seqlen_q, seqlen_k, causal, dtype):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 2, 2, 64, dtype)
    check_forward_and_gradients(q, k, v, causal=causal)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(70, 70), (130, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads_q,heads_kv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_mha_gqa_mqa(heads_q, heads_kv, causal, dtype, seqlen_q, seqlen_k):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, 32, dtype)
    check_forward_and_gradients(q, k, v, causal=causal)


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
    check_forward_and_gradients(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(5, 2), (129, 17), (200, 64)])
def test_rows_without_visible_keys(seqlen_q, seqlen_k, dtype):
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k query rows see no key
    (bottom-right alignment). Their out is exactly 0, lse -inf, dq exactly 0; nothing is NaN."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 48, dtype)
    empty_rows = seqlen_q - seqlen_k
    out, lse = check_forward(q, k, v, causal=True)
    assert torch.equal(out[:, :empty_rows], torch.zeros_like(out[:, :empty_rows]))
    assert torch.isneginf(lse[:, :, :empty_rows]).all()
    assert torch.isfinite(lse[:, :, empty_rows:]).all()
    assert out[:, empty_rows:].abs().amax() > 0

    dq, dk, dv = check_gradients(q, k, v, causal=True)
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(grad).all(), f"{name} has non-finite values"
    assert torch.equal(dq[:, :empty_rows], torch.zeros_like(dq[:, :empty_rows]))
    assert dq[:, empty_rows:].abs().amax() > 0


def run_forward_backward(q, k, v, dout, *, causal):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = flash_ext.attention(*leaves, causal=causal, return_lse=True)
    grads = torch.autograd.grad(out, leaves, dout)
    return (out.detach(), lse, *grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "contiguous"])
def test_input_layouts(layout, dtype):
    """Strided inputs give the reference's results, and bit for bit those of contiguous copies."""
    q, k, v = make_qkv(2, 75, 90, 4, 2, 40, dtype, layout=layout)
    assert not (q.is_contiguous() and q.storage_offset() == 0)
    check_forward_and_gradients(q, k, v, causal=True)

    dout = torch.randn(q.shape, dtype=dtype)
    strided_results = run_forward_backward(q, k, v, dout, causal=True)
    contiguous_results = run_forward_backward(q.contiguous(), k.contiguous(), v.contiguous(), dout, causal=True)
    for name, strided, contiguous in zip(("out", "lse", "dq", "dk", "dv"), strided_results, contiguous_results):
        assert torch.equal(strided, contiguous), f"{name} differs between {layout} and contiguous inputs"


def test_mixed_input_layouts():
    q, _, _ = make_qkv(2, 66, 66, 4, 2, 64, torch.float32, layout="transposed")
    _, k, _ = make_qkv(2, 66, 66, 4, 2, 64, torch.float32, layout="last_dim_strided")
    _, _, v = make_qkv(2, 66, 66, 4, 2, 64, torch.float32, layout="offset_by_3")
    check_forward_and_gradients(q, k, v, causal=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("dout_layout", ["transposed", "expanded"])
def test_noncontiguous_dout(dout_layout, dtype):
    """dout as autograd hands it over: a transposed view, or (from out.sum()) a stride-0 expansion."""
    q, k, v = make_qkv(2, 70, 70, 4, 4, 32, dtype)
    if dout_layout == "transposed":
        dout = torch.randn(2, 4, 70, 32, dtype=dtype).transpose(1, 2)
    else:
        dout = torch.tensor(0.75, dtype=dtype).expand(q.shape)
    assert not dout.is_contiguous()
    check_gradients(q, k, v, causal=True, dout=dout)
    strided_results = run_forward_backward(q, k, v, dout, causal=True)
    contiguous_results = run_forward_backward(q, k, v, dout.contiguous(), causal=True)
    for name, strided, contiguous in zip(("out", "lse", "dq", "dk", "dv"), strided_results, contiguous_results):
        assert torch.equal(strided, contiguous), f"{name} differs between a {dout_layout} and a contiguous dout"


@pytest.mark.parametrize("softmax_scale", [0.05, 0.3, 2.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_explicit_softmax_scale(softmax_scale, causal):
    q, k, v = make_qkv(2, 80, 100, 2, 1, 64, torch.float32)
    check_forward_and_gradients(q, k, v, causal=causal, softmax_scale=softmax_scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_scores(dtype):
    """Scores with a spread of about +-100 overflow exp() unless the row max is subtracted."""
    q, k, v = make_qkv(2, 100, 150, 2, 2, 64, dtype)
    q = q * 12
    check_forward_and_gradients(q, k, v, causal=True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_repeated_runs_are_bitwise_identical(deterministic):
    q, k, v = make_qkv(2, 150, 150, 4, 2, 64, torch.bfloat16)
    dout = torch.randn(q.shape, dtype=q.dtype)

    def run():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = flash_ext.attention(*leaves, causal=True, return_lse=True, deterministic=deterministic)
        return (out.detach(), lse, *torch.autograd.grad(out, leaves, dout))

    first, second = run(), run()
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two identical calls"

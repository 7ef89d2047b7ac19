"""The CPU path's features against the float64 reference, forward and gradients: sliding windows,
softcap, ALiBi, dropout (with the call's own keep mask), variable-length batches, and all of them
combined. The dropout random numbers themselves (Philox, the element mapping, the statistics,
reproducibility) are tested in test_dropout.py.
"""
import time

import pytest
import torch

import flash_ext
from flash_ext.testing import attention_with_rng_state
from make_inputs import make_qkv, make_varlen_qkv
from tolerance import check_forward, check_gradients, check_varlen_forward, check_varlen_gradients

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


def check_forward_and_gradients(q, k, v, *, causal=False, **features):
    out, lse = check_forward(q, k, v, causal=causal, **features)
    check_gradients(q, k, v, causal=causal, **features)
    return out, lse


def alibi_slopes(batch, heads, per_batch):
    """The usual geometric slopes 2^(-8 (h + 1) / heads), varied per batch row when per_batch."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float32) / heads)
    if not per_batch:
        return slopes
    return slopes[None] * torch.rand(batch, 1) * 2


# ---- Sliding window ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 250), (250, 113)])
@pytest.mark.parametrize("window_size", [(0, 0), (16, 0), (-1, 8), (100, 100)], ids=str)
def test_sliding_window(window_size, seqlen_q, seqlen_k, dtype):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 32, dtype)
    out, lse = check_forward_and_gradients(q, k, v, window_size=window_size)
    # Rows whose band misses [0, seqlen_k) see nothing: out 0 and lse -inf, exactly as the reference says.
    assert torch.isfinite(lse).any()


@pytest.mark.parametrize("window_size", [(16, 8), (16, -1), (-1, 3)], ids=str)
def test_causal_clamps_the_window_right_side_to_zero(window_size):
    q, k, v = make_qkv(2, 90, 150, 2, 2, 32, torch.float32)
    left = window_size[0]
    combined = flash_ext.attention(q, k, v, causal=True, window_size=window_size, return_lse=True)
    clamped = flash_ext.attention(q, k, v, window_size=(left, 0), return_lse=True)
    for a, b in zip(combined, clamped):
        assert torch.equal(a, b)
    check_forward_and_gradients(q, k, v, causal=True, window_size=window_size)


def test_window_minus_one_zero_is_causal():
    q, k, v = make_qkv(2, 70, 130, 2, 1, 32, torch.bfloat16)
    assert torch.equal(flash_ext.attention(q, k, v, window_size=(-1, 0)), flash_ext.attention(q, k, v, causal=True))


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(200, 200), (150, 213), (213, 150)])
def test_window_edges_at_tile_boundaries(seqlen_q, seqlen_k):
    """Band skipping works on 64-row tiles: windows whose edges fall just before, on and just after a
    tile boundary (left/right in 0, 1, 63, 64, 65) must not drop a tile that a row needs."""
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 1, 1, 16, torch.float32)
    for left in (-1, 0, 1, 63, 64, 65):
        for right in (-1, 0, 1, 63, 64, 65):
            check_forward_and_gradients(q, k, v, window_size=(left, right))


def test_window_cost_grows_with_the_window_not_the_sequence():
    """Tiles outside the band are skipped: a 32-key window over 4096 keys does a small fraction of
    the work of full attention (about 2 of 64 key tiles per query tile). The bound is loose (4x)."""
    q, k, v = make_qkv(1, 4096, 4096, 1, 1, 32, torch.float32)

    def best_time(**kwargs):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            flash_ext.attention(q, k, v, **kwargs)
            times.append(time.perf_counter() - start)
        return min(times)

    full, windowed = best_time(), best_time(window_size=(32, 0))
    assert windowed < full / 4, f"window (32, 0) took {windowed:.4f}s, full attention {full:.4f}s"


# ---- Softcap -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("softcap", [30.0, 50.0])
def test_softcap(softcap, causal, dtype):
    # softmax_scale 1 and q * 4: scores of a few hundred, far into tanh's saturation.
    q, k, v = make_qkv(2, 80, 140, 4, 2, 64, dtype)
    q = q * 4
    out, _ = check_forward_and_gradients(q, k, v, causal=causal, softmax_scale=1.0, softcap=softcap)
    uncapped = flash_ext.attention(q, k, v, causal=causal, softmax_scale=1.0)
    assert (out.float() - uncapped.float()).abs().max() > 0.1, "softcap made no difference"


# ---- ALiBi -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("per_batch", [False, True], ids=["slopes-heads", "slopes-batch-heads"])
def test_alibi(per_batch, causal, dtype):
    q, k, v = make_qkv(3, 90, 120, 4, 2, 32, dtype)
    slopes = alibi_slopes(3, 4, per_batch)
    out, _ = check_forward_and_gradients(q, k, v, causal=causal, alibi_slopes=slopes)
    assert (out.float() - flash_ext.attention(q, k, v, causal=causal).float()).abs().max() > 0.01


def test_alibi_with_softcap_and_window():
    """ALiBi is added after the softcap; both are zero outside the window."""
    q, k, v = make_qkv(2, 100, 100, 4, 4, 32, torch.float32)
    check_forward_and_gradients(q * 3, k, v, window_size=(20, 5), softcap=5.0, alibi_slopes=alibi_slopes(2, 4, True))


# ---- Dropout against the reference with the call's own mask -------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(97, 130), (130, 61)])
def test_dropout_matches_reference_with_its_mask(seqlen_q, seqlen_k, causal, dtype):
    """Forward and gradients against the reference with the keep mask of the very call: the
    backward must regenerate the forward's mask for the gradients to match."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, 32, dtype)
    check_forward_and_gradients(q, k, v, causal=causal, dropout_p=0.17)


def test_dropout_changes_the_output_but_not_lse():
    q, k, v = make_qkv(2, 64, 64, 2, 2, 32, torch.float32)
    out, lse, rng_state = attention_with_rng_state(q, k, v, dropout_p=0.17)
    out_plain, lse_plain = flash_ext.attention(q, k, v, return_lse=True)
    assert (out - out_plain).abs().max() > 0.01
    torch.testing.assert_close(lse, lse_plain, rtol=0, atol=1e-6)  # lse is of the undropped softmax
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,) and rng_state.any()


# ---- Variable-length batches ---------------------------------------------------------------------

# Lengths with 0 and 1 and one long sequence; key lengths differ from query lengths.
LENGTHS_Q = [0, 1, 37, 300, 5, 64]
LENGTHS_K = [3, 0, 64, 260, 1, 70]
VARLEN_FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window_size=(16, 4)),
    "softcap": dict(softcap=30.0, softmax_scale=1.0),
    "alibi": dict(alibi_slopes=alibi_slopes(6, 4, True)),
    "dropout": dict(dropout_p=0.17),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("feature", list(VARLEN_FEATURES))
def test_varlen(feature, dtype):
    q, k, v, cu_q, cu_k = make_varlen_qkv(LENGTHS_Q, LENGTHS_K, 4, 2, 32, dtype)
    features = dict(VARLEN_FEATURES[feature])
    causal = features.pop("causal", False)
    out, lse = check_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, **features)
    check_varlen_gradients(q, k, v, cu_q, cu_k, causal=causal, **features)
    # Sequence 1 has a query but no key: out 0 and lse -inf.
    assert torch.equal(out[0:1], torch.zeros_like(out[0:1])) and torch.isneginf(lse[:, 0]).all()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_equals_dense_per_sequence(causal):
    """Each packed sequence gives bit for bit what a dense call on it alone gives (forward and
    gradients): the sequences do not see each other and tiles start at each sequence's start."""
    q, k, v, cu_q, cu_k = make_varlen_qkv([70, 1, 130], [90, 65, 129], 4, 2, 40, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_ext.attention_varlen(*leaves, cu_q, cu_k, 130, 129, causal=causal, window_size=(50, -1),
                                          return_lse=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    for b in range(3):
        rows_q, rows_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        dense = [t[rows].detach().clone()[None].requires_grad_() for t, rows in zip((q, k, v), (rows_q, rows_k, rows_k))]
        out_b, lse_b = flash_ext.attention(*dense, causal=causal, window_size=(50, -1), return_lse=True)
        grads_b = torch.autograd.grad(out_b, dense, dout[rows_q][None])
        assert torch.equal(out[rows_q], out_b[0].detach()) and torch.equal(lse[:, rows_q], lse_b[0])
        for grad, grad_b, rows in zip(grads, grads_b, (rows_q, rows_k, rows_k)):
            assert torch.equal(grad[rows], grad_b[0])


def test_varlen_max_seqlen_may_exceed_the_longest():
    q, k, v, cu_q, cu_k = make_varlen_qkv([5, 20], [7, 30], 2, 1, 16, torch.float32)
    exact = flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 20, 30, causal=True)
    assert torch.equal(exact, flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 200, 300, causal=True))


@pytest.mark.parametrize("lengths_q,lengths_k", [([], []), ([0, 0], [0, 4]), ([3, 0], [0, 0])],
                         ids=["no-sequences", "no-queries", "no-keys"])
def test_varlen_empty(lengths_q, lengths_k):
    q, k, v, cu_q, cu_k = make_varlen_qkv(lengths_q, lengths_k, 2, 2, 16, torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = flash_ext.attention_varlen(*leaves, cu_q, cu_k, max(lengths_q, default=0), max(lengths_k, default=0),
                                          return_lse=True)
    assert out.shape == q.shape and lse.shape == (2, q.shape[0])
    assert torch.equal(out.detach(), torch.zeros_like(out)) and torch.isneginf(lse).all()
    out.backward(torch.randn_like(out))
    for t in leaves:
        assert torch.equal(t.grad, torch.zeros_like(t))


# ---- Everything at once --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_varlen_gqa_window_softcap_alibi_dropout(dtype):
    q, k, v, cu_q, cu_k = make_varlen_qkv([1, 90, 0, 150], [40, 90, 8, 200], 6, 2, 48, dtype)
    features = dict(window_size=(40, 10), softcap=20.0, alibi_slopes=alibi_slopes(4, 6, True), dropout_p=0.17)
    check_varlen_forward(q, k, v, cu_q, cu_k, causal=True, **features)
    check_varlen_gradients(q, k, v, cu_q, cu_k, causal=True, **features)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dense_gqa_window_softcap_alibi_dropout(dtype):
    q, k, v = make_qkv(2, 110, 170, 6, 3, 64, dtype, layout="transposed")
    features = dict(window_size=(64, 32), softcap=30.0, alibi_slopes=alibi_slopes(2, 6, False), dropout_p=0.17)
    check_forward_and_gradients(q, k, v, **features)

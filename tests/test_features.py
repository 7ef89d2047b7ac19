"""The features against the float64 reference, forward and gradients, on the CPU and on CUDA (both dQ
paths there): sliding windows, softcap, ALiBi, dropout (with the call's own keep mask, which
flash_ext.testing computes with the CPU's Philox function: so on CUDA these also show that CPU and CUDA
drop the same elements), variable-length batches, and all of them combined. The dropout random numbers
themselves (Philox, the element mapping, the statistics, reproducibility) are tested in test_dropout.py;
CUDA-only cases (persistent walks, long ALiBi rows) in test_cuda_features.py.
"""
import time

import pytest
import torch

import flash_ext
from devices import CAUSAL, DQ_PATHS, named, parametrize_devices
from flash_ext.testing import attention_with_rng_state
from make_inputs import alibi_slopes, make_qkv, make_varlen_qkv
from tolerance import check_forward_and_gradients, check_varlen_forward, check_varlen_gradients

CPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CUDA_DTYPES = [torch.float16, torch.bfloat16]


# ---- Sliding window ----------------------------------------------------------------------------

WINDOWS = [(0, 0), (16, 0), (-1, 8), (100, 100)]


@parametrize_devices(
    cpu=dict(window_size=WINDOWS, seqlens=[(113, 250), (250, 113)], dtype=[torch.float32, torch.bfloat16],
             head_dim=[32], deterministic=[False]),
    cuda=dict(window_size=WINDOWS + [(70, 130)], seqlens=[(113, 250), (250, 113), (300, 300)],
              dtype=[torch.bfloat16], head_dim=[64, 128, 256], deterministic=DQ_PATHS),
)
def test_sliding_window(device, window_size, seqlens, dtype, head_dim, deterministic):
    q, k, v = make_qkv(2, *seqlens, 4, 2, head_dim, dtype, device=device)
    out, lse = check_forward_and_gradients(q, k, v, window_size=window_size, deterministic=deterministic)
    # Rows whose band misses [0, seqlen_k) see nothing: out 0 and lse -inf, exactly as the reference says.
    assert torch.isfinite(lse).any()


@parametrize_devices(
    cpu=dict(seqlens=[(200, 200), (150, 213), (213, 150)], heads=[(1, 1)], head_dim=[16], dtype=[torch.float32],
             lefts=[(-1, 0, 1, 63, 64, 65)]),
    cuda=dict(seqlens=[(200, 200), (150, 213), (213, 150)], heads=[(2, 1)], head_dim=[64], dtype=[torch.float16],
              lefts=[(-1, 0, 1, 63, 64, 65, 127, 128)]),
)
def test_window_edges_at_tile_boundaries(device, seqlens, heads, head_dim, dtype, lefts):
    """Band skipping works on 64-row tiles (and 128-row ones on CUDA): windows whose edges fall just
    before, on and just after a tile boundary must not drop a tile that a row needs."""
    q, k, v = make_qkv(1, *seqlens, *heads, head_dim, dtype, device=device)
    for left in lefts:
        for right in (-1, 0, 1, 63, 64, 65):
            check_forward_and_gradients(q, k, v, window_size=(left, right))


@parametrize_devices(
    cpu=dict(window_size=[(16, 8), (16, -1), (-1, 3)], head_dim=[32], dtype=[torch.float32]),
    cuda=dict(window_size=[(16, 8)], head_dim=[64], dtype=[torch.bfloat16]),
)
def test_causal_clamps_the_window_right_side_to_zero(device, window_size, head_dim, dtype):
    q, k, v = make_qkv(2, 90, 150, 2, 2, head_dim, dtype, device=device)
    left = window_size[0]
    combined = flash_ext.attention(q, k, v, causal=True, window_size=window_size, return_lse=True)
    clamped = flash_ext.attention(q, k, v, window_size=(left, 0), return_lse=True)
    for a, b in zip(combined, clamped):
        assert torch.equal(a, b)
    check_forward_and_gradients(q, k, v, causal=True, window_size=window_size)


def test_window_minus_one_zero_is_causal():
    q, k, v = make_qkv(2, 70, 130, 2, 1, 32, torch.bfloat16)
    assert torch.equal(flash_ext.attention(q, k, v, window_size=(-1, 0)), flash_ext.attention(q, k, v, causal=True))


def test_window_cost_grows_with_the_window_not_the_sequence():
    """Tiles outside the band are skipped: a 32-key window over 4096 keys does a small fraction of
    the work of full attention (about 2 of 64 key tiles per query tile). The bound is loose (4x)."""
    q, k, v = make_qkv(1, 4096, 4096, 1, 1, 32, torch.float32)

    def best_time(runs, **kwargs):
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            flash_ext.attention(q, k, v, **kwargs)
            times.append(time.perf_counter() - start)
        return min(times)

    # The windowed call's best of 3 against one full call: noise can only slow the full call down, and a
    # window whose tiles were not skipped would cost as much as full attention, far from the 4x bound.
    full, windowed = best_time(1), best_time(3, window_size=(32, 0))
    assert windowed < full / 4, f"window (32, 0) took {windowed:.4f}s, full attention {full:.4f}s"


# ---- Softcap -----------------------------------------------------------------------------------


@parametrize_devices(
    # softmax_scale 1 and q * 4: scores of a few hundred, far into tanh's saturation.
    cpu=dict(softcap=[30.0, 50.0], causal=CAUSAL, dtype=CPU_DTYPES, head_dim=[64], deterministic=[False],
             setup=[dict(seqlens=(80, 140), k_factor=1, softmax_scale=1.0)]),
    # q * 4 and k * 4 at the default scale: scores of tens, bent by the cap.
    cuda=dict(softcap=[30.0, 50.0], causal=[True], dtype=CUDA_DTYPES, head_dim=[64, 96, 128, 256],
              deterministic=DQ_PATHS, setup=[dict(seqlens=(177, 203), k_factor=4, softmax_scale=None)]),
)
def test_softcap(device, softcap, causal, dtype, head_dim, deterministic, setup):
    q, k, v = make_qkv(2, *setup["seqlens"], 4, 2, head_dim, dtype, device=device)
    q, k = q * 4, k * setup["k_factor"]
    scale = setup["softmax_scale"]
    out, _ = check_forward_and_gradients(q, k, v, causal=causal, softmax_scale=scale, softcap=softcap,
                                         deterministic=deterministic)
    uncapped = flash_ext.attention(q, k, v, causal=causal, softmax_scale=scale)
    assert (out.float() - uncapped.float()).abs().max() > 0.1, "softcap made no difference"


# ---- ALiBi -------------------------------------------------------------------------------------

PER_BATCH = [named(False, "slopes-heads"), named(True, "slopes-batch-heads")]


@parametrize_devices(
    cpu=dict(per_batch=PER_BATCH, causal=CAUSAL, dtype=[torch.float32, torch.float16], head_dim=[32],
             deterministic=[False], shape=[(3, 90, 120)]),
    cuda=dict(per_batch=PER_BATCH, causal=CAUSAL, dtype=[torch.bfloat16], head_dim=[64, 128, 256],
              deterministic=DQ_PATHS, shape=[(2, 160, 230)]),
)
def test_alibi(device, per_batch, causal, dtype, head_dim, deterministic, shape):
    batch, seqlen_q, seqlen_k = shape
    q, k, v = make_qkv(batch, seqlen_q, seqlen_k, 4, 2, head_dim, dtype, device=device)
    slopes = alibi_slopes(batch, 4, per_batch, device)
    out, _ = check_forward_and_gradients(q, k, v, causal=causal, alibi_slopes=slopes, deterministic=deterministic)
    assert (out.float() - flash_ext.attention(q, k, v, causal=causal).float()).abs().max() > 0.01


def test_alibi_with_softcap_and_window():
    """ALiBi is added after the softcap; both are zero outside the window."""
    q, k, v = make_qkv(2, 100, 100, 4, 4, 32, torch.float32)
    check_forward_and_gradients(q * 3, k, v, window_size=(20, 5), softcap=5.0, alibi_slopes=alibi_slopes(2, 4, True))


# ---- Dropout against the reference with the call's own mask -------------------------------------


@parametrize_devices(
    cpu=dict(seqlens=[(97, 130), (130, 61)], causal=CAUSAL, dtype=CPU_DTYPES, head_dim=[32], deterministic=[False]),
    cuda=dict(seqlens=[(177, 203)], causal=CAUSAL, dtype=[torch.bfloat16], head_dim=[64, 128, 256],
              deterministic=DQ_PATHS),
)
def test_dropout_matches_reference_with_its_mask(device, seqlens, causal, dtype, head_dim, deterministic):
    """Forward and gradients against the reference with the keep mask of the very call: the
    backward must regenerate the forward's mask for the gradients to match."""
    q, k, v = make_qkv(2, *seqlens, 4, 2, head_dim, dtype, device=device)
    check_forward_and_gradients(q, k, v, causal=causal, dropout_p=0.17, deterministic=deterministic)


def test_dropout_changes_the_output_but_not_lse():
    q, k, v = make_qkv(2, 64, 64, 2, 2, 32, torch.float32)
    out, lse, rng_state = attention_with_rng_state(q, k, v, dropout_p=0.17)
    out_plain, lse_plain = flash_ext.attention(q, k, v, return_lse=True)
    assert (out - out_plain).abs().max() > 0.01
    torch.testing.assert_close(lse, lse_plain, rtol=0, atol=1e-6)  # lse is of the undropped softmax
    assert rng_state.dtype == torch.int64 and rng_state.shape == (2,) and rng_state.any()


# ---- Variable-length batches ---------------------------------------------------------------------

# CPU: lengths with 0 and 1 and one long sequence; key lengths differ from query lengths.
CPU_LENGTHS = [named(([0, 1, 37, 300, 5, 64], [3, 0, 64, 260, 1, 70]), "mixed")]
CUDA_LENGTHS = [named(([5, 0, 70, 1, 300, 129], [9, 3, 64, 1, 300, 200]), "mixed"),
                named(([128, 128], [128, 128]), "equal"),
                named(([3, 17], [0, 40]), "no_keys")]
# The features as functions of (batch, device).
VARLEN_FEATURES = {
    "plain": lambda batch, device: {},
    "causal": lambda batch, device: dict(causal=True),
    "window": lambda batch, device: dict(window_size=(16, 4)),
    "softcap": lambda batch, device: dict(softcap=30.0, softmax_scale=1.0),
    "alibi": lambda batch, device: dict(alibi_slopes=alibi_slopes(batch, 4, True, device)),
    "dropout": lambda batch, device: dict(dropout_p=0.17),
}


@parametrize_devices(
    cpu=dict(lengths=CPU_LENGTHS, feature=list(VARLEN_FEATURES), dtype=[torch.float32, torch.bfloat16],
             head_dim=[32], deterministic=[False]),
    cuda=dict(lengths=CUDA_LENGTHS, feature=["plain", "causal"], dtype=[torch.bfloat16], head_dim=[64, 128, 256, 59],
              deterministic=DQ_PATHS),
)
def test_varlen(device, lengths, feature, dtype, head_dim, deterministic):
    lengths_q, lengths_k = lengths
    q, k, v, cu_q, cu_k = make_varlen_qkv(lengths_q, lengths_k, 4, 2, head_dim, dtype, device=device)
    features = VARLEN_FEATURES[feature](len(lengths_q), device)
    causal = features.pop("causal", False)
    out, lse = check_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, **features)
    check_varlen_gradients(q, k, v, cu_q, cu_k, causal=causal, deterministic=deterministic, **features)
    # A sequence with queries but no key: out 0 and lse -inf.
    for b, (length_q, length_k) in enumerate(zip(lengths_q, lengths_k)):
        if length_q and not length_k:
            rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
            assert torch.equal(out[rows], torch.zeros_like(out[rows])) and torch.isneginf(lse[:, rows]).all()


@parametrize_devices(
    cpu=dict(causal=CAUSAL, setup=[dict(lengths=([70, 1, 130], [90, 65, 129]), dtype=torch.float32, head_dim=40,
                                        window_size=(50, -1), gradients=True)]),
    # Forward only: the default CUDA backward sums dQ with atomics, in an order that need not repeat.
    cuda=dict(causal=[True], setup=[dict(lengths=([37, 200, 1], [50, 260, 9]), dtype=torch.float16, head_dim=128,
                                         window_size=(-1, -1), gradients=False)]),
)
def test_varlen_equals_dense_per_sequence(device, causal, setup):
    """Each packed sequence gives bit for bit what a dense call on it alone gives (forward and, on the CPU,
    gradients): the sequences do not see each other and tiles start at each sequence's start."""
    lengths_q, lengths_k = setup["lengths"]
    q, k, v, cu_q, cu_k = make_varlen_qkv(lengths_q, lengths_k, 4, 2, setup["head_dim"], setup["dtype"],
                                          device=device)
    options = dict(causal=causal, window_size=setup["window_size"])
    leaves = [t.clone().requires_grad_(setup["gradients"]) for t in (q, k, v)]
    out, lse = flash_ext.attention_varlen(*leaves, cu_q, cu_k, max(lengths_q), max(lengths_k), return_lse=True,
                                          **options)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout) if setup["gradients"] else None
    for b in range(len(lengths_q)):
        rows_q = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rows_k = slice(int(cu_k[b]), int(cu_k[b + 1]))
        dense = [t[rows].detach().clone()[None].requires_grad_(setup["gradients"])
                 for t, rows in zip((q, k, v), (rows_q, rows_k, rows_k))]
        out_b, lse_b = flash_ext.attention(*dense, return_lse=True, **options)
        assert torch.equal(out[rows_q].detach(), out_b[0].detach()), f"sequence {b}: out differs from the dense call"
        assert torch.equal(lse[:, rows_q], lse_b[0]), f"sequence {b}: lse differs from the dense call"
        if grads is not None:
            grads_b = torch.autograd.grad(out_b, dense, dout[rows_q][None])
            for name, grad, grad_b, rows in zip(("dq", "dk", "dv"), grads, grads_b, (rows_q, rows_k, rows_k)):
                assert torch.equal(grad[rows], grad_b[0]), f"sequence {b}: {name} differs from the dense call"


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


@parametrize_devices(
    cpu=dict(dtype=CPU_DTYPES, setup=[dict(lengths=([1, 90, 0, 150], [40, 90, 8, 200]), head_dim=48, causal=True,
                                           window_size=(40, 10), softcap=20.0)]),
    cuda=dict(dtype=[torch.float16], setup=[dict(lengths=([90, 0, 1, 257], [120, 7, 1, 300]), head_dim=128,
                                                 causal=False, window_size=(48, 16), softcap=30.0)]),
)
def test_varlen_gqa_window_softcap_alibi_dropout(device, dtype, setup):
    lengths_q, lengths_k = setup["lengths"]
    q, k, v, cu_q, cu_k = make_varlen_qkv(lengths_q, lengths_k, 6, 2, setup["head_dim"], dtype, device=device)
    features = dict(window_size=setup["window_size"], softcap=setup["softcap"],
                    alibi_slopes=alibi_slopes(len(lengths_q), 6, True, device), dropout_p=0.17)
    check_varlen_forward(q, k, v, cu_q, cu_k, causal=setup["causal"], **features)
    check_varlen_gradients(q, k, v, cu_q, cu_k, causal=setup["causal"], **features)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_dense_gqa_window_softcap_alibi_dropout(dtype):
    q, k, v = make_qkv(2, 110, 170, 6, 3, 64, dtype, layout="transposed")
    features = dict(window_size=(64, 32), softcap=30.0, alibi_slopes=alibi_slopes(2, 6, False), dropout_p=0.17)
    check_forward_and_gradients(q, k, v, **features)

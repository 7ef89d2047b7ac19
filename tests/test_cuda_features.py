"""The CUDA kernels' features against the float64 reference (flash-attn's tolerance rule), forward and
gradients with both dQ paths: sliding windows, softcap, ALiBi, variable-length batches and all of
them combined. Dropout is not in the CUDA kernels yet: it must fail with a clear error.
Every test here is marked `cuda` and is skipped where torch sees no GPU."""
import pytest
import torch

import flash_ext
from flash_ext.testing import attention_with_rng_state
from make_inputs import make_qkv, make_varlen_qkv
from tolerance import check_forward, check_gradients, check_varlen_forward, check_varlen_gradients

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
DQ_PATHS = [False, True]
DQ_PATH_IDS = ["atomic_dq", "deterministic"]


def check_forward_and_gradients(q, k, v, *, causal=False, deterministic=False, **features):
    out, lse = check_forward(q, k, v, causal=causal, **features)
    check_gradients(q, k, v, causal=causal, deterministic=deterministic, **features)
    return out, lse


def alibi_slopes(batch, heads, per_batch):
    slopes = 2.0 ** (-8.0 * torch.arange(1, heads + 1, dtype=torch.float32, device="cuda") / heads)
    return slopes[None] * torch.rand(batch, 1, device="cuda") * 2 if per_batch else slopes


@pytest.mark.parametrize("deterministic", DQ_PATHS, ids=DQ_PATH_IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(113, 250), (250, 113), (300, 300)])
@pytest.mark.parametrize("window_size", [(0, 0), (16, 0), (-1, 8), (100, 100), (70, 130)], ids=str)
def test_sliding_window(window_size, seqlen_q, seqlen_k, head_dim, deterministic):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.bfloat16, device="cuda")
    check_forward_and_gradients(q, k, v, window_size=window_size, deterministic=deterministic)


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(200, 200), (150, 213), (213, 150)])
def test_window_edges_at_tile_boundaries(seqlen_q, seqlen_k):
    """Band skipping works on 64- and 128-row tiles: window edges just before, on and after a boundary."""
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 64, torch.float16, device="cuda")
    for left in (-1, 0, 1, 63, 64, 65, 127, 128):
        for right in (-1, 0, 1, 63, 64, 65):
            check_forward_and_gradients(q, k, v, window_size=(left, right))


def test_causal_with_window_equals_the_clamped_window():
    q, k, v = make_qkv(2, 90, 150, 2, 2, 64, torch.bfloat16, device="cuda")
    combined = flash_ext.attention(q, k, v, causal=True, window_size=(16, 8), return_lse=True)
    clamped = flash_ext.attention(q, k, v, window_size=(16, 0), return_lse=True)
    for a, b in zip(combined, clamped):
        assert torch.equal(a, b)


@pytest.mark.parametrize("deterministic", DQ_PATHS, ids=DQ_PATH_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("softcap", [30.0, 50.0])
def test_softcap(softcap, head_dim, dtype, deterministic):
    q, k, v = make_qkv(2, 177, 203, 4, 2, head_dim, dtype, device="cuda")
    # Large scores, so that the cap actually bends them.
    check_forward_and_gradients(q * 4, k * 4, v, causal=True, softcap=softcap, deterministic=deterministic)


@pytest.mark.parametrize("deterministic", DQ_PATHS, ids=DQ_PATH_IDS)
@pytest.mark.parametrize("per_batch", [False, True], ids=["per_head", "per_batch_and_head"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_alibi(causal, head_dim, per_batch, deterministic):
    q, k, v = make_qkv(2, 160, 230, 4, 2, head_dim, torch.bfloat16, device="cuda")
    check_forward_and_gradients(q, k, v, causal=causal, alibi_slopes=alibi_slopes(2, 4, per_batch),
                                deterministic=deterministic)


VARLEN_LENGTHS = {
    "mixed": ([5, 0, 70, 1, 300, 129], [9, 3, 64, 1, 300, 200]),
    "equal": ([128, 128], [128, 128]),
    "no_keys": ([3, 17], [0, 40]),
}


@pytest.mark.parametrize("deterministic", DQ_PATHS, ids=DQ_PATH_IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 59])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("lengths", list(VARLEN_LENGTHS.values()), ids=list(VARLEN_LENGTHS))
def test_varlen(lengths, causal, head_dim, deterministic):
    q, k, v, cu_q, cu_k = make_varlen_qkv(*lengths, 4, 2, head_dim, torch.bfloat16, device="cuda")
    check_varlen_forward(q, k, v, cu_q, cu_k, causal=causal)
    check_varlen_gradients(q, k, v, cu_q, cu_k, causal=causal, deterministic=deterministic)


def test_varlen_sequence_equals_dense_call():
    """Each packed sequence gives bit for bit what a dense call on it alone gives."""
    lengths_q, lengths_k = [37, 200, 1], [50, 260, 9]
    q, k, v, cu_q, cu_k = make_varlen_qkv(lengths_q, lengths_k, 4, 2, 128, torch.float16, device="cuda")
    out, lse = flash_ext.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True,
                                          return_lse=True)
    for b in range(len(lengths_q)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        out_b, lse_b = flash_ext.attention(q[None, rows], k[None, keys], v[None, keys], causal=True, return_lse=True)
        assert torch.equal(out[rows], out_b[0]), f"sequence {b}: out differs from the dense call"
        assert torch.equal(lse[:, rows], lse_b[0]), f"sequence {b}: lse differs from the dense call"


@pytest.mark.parametrize("deterministic", DQ_PATHS, ids=DQ_PATH_IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_all_features_combined(head_dim, deterministic):
    """varlen + GQA + window + softcap + ALiBi (no dropout: not on CUDA yet)."""
    q, k, v, cu_q, cu_k = make_varlen_qkv([90, 0, 257], [120, 7, 300], 6, 2, head_dim, torch.bfloat16, device="cuda")
    features = dict(window_size=(48, 16), softcap=30.0, alibi_slopes=alibi_slopes(3, 6, True))
    check_varlen_forward(q, k, v, cu_q, cu_k, causal=False, **features)
    check_varlen_gradients(q, k, v, cu_q, cu_k, causal=False, deterministic=deterministic, **features)


def test_dropout_raises_on_cuda():
    q, k, v = make_qkv(2, 64, 64, 4, 2, 64, torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match=r"dropout \(dropout_p=0.1\) is not supported by the CUDA kernels yet"):
        flash_ext.attention(q, k, v, dropout_p=0.1)


def test_rng_state_is_zeros_without_dropout():
    q, k, v = make_qkv(1, 16, 16, 2, 2, 64, torch.float16, device="cuda")
    _, _, rng_state = attention_with_rng_state(q, k, v)
    assert rng_state.device == q.device and torch.equal(rng_state.cpu(), torch.zeros(2, dtype=torch.int64))

"""The CUDA kernels' features against the float64 reference (flash-attn's tolerance rule), forward and
gradients with both dQ paths: sliding windows, softcap, ALiBi, dropout (against the reference with the
call's own keep mask, which flash_ext.testing computes with the CPU's Philox function: so these also
show that CPU and CUDA drop the same elements), variable-length batches and all of them combined.
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


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("seqlen_q,seqlen_k,window_size", [(1100, 1100, (16, 0)), (1100, 1100, (300, 200)),
                                                           (1100, 700, (0, 0)), (900, 1300, (1024, 0)),
                                                           (1100, 1100, (129, -1))], ids=str)
def test_window_walk_over_many_tiles(seqlen_q, seqlen_k, window_size, dtype):
    """hd128 windows take the persistent forward (one CTA per SM walking row blocks): with 3 x 8 heads x 7-9
    row blocks there are more tiles than SMs, so each CTA reuses its buffers over several tiles of different
    lengths (and, with seqlen_q > seqlen_k at window (0, 0), skips tiles that see no key)."""
    q, k, v = make_qkv(3, seqlen_q, seqlen_k, 8, 4, 128, dtype, device="cuda")
    check_forward(q, k, v, causal=False, window_size=window_size)
    # Twice in a row: a walk must leave nothing behind that the next launch depends on.
    check_forward(q, k, v, causal=False, window_size=window_size)


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


@pytest.mark.parametrize("features", [{}, {"softcap": 20.0}, {"causal": True}, {"window_size": (300, 200)}],
                         ids=["full", "softcap", "causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_alibi_long_rows(head_dim, features):
    """Many key blocks on either side of the diagonal (the forward splits ALiBi's bias into a column and a
    row term there), small slopes so that far blocks still carry weight, seqlen_q != seqlen_k."""
    q, k, v = make_qkv(2, 700, 1000, 4, 2, head_dim, torch.bfloat16, device="cuda")
    slopes = torch.tensor([[0.002, 0.01, 0.04, 0.2], [0.005, 0.02, 0.08, 0.3]], device="cuda")
    check_forward_and_gradients(q * 2, k, v, alibi_slopes=slopes, **features)


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
    """varlen + GQA + window + softcap + ALiBi (with dropout too: test_dropout_varlen_with_every_feature)."""
    q, k, v, cu_q, cu_k = make_varlen_qkv([90, 0, 257], [120, 7, 300], 6, 2, head_dim, torch.bfloat16, device="cuda")
    features = dict(window_size=(48, 16), softcap=30.0, alibi_slopes=alibi_slopes(3, 6, True))
    check_varlen_forward(q, k, v, cu_q, cu_k, causal=False, **features)
    check_varlen_gradients(q, k, v, cu_q, cu_k, causal=False, deterministic=deterministic, **features)


@pytest.mark.parametrize("deterministic", DQ_PATHS, ids=DQ_PATH_IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout(causal, head_dim, deterministic):
    q, k, v = make_qkv(2, 177, 203, 4, 2, head_dim, torch.bfloat16, device="cuda")
    check_forward_and_gradients(q, k, v, causal=causal, dropout_p=0.17, deterministic=deterministic)


def test_dropout_varlen_with_every_feature():
    q, k, v, cu_q, cu_k = make_varlen_qkv([90, 0, 1, 257], [120, 7, 1, 300], 6, 2, 128, torch.float16, device="cuda")
    features = dict(window_size=(48, 16), softcap=30.0, alibi_slopes=alibi_slopes(4, 6, True), dropout_p=0.17)
    check_varlen_forward(q, k, v, cu_q, cu_k, causal=False, **features)
    check_varlen_gradients(q, k, v, cu_q, cu_k, causal=False, **features)


def test_dropout_is_reproducible_after_manual_seed_and_differs_between_calls():
    q, k, v = make_qkv(2, 300, 300, 4, 4, 64, torch.bfloat16, device="cuda")
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        runs.append([attention_with_rng_state(q, k, v, dropout_p=0.2) for _ in range(2)])
    for (out_a, _, rng_a), (out_b, _, rng_b) in zip(runs[0], runs[1]):
        assert torch.equal(rng_a, rng_b) and torch.equal(out_a, out_b), "not reproducible after torch.manual_seed"
    assert not torch.equal(runs[0][0][2], runs[0][1][2]), "two calls drew the same seed and offset"
    assert not torch.equal(runs[0][0][0], runs[0][1][0])


def test_dropped_fraction_on_cuda():
    """With v = 1 for one key and 0 elsewhere, out[i] = P_ij * keep_ij / (1 - p): the kept fraction
    over many rows and heads is the keep rate."""
    p = 0.17
    batch, seqlen, heads = 4, 512, 8
    q = torch.zeros(batch, seqlen, heads, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros_like(q)  # uniform probabilities 1 / seqlen
    v = torch.zeros_like(q)
    v[..., 0] = 1.0
    out, _, rng_state = attention_with_rng_state(q, k, v, dropout_p=p)
    keep = flash_ext.testing.dropout_keep_mask(rng_state, batch, heads, seqlen, seqlen, p)
    expected = keep.float().mean(-1) / (1 - p)  # (batch, heads, seqlen): sum over keys of keep / seqlen / (1 - p)
    assert torch.allclose(out[..., 0].float().permute(0, 2, 1).cpu(), expected, atol=2e-2)
    assert abs(1 - keep.float().mean().item() - p) < 0.01


def test_dropout_in_a_cuda_graph():
    """Captured: every replay draws new offsets on the device; rng_state (written by the kernel) says
    which, and the output matches the reference with that mask."""
    q, k, v = make_qkv(2, 200, 230, 4, 2, 64, torch.float16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        attention_with_rng_state(q, k, v, dropout_p=0.17)  # warm-up on the side stream
        with torch.cuda.graph(graph, stream=stream):
            out, lse, rng_state = attention_with_rng_state(q, k, v, dropout_p=0.17)
    torch.cuda.current_stream().wait_stream(stream)
    states = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        states.append(rng_state.clone())
        keep = flash_ext.testing.dropout_keep_mask(rng_state, 2, 4, 200, 230, 0.17)
        from flash_ext.reference import attention_ref
        ref, _ = attention_ref(q, k, v, dropout_p=0.17, dropout_mask=keep.to(q.device))
        assert (out.double() - ref).abs().max().item() < 0.02
    assert not torch.equal(states[0], states[1]), "graph replays reused one dropout mask"


def test_rng_state_is_zeros_without_dropout():
    q, k, v = make_qkv(1, 16, 16, 2, 2, 64, torch.float16, device="cuda")
    _, _, rng_state = attention_with_rng_state(q, k, v)
    assert rng_state.device == q.device and torch.equal(rng_state.cpu(), torch.zeros(2, dtype=torch.int64))

"""The CUDA kernels' features where they have no CPU counterpart, against the float64 reference
(flash-attn's tolerance rule): persistent walks over many tiles, long ALiBi rows, every feature combined
over both dQ paths, the dropped fraction and dropout in a CUDA graph. (The features on both devices are
tested in test_features.py, with CUDA parameters marked `cuda`.) Every test here is marked `cuda` and is
skipped where torch sees no GPU."""
import pytest
import torch

import flash_ext
from devices import DQ_PATHS, DTYPE_IDS
from flash_ext.reference import attention_ref
from flash_ext.testing import attention_with_rng_state
from make_inputs import alibi_slopes, make_qkv, make_varlen_qkv
from tolerance import check_forward, check_forward_and_gradients, check_varlen_forward, check_varlen_gradients

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_NAMES = [DTYPE_IDS[dtype] for dtype in DTYPES]
DQ_PATH_VALUES = [path.value for path in DQ_PATHS]
DQ_PATH_IDS = [path.id for path in DQ_PATHS]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_NAMES)
@pytest.mark.parametrize("seqlen_q,seqlen_k,window_size", [(1100, 1100, (16, 0)), (1100, 1100, (300, 200)),
                                                           (1100, 700, (0, 0)), (900, 1300, (1024, 0)),
                                                           (1100, 1100, (129, -1)), (1100, 1100, (-1, -1)),
                                                           (1100, 1100, (-1, 0)), (2100, 700, (-1, 0)),
                                                           (700, 1300, (-1, 0))], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("score_mods", [{}, {"softcap": 20.0}, {"alibi": True}, {"softcap": 20.0, "alibi": True}],
                         ids=["plain", "softcap", "alibi", "softcap+alibi"])
def test_persistent_forward_over_many_tiles(seqlen_q, seqlen_k, window_size, head_dim, dtype, score_mods):
    """Calls without dropout take the persistent forward (one CTA per SM taking row blocks from a counter):
    with 3 x 8 heads x 6-17 row blocks there are more tiles than SMs, so each CTA reuses its buffers over
    several tiles of different lengths and heads (each with its own ALiBi slope; with seqlen_q > seqlen_k at
    window (0, 0) or causal, passing tiles that see no key between others)."""
    q, k, v = make_qkv(3, seqlen_q, seqlen_k, 8, 4, head_dim, dtype, device="cuda")
    features = {"softcap": score_mods["softcap"]} if "softcap" in score_mods else {}
    if score_mods.get("alibi"):
        features["alibi_slopes"] = alibi_slopes(3, 8, True, "cuda") / 8  # far keys still carry weight
    check_forward(q, k, v, causal=False, window_size=window_size, **features)
    # Twice in a row: a walk must leave nothing behind that the next launch depends on.
    check_forward(q, k, v, causal=False, window_size=window_size, **features)


@pytest.mark.parametrize("features", [{}, {"causal": True}, {"window_size": (100, 0)}, {"softcap": 20.0, "alibi": True}],
                         ids=["full", "causal", "window", "softcap+alibi"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_persistent_forward_varlen(head_dim, features):
    """Variable-length batches in the persistent forward: 41 sequences (more than the 32 its tile numbering sums
    per step), empty ones, ones shorter than a row block, one row past a block, seqlen_q above and below
    seqlen_k; many more tiles than SMs, and the grid's row blocks past each shorter sequence never handed out."""
    generator = torch.Generator().manual_seed(head_dim)
    lengths_q = torch.randint(0, 600, (41,), generator=generator).tolist()
    lengths_k = torch.randint(0, 600, (41,), generator=generator).tolist()
    lengths_q[:6], lengths_k[:6] = [0, 1, 128, 129, 700, 5], [9, 0, 128, 300, 129, 700]
    q, k, v, cu_q, cu_k = make_varlen_qkv(lengths_q, lengths_k, 8, 2, head_dim, torch.bfloat16, device="cuda")
    options = {name: value for name, value in features.items() if name != "alibi"}
    if features.get("alibi"):
        options["alibi_slopes"] = alibi_slopes(41, 8, True, "cuda") / 8
    causal = options.pop("causal", False)
    check_varlen_forward(q, k, v, cu_q, cu_k, causal=causal, **options)


@pytest.mark.parametrize("features", [{}, {"softcap": 20.0}, {"causal": True}, {"window_size": (300, 200)}],
                         ids=["full", "softcap", "causal", "window"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_alibi_long_rows(head_dim, features):
    """Many key blocks on either side of the diagonal (the forward splits ALiBi's bias into a column and a
    row term there), small slopes so that far blocks still carry weight, seqlen_q != seqlen_k."""
    q, k, v = make_qkv(2, 700, 1000, 4, 2, head_dim, torch.bfloat16, device="cuda")
    slopes = torch.tensor([[0.002, 0.01, 0.04, 0.2], [0.005, 0.02, 0.08, 0.3]], device="cuda")
    check_forward_and_gradients(q * 2, k, v, alibi_slopes=slopes, **features)


@pytest.mark.parametrize("deterministic", DQ_PATH_VALUES, ids=DQ_PATH_IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_all_features_combined(head_dim, deterministic):
    """varlen + GQA + window + softcap + ALiBi over both dQ paths (with dropout too:
    test_features.py, test_varlen_gqa_window_softcap_alibi_dropout)."""
    q, k, v, cu_q, cu_k = make_varlen_qkv([90, 0, 257], [120, 7, 300], 6, 2, head_dim, torch.bfloat16, device="cuda")
    features = dict(window_size=(48, 16), softcap=30.0, alibi_slopes=alibi_slopes(3, 6, True, "cuda"))
    check_varlen_forward(q, k, v, cu_q, cu_k, causal=False, **features)
    check_varlen_gradients(q, k, v, cu_q, cu_k, causal=False, deterministic=deterministic, **features)


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
        ref, _ = attention_ref(q, k, v, dropout_p=0.17, dropout_mask=keep.to(q.device))
        assert (out.double() - ref).abs().max().item() < 0.02
    assert not torch.equal(states[0], states[1]), "graph replays reused one dropout mask"

"""The CUDA path where it has no CPU counterpart: gradients over head dims, seqlens and both dQ paths,
the atomic dQ path against the deterministic one, split tail walks, the dQ conversion overlap, the
persistent dK/dV CTAs, CPU/CUDA agreement, 64-bit offsets, CUDA graphs, and which kernels (sm80 or sm90)
run. (The forward over head dims, seqlens, layouts and the other properties that hold on both devices is
tested in test_numerics.py and test_api.py, with CUDA parameters marked `cuda`.) Every test here is
marked `cuda` and is skipped where torch sees no GPU.
"""
import pytest
import torch

import flash_ext
from cuda_poison import check_cuda_forward
from flash_ext.reference import attention_ref
from flash_ext.testing import sm90_kernels
from kernel_names import backward_kernel_names, forward_kernel_names, sm90_expected
from make_inputs import make_qkv, make_varlen_qkv
from tolerance import FWD_FACTOR, assert_within_tolerance, check_gradients, check_varlen_gradients

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
HEAD_DIMS = [32, 64, 96, 128, 160, 192, 224, 256, 59]


@pytest.fixture
def sm80_only():
    """The test runs with the sm90 kernels off (the sm80 ones run on every GPU from sm_80 on)."""
    with sm90_kernels(False):
        yield


def test_float32_is_rejected_on_cuda():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 64, torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="q has dtype Float; expected float16 or bfloat16 on CUDA"):
        flash_ext.attention(q, k, v)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_dq", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gradients(head_dim, dtype, causal, deterministic):
    """Both dQ paths: fp32 atomics from the dK/dV kernel (default) and the separate dQ kernel."""
    q, k, v = make_qkv(2, 257, 190, 6, 2, head_dim, dtype, device="cuda")
    check_gradients(q, k, v, causal=causal, deterministic=deterministic)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 1), (1, 239), (17, 17), (128, 217), (512, 256), (1023, 1024)])
@pytest.mark.parametrize("heads_q,heads_kv", [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_gradients_seqlens(seqlen_q, seqlen_k, heads_q, heads_kv, causal):
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, heads_q, heads_kv, 128, torch.bfloat16, device="cuda")
    check_gradients(q, k, v, causal=causal)


def test_atomic_dq_path_keeps_dk_dv_bitwise_and_dq_close(sm80_only):
    """deterministic=False: dK and dV have a single writer, so they are bit-identical to the
    deterministic path's; dQ differs at most by the rounding of differently ordered fp32 sums. (Both
    paths of the sm80 kernels: on Hopper the sm90 dK/dV kernel takes the atomic path at head_dim 128,
    with its own summation order: test_sm90_backward_is_taken.)"""
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 300, 280, 6, 2, 128, torch.bfloat16, device="cuda"))
    dout = torch.randn(2, 300, 6, 128, dtype=torch.bfloat16, device="cuda")
    grads = {}
    for deterministic in (False, True):
        out = flash_ext.attention(q, k, v, causal=True, deterministic=deterministic)
        grads[deterministic] = torch.autograd.grad(out, (q, k, v), dout)
    for name, fast, exact in zip(("dq", "dk", "dv"), grads[False], grads[True]):
        if name == "dq":
            bound = 2 * torch.finfo(torch.bfloat16).eps * exact.float().abs().max().item()
            assert (fast.float() - exact.float()).abs().max().item() <= bound, "dq: the two paths differ beyond rounding"
        else:
            assert torch.equal(fast, exact), f"{name} differs between the two dQ paths"


def split_tail_inputs(heads_per_kv, dtype=torch.bfloat16):
    """One more dK/dV walk than the GPU has SMs (hd128: one 128-key block per kv head, 100 keys), so that
    the last walk is a tail walk: run in pieces whose dK / dV meet in fp32 sums (TailSplit in params.h)."""
    heads_kv = torch.cuda.get_device_properties(0).multi_processor_count + 1
    return make_qkv(1, 1024, 100, heads_kv * heads_per_kv, heads_kv, 128, dtype, device="cuda")


@pytest.mark.parametrize("heads_per_kv", [1, 2], ids=["mha", "gqa"])
def test_gradients_with_split_tail_walks(heads_per_kv, sm80_only):
    """Whole waves of walks plus split tail walks; with GQA a piece may cross a query-head boundary.
    (The split is the sm80 dK/dV kernel's; on Hopper the sm90 one would take head_dim 128.)"""
    check_gradients(*split_tail_inputs(heads_per_kv), causal=False)


def test_split_tail_walks_are_taken(sm80_only):
    """The shapes above do run the split (its dK / dV conversion kernel shows in the profile), and causal
    attention, whose walks differ in length, does not."""
    kernels = {}
    for causal in (False, True):
        q, k, v = (t.requires_grad_() for t in split_tail_inputs(2))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = flash_ext.attention(q, k, v, causal=causal)
            out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
        kernels[causal] = [event.key for event in prof.key_averages()]
    assert any("convert_dkv" in name for name in kernels[False]), f"no split: {kernels[False]}"
    assert not any("convert_dkv" in name for name in kernels[True]), f"causal was split: {kernels[True]}"


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("features", [{"causal": False}, {"causal": True}, {"causal": False, "window_size": (300, 0)}],
                         ids=["full", "causal", "window"])
def test_dq_conversion_overlapping_the_dkdv_kernel(features, head_dim):
    """After the sm90 dK/dV kernel the dQ conversion starts on the SMs its last wave leaves idle and converts
    a (batch, head)'s rows once all CTAs of that (batch, kv head) have counted themselves
    (common/finished_walks.cuh): 3 x 8 kv heads x 8-30 key blocks are 2-6 waves of CTAs, with GQA and
    seqlen_q != seqlen_k; twice in a row, since the counters must start from zero in every call."""
    q, k, v = make_qkv(3, 1000, 1900, 16, 8, head_dim, torch.bfloat16, device="cuda")
    for _ in range(2):
        check_gradients(q, k, v, **features)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_dq_conversion_overlap_with_variable_lengths(head_dim):
    """The same handshake in a variable-length batch: each sequence waits for its own CTAs, counted from its
    key length (none for the sequence without keys, 14 or 27 for the longest, one for the shortest)."""
    lengths_q, lengths_k = [700, 5, 0, 1500, 300], [900, 0, 40, 1700, 1]
    q, k, v, cu_q, cu_k = make_varlen_qkv(lengths_q, lengths_k, 16, 8, head_dim, torch.bfloat16, device="cuda")
    for causal in (False, True):
        check_varlen_gradients(q, k, v, cu_q, cu_k, causal=causal)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("features", [{"window_size": (0, 0)}, {"window_size": (200, 0), "softcap": 30.0},
                                      {"causal": True, "dropout_p": 0.17}],
                         ids=["diagonal_window", "window_softcap", "causal_dropout"])
def test_persistent_dkdv_ctas_over_many_walks(features, head_dim):
    """The sm90 dK/dV kernel's CTAs are persistent (one per SM, each taking walks from a counter until none
    is left): 3 x 8 kv heads x 15-30 key blocks are more walks than SMs, of different lengths, so each CTA
    reuses its buffers and barriers over several walks, in each variant (plain, softcap, dropout). At window
    (0, 0) with seqlen_q < seqlen_k the first 1200 keys are seen by no query: walks of no step, whose dK / dV
    are zeros. Twice in a row: the counter must start from zero in every call."""
    q, k, v = make_qkv(3, 700, 1900, 16, 8, head_dim, torch.bfloat16, device="cuda")
    features = {"causal": False, **features}
    for _ in range(2):
        check_gradients(q, k, v, **features)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gradients_large_logits_are_finite(dtype):
    """Inputs scaled x30 (scores in the thousands): no NaN or inf in any gradient."""
    q, k, v = (t * 30 for t in make_qkv(1, 200, 200, 2, 2, 64, dtype, device="cuda"))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flash_ext.attention(q, k, v, causal=True)
    for name, grad in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), torch.randn_like(out))):
        assert torch.isfinite(grad).all(), f"{name} has non-finite values"


def test_gradients_match_cpu_path():
    q, k, v = make_qkv(1, 150, 170, 4, 2, 96, torch.float16, device="cpu")
    dout = torch.randn(1, 150, 4, 96, dtype=torch.float16)
    grads = {}
    for device in ("cpu", "cuda"):
        inputs = [t.to(device).requires_grad_() for t in (q, k, v)]
        out = flash_ext.attention(*inputs, causal=True)
        grads[device] = torch.autograd.grad(out, inputs, dout.to(device))
    for name, grad_cpu, grad_cuda in zip(("dq", "dk", "dv"), grads["cpu"], grads["cuda"]):
        err = (grad_cpu.float() - grad_cuda.cpu().float()).abs().max().item()
        scale = grad_cpu.float().abs().max().item()
        assert err <= 0.02 * scale, f"{name}: CPU and CUDA differ by {err} (magnitude {scale})"


def test_matches_cpu_path():
    """Same inputs on both devices: CUDA and the CPU specification agree within the rule's budget."""
    q, k, v = make_qkv(2, 150, 170, 4, 2, 96, torch.bfloat16, device="cpu")
    out_cpu, lse_cpu = flash_ext.attention(q, k, v, causal=True, return_lse=True)
    out_cuda, lse_cuda = flash_ext.attention(q.cuda(), k.cuda(), v.cuda(), causal=True, return_lse=True)
    out64, lse64 = attention_ref(q, k, v, causal=True)
    out_lowp, lse_lowp = attention_ref(q, k, v, causal=True, upcast=False)
    for name, result in (("out_cuda", out_cuda), ("out_cpu", out_cpu)):
        assert_within_tolerance(name, result.cpu(), out_lowp, out64, FWD_FACTOR)
    assert_within_tolerance("lse_cuda", lse_cuda.cpu(), lse_lowp, lse64, FWD_FACTOR)


def test_offsets_beyond_int32():
    """k and v of more than 2^31 elements: the second batch entry starts past 2^31, so any 32-bit
    offset arithmetic would read the wrong keys. Its output must equal, bit for bit, the same
    problem given as small tensors (whose correctness the other tests establish)."""
    heads, head_dim = 16, 128
    seqlen_k = 2**31 // (heads * head_dim) + 64  # one batch entry alone is past 2^31 elements
    q = torch.randn(2, 16, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, seqlen_k, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    assert k.numel() > 2**31
    out = flash_ext.attention(q, k, v)
    out_small = flash_ext.attention(q[1:].clone(), k[1:].clone(), v[1:].clone())
    assert torch.equal(out[1:], out_small), "the batch entry past 2^31 elements differs from the same problem alone"
    del k, v


def test_cuda_graph_capture():
    """No host synchronisation in the forward: it can be captured in a CUDA graph and replayed."""
    q, k, v = make_qkv(2, 200, 300, 4, 2, 59, torch.float16, device="cuda")
    expected = flash_ext.attention(q, k, v, causal=True)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_ext.attention(q, k, v, causal=True)  # warm-up on the side stream, as capture requires
        with torch.cuda.graph(graph, stream=stream):
            captured = flash_ext.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    for source in (q, k, v):
        source.copy_(torch.randn_like(source))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, flash_ext.attention(q, k, v, causal=True)), "graph replay differs from eager"
    assert not torch.equal(captured, expected), "replay did not see the new inputs"


# ---- The sm90 (wgmma + TMA) forward: dense calls at head_dim 64 / 128 / 256 on an H100 / H200 take it ----

@pytest.mark.skipif(not torch.cuda.is_available() or not sm90_expected(),
                    reason="needs a compute capability 9.0 GPU and a build with 90a")
def test_sm90_forward_is_taken():
    """hd64 / 128 / 256 calls run the sm90 kernels (plain, softcap, ALiBi, varlen: the persistent one; dropout:
    the one-tile one); hd96 and sm90_kernels(False) the sm80 one; kernel_path says which."""
    q, k, v = make_qkv(2, 300, 300, 4, 2, 128, torch.bfloat16, device="cuda")
    for head_dim in (64, 128, 256):
        q, k, v = make_qkv(2, 300, 300, 4, 2, head_dim, torch.bfloat16, device="cuda")
        slopes = torch.full((4,), 0.1, device="cuda")
        for features in ({}, {"softcap": 30.0}, {"alibi_slopes": slopes}, {"dropout_p": 0.1}):
            names = forward_kernel_names(q, k, v, causal=True, **features)
            # without dropout: the persistent kernel (its own test: test_cuda_features.py)
            kernel = "attention_fwd_sm90_kernel" if "dropout_p" in features else "attention_fwd_sm90_persistent_kernel"
            assert any(kernel in name for name in names), f"hd{head_dim} {features}: {names}"
        assert "sm90 wgmma" in flash_ext.kernel_path(q)
    q, k, v, cu_q, cu_k = make_varlen_qkv([37, 200, 1], [50, 260, 9], 4, 2, 128, torch.bfloat16, device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 200, 260, causal=True)
        torch.cuda.synchronize()
    assert any("attention_fwd_sm90_persistent_kernel" in event.key for event in prof.key_averages()), "varlen"
    q, k, v = make_qkv(2, 300, 300, 4, 2, 96, torch.bfloat16, device="cuda")
    names = forward_kernel_names(q, k, v)
    assert not any("sm90" in name for name in names), names
    q, k, v = make_qkv(2, 300, 300, 4, 2, 128, torch.bfloat16, device="cuda")
    with sm90_kernels(False):
        names = forward_kernel_names(q, k, v, causal=True)
        assert "sm90" not in flash_ext.kernel_path(q)
    assert not any("sm90" in name for name in names) and any("attention_fwd_kernel" in name for name in names), names
    assert "sm90 wgmma" in flash_ext.kernel_path(q)  # the setting is restored


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 239), (17, 17), (129, 127), (1000, 1000)])
def test_sm80_forward_where_sm90_is_default(seqlen_q, seqlen_k, causal, head_dim, dtype, sm80_only):
    """The sm80 forward at the head dims the sm90 one takes by default on Hopper still holds."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, dtype, device="cuda")
    check_cuda_forward(q, k, v, causal=causal)


# ---- The sm90 dK/dV kernel: head_dim 128 backward calls on an H100 / H200 take it ----

@pytest.mark.skipif(not torch.cuda.is_available() or not sm90_expected(),
                    reason="needs a compute capability 9.0 GPU and a build with 90a")
def test_sm90_backward_is_taken():
    """hd64 / 128 / 256 backward calls (plain, causal, softcap, ALiBi, window, dropout, GQA, varlen, deterministic)
    run the sm90 dK/dV kernel; other head dims and sm90_kernels(False) the sm80 one. Its gradients match the
    deterministic sm80 path's within rounding."""
    q, k, v = make_qkv(2, 300, 333, 4, 2, 128, torch.bfloat16, device="cuda")
    slopes = torch.rand(4, device="cuda")
    for features in ({}, {"causal": True}, {"softcap": 30.0}, {"alibi_slopes": slopes}, {"window_size": (50, 20)},
                     {"dropout_p": 0.1}):
        names = backward_kernel_names(q, k, v, **features)
        assert any("attention_bwd_dkdv_sm90_kernel" in name for name in names), f"{features}: {names}"
    assert "sm90 wgmma + TMA dK/dV" in flash_ext.kernel_path(q)
    names = backward_kernel_names(q, k, v, deterministic=True)
    assert any("dkdv_sm90" in name for name in names), f"deterministic: {names}"
    for head_dim in (64, 256):
        qh, kh, vh = make_qkv(2, 300, 333, 4, 2, head_dim, torch.bfloat16, device="cuda")
        assert any("dkdv_sm90" in name for name in backward_kernel_names(qh, kh, vh, causal=True)), head_dim
    q96, k96, v96 = make_qkv(2, 300, 333, 4, 2, 96, torch.bfloat16, device="cuda")
    assert not any("dkdv_sm90" in name for name in backward_kernel_names(q96, k96, v96))
    qv, kv, vv, cu_q, cu_k = make_varlen_qkv([37, 200, 0, 1], [50, 260, 9, 0], 4, 2, 128, torch.bfloat16, device="cuda")
    qv, kv, vv = (t.requires_grad_() for t in (qv, kv, vv))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = flash_ext.attention_varlen(qv, kv, vv, cu_q, cu_k, 200, 260, causal=True)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
    assert any("dkdv_sm90" in event.key for event in prof.key_averages()), "varlen: not sm90"

    # Against the deterministic sm80 path: the same math in another summation order.
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 300, 280, 6, 2, 128, torch.bfloat16, device="cuda"))
    dout = torch.randn(2, 300, 6, 128, dtype=torch.bfloat16, device="cuda")
    grads = {}
    for sm90 in (True, False):
        with sm90_kernels(sm90):
            out = flash_ext.attention(q, k, v, causal=True, deterministic=not sm90)
            grads[sm90] = torch.autograd.grad(out, (q, k, v), dout)
    for name, fast, exact in zip(("dq", "dk", "dv"), grads[True], grads[False]):
        bound = 4 * torch.finfo(torch.bfloat16).eps * exact.float().abs().max().item()
        err = (fast.float() - exact.float()).abs().max().item()
        assert err <= bound, f"{name}: the sm90 and sm80 backward differ by {err} (bound {bound})"

    with sm90_kernels(False):
        names = backward_kernel_names(q, k, v, causal=True)
    assert not any("sm90" in name for name in names) and any("attention_bwd_dkdv_kernel" in n for n in names), names


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", [(1, 239), (17, 17), (129, 127), (1000, 1000)])
def test_sm80_backward_where_sm90_is_default(seqlen_q, seqlen_k, causal, head_dim, sm80_only):
    """The sm80 dK/dV kernel at the head dims the sm90 one takes by default on Hopper still holds."""
    q, k, v = make_qkv(2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.bfloat16, device="cuda")
    check_gradients(q, k, v, causal=causal)

"""deterministic=True on Hopper: the sm90 dK/dV kernel adds dQ with atomics in one fixed order
(csrc/common/ordered_dq.cuh). Repeated backward calls give bitwise the same dq, dk, dv, with many walks
adding into the same dQ rows at once (several key blocks, GQA, causal and windowed bands, variable lengths
with sequence ends inside a query block, the per-walk variants for softcap / ALiBi / dropout); the result is
within tolerance of the float64 reference and of the default path, and dk / dv equal the default's where their
sums keep the same order. Marked `cuda`; the sm90 checks are skipped on other GPUs and builds without 90a.
"""
import pytest
import torch

import flash_ext
from flash_ext.testing import sm90_kernels
from kernel_names import backward_kernel_names, sm90_expected
from make_inputs import alibi_slopes, make_qkv, make_varlen_qkv
from tolerance import check_gradients, check_varlen_gradients

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or not sm90_expected(),
                       reason="needs a compute capability 9.0 GPU and a build with 90a"),
]

RUNS = 6


def dense_gradients(q, k, v, dout, **options):
    """(dq, dk, dv) of one deterministic backward; dropout's stream reseeded so that every run draws the same
    keep mask."""
    torch.cuda.manual_seed(1234)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = flash_ext.attention(*leaves, **options)
    return torch.autograd.grad(out, leaves, dout)


def varlen_gradients(q, k, v, cu_q, cu_k, dout, **options):
    torch.cuda.manual_seed(1234)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    max_q = int((cu_q[1:] - cu_q[:-1]).max())
    max_k = int((cu_k[1:] - cu_k[:-1]).max())
    out = flash_ext.attention_varlen(*leaves, cu_q, cu_k, max_q, max_k, **options)
    return torch.autograd.grad(out, leaves, dout)


def assert_repeatable(run, runs=RUNS):
    first = run()
    for attempt in range(1, runs):
        again = run()
        for name, a, b in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name} of run {attempt} differs from run 0 (max {(a - b).abs().max()})"
    return first


DENSE_CASES = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(200, 70)),
    "causal_window": dict(causal=True, window_size=(300, 0)),
}


@pytest.mark.parametrize("case", list(DENSE_CASES))
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_dense_bitwise_repeatable(head_dim, case):
    """Key blocks of 128 (64 at hd256) keys over 1100 keys, GQA 8 / 2: up to 18 walks of a head add into each
    dQ row, and the CTAs of two batch entries and kv heads run at once."""
    options = DENSE_CASES[case]
    q, k, v = make_qkv(2, 1000, 1100, 8, 2, head_dim, torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    assert any("dkdv_sm90" in name for name in backward_kernel_names(q, k, v, deterministic=True, **options))
    assert_repeatable(lambda: dense_gradients(q, k, v, dout, deterministic=True, **options))


@pytest.mark.parametrize("seqlen_q,seqlen_k", [(300, 2000), (2000, 300), (4096, 4096)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_bitwise_repeatable_lengths(seqlen_q, seqlen_k, causal):
    """Bottom-right causal with seqlen_q < seqlen_k (every query block seen by all early key blocks) and
    > (rows that see no key), and a long square one (32 key blocks per head)."""
    q, k, v = make_qkv(1, seqlen_q, seqlen_k, 4, 4, 128, torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    assert_repeatable(lambda: dense_gradients(q, k, v, dout, causal=causal, deterministic=True), runs=4)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tile_groups_with_a_partial_last_group(causal):
    """The tile order takes (batch, kv head) pairs in groups of about 32k query rows (the launcher's
    ordered_tile_group_width): GQA 8 / 2 at seqlen 2048 gives groups of 4 pairs, so 3 x 2 pairs make a group of
    4 and one of 2. Repeatable, right, and dk / dv (each summed by one walk, in its own order) equal to the
    default path's."""
    q, k, v = make_qkv(3, 2048, 2048, 8, 2, 64, torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    ordered = assert_repeatable(lambda: dense_gradients(q, k, v, dout, causal=causal, deterministic=True), runs=3)
    default = dense_gradients(q, k, v, dout, causal=causal, deterministic=False)
    for name, a, b in zip(("dq", "dk", "dv"), ordered, default):
        if name != "dq":
            assert torch.equal(a, b), name
        bound = 4 * torch.finfo(torch.bfloat16).eps * b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= bound, name
    check_gradients(q, k, v, causal=causal, dout=dout, deterministic=True)


@pytest.mark.parametrize("feature", ["softcap", "alibi", "dropout"])
def test_per_walk_variants_bitwise_repeatable(feature):
    """Softcap, ALiBi and dropout run the per-walk (non-persistent) kernel, which takes its tiles from a
    counter in deterministic mode."""
    q, k, v = make_qkv(2, 900, 1000, 4, 2, 128, torch.bfloat16, device="cuda")
    features = {"softcap": dict(softcap=20.0), "alibi": dict(alibi_slopes=alibi_slopes(2, 4, False, "cuda")),
                "dropout": dict(dropout_p=0.15)}[feature]
    dout = torch.randn_like(q)
    assert_repeatable(lambda: dense_gradients(q, k, v, dout, causal=True, deterministic=True, **features))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_bitwise_repeatable(causal, head_dim):
    """Sequence ends inside query blocks and inside a warp's 16 rows: the warps past an end add zeros
    without taking turns (the next sequence's turns are not theirs)."""
    lengths_q = [70, 1, 517, 0, 333, 129]
    lengths_k = [90, 300, 517, 17, 200, 640]
    q, k, v, cu_q, cu_k = make_varlen_qkv(lengths_q, lengths_k, 6, 2, head_dim, torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    assert_repeatable(lambda: varlen_gradients(q, k, v, cu_q, cu_k, dout, causal=causal, deterministic=True))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradients_match_reference(head_dim, causal):
    q, k, v = make_qkv(2, 700, 650, 6, 2, head_dim, torch.bfloat16, device="cuda")
    check_gradients(q, k, v, causal=causal, deterministic=True)


@pytest.mark.parametrize("features", [dict(window_size=(100, 40)), dict(softcap=15.0), dict(dropout_p=0.2)],
                         ids=["window", "softcap", "dropout"])
def test_varlen_gradients_match_reference(features):
    q, k, v, cu_q, cu_k = make_varlen_qkv([130, 7, 400], [200, 64, 390], 4, 2, 128, torch.bfloat16, device="cuda")
    check_varlen_gradients(q, k, v, cu_q, cu_k, causal=True, deterministic=True, **features)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_close_to_default_path(head_dim):
    """Against deterministic=False: dq within the rounding of another summation order; dk and dv (single
    writer) bitwise equal where the walks keep their order (hd64 / 128; at hd256 the default rotates where
    each walk starts, which reorders the dK / dV sums)."""
    q, k, v = make_qkv(2, 1000, 1000, 4, 2, head_dim, torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    ordered = dense_gradients(q, k, v, dout, causal=True, deterministic=True)
    default = dense_gradients(q, k, v, dout, causal=True, deterministic=False)
    for name, a, b in zip(("dq", "dk", "dv"), ordered, default):
        if name != "dq" and head_dim != 256:
            assert torch.equal(a, b), name
        bound = 4 * torch.finfo(torch.bfloat16).eps * b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() <= bound, name


def test_sm80_kernels_stay_deterministic():
    """With the sm90 kernels off, deterministic=True takes the sm80 dQ kernel (no atomics)."""
    q, k, v = make_qkv(2, 600, 600, 4, 2, 128, torch.bfloat16, device="cuda")
    dout = torch.randn_like(q)
    with sm90_kernels(False):
        names = backward_kernel_names(q, k, v, causal=True, deterministic=True)
        assert not any("sm90" in name for name in names) and any("bwd_dq_kernel" in name for name in names), names
        assert_repeatable(lambda: dense_gradients(q, k, v, dout, causal=True, deterministic=True), runs=3)

"""The public API on the CPU: input checks and their messages, empty inputs, op registration
(opcheck, torch.compile), info(), kernel_path(), `python -m flash_ext`, return_lse and the default
softmax_scale."""
import math
import os
import subprocess
import sys

import pytest
import torch

import flash_ext
from flash_ext.reference import attention_ref
from make_inputs import make_qkv
from tolerance import FWD_FACTOR, assert_within_tolerance


def randn(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


# ---- Bad inputs --------------------------------------------------------------------------------
# (id, lambda returning (q, k, v, kwargs), error type, fragment of the message that names the argument)

BAD_INPUTS = [
    ("q-float64", lambda: (randn(1, 4, 2, 16, dtype=torch.float64), randn(1, 4, 2, 16, dtype=torch.float64),
                           randn(1, 4, 2, 16, dtype=torch.float64), {}), RuntimeError, "q has dtype Double"),
    ("q-int32", lambda: (torch.randint(-5, 5, (1, 4, 2, 16), dtype=torch.int32),
                         torch.randint(-5, 5, (1, 4, 2, 16), dtype=torch.int32),
                         torch.randint(-5, 5, (1, 4, 2, 16), dtype=torch.int32), {}), RuntimeError, "q has dtype Int"),
    ("k-dtype-differs", lambda: (randn(1, 4, 2, 16), randn(1, 4, 2, 16, dtype=torch.float16), randn(1, 4, 2, 16), {}),
     RuntimeError, "k has dtype Half but q has Float"),
    ("v-dtype-differs", lambda: (randn(1, 4, 2, 16, dtype=torch.bfloat16), randn(1, 4, 2, 16, dtype=torch.bfloat16),
                                 randn(1, 4, 2, 16), {}), RuntimeError, "v has dtype Float but q has BFloat16"),
    ("q-rank-3", lambda: (randn(4, 2, 16), randn(1, 4, 2, 16), randn(1, 4, 2, 16), {}),
     RuntimeError, "q must have 4 dimensions"),
    ("k-rank-5", lambda: (randn(1, 4, 2, 16), randn(1, 1, 4, 2, 16), randn(1, 4, 2, 16), {}),
     RuntimeError, "k must have 4 dimensions"),
    ("v-rank-3", lambda: (randn(1, 4, 2, 16), randn(1, 4, 2, 16), randn(4, 2, 16), {}),
     RuntimeError, "v must have 4 dimensions"),
    ("batch-differs", lambda: (randn(2, 4, 2, 16), randn(3, 4, 2, 16), randn(3, 4, 2, 16), {}),
     RuntimeError, "k has batch 3 but q has batch 2"),
    ("head-dim-differs", lambda: (randn(1, 4, 2, 16), randn(1, 4, 2, 32), randn(1, 4, 2, 32), {}),
     RuntimeError, "k has head_dim 32 but q has head_dim 16"),
    ("k-v-seqlen-differ", lambda: (randn(1, 4, 2, 16), randn(1, 5, 2, 16), randn(1, 6, 2, 16), {}),
     RuntimeError, "k and v must have the same shape"),
    ("k-v-heads-differ", lambda: (randn(1, 4, 2, 16), randn(1, 5, 2, 16), randn(1, 5, 1, 16), {}),
     RuntimeError, "k and v must have the same shape"),
    ("heads-not-multiple", lambda: (randn(1, 4, 3, 16), randn(1, 4, 2, 16), randn(1, 4, 2, 16), {}),
     RuntimeError, "heads_q (q.size(2) = 3) must be a multiple of heads_kv (k.size(2) = 2)"),
    ("heads-kv-zero", lambda: (randn(1, 4, 2, 16), randn(1, 4, 0, 16), randn(1, 4, 0, 16), {}),
     RuntimeError, "k and v have 0 heads (k.size(2)) but q has 2; heads_kv must be >= 1"),
    ("head-dim-257", lambda: (randn(1, 4, 2, 257), randn(1, 4, 2, 257), randn(1, 4, 2, 257), {}),
     RuntimeError, "head_dim (last dimension of q) must be in 1..256, got 257"),
    ("head-dim-0", lambda: (randn(1, 4, 2, 0), randn(1, 4, 2, 0), randn(1, 4, 2, 0), {}),
     RuntimeError, "head_dim (last dimension of q) must be in 1..256, got 0"),
] + [
    (f"softmax-scale-{scale}", lambda scale=scale: (randn(1, 4, 2, 16), randn(1, 4, 2, 16), randn(1, 4, 2, 16),
                                                     {"softmax_scale": scale}),
     RuntimeError, "softmax_scale must be a finite positive number")
    for scale in (-0.5, 0.0, math.nan, math.inf, -math.inf)
]


@pytest.mark.parametrize("make_args,error_type,message", [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_inputs_are_rejected(make_args, error_type, message):
    q, k, v, kwargs = make_args()
    with pytest.raises(error_type) as error:
        flash_ext.attention(q, k, v, **kwargs)
    assert message in str(error.value)
    assert "flash_ext:" in str(error.value)


def valid_bwd_args(dtype=torch.float32):
    q, k, v = make_qkv(2, 5, 7, 4, 2, 16, dtype)
    out, lse = flash_ext.attention(q, k, v, return_lse=True)
    return dict(dout=torch.randn_like(out), q=q, k=k, v=v, out=out, lse=lse,
                softmax_scale=0.25, causal=False, deterministic=False)


BAD_BWD_INPUTS = [
    ("dout-shape", "dout", lambda a: a["dout"][:, :4], "dout must match q in shape, dtype and device"),
    ("dout-dtype", "dout", lambda a: a["dout"].half(), "dout must match q in shape, dtype and device"),
    ("out-shape", "out", lambda a: a["out"][:, :, :2], "out must match q in shape, dtype and device"),
    ("out-dtype", "out", lambda a: a["out"].bfloat16(), "out must match q in shape, dtype and device"),
    ("lse-shape", "lse", lambda a: a["lse"].transpose(1, 2), "lse must be float32 of shape (batch, heads_q, seqlen_q)"),
    ("lse-dtype", "lse", lambda a: a["lse"].double(), "lse must be float32 of shape (batch, heads_q, seqlen_q)"),
    ("k-shape", "k", lambda a: a["k"][:, :, :1], "k and v must have the same shape"),
    ("softmax-scale", "softmax_scale", lambda a: -1.0, "softmax_scale must be a finite positive number"),
]


@pytest.mark.parametrize("argument,make_bad_value,message", [case[1:] for case in BAD_BWD_INPUTS],
                         ids=[case[0] for case in BAD_BWD_INPUTS])
def test_bad_bwd_inputs_are_rejected(argument, make_bad_value, message):
    args = valid_bwd_args()
    args[argument] = make_bad_value(args)
    with pytest.raises(RuntimeError) as error:
        torch.ops.flash_ext.bwd(**args)
    assert message in str(error.value)


def test_q_and_k_on_different_devices_are_rejected():
    # Without a GPU the only second device is 'meta'; any tensor on it routes the call to the fake.
    q, k, v = make_qkv(1, 4, 4, 2, 2, 16, torch.float32)
    with pytest.raises(RuntimeError, match="device"):
        flash_ext.attention(q, k.to("meta"), v)


def test_meta_inputs_give_shapes():
    q, k, v = (t.to("meta") for t in make_qkv(2, 5, 7, 4, 2, 59, torch.bfloat16))
    out, lse = flash_ext.attention(q, k, v, return_lse=True)
    assert out.device.type == "meta" and out.shape == (2, 5, 4, 59) and out.dtype == torch.bfloat16
    assert lse.device.type == "meta" and lse.shape == (2, 4, 5) and lse.dtype == torch.float32


# ---- Empty inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k", [(0, 5, 7), (2, 0, 7), (2, 5, 0), (2, 0, 0)],
                         ids=["batch0", "seqlen_q0", "seqlen_k0", "both0"])
def test_empty_inputs(batch, seqlen_q, seqlen_k, causal, dtype):
    q, k, v = (t.requires_grad_() for t in make_qkv(batch, seqlen_q, seqlen_k, 4, 2, 16, dtype))
    out, lse = flash_ext.attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (batch, seqlen_q, 4, 16) and out.dtype == dtype
    assert lse.shape == (batch, 4, seqlen_q) and lse.dtype == torch.float32
    # With no keys every row is empty: out 0 and lse -inf (nothing to check when out has no elements).
    assert torch.equal(out.detach(), torch.zeros_like(out))
    assert torch.isneginf(lse).all()

    out.backward(torch.randn_like(out))
    for name, x in (("dq", q), ("dk", k), ("dv", v)):
        assert x.grad is not None, f"{name} is None"
        assert x.grad.shape == x.shape and x.grad.dtype == dtype, f"{name}: {x.grad.shape} {x.grad.dtype}"
        assert torch.equal(x.grad, torch.zeros_like(x)), f"{name} is not zero"


# ---- Op registration: opcheck and torch.compile ---------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_opcheck_fwd(causal, dtype):
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 9, 11, 4, 2, 16, dtype, layout="transposed"))
    torch.library.opcheck(torch.ops.flash_ext.fwd, (q, k, v, 0.25, causal, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_opcheck_bwd(causal, dtype):
    q, k, v = make_qkv(2, 9, 11, 4, 2, 16, dtype)
    out, lse, _ = torch.ops.flash_ext.fwd(q, k, v, 0.25, causal, False)
    torch.library.opcheck(torch.ops.flash_ext.bwd, (torch.randn_like(out), q, k, v, out, lse, 0.25, causal, False))


def training_loss(q, k, v, weight):
    out, lse = flash_ext.attention(q, k, v, causal=True, return_lse=True)
    return (out * weight).sum() + lse.sum(), out, lse


def test_torch_compile_matches_eager(compile_backend):
    torch._dynamo.reset()
    compiled_loss = torch.compile(training_loss, fullgraph=True, backend=compile_backend)
    q, k, v = make_qkv(2, 33, 47, 4, 2, 32, torch.float32)
    weight = torch.randn(q.shape)

    results = {}
    for name, fn in (("eager", training_loss), ("compiled", compiled_loss)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        loss, out, lse = fn(*leaves, weight)
        loss.backward()
        results[name] = (out.detach(), lse.detach(), *(t.grad for t in leaves))
    for name, eager, compiled in zip(("out", "lse", "dq", "dk", "dv"), results["eager"], results["compiled"]):
        assert torch.equal(compiled, eager), f"{name} differs between torch.compile and eager"
    assert results["eager"][2].abs().amax() > 0  # a real gradient reached q


def test_torch_compile_dynamic_shapes():
    """A second seqlen makes dynamo retrace with symbolic shapes; the fake implementations must handle them."""
    torch._dynamo.reset()
    compiled = torch.compile(flash_ext.attention, fullgraph=True, backend="aot_eager", dynamic=True)
    for seqlen_q, seqlen_k in ((17, 30), (40, 25)):
        q, k, v = make_qkv(1, seqlen_q, seqlen_k, 2, 1, 16, torch.float32)
        torch.testing.assert_close(compiled(q, k, v, causal=True), flash_ext.attention(q, k, v, causal=True),
                                   rtol=0, atol=0)


# ---- info, kernel_path, python -m flash_ext ----------------------------------------------------


def test_info():
    info = flash_ext.info()
    assert set(info) == {"version", "build", "cuda_archs", "torch", "torch_cuda", "device"}
    assert info["version"] == flash_ext.__version__
    assert info["build"] in ("cpu", "cuda")
    assert (info["build"] == "cuda") == bool(info["cuda_archs"]), info
    assert info["torch"] == torch.__version__ and info["torch_cuda"] == torch.version.cuda
    if not torch.cuda.is_available():
        assert info["device"] == "cpu"


def test_python_m_flash_ext(tmp_path):
    # The child imports the flash_ext this process imported (an install or an in-place build).
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(flash_ext.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-m", "flash_ext"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines() if line.strip())
    assert lines["version"] == flash_ext.__version__
    assert lines["build"] == flash_ext.info()["build"]
    assert lines["path/cpu"].startswith("cpu:")


def test_kernel_path_on_cpu():
    q, k, v = make_qkv(1, 3, 3, 2, 2, 59, torch.bfloat16)
    path = flash_ext.kernel_path(q, k, v, causal=True)
    assert path.startswith("cpu:") and "head_dim 59" in path and "bfloat16" in path, path
    assert flash_ext.kernel_path(q.to("meta")).startswith("unsupported device meta")


# ---- return_lse, default softmax_scale, autograd details ---------------------------------------


def test_return_lse():
    q, k, v = make_qkv(2, 6, 9, 4, 2, 16, torch.float32)
    out_only = flash_ext.attention(q, k, v)
    assert isinstance(out_only, torch.Tensor)
    result = flash_ext.attention(q, k, v, return_lse=True)
    assert isinstance(result, tuple) and len(result) == 2
    out, lse = result
    assert torch.equal(out, out_only)
    assert lse.shape == (2, 4, 6) and lse.dtype == torch.float32
    # lse = log sum_j exp(scale * q.k_j), checked directly on one row.
    scores = (q[1, 2, 3] @ k[1, :, 1].T) / math.sqrt(16)
    torch.testing.assert_close(lse[1, 3, 2], torch.logsumexp(scores.double(), 0).float())


@pytest.mark.parametrize("head_dim", [16, 59])
def test_default_softmax_scale_is_rsqrt_head_dim(head_dim):
    q, k, v = make_qkv(2, 20, 30, 2, 2, head_dim, torch.float32)
    scale = 1 / math.sqrt(head_dim)
    out_default = flash_ext.attention(q, k, v)
    assert torch.equal(out_default, flash_ext.attention(q, k, v, softmax_scale=scale))
    out64, _ = attention_ref(q, k, v, softmax_scale=scale)
    out_lowp, _ = attention_ref(q, k, v, softmax_scale=scale, upcast=False)
    assert_within_tolerance("out", out_default, out_lowp, out64, FWD_FACTOR)
    out_unscaled = flash_ext.attention(q, k, v, softmax_scale=1.0)
    assert (out_unscaled - out_default).abs().max() > 1e-2  # the scale does matter for these inputs


def test_lse_is_not_differentiable_and_partial_requires_grad():
    q, k, v = make_qkv(2, 20, 30, 2, 1, 16, torch.float32)
    q.requires_grad_()
    out, lse = flash_ext.attention(q, k, v, causal=True, return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, _ = attention_ref(q64, k64, v64, causal=True)
    (dq64,) = torch.autograd.grad(out64, q64, dout.double())
    torch.testing.assert_close(dq, dq64.float(), rtol=1e-4, atol=1e-5)

"""The public API: input checks and their messages (the Python-type contract of the arguments, and
the op's checks of the tensors), empty inputs, op registration (opcheck, torch.compile), info(),
kernel_path(), `python -m flash_ext`, return_lse and the default softmax_scale. CPU and CUDA where a
property holds on both (tests/devices.py)."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import flash_ext
from bad_inputs import BAD_TENSORS, ids, params
from cuda_poison import run_poisoned
from devices import CAUSAL, named, parametrize_devices
from flash_ext.reference import attention_ref
from flash_ext.testing import attention_with_rng_state
from make_inputs import make_qkv, make_varlen_qkv
from tolerance import FWD_FACTOR, assert_within_tolerance

# ---- Bad tensors: the op's checks ----------------------------------------------------------------


@pytest.mark.parametrize("make,error_type,message", params(BAD_TENSORS), ids=ids(BAD_TENSORS))
def test_bad_inputs_are_rejected(make, error_type, message):
    function, args, kwargs = make()
    with pytest.raises(error_type) as error:
        function(*args, **kwargs)
    assert message in str(error.value)
    assert "flash_ext:" in str(error.value)


@parametrize_devices(cpu=dict(argument=["k", "v"], other=["meta"]), cuda=dict(argument=["k", "v"], other=["cpu"]))
def test_inputs_on_different_devices_are_rejected(device, argument, other):
    # Without a GPU the only second device is 'meta'; any tensor on it routes the call to the fake.
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v = make_qkv(1, 8, 8, 2, 2, 64, dtype, device=device)
    args = {"q": q, "k": k, "v": v}
    args[argument] = args[argument].to(other)
    with pytest.raises(RuntimeError, match=f"flash_ext: {argument} is on {other} but q is on {q.device}"):
        flash_ext.attention(**args)


def test_meta_inputs_give_shapes():
    q, k, v = (t.to("meta") for t in make_qkv(2, 5, 7, 4, 2, 59, torch.bfloat16))
    out, lse = flash_ext.attention(q, k, v, return_lse=True)
    assert out.device.type == "meta" and out.shape == (2, 5, 4, 59) and out.dtype == torch.bfloat16
    assert lse.device.type == "meta" and lse.shape == (2, 4, 5) and lse.dtype == torch.float32


# ---- The Python-type contract: checked by flash_ext.attention before the op -----------------------
# (id, keyword arguments, error type, fragment of the message). Every message names the argument.

SLOPES = torch.full((4,), 0.25)
BAD_KWARGS = [
    ("causal-str", dict(causal="no"), TypeError, "causal must be a bool (True or False), got 'no' of type str"),
    ("causal-int", dict(causal=1), TypeError, "causal must be a bool (True or False), got 1 of type int"),
    ("causal-none", dict(causal=None), TypeError, "causal must be a bool"),
    ("causal-tensor", dict(causal=torch.tensor(True)), TypeError,
     "causal must be a bool (True or False), got a tensor"),
    ("deterministic-str", dict(deterministic="yes"), TypeError, "deterministic must be a bool"),
    ("return-lse-int", dict(return_lse=1), TypeError, "return_lse must be a bool"),
    ("window-float", dict(window_size=(2.7, 0)), TypeError, "window_size[0] must be an int, got 2.7 of type float"),
    ("window-integral-float", dict(window_size=(0, 3.0)), TypeError, "window_size[1] must be an int, got 3.0"),
    ("window-bool", dict(window_size=(True, 0)), TypeError, "window_size[0] must be an int, got True of type bool"),
    ("window-numpy-float", dict(window_size=(np.float64(3), 0)), TypeError, "window_size[0] must be an int"),
    ("window-float-tensor", dict(window_size=(torch.tensor(3.0), 0)), TypeError, "window_size[0] must be an int"),
    ("window-str", dict(window_size=("3", 0)), TypeError, "window_size[0] must be an int, got '3' of type str"),
    ("window-int", dict(window_size=3), ValueError, "window_size must be a pair (left, right) of ints, got 3"),
    ("window-one", dict(window_size=(3,)), ValueError, "window_size must be a pair (left, right) of ints"),
    ("window-three", dict(window_size=(3, 0, 1)), ValueError, "window_size must be a pair (left, right) of ints"),
    ("window-string", dict(window_size="30"), ValueError, "window_size must be a pair (left, right) of ints"),
    ("window-tensor", dict(window_size=torch.tensor([3, 0])), ValueError, "window_size must be a pair"),
    ("alibi-list", dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]), TypeError,
     "alibi_slopes must be None or a float32 torch.Tensor of shape (heads_q,) or (batch, heads_q), got [0.5"),
    ("alibi-numpy", dict(alibi_slopes=np.ones(4, dtype=np.float32)), TypeError,
     "alibi_slopes must be None or a float32 torch.Tensor"),
    ("alibi-float", dict(alibi_slopes=0.5), TypeError, "alibi_slopes must be None or a float32 torch.Tensor"),
    ("softmax-scale-tensor", dict(softmax_scale=torch.tensor(0.25)), TypeError,
     "softmax_scale must be a real number (a float or an int), got a tensor of shape () and dtype torch.float32 "
     "(pass a Python number, e.g. tensor.item())"),
    ("softmax-scale-str", dict(softmax_scale="0.25"), TypeError, "softmax_scale must be a real number"),
    ("softmax-scale-bool", dict(softmax_scale=True), TypeError, "softmax_scale must be a real number"),
    ("softmax-scale-complex", dict(softmax_scale=0.25j), TypeError, "softmax_scale must be a real number"),
    ("softcap-tensor", dict(softcap=torch.tensor(30.0)), TypeError, "softcap must be a real number"),
    ("softcap-none", dict(softcap=None), TypeError, "softcap must be a real number (a float or an int), got None"),
    ("dropout-str", dict(dropout_p="0.1"), TypeError, "dropout_p must be a real number"),
    ("dropout-tensor", dict(dropout_p=torch.tensor(0.1)), TypeError, "dropout_p must be a real number"),
    ("dropout-none", dict(dropout_p=None), TypeError, "dropout_p must be a real number"),
]


def call_with(entry, **kwargs):
    """entry(...) on small valid inputs, with kwargs."""
    if entry == "attention_varlen":
        q, k, v, cu_q, cu_k = make_varlen_qkv([3, 5], [4, 6], 4, 2, 16, torch.float32)
        return flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, **kwargs)
    q, k, v = make_qkv(1, 5, 6, 4, 2, 16, torch.float32)
    function = flash_ext.attention if entry == "attention" else attention_with_rng_state
    return function(q, k, v, **kwargs)


# Each case through each entry point that takes the argument (attention_with_rng_state has no return_lse).
TYPE_CASES = [pytest.param(kwargs, error_type, message, entry, id=f"{entry}-{case_id}")
              for entry in ("attention", "attention_varlen", "attention_with_rng_state")
              for case_id, kwargs, error_type, message in BAD_KWARGS
              if not (entry == "attention_with_rng_state" and "return_lse" in kwargs)]


@pytest.mark.parametrize("kwargs,error_type,message,entry", TYPE_CASES)
def test_python_types_are_checked(kwargs, error_type, message, entry):
    with pytest.raises(error_type) as error:
        call_with(entry, **kwargs)
    assert f"flash_ext: {message}" in str(error.value)


def test_tensor_arguments_must_be_tensors():
    q, k, v, cu_q, cu_k = make_varlen_qkv([3, 5], [4, 6], 4, 2, 16, torch.float32)
    with pytest.raises(TypeError, match=r"flash_ext: q must be a torch.Tensor, got \[\[1.0\]\] of type list"):
        flash_ext.attention([[1.0]], k[None], v[None])
    with pytest.raises(TypeError, match="flash_ext: v must be a torch.Tensor, got None"):
        flash_ext.attention(q[None], k[None], None)
    with pytest.raises(TypeError, match=r"cu_seqlens_q must be a torch.Tensor, got \[0, 3, 8\] of type list"):
        flash_ext.attention_varlen(q, k, v, [0, 3, 8], cu_k, 5, 6)
    with pytest.raises(TypeError, match="flash_ext: max_seqlen_q must be an int, got 5.0 of type float"):
        flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 5.0, 6)
    with pytest.raises(TypeError, match="flash_ext: max_seqlen_k must be an int, got True of type bool"):
        flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 5, True)


def test_integer_and_real_like_arguments_are_accepted():
    """Integer-like window sides (numpy ints, 0-d integer tensors: operator.index), ints and numpy floats for
    the real-number options and numpy bools for the flags give what the plain Python values give."""
    q, k, v = make_qkv(2, 20, 30, 4, 2, 16, torch.float32)
    expected = flash_ext.attention(q, k, v, causal=True, window_size=(5, 0), softmax_scale=1.0, softcap=30.0)
    for window_size in ((np.int64(5), np.int32(0)), [5, 0], (torch.tensor(5), torch.tensor(0, dtype=torch.int32))):
        for options in (dict(softmax_scale=1, softcap=30), dict(softmax_scale=np.float32(1.0), softcap=np.float64(30)),
                        dict(softmax_scale=1.0, softcap=30.0, dropout_p=0)):
            out = flash_ext.attention(q, k, v, causal=np.bool_(True), window_size=window_size, **options)
            assert torch.equal(out, expected), (window_size, options)
    varlen_q, varlen_k, varlen_v, cu_q, cu_k = make_varlen_qkv([3, 5], [4, 6], 4, 2, 16, torch.float32)
    assert torch.equal(flash_ext.attention_varlen(varlen_q, varlen_k, varlen_v, cu_q, cu_k, np.int64(5), 6),
                       flash_ext.attention_varlen(varlen_q, varlen_k, varlen_v, cu_q, cu_k, 5, 6))


@pytest.mark.parametrize("function", ["attention", "attention_varlen"])
def test_alibi_slopes_that_require_grad_are_rejected(function):
    slopes = torch.rand(4, requires_grad=True)
    if function == "attention":
        q, k, v = make_qkv(1, 5, 6, 4, 2, 16, torch.float32)
        call = lambda slopes: flash_ext.attention(q, k, v, alibi_slopes=slopes)  # noqa: E731
    else:
        q, k, v, cu_q, cu_k = make_varlen_qkv([3, 5], [4, 6], 4, 2, 16, torch.float32)
        call = lambda slopes: flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, alibi_slopes=slopes)  # noqa: E731
    q.requires_grad_()
    with pytest.raises(ValueError) as error:
        call(slopes)
    message = str(error.value)
    assert "flash_ext: alibi_slopes requires grad" in message
    assert "does not compute the gradient of the ALiBi slopes" in message and "alibi_slopes.detach()" in message
    expected = call(slopes.detach())
    assert expected.requires_grad  # q's gradient still flows
    with torch.no_grad():  # without grad mode nothing would be owed to the slopes
        assert torch.equal(call(slopes), expected)
    with pytest.raises(ValueError, match="alibi_slopes requires grad"):
        call(slopes * 2)  # a non-leaf that requires grad too


# ---- Zero heads ----------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_zero_heads_give_empty_results(device):
    """q (b, s, 0, d) with k, v (b, s, 0, d): empty out and lse (an empty problem, like any empty tensor), and
    empty gradients; the same for attention_varlen."""
    q, k, v = (t.to(device).requires_grad_() for t in make_qkv(2, 5, 7, 0, 0, 16, torch.float32))
    out, lse = flash_ext.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 5, 0, 16) and lse.shape == (2, 0, 5) and lse.dtype == torch.float32
    if device == "cpu":
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]

    q, k, v, cu_q, cu_k = (t.to(device) for t in make_varlen_qkv([3, 5], [4, 6], 0, 0, 16, torch.float32))
    out, lse = flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 5, 6, return_lse=True)
    assert out.shape == (8, 0, 16) and lse.shape == (0, 8)


# ---- Empty inputs ----------------------------------------------------------------------------

EMPTY_SHAPES = {"batch0": (0, 5, 7), "seqlen_q0": (2, 0, 7), "seqlen_k0": (2, 5, 0), "both0": (2, 0, 0)}


@parametrize_devices(
    cpu=dict(shape=[named(s, i) for i, s in EMPTY_SHAPES.items()], causal=CAUSAL,
             dtype=[torch.float32, torch.bfloat16], head_dim=[16]),
    cuda=dict(shape=[named(EMPTY_SHAPES[i], i) for i in ("batch0", "seqlen_q0", "seqlen_k0")], causal=[True],
              dtype=[torch.bfloat16], head_dim=[59]),
)
def test_empty_inputs(device, shape, causal, dtype, head_dim):
    batch, seqlen_q, seqlen_k = shape
    q, k, v = (t.requires_grad_() for t in make_qkv(batch, seqlen_q, seqlen_k, 4, 2, head_dim, dtype, device=device))
    out, lse = run_poisoned(q, k, v, causal=causal)
    assert out.shape == (batch, seqlen_q, 4, head_dim) and out.dtype == dtype
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


@pytest.mark.slow
@parametrize_devices(
    cpu=dict(shape=[(2, 33, 47, 4, 2, 32)], dtype=[torch.float32], backward=[True]),
    # Forward only: the default CUDA backward sums dQ with atomics, so two backwards need not agree bit for bit.
    cuda=dict(shape=[(2, 100, 140, 4, 2, 64)], dtype=[torch.bfloat16], backward=[False]),
)
def test_torch_compile_matches_eager(device, shape, dtype, backward, compile_backend):
    """fullgraph torch.compile of a loss around flash_ext.attention: out, lse (and the gradients) bit for bit
    those of eager mode."""
    torch._dynamo.reset()
    compiled_loss = torch.compile(training_loss, fullgraph=True, backend=compile_backend)
    q, k, v = make_qkv(*shape, dtype, device=device)
    weight = torch.randn(q.shape, dtype=dtype, device=device)

    results = {}
    for name, fn in (("eager", training_loss), ("compiled", compiled_loss)):
        leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
        loss, out, lse = fn(*leaves, weight)
        if backward:
            loss.backward()
        results[name] = (out.detach(), lse.detach(), *(t.grad for t in leaves if backward))
    names = ("out", "lse", "dq", "dk", "dv")
    for name, eager, compiled in zip(names, results["eager"], results["compiled"]):
        assert torch.equal(compiled, eager), f"{name} differs between torch.compile and eager"
    if backward:
        assert results["eager"][2].abs().amax() > 0  # a real gradient reached q


@pytest.mark.slow
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


@parametrize_devices(cpu=dict(), cuda=dict())
def test_kernel_path(device):
    """kernel_path names the device's implementation and the head dim (on CUDA the padded one and the GPU);
    info() names the build and the device."""
    q, k, v = make_qkv(1, 4, 4, 2, 2, 59, torch.bfloat16, device=device)
    path = flash_ext.kernel_path(q, k, v, causal=True)
    assert path.startswith(device), path
    assert flash_ext.kernel_path(q.to("meta")).startswith("unsupported device meta")
    if device == "cpu":
        assert "head_dim 59" in path and "bfloat16" in path, path
        return
    info = flash_ext.info()
    assert info["build"] == "cuda", f"this flash_ext build has no CUDA kernels: {info}"
    major, minor = torch.cuda.get_device_capability()
    assert f"(sm_{major}{minor})" in info["device"]
    assert "head_dim padded 59->64" in path and f"sm_{major}{minor}" in path, path
    assert "head_dim 256" in flash_ext.kernel_path(q.new_empty(1, 4, 2, 256))


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

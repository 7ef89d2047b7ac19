"""The API of the features (window_size, softcap, alibi_slopes, dropout_p, attention_varlen) on the
CPU: bad inputs and their messages (also of the backward op called directly), meta inputs, opcheck of
the new ops and arguments, torch.compile."""
import pytest
import torch

import flash_ext
from bad_inputs import BAD_BWD_INPUTS, BAD_OPTIONS, VALUES, ids, params, varlen_args
from flash_ext.testing import attention_varlen_with_rng_state
from make_inputs import make_qkv, make_varlen_qkv


@pytest.mark.parametrize("make,error_type,message", params(BAD_OPTIONS + VALUES), ids=ids(BAD_OPTIONS + VALUES))
def test_bad_feature_inputs_are_rejected(make, error_type, message):
    function, args, kwargs = make()
    with pytest.raises(error_type) as error:
        function(*args, **kwargs)
    assert message in str(error.value)
    assert "flash_ext:" in str(error.value)


@pytest.mark.parametrize("make,error_type,message", params(BAD_BWD_INPUTS), ids=ids(BAD_BWD_INPUTS))
def test_bad_bwd_inputs_are_rejected(make, error_type, message):
    function, args, kwargs = make()
    with pytest.raises(error_type) as error:
        function(*args, **kwargs)
    assert message in str(error.value)
    assert "flash_ext:" in str(error.value)


def test_cu_seqlens_on_another_device_is_rejected():
    (q, k, v, cu_q, cu_k, max_q, max_k), _ = varlen_args()
    with pytest.raises(RuntimeError, match="cu_seqlens_q is on meta"):
        flash_ext.attention_varlen(q, k, v, cu_q.to("meta"), cu_k, max_q, max_k)


def test_varlen_meta_inputs_give_shapes():
    q, k, v, cu_q, cu_k = (t.to("meta") for t in make_varlen_qkv([3, 5], [2, 9], 4, 2, 24, torch.bfloat16))
    out, lse = flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 5, 9, return_lse=True, dropout_p=0.1,
                                          window_size=(4, 4))
    assert out.device.type == "meta" and out.shape == (8, 4, 24) and out.dtype == torch.bfloat16
    assert lse.device.type == "meta" and lse.shape == (4, 8) and lse.dtype == torch.float32


def test_alibi_slopes_may_be_strided():
    q, k, v = make_qkv(2, 20, 30, 4, 2, 16, torch.float32)
    slopes = torch.rand(4, 2).t()  # (2, 4) with a non-contiguous head dimension
    assert not slopes.is_contiguous()
    assert torch.equal(flash_ext.attention(q, k, v, alibi_slopes=slopes),
                       flash_ext.attention(q, k, v, alibi_slopes=slopes.contiguous()))


# ---- opcheck ---------------------------------------------------------------------------------------
# Dropout is left out of the checks that compare two runs (each call draws a fresh mask).

SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
FEATURE_OPTIONS = {
    "window": (0.25, False, False, 3, 2, 0.0, None, 0.0),
    "causal-softcap": (0.25, True, False, -1, -1, 5.0, None, 0.0),
    "alibi": (0.25, False, True, -1, 1, 0.0, SLOPES, 0.0),
}
DETERMINISTIC_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
RANDOM_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("options", list(FEATURE_OPTIONS.values()) + [(0.25, False, False, 4, 0, 2.0, SLOPES, 0.3)],
                         ids=list(FEATURE_OPTIONS) + ["all-with-dropout"])
def test_opcheck_fwd_bwd_with_features(options):
    test_utils = RANDOM_UTILS if options[-1] > 0 else DETERMINISTIC_UTILS
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 9, 11, 4, 2, 16, torch.float32))
    torch.library.opcheck(torch.ops.flash_ext.fwd, (q, k, v, *options), test_utils=test_utils)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse, rng_state = torch.ops.flash_ext.fwd(q, k, v, *options)
    torch.library.opcheck(torch.ops.flash_ext.bwd, (torch.randn_like(out), q, k, v, out, lse, *options, rng_state),
                          test_utils=DETERMINISTIC_UTILS)


@pytest.mark.parametrize("options", list(FEATURE_OPTIONS.values()) + [(0.25, True, False, -1, -1, 0.0, None, 0.3)],
                         ids=list(FEATURE_OPTIONS) + ["dropout"])
def test_opcheck_varlen(options):
    test_utils = RANDOM_UTILS if options[-1] > 0 else DETERMINISTIC_UTILS
    q, k, v, cu_q, cu_k = make_varlen_qkv([3, 0, 8], [5, 2, 6], 4, 2, 16, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    layout = (cu_q, cu_k, 8, 6)
    torch.library.opcheck(torch.ops.flash_ext.varlen_fwd, (q, k, v, *layout, *options), test_utils=test_utils)
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse, rng_state = torch.ops.flash_ext.varlen_fwd(q, k, v, *layout, *options)
    torch.library.opcheck(torch.ops.flash_ext.varlen_bwd,
                          (torch.randn_like(out), q, k, v, out, lse, *layout, *options, rng_state),
                          test_utils=DETERMINISTIC_UTILS)


def test_opcheck_dropout_keep_mask():
    torch.library.opcheck(torch.ops.flash_ext.dropout_keep_mask, (torch.tensor([3, 4]), 2, 3, 5, 6, 0.5))


# ---- torch.compile -----------------------------------------------------------------------------------


def varlen_loss(q, k, v, cu_q, cu_k, slopes, weight):
    out, lse = flash_ext.attention_varlen(q, k, v, cu_q, cu_k, 40, 50, causal=True, window_size=(12, 0),
                                          softcap=10.0, alibi_slopes=slopes, dropout_p=0.2, return_lse=True)
    return (out * weight).sum() + lse.clamp(min=-10).sum(), out, lse


@pytest.mark.slow
def test_torch_compile_varlen_with_every_feature():
    """fullgraph compile of attention_varlen with every feature: the same results as eager, bit for
    bit, dropout included (the same torch.manual_seed draws the same mask)."""
    torch._dynamo.reset()
    compiled_loss = torch.compile(varlen_loss, fullgraph=True, backend="aot_eager")
    q, k, v, cu_q, cu_k = make_varlen_qkv([40, 0, 17], [50, 3, 20], 4, 2, 16, torch.float32)
    slopes = torch.rand(3, 4)
    weight = torch.randn(q.shape)
    results = {}
    for name, fn in (("eager", varlen_loss), ("compiled", compiled_loss)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(11)
        loss, out, lse = fn(*leaves, cu_q, cu_k, slopes, weight)
        loss.backward()
        results[name] = (out.detach(), lse.detach(), *(t.grad for t in leaves))
    for name, eager, compiled in zip(("out", "lse", "dq", "dk", "dv"), results["eager"], results["compiled"]):
        assert torch.equal(compiled, eager), f"{name} differs between torch.compile and eager"


def test_rng_state_is_returned_on_the_inputs_device():
    (q, k, v, cu_q, cu_k, max_q, max_k), _ = varlen_args()
    _, _, rng_state = attention_varlen_with_rng_state(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.5)
    assert rng_state.device == q.device and rng_state.dtype == torch.int64 and rng_state.shape == (2,)

"""NaN and inf in q, k or v propagate into out, lse and the gradients as in plain softmax attention:
NaN exactly where torch.nn.functional.scaled_dot_product_attention's math backend in float64 has NaN,
and elsewhere within tolerance.py's rule of that reference (the error budget: flash_ext.reference in the
inputs' dtype, which must have its NaN at the same places). A query row whose scores hold a NaN is not a
row that sees no key: its out and lse are NaN, not 0 and -inf.

Full attention only: with a mask, SDPA's math backend adds -inf to the masked scores, so a NaN in a key
that a query does not see still reaches that query there, while flash_ext never reads the masked score.
"""
import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash_ext
from devices import named, parametrize_devices
from flash_ext.reference import attention_ref
from make_inputs import make_qkv
from tolerance import EPS, FWD_FACTOR, GRAD_FACTOR, magnitude, max_abs_error

BATCH, SEQLEN_Q, SEQLEN_K, HEADS_Q, HEADS_KV = 2, 37, 45, 4, 2
# Batch 1, query row 5, query head 3 (kv head 1); key 7; head_dim column 2.
B, ROW, HEAD, KEY, COLUMN = 1, 5, 3, 7, 2
KV_HEAD = HEAD // (HEADS_Q // HEADS_KV)


def plant(q, k, v, where, value):
    """Copies of q, k, v with one element set to value: a q row, a k row or a v element."""
    q, k, v = (t.clone() for t in (q, k, v))
    if where == "q":
        q[B, ROW, HEAD, COLUMN] = value
    elif where == "k":
        k[B, KEY, KV_HEAD, COLUMN] = value
    else:
        v[B, KEY, KV_HEAD, COLUMN] = value
    return q, k, v


def sdpa_math64(q, k, v, dout):
    """out and (dq, dk, dv) of SDPA's math backend in float64 on (batch, seqlen, heads, head_dim) tensors."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves),
                                                               enable_gqa=True).transpose(1, 2)
    return out.detach(), torch.autograd.grad(out, leaves, dout.double())


def reference_lowp(q, k, v, dout):
    """out and (dq, dk, dv) of flash_ext.reference in the inputs' dtype: the tolerance rule's budget."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, upcast=False)
    return out.detach(), torch.autograd.grad(out, leaves, dout)


def assert_like_sdpa(name, result, result_lowp, ref64, factor, scale=None):
    """NaN exactly where the float64 reference has NaN; elsewhere the tolerance rule of tolerance.py (which
    also wants any infinity at the reference's place, with its sign)."""
    result, result_lowp, ref64 = (t.detach().cpu() for t in (result, result_lowp, ref64))
    nan, nan64 = torch.isnan(result), torch.isnan(ref64)
    assert torch.equal(nan, nan64), (
        f"{name}: NaN at {nan.sum().item()} elements, the reference at {nan64.sum().item()}; "
        f"{(nan & ~nan64).sum().item()} only here, {(nan64 & ~nan).sum().item()} only in the reference")
    assert torch.equal(torch.isnan(result_lowp), nan64), f"{name}: flash_ext.reference's NaN differ from SDPA's"
    keep = ~nan64
    error = max_abs_error(result[keep], ref64[keep])
    budget = max_abs_error(result_lowp[keep], ref64[keep])
    assert math.isfinite(budget), f"{name}: the low-precision reference itself is off ({budget})"
    eps = EPS[result.dtype] * (magnitude(ref64) if scale is None else scale)
    assert error <= factor * budget + eps, f"{name}: max error {error:.3e} outside the NaN exceeds the rule's bound"


@parametrize_devices(
    cpu=dict(where=["q", "k", "v"], value=[named(math.nan, "nan"), named(math.inf, "inf")],
             dtype=[torch.float32]),
    cuda=dict(where=["q", "k", "v"], value=[named(math.nan, "nan"), named(math.inf, "inf")],
              dtype=[torch.float16, torch.bfloat16]),
)
def test_nonfinite_inputs_propagate_as_in_sdpa(device, where, value, dtype):
    q, k, v = plant(*make_qkv(BATCH, SEQLEN_Q, SEQLEN_K, HEADS_Q, HEADS_KV, 32, dtype, device=device), where, value)
    dout = torch.randn(q.shape, dtype=dtype, device=device)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_ext.attention(*leaves, return_lse=True)

    out64, grads64 = sdpa_math64(q, k, v, dout)
    out_lowp, grads_lowp = reference_lowp(q, k, v, dout)
    assert not torch.isfinite(out64).all(), "the planted value does not reach the reference's out"
    assert_like_sdpa("out", out, out_lowp, out64, FWD_FACTOR)

    # lse: not finite exactly in the rows whose scores hold the planted value (a NaN or inf in v leaves the
    # scores alone): NaN for a NaN score; for a +inf score NaN or +inf (either says that the softmax of the
    # row is undefined), never the -inf of a row that sees no key.
    lse = lse.detach().cpu()
    if where == "v":
        assert torch.isfinite(lse).all(), "a NaN or inf in v reached lse"
    else:
        rows64 = torch.isnan(out64).any(dim=-1).transpose(1, 2).cpu()  # (batch, heads_q, seqlen_q)
        assert not torch.isneginf(lse).any(), f"{torch.isneginf(lse).sum().item()} rows have lse -inf"
        assert torch.equal(~torch.isfinite(lse), rows64), (
            f"lse is not finite in {(~torch.isfinite(lse)).sum().item()} rows, expected in {rows64.sum().item()}")
        if math.isnan(value):
            assert torch.isnan(lse[rows64]).all(), "a row with a NaN score has an lse that is not NaN"

    grads = torch.autograd.grad(out, leaves, dout)
    scale = magnitude(*grads64)
    for name, grad, grad_lowp, grad64 in zip(("dq", "dk", "dv"), grads, grads_lowp, grads64):
        assert_like_sdpa(name, grad, grad_lowp, grad64, GRAD_FACTOR, scale=scale)

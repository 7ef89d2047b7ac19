"""The one tolerance rule of the numerical tests (flash-attn's), and the checks that apply it.

    max|result - ref64| <= factor * max|result_lowp - ref64| + eps

ref64        the float64 reference: attention_ref(upcast=True), or autograd through it on float64 copies
             of the inputs.
result_lowp  the same computation in plain PyTorch in the input dtype (attention_ref(upcast=False)): the
             error that a straightforward implementation at that precision makes.
factor       2 for forward results (out, lse), 3 for gradients.
eps          a floor for results that the low-precision reference gets (almost) exactly right, such as
             seqlen_k = 1: 1e-5 for float32 results; for float16 and bfloat16 results half a unit in the
             last place (finfo.eps / 2), the error of rounding an exact value once. Both are relative to
             the reference's largest magnitude (taken as at least 1); for gradients, to the largest of
             dq, dk and dv, which share one computation (with seqlen_k = 1, dk is exactly 0 and the
             low-precision reference gets it exactly, while an implementation that sums dP and
             D = rowsum(dout * out) in different orders leaves a rounding residue of dv's scale).

Infinities (lse = -inf of a row that sees no key) must sit at the same positions with the same sign in
result and reference; they then count as no error. A NaN anywhere in the result fails the check.

The check_* helpers take flash_ext's feature arguments (window_size, softcap, alibi_slopes, dropout_p) as
keywords and hand them to the reference too; with dropout, the reference applies the very keep mask of the
flash_ext call (flash_ext.testing.dropout_keep_mask of the call's rng_state), in forward and backward.
"""
import math

import torch

from flash_ext.reference import attention_ref, attention_varlen_ref
from flash_ext.testing import (attention_varlen_with_rng_state, attention_with_rng_state,
                               dropout_keep_mask)

FWD_FACTOR = 2
GRAD_FACTOR = 3
EPS = {
    torch.float32: 1e-5,
    torch.float16: torch.finfo(torch.float16).eps / 2,
    torch.bfloat16: torch.finfo(torch.bfloat16).eps / 2,
}


def max_abs_error(result, ref):
    """max |result - ref| as a Python float (float64 arithmetic); inf where the infinities disagree,
    nan where result has a NaN."""
    assert tuple(result.shape) == tuple(ref.shape), f"shape {tuple(result.shape)} != reference {tuple(ref.shape)}"
    result = result.detach().to(device=ref.device, dtype=torch.float64)
    ref = ref.detach().to(torch.float64)
    if result.numel() == 0:
        return 0.0
    if torch.isnan(result).any():
        return math.nan
    result_inf, ref_inf = torch.isinf(result), torch.isinf(ref)
    if not torch.equal(result_inf, ref_inf) or not torch.equal(result[result_inf], ref[ref_inf]):
        return math.inf
    finite = ~ref_inf
    if not finite.any():
        return 0.0
    return (result[finite] - ref[finite]).abs().max().item()


def magnitude(*tensors):
    """The largest finite |value| in the tensors, at least 1."""
    finite = [t[torch.isfinite(t)] for t in tensors]
    return max([1.0] + [t.abs().max().item() for t in finite if t.numel()])


def assert_within_tolerance(name, result, result_lowp, ref64, factor, scale=None):
    """The rule above; eps is EPS[result.dtype] * scale, scale defaulting to magnitude(ref64)."""
    error = max_abs_error(result, ref64)
    budget = max_abs_error(result_lowp, ref64)
    assert math.isfinite(budget), f"{name}: the low-precision reference itself is off ({budget}); the rule is void"
    eps = EPS[result.dtype] * (magnitude(ref64) if scale is None else scale)
    bound = factor * budget + eps
    assert error <= bound, (
        f"{name} ({result.dtype}, shape {tuple(result.shape)}): max|{name} - ref64| = {error:.3e} exceeds "
        f"{factor} * max|{name}_lowp - ref64| ({budget:.3e}) + eps ({eps:.1e}) = {bound:.3e}"
    )


def reference_options(features, rng_state, batch, heads_q, seqlen_q, seqlen_k):
    """The reference's keyword arguments for a flash_ext call with `features`: the same ones, plus
    the call's dropout keep mask when dropout is on."""
    options = dict(features)
    options.pop("deterministic", None)  # how the backward runs, not what it computes
    if options.get("dropout_p", 0.0) > 0:
        options["dropout_mask"] = dropout_keep_mask(rng_state, batch, heads_q, seqlen_q, seqlen_k, options["dropout_p"])
    return options


def assert_forward_within_tolerance(out, lse, reference, *args, **options):
    """out and lse against reference(*args, **options) in float64 and in the inputs' dtype."""
    with torch.no_grad():
        out64, lse64 = reference(*args, **options)
        out_lowp, lse_lowp = reference(*args, upcast=False, **options)
    assert_within_tolerance("out", out, out_lowp, out64, FWD_FACTOR)
    assert_within_tolerance("lse", lse, lse_lowp, lse64, FWD_FACTOR)


def check_forward(q, k, v, *, causal, softmax_scale=None, **features):
    """flash_ext.attention's out and lse against the float64 reference; returns (out, lse)."""
    out, lse, rng_state = attention_with_rng_state(q, k, v, causal=causal, softmax_scale=softmax_scale, **features)
    batch, seqlen_q, heads_q, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert out.is_contiguous(), f"out has strides {out.stride()}; it is documented as contiguous"
    assert lse.shape == (batch, heads_q, seqlen_q) and lse.dtype == torch.float32
    options = reference_options(features, rng_state, batch, heads_q, seqlen_q, k.shape[1])
    assert_forward_within_tolerance(out, lse, attention_ref, q, k, v, causal=causal, softmax_scale=softmax_scale,
                                    **options)
    return out, lse


def leaf_copies(tensors, dtype=None):
    """Fresh autograd leaves holding the same values (and, without a dtype change, the same strides)."""
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


def assert_gradients_within_tolerance(grads, dout, reference, qkv, *args, **options):
    """grads (dq, dk, dv) against autograd through reference(q, k, v, *args, **options) in float64
    and in the inputs' dtype, for the output gradient dout."""
    inputs64 = leaf_copies(qkv, torch.float64)
    out64, _ = reference(*inputs64, *args, **options)
    grads64 = torch.autograd.grad(out64, inputs64, dout.double())

    inputs_lowp = leaf_copies(qkv)
    out_lowp, _ = reference(*inputs_lowp, *args, upcast=False, **options)
    grads_lowp = torch.autograd.grad(out_lowp, inputs_lowp, dout)

    scale = magnitude(*grads64)
    for name, x, grad, grad_lowp, grad64 in zip(("dq", "dk", "dv"), qkv, grads, grads_lowp, grads64):
        assert grad.shape == x.shape and grad.dtype == x.dtype, f"{name}: {grad.shape} {grad.dtype}"
        assert_within_tolerance(name, grad, grad_lowp, grad64, GRAD_FACTOR, scale=scale)


def check_gradients(q, k, v, *, causal, softmax_scale=None, dout=None, **features):
    """dq, dk, dv from autograd through flash_ext.attention against autograd through the float64
    reference, for a random dout (or the one given); returns (dq, dk, dv)."""
    inputs = leaf_copies((q, k, v))
    out, _, rng_state = attention_with_rng_state(*inputs, causal=causal, softmax_scale=softmax_scale, **features)
    if dout is None:
        dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    options = reference_options(features, rng_state, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    assert_gradients_within_tolerance(grads, dout, attention_ref, (q, k, v), causal=causal,
                                      softmax_scale=softmax_scale, **options)
    return grads


def check_forward_and_gradients(q, k, v, *, causal=False, deterministic=False, **features):
    """check_forward and check_gradients (deterministic chooses the backward's dQ path); returns (out, lse)."""
    out, lse = check_forward(q, k, v, causal=causal, **features)
    check_gradients(q, k, v, causal=causal, deterministic=deterministic, **features)
    return out, lse


def check_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal, softmax_scale=None, **features):
    """flash_ext.attention_varlen's out and lse against the float64 per-sequence reference; returns (out, lse)."""
    max_seqlen_q, max_seqlen_k = max_seqlen(cu_seqlens_q), max_seqlen(cu_seqlens_k)
    out, lse, rng_state = attention_varlen_with_rng_state(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                          max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                                          **features)
    total_q, heads_q, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (heads_q, total_q) and lse.dtype == torch.float32
    options = reference_options(features, rng_state, len(cu_seqlens_q) - 1, heads_q, max_seqlen_q, max_seqlen_k)
    assert_forward_within_tolerance(out, lse, attention_varlen_ref, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                    causal=causal, softmax_scale=softmax_scale, **options)
    return out, lse


def check_varlen_gradients(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal, softmax_scale=None, **features):
    """dq, dk, dv through flash_ext.attention_varlen against the float64 per-sequence reference."""
    max_seqlen_q, max_seqlen_k = max_seqlen(cu_seqlens_q), max_seqlen(cu_seqlens_k)
    inputs = leaf_copies((q, k, v))
    out, _, rng_state = attention_varlen_with_rng_state(*inputs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                        max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                                        **features)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, inputs, dout)
    options = reference_options(features, rng_state, len(cu_seqlens_q) - 1, q.shape[1], max_seqlen_q, max_seqlen_k)
    assert_gradients_within_tolerance(grads, dout, attention_varlen_ref, (q, k, v), cu_seqlens_q, cu_seqlens_k,
                                      causal=causal, softmax_scale=softmax_scale, **options)
    return grads


def max_seqlen(cu_seqlens):
    """The longest sequence of int32 prefix sums (0 for an empty batch)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return int(lengths.max()) if lengths.numel() else 0

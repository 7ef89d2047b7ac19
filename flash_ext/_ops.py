"""Python-side registrations for the ops defined in csrc/flash_api.cpp: fake (meta)
implementations, so torch.compile can trace them, and autograd, whose backward is the
`flash_ext::bwd` op."""
import math

import torch


def _check_inputs(q, k, v, softmax_scale):
    """The checks of check_qkv/check_softmax_scale in csrc/flash_api.cpp, for calls that reach the
    fake: tracing (torch.compile) and any call with a tensor on the meta device, which would
    otherwise return uninitialised memory instead of an error."""
    for name, t, dims in (("q", q, "(batch, seqlen_q, heads_q, head_dim)"), ("k", k, "(batch, seqlen_k, heads_kv, head_dim)"),
                          ("v", v, "(batch, seqlen_k, heads_kv, head_dim)")):
        torch._check(t.dim() == 4, lambda: f"flash_ext: {name} must have 4 dimensions {dims}, got {t.dim()}")
    for name, t in (("k", k), ("v", v)):
        torch._check(t.dtype == q.dtype, lambda: f"flash_ext: {name} has dtype {t.dtype} but q has {q.dtype}")
        torch._check(t.device == q.device, lambda: f"flash_ext: {name} is on {t.device} but q is on {q.device}; "
                                                   "q, k and v must be on one device")
    torch._check(q.dtype in (torch.float16, torch.bfloat16, torch.float32),
                 lambda: f"flash_ext: q has dtype {q.dtype}; expected float16 or bfloat16 (or float32 on the CPU)")
    torch._check(k.shape == v.shape, lambda: f"flash_ext: k and v must have the same shape, got {k.shape} and {v.shape}")
    torch._check(k.shape[0] == q.shape[0], lambda: f"flash_ext: k has batch {k.shape[0]} but q has batch {q.shape[0]}")
    torch._check(k.shape[3] == q.shape[3], lambda: f"flash_ext: k has head_dim {k.shape[3]} but q has head_dim {q.shape[3]}")
    torch._check(1 <= q.shape[3] <= 256, lambda: f"flash_ext: head_dim must be in 1..256, got {q.shape[3]}")
    torch._check(k.shape[2] >= 1 and q.shape[2] % k.shape[2] == 0,
                 lambda: f"flash_ext: heads_q ({q.shape[2]}) must be a multiple of heads_kv ({k.shape[2]})")
    torch._check(math.isfinite(softmax_scale) and softmax_scale > 0,
                 lambda: f"flash_ext: softmax_scale must be a finite positive number, got {softmax_scale}")


@torch.library.register_fake("flash_ext::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False):
    _check_inputs(q, k, v, softmax_scale)
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty(q.shape)
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_ext::bwd")
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
    _check_inputs(q, k, v, softmax_scale)
    torch._check(dout.shape == q.shape and out.shape == q.shape, lambda: "flash_ext: dout and out must match q's shape")
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = deterministic
    # lse is an output for inspection (e.g. to merge partial attentions); its gradient is not
    # propagated, as in flash-attn.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flash_ext.bwd(
        dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic
    )
    return dq, dk, dv, None, None, None


torch.library.register_autograd("flash_ext::fwd", _backward, setup_context=_setup_context)

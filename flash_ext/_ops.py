"""Python-side registrations for the ops defined in csrc/flash_api.cpp: fake (meta)
implementations, so torch.compile can trace them, and autograd, whose backward is the
`flash_ext::bwd` op."""
import torch


@torch.library.register_fake("flash_ext::fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, deterministic=False):
    batch, seqlen_q, heads_q, _ = q.shape
    out = q.new_empty(q.shape)
    lse = q.new_empty((batch, heads_q, seqlen_q), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("flash_ext::bwd")
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, deterministic):
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

"""End to end: a small pre-norm transformer block (GQA causal attention + MLP) whose output and
gradients of a loss (input and every weight) are computed three ways: with flash_ext.attention, with
PyTorch's scaled_dot_product_attention, both in the low-precision dtype, and in float64 with the
reference attention. flash_ext must be within the tolerance rule's gradient factor of SDPA's error
against float64. Runs on the CPU (CI) and on CUDA (marked `cuda`)."""
import pytest
import torch

import flash_ext
from flash_ext.reference import attention_ref
from tolerance import EPS, FWD_FACTOR, GRAD_FACTOR, max_abs_error

DIM, HEADS_Q, HEADS_KV, HEAD_DIM = 256, 4, 2, 64


def make_weights(dtype, device, generator):
    def weight(*shape):
        return (torch.randn(*shape, generator=generator, dtype=torch.float64) / shape[-1] ** 0.5).to(device, dtype)

    return {
        "wq": weight(HEADS_Q * HEAD_DIM, DIM),
        "wkv": weight(2 * HEADS_KV * HEAD_DIM, DIM),
        "wo": weight(DIM, HEADS_Q * HEAD_DIM),
        "w1": weight(4 * DIM, DIM),
        "w2": weight(DIM, 4 * DIM),
    }


def flash_attention(q, k, v):
    return flash_ext.attention(q, k, v, causal=True)


def sdpa_attention(q, k, v):
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    )
    return out.transpose(1, 2)


def reference_attention(q, k, v):
    return attention_ref(q, k, v, causal=True)[0]


def block(x, w, attention):
    batch, seqlen, _ = x.shape
    h = torch.nn.functional.rms_norm(x, (DIM,))
    q = (h @ w["wq"].T).view(batch, seqlen, HEADS_Q, HEAD_DIM)
    k, v = (h @ w["wkv"].T).view(batch, seqlen, 2, HEADS_KV, HEAD_DIM).unbind(2)
    x = x + attention(q, k, v).reshape(batch, seqlen, -1) @ w["wo"].T
    h = torch.nn.functional.rms_norm(x, (DIM,))
    return x + torch.nn.functional.gelu(h @ w["w1"].T) @ w["w2"].T


def output_and_grads(x, weights, target, attention):
    """The block's output, and the gradients of loss = mean(output * target)."""
    leaves = [t.detach().clone().requires_grad_() for t in [x, *weights.values()]]
    out = block(leaves[0], dict(zip(weights, leaves[1:])), attention)
    loss = (out.double() * target).mean()
    return out.detach(), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda,
                                        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])],
)
def test_block_loss_and_gradients_match_sdpa(device):
    dtype = torch.bfloat16
    generator = torch.Generator().manual_seed(1234)
    weights = make_weights(dtype, device, generator)
    x = torch.randn(2, 200, DIM, generator=generator, dtype=torch.float64).to(device, dtype)
    target = torch.randn(2, 200, DIM, generator=generator, dtype=torch.float64).to(device)

    out, grads = output_and_grads(x, weights, target, flash_attention)
    out_sdpa, grads_sdpa = output_and_grads(x, weights, target, sdpa_attention)
    weights64 = {name: w.double() for name, w in weights.items()}
    out64, grads64 = output_and_grads(x.double(), weights64, target, reference_attention)

    # The loss is a mean with heavy cancellation; the block output it is computed from is the
    # meaningful forward check.
    err, err_sdpa = max_abs_error(out, out64), max_abs_error(out_sdpa, out64)
    budget = FWD_FACTOR * err_sdpa + EPS[dtype] * out64.abs().max().item()
    assert err <= budget, f"block output: error {err:.3e} > {budget:.3e} (SDPA's error {err_sdpa:.3e})"
    names = ["x", *weights]
    for name, grad, grad_sdpa, grad64 in zip(names, grads, grads_sdpa, grads64):
        err = max_abs_error(grad, grad64)
        err_sdpa = max_abs_error(grad_sdpa, grad64)
        budget = GRAD_FACTOR * err_sdpa + EPS[dtype] * grad64.abs().max().item()
        assert err <= budget, f"d{name}: error {err:.3e} > {budget:.3e} (SDPA's error {err_sdpa:.3e})"

"""Small CUDA cases for compute-sanitizer (memcheck, racecheck): forward and backward (both dQ
paths), ragged tiles, causal with seqlen_q != seqlen_k, GQA, a padded head dim, and head dims on
both sides of the backward's split at 128. Checks results too, so a clean sanitizer report on a
wrong answer does not pass.

    compute-sanitizer --tool memcheck  python3 scripts/sanitize.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize.py
"""
import torch

import flash_ext
from flash_ext.reference import attention_ref

torch.manual_seed(0)
cases = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal
    (1, 129, 77, 4, 2, 64, True),
    (2, 17, 200, 2, 1, 128, False),
    (1, 200, 17, 2, 2, 59, True),
    (1, 65, 130, 2, 2, 256, True),
]
for batch, sq, sk, hq, hkv, hd, causal in cases:
    q = torch.randn(batch, sq, hq, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, sk, hkv, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, sk, hkv, hd, device="cuda", dtype=torch.bfloat16)
    dout = torch.randn(batch, sq, hq, hd, device="cuda", dtype=torch.bfloat16)
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*ref_inputs, causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_inputs, dout.double())
    inputs = [t.requires_grad_() for t in (q, k, v)]
    out = flash_ext.attention(*inputs, causal=causal)
    err = (out.double() - ref).abs().max().item()
    assert err < 0.05, f"case {(batch, sq, sk, hq, hkv, hd, causal)}: forward max error {err}"
    for deterministic in (False, True):
        out = flash_ext.attention(*inputs, causal=causal, deterministic=deterministic)
        grads = torch.autograd.grad(out, inputs, dout)
        for name, grad, ref_grad in zip(("dq", "dk", "dv"), grads, ref_grads):
            err = (grad.double() - ref_grad).abs().max().item()
            bound = 0.05 * max(1.0, ref_grad.abs().max().item())
            assert err < bound, f"case {(batch, sq, sk, hq, hkv, hd, causal)}, deterministic={deterministic}: {name} error {err}"
torch.cuda.synchronize()
print(f"sanitize: {len(cases)} cases ok (forward, backward with both dQ paths)")

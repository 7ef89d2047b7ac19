"""Small CUDA forward cases for compute-sanitizer (memcheck, racecheck): ragged tiles, causal
with seqlen_q != seqlen_k, GQA, a padded head dim. Checks results too, so a clean sanitizer
report on a wrong answer does not pass.

    compute-sanitizer --tool memcheck  python3 scripts/sanitize_fwd.py
    compute-sanitizer --tool racecheck python3 scripts/sanitize_fwd.py
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
    out = flash_ext.attention(q, k, v, causal=causal)
    ref, _ = attention_ref(q, k, v, causal=causal)
    err = (out.double() - ref).abs().max().item()
    assert err < 0.05, f"case {(batch, sq, sk, hq, hkv, hd, causal)}: max error {err}"
torch.cuda.synchronize()
print(f"sanitize_fwd: {len(cases)} cases ok")

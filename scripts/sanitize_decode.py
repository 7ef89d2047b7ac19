"""Small CUDA cases of flash_ext.attention_with_kvcache for compute-sanitizer (memcheck, racecheck): the decode
kernels, and prefills (the sm90 forward reading dense or paged caches in place), checked against the reference;
run on its own or at the end of scripts/sanitize.py.

    compute-sanitizer --tool racecheck python3 scripts/sanitize_decode.py
"""
import torch

import flash_ext
from flash_ext.reference import attention_with_kvcache_ref

torch.manual_seed(0)
# Decode: one row tile (warps on their own slices; splits merged by the last CTA), four row tiles (warps sharing
# each stage; 20 rows: a partial last tile), paged and dense caches. Prefill (280 packed rows per kv head):
# pages of whole key blocks and a dense cache, sequences ending inside a block (stale rows zeroed).
kvcache_cases = [  # batch, seqlen_q, heads_q, heads_kv, head_dim, capacity, page_size (0: dense), num_splits
    (2, 1, 8, 2, 128, 700, 0, 0),
    (2, 1, 4, 1, 64, 520, 16, 3),
    (1, 5, 8, 2, 128, 300, 0, 1),
    (2, 16, 8, 2, 256, 260, 32, 0),
    (2, 70, 8, 2, 128, 768, 256, 0),
    (2, 70, 8, 2, 64, 640, 128, 0),
    (2, 70, 8, 2, 256, 700, 0, 0),
]
for batch, sq, hq, hkv, hd, capacity, page, splits in kvcache_cases:
    if page:
        blocks = capacity // page
        k_cache, v_cache = (torch.randn(batch * blocks, page, hkv, hd, device="cuda", dtype=torch.bfloat16)
                            for _ in range(2))
        table = torch.randperm(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    else:
        k_cache, v_cache = (torch.randn(batch, capacity, hkv, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        table = None
    q = torch.randn(batch, sq, hq, hd, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(batch, 3, hkv, hd, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seqlens = torch.tensor([capacity // 2 + 7 * b for b in range(batch)], device="cuda", dtype=torch.int32)
    ref, _, _, _ = attention_with_kvcache_ref(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                              block_table=table, causal=True)
    out = flash_ext.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                           block_table=table, causal=True, num_splits=splits)
    err = (out.double() - ref.double()).abs().max().item()
    assert err < 0.05, f"kvcache case {(batch, sq, hq, hkv, hd, capacity, page, splits)}: max error {err}"
torch.cuda.synchronize()
print(f"sanitize_decode: {len(kvcache_cases)} kvcache cases ok")

"""Quick CUDA forward check against the float64 reference (used before the full pytest
suite exists on a device): prints one line per case and exits nonzero on any failure."""
import sys

import torch

import flash_ext
from flash_ext.reference import attention_ref

torch.manual_seed(0)
failures = 0
cases = []
for hd in (32, 59, 64, 96, 128, 160, 192, 224, 256):
    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            cases.append((2, 3, 3, hd, 113, 203, dtype, causal))
for sq, sk in ((1, 1), (1, 239), (17, 17), (128, 217), (127, 512), (512, 256), (1023, 1024), (2048, 2048)):
    for causal in (False, True):
        cases.append((2, 9, 3, 128, sq, sk, torch.bfloat16, causal))
        cases.append((1, 4, 1, 64, sq, sk, torch.float16, causal))
for b, hq, hkv, hd, sq, sk, dtype, causal in cases:
    q = torch.randn(b, sq, hq, hd, device="cuda", dtype=dtype)
    k = torch.randn(b, sk, hkv, hd, device="cuda", dtype=dtype)
    v = torch.randn(b, sk, hkv, hd, device="cuda", dtype=dtype)
    out, lse = flash_ext.attention(q, k, v, causal=causal, return_lse=True)
    out2 = flash_ext.attention(q, k, v, causal=causal)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    low, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    err = (out.double() - ref).abs().max().item()
    low_err = (low.double() - ref).abs().max().item()
    finite = torch.isfinite(ref_lse)
    lse_err = (lse.double() - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
    lse_ok = bool((lse[~finite] == float("-inf")).all())
    ok = err <= 2 * low_err + 1e-4 and lse_err < 1e-3 and lse_ok and torch.equal(out, out2) and not out.isnan().any()
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} b{b} hq{hq} hkv{hkv} hd{hd} sq{sq} sk{sk} {str(dtype)[6:]} causal={causal}: "
          f"err {err:.2e} (lowp {low_err:.2e}) lse_err {lse_err:.2e} lse_-inf_ok {lse_ok}")
print(f"{len(cases) - failures}/{len(cases)} passed")
sys.exit(1 if failures else 0)

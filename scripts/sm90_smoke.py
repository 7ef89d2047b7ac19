#!/usr/bin/env python3
"""A first look at the sm90 forward on a Hopper GPU, one line per case as it finishes (so a hang shows
where): max |out - reference| of the sm90 kernel, of the sm80 kernel (FLASH_EXT_DISABLE_SM90=1) and of
the reference computed in bf16 (the tolerance rule's yardstick), plus lse's. Run under `timeout`.

    PYTHONPATH=. timeout 120 python scripts/sm90_smoke.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flash_ext  # noqa: E402
from flash_ext.reference import attention_ref  # noqa: E402

CASES = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, options
    (1, 128, 128, 1, 1, {}),
    (2, 300, 300, 4, 2, {}),
    (2, 300, 300, 4, 2, {"causal": True}),
    (1, 17, 1000, 2, 2, {"causal": True}),
    (1, 1000, 17, 2, 1, {"causal": True}),
    (2, 1, 239, 3, 3, {}),
    (1, 700, 900, 2, 2, {"window_size": (100, 50)}),
    (2, 300, 300, 4, 2, {"softcap": 30.0}),
    (1, 2048, 2048, 8, 8, {"causal": True}),
]


def run(q, k, v, disable, **options):
    if disable:
        os.environ["FLASH_EXT_DISABLE_SM90"] = "1"
    try:
        out, lse = flash_ext.attention(q, k, v, return_lse=True, **options)
        torch.cuda.synchronize()
    finally:
        os.environ.pop("FLASH_EXT_DISABLE_SM90", None)
    return out, lse


def main():
    print(flash_ext.info(), flush=True)
    torch.manual_seed(0)
    for batch, sq, sk, hq, hkv, options in CASES:
        q = torch.randn(batch, sq, hq, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(batch, sk, hkv, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(batch, sk, hkv, 128, device="cuda", dtype=torch.bfloat16)
        out90, lse90 = run(q, k, v, False, **options)
        out80, lse80 = run(q, k, v, True, **options)
        out64, lse64 = attention_ref(q, k, v, **options)
        outlp, _ = attention_ref(q, k, v, upcast=False, **options)
        finite = torch.isfinite(lse64)
        err = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
        lse_err = lambda a: (a.double() - lse64)[finite].abs().max().item() if finite.any() else 0.0  # noqa: E731
        print(f"b{batch} sq{sq} sk{sk} h{hq}/{hkv} {options}: out sm90 {err(out90, out64):.2e} sm80 "
              f"{err(out80, out64):.2e} bf16-ref {err(outlp, out64):.2e}; lse sm90 {lse_err(lse90):.2e} "
              f"sm80 {lse_err(lse80):.2e}; nan {torch.isnan(out90).any().item()}", flush=True)


if __name__ == "__main__":
    main()

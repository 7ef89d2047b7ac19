"""A short, fixed workload for Nsight Compute: flash_ext forward (or forward + backward) at one
benchmark shape, run 4 times.

    ncu --clock-control none --kernel-name regex:attention_fwd --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python3 benchmarks/profile_kernels.py --head-dim 128 --seqlen 8192
    ncu ... --kernel-name regex:attention_bwd_dkdv ... python3 benchmarks/profile_kernels.py --backward
"""
import argparse

import torch

import flash_ext

parser = argparse.ArgumentParser()
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--seqlen", type=int, default=8192)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--backward", action="store_true", help="also run the backward (deterministic=False)")
args = parser.parse_args()

heads, batch = 2048 // args.head_dim, 16384 // args.seqlen
q, k, v = (torch.randn(batch, args.seqlen, heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                       requires_grad=args.backward) for _ in range(3))
for _ in range(4):
    out = flash_ext.attention(q, k, v, causal=args.causal)
    if args.backward:
        out.backward(torch.randn_like(out))
torch.cuda.synchronize()

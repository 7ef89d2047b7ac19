"""A short, fixed workload for Nsight Compute: flash_ext forward at one benchmark shape.

    ncu --clock-control none --kernel-name regex:attention_fwd --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python3 benchmarks/profile_fwd.py --head-dim 128 --seqlen 8192
"""
import argparse

import torch

import flash_ext

parser = argparse.ArgumentParser()
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--seqlen", type=int, default=8192)
parser.add_argument("--causal", action="store_true")
args = parser.parse_args()

heads, batch = 2048 // args.head_dim, 16384 // args.seqlen
q, k, v = (torch.randn(batch, args.seqlen, heads, args.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for _ in range(4):
    flash_ext.attention(q, k, v, causal=args.causal)
torch.cuda.synchronize()

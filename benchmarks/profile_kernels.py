"""A short, fixed workload for Nsight Compute: flash_ext forward (or forward + backward) at one
benchmark shape, run 4 times.

    ncu --clock-control none --kernel-name regex:attention_fwd --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python3 benchmarks/profile_kernels.py --head-dim 128 --seqlen 8192
    ncu ... --kernel-name regex:attention_bwd_dkdv ... python3 benchmarks/profile_kernels.py --backward
    ncu ... --kernel-name regex:flash_bwd_dq_dk_dv ... python3 benchmarks/profile_kernels.py --backward --impl sdpa_flash
"""
import argparse

import torch
import torch.nn.functional as F

import flash_ext

parser = argparse.ArgumentParser()
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--seqlen", type=int, default=8192)
parser.add_argument("--causal", action="store_true")
parser.add_argument("--backward", action="store_true", help="also run the backward (deterministic=False)")
parser.add_argument("--impl", choices=["flash_ext", "sdpa_flash"], default="flash_ext",
                    help="sdpa_flash: PyTorch SDPA's FlashAttention-2 backend, to profile beside ours")
parser.add_argument("--softcap", type=float, default=0.0, help="flash_ext only: > 0 runs the softcap kernels")
parser.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"),
                    help="flash_ext only: window_size, e.g. --window 1024 0")
args = parser.parse_args()
if (args.softcap > 0 or tuple(args.window) != (-1, -1)) and args.impl != "flash_ext":
    parser.error("--softcap and --window need --impl flash_ext (SDPA has neither)")


def attention(q, k, v):
    if args.impl == "flash_ext":
        return flash_ext.attention(q, k, v, causal=args.causal, softcap=args.softcap, window_size=tuple(args.window))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=args.causal).transpose(1, 2)


heads, batch = 2048 // args.head_dim, 16384 // args.seqlen
q, k, v = (torch.randn(batch, args.seqlen, heads, args.head_dim, device="cuda", dtype=torch.bfloat16,
                       requires_grad=args.backward) for _ in range(3))
for _ in range(4):
    out = attention(q, k, v)
    if args.backward:
        out.backward(torch.randn_like(out))
torch.cuda.synchronize()

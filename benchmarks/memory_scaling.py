"""Peak GPU memory of flash_ext forward + backward against sequence length (batch 1, 16 heads,
head_dim 128, bf16, causal): it should grow linearly, as q, k, v, out, the gradients and the
O(seqlen) scratch do; an N x N buffer anywhere would make it quadratic.

    python benchmarks/memory_scaling.py [--seqlens 16384,32768,65536] [--json PATH]
"""
import argparse
import json

import torch

import flash_ext


def peak_bytes(seqlen, heads=16, head_dim=128, dtype=torch.bfloat16):
    """Peak memory allocated during one forward + backward, above what the inputs already take."""
    q, k, v = (torch.randn(1, seqlen, heads, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(1, seqlen, heads, head_dim, device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    out = flash_ext.attention(q, k, v, causal=True)
    out.backward(dout)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="16384,32768,65536")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    seqlens = [int(s) for s in args.seqlens.split(",")]
    rows = []
    for seqlen in seqlens:
        peak = peak_bytes(seqlen)
        rows.append({"seqlen": seqlen, "peak_bytes": peak, "bytes_per_token": peak / seqlen})
        print(f"seqlen {seqlen:6d}: peak {peak / 2**20:9.1f} MiB above inputs, {peak / seqlen:8.0f} B/token")
    # Linear growth: bytes per token stay flat (within 10%) from the shortest to the longest.
    ratio = rows[-1]["bytes_per_token"] / rows[0]["bytes_per_token"]
    print(f"bytes/token at {seqlens[-1]} over {seqlens[0]}: {ratio:.3f} ({'linear' if ratio < 1.1 else 'NOT linear'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Where a backward's time goes: per-kernel GPU time (torch.profiler) of flash_ext's backward, and
of SDPA's FlashAttention-2 backend beside it, at a few shapes of the benchmarks.

    python benchmarks/kernel_breakdown.py [--cases window,causal16k,plain8k] [--iters 10] [--timeline] [--forward]

Each case runs the backward --iters times after a warm-up; the table lists every kernel's mean
time per backward (microseconds) and its share of the sum. bf16, head_dim 128, 16 heads. Kernels that
overlap (the dQ conversion starts during the dK/dV kernel's last wave: common/finished_walks.cuh) count
in full, so the sum can exceed the backward's time; --timeline prints, for the last backward, each
kernel's start and end relative to the first kernel's start (where they overlap), and the median span
per backward (first kernel's start to last kernel's end: the GPU time of a backward). --forward: the same
for flash_ext's forward (no SDPA), e.g. to compare two builds' kernels with less noise than do_bench's.
"""
import argparse
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import flash_ext

HEADS, HEAD_DIM = 16, 128

# name -> (batch, seqlen, flash_ext keyword arguments, SDPA is_causal or None where SDPA has no equivalent)
CASES = {
    "window": (1, 16384, dict(window_size=(1024, 0)), None),
    "window2": (1, 16384, dict(window_size=(1024, 1024)), None),
    # Left windows of other widths: the same 2048 walks with 10 / 34 / 66 steps instead of 18, so that a
    # straight line through the spans splits a walk's cost into its steps and a fixed part.
    "window512": (1, 16384, dict(window_size=(512, 0)), None),
    "window2048": (1, 16384, dict(window_size=(2048, 0)), None),
    "window4096": (1, 16384, dict(window_size=(4096, 0)), None),
    "causal16k": (1, 16384, dict(causal=True), True),
    "plain8k": (2, 8192, dict(), False),
    "plain2k": (8, 2048, dict(), False),
}


def kernel_times(backward, iters, timeline=False):
    for _ in range(3):
        backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            backward()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    kernels = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / iters
            kernels.append((event.time_range.start, event.time_range.end, event.name))
    if timeline:
        kernels.sort()
        per_call = len(kernels) // iters  # every call launches the same kernels
        spans = sorted(kernels[c + per_call - 1][1] - kernels[c][0] for c in range(0, len(kernels), per_call))
        print(f"  span per call (first kernel's start to last kernel's end): median {spans[len(spans) // 2]:.1f} us,"
              f" min {spans[0]:.1f}, max {spans[-1]:.1f} ({iters} calls)")
        last = kernels[-per_call:]
        origin = last[0][0]
        print(f"  timeline of the last call (us from its first kernel's start; span {last[-1][1] - origin:.1f}):")
        for start, end, name in last:
            print(f"    {start - origin:9.1f} .. {end - origin:9.1f}  {name[:100]}")
    return totals


def report(title, totals):
    total = sum(totals.values())
    print(f"\n{title}: {total:9.1f} us per backward")
    for name, us in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"  {us:9.1f} us {100 * us / total:5.1f}%  {name[:110]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeline", action="store_true")
    parser.add_argument("--forward", action="store_true")
    args = parser.parse_args()
    for case in args.cases.split(","):
        batch, seqlen, kwargs, sdpa_causal = CASES[case]
        q, k, v = (torch.randn(batch, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        if args.forward:
            with torch.no_grad():
                report(f"flash_ext forward {case} {kwargs}",
                       kernel_times(lambda: flash_ext.attention(q, k, v, **kwargs), args.iters,  # noqa: B023
                                    args.timeline))
            continue
        out = flash_ext.attention(q, k, v, **kwargs)
        dout = torch.randn_like(out)
        report(f"flash_ext {case} {kwargs}",
               kernel_times(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), args.iters,
                            args.timeline))
        if sdpa_causal is not None:
            qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                out_t = F.scaled_dot_product_attention(qt, kt, vt, is_causal=sdpa_causal)
            dout_t = dout.transpose(1, 2)
            report(f"sdpa_flash {case}",
                   kernel_times(lambda: torch.autograd.grad(out_t, (qt, kt, vt), dout_t, retain_graph=True),
                                args.iters))


if __name__ == "__main__":
    main()

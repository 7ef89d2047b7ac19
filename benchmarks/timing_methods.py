"""One backward timed three ways, to see what a benchmark's number holds besides the kernels.

bench_features.py times with triton's do_bench (the L2 cleared before every repeat, median), while
kernel_breakdown.py --timeline reports the GPU span of each call (profiler, no clearing); for the window
backward the two differed by 40-160 us (stop 25). Here, per case (bf16, hd128, 16 heads, seqlen 16k):

  do_bench     as bench_features.py: median ms, the L2 cleared before each repeat
  events       CUDA events around 20 back-to-back calls after a warm-up: mean ms per call, no clearing
  host         host time of those 20 calls (perf_counter, synchronised): if it exceeds `events`, the
               launches, not the GPU, set the pace

    python benchmarks/timing_methods.py [--cases window,window2,causal,full]
"""
import argparse
import time

import torch
from triton.testing import do_bench

import flash_ext

CASES = {"window": dict(window_size=(1024, 0)), "window2": dict(window_size=(1024, 1024)),
         "causal": dict(causal=True), "full": dict(causal=False)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    q, k, v = (torch.randn(1, 16384, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    print(f"{'case':8s} {'do_bench':>9s} {'events':>9s} {'host':>9s}  (ms per backward)")
    for name in args.cases.split(","):
        out = flash_ext.attention(q, k, v, **CASES[name])
        dout = torch.randn_like(out)

        def backward():
            q.grad = k.grad = v.grad = None  # as do_bench's grad_to_none: no accumulation kernels
            out.backward(dout, retain_graph=True)

        bench_ms = do_bench(backward, warmup=25, rep=100, return_mode="median", grad_to_none=[q, k, v])
        for _ in range(5):
            backward()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host_start = time.perf_counter()
        start.record()
        for _ in range(20):
            backward()
        end.record()
        torch.cuda.synchronize()
        host_ms = (time.perf_counter() - host_start) * 1e3 / 20
        print(f"{name:8s} {bench_ms:9.3f} {start.elapsed_time(end) / 20:9.3f} {host_ms:9.3f}", flush=True)


if __name__ == "__main__":
    main()

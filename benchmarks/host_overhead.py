"""Host (CPU) time per call of flash_ext's forward and backward, beside their do_bench time and GPU span.

Why: triton's do_bench, which bench_features.py and bench_attention.py use, records its start event right after
an L2 flush (a 256 MB fill, ~65 us on an H200) and then calls the function; if the call's host path (autograd,
the custom op, allocations, TMA descriptors, launches) takes longer than that fill, the GPU idles inside the
timed region. That idle time counts against short calls and against relative targets such as issue 5's
window (1024, 0) backward, whose GPU span (~0.87 ms) is a sixth of causal's.

Per case it prints: host us per call (calls enqueued behind a long torch.cuda._sleep, so that no launch waits
for the GPU), do_bench median, and the GPU span of one isolated call (first kernel start to last kernel end,
torch.profiler: launched onto an idle GPU, so the host's gaps between its launches count, and its L2 holds
what the previous call left); for the first case also torch.profiler's CPU table of ten backwards and the
host / GPU timeline of one (where the host time goes, when each launch happens).

    python benchmarks/host_overhead.py [--cases window,short]
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import flash_ext

CASES = {  # name: (batch, seqlen, heads, head_dim, attention kwargs)
    "window": (1, 16384, 16, 128, {"window_size": (1024, 0)}),
    "causal16k": (1, 16384, 16, 128, {"causal": True}),
    "short": (1, 512, 16, 128, {"causal": True}),
}


def host_us_per_call(fn, calls=100):
    """Host time of fn, with the GPU kept busy so that no launch blocks on a full queue or a sync (after a
    warm-up call: a kernel's first launch loads its module, which waits for the GPU)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e9))  # ~1.5 s of GPU time at ~2 GHz: longer than the calls take to enqueue
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def gpu_span_us(fn):
    """First kernel's start to last kernel's end of one call onto an idle GPU (microseconds), after a warm-up."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return float("nan")
    return max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)


def print_timeline(fn):
    """Host events of one call (after warm-up), in order, with their start offsets: where the host time goes
    and when each launch happens; then the GPU kernels' offsets on the same clock."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):  # the profiler's own start-up (buffer requests) lands in the first
            fn()
            torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.name != "cudaDeviceSynchronize"), key=lambda e: e.time_range.start)
    roots = [e for e in events if e.name.startswith("autograd::engine::evaluate_function: Generated")]
    t0 = roots[-1].time_range.start if roots else events[0].time_range.start
    events = [e for e in events if e.time_range.start >= t0]
    for e in events:
        where = "GPU" if e.device_type == torch.autograd.DeviceType.CUDA else "CPU"
        print(f"  {where} {e.time_range.start - t0:8.1f} us  {e.time_range.end - e.time_range.start:8.1f} us  {e.name[:90]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="short,window,causal16k", help="comma list of " + ", ".join(CASES))
    args = parser.parse_args()
    for name in args.cases.split(","):
        batch, seqlen, heads, head_dim, kwargs = CASES[name]
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16)

        def forward():
            with torch.no_grad():
                return flash_ext.attention(q, k, v, **kwargs)

        out = flash_ext.attention(q, k, v, **kwargs)

        def backward():
            for x in (q, k, v):
                x.grad = None
            out.backward(dout, retain_graph=True)

        for label, fn in (("fwd", forward), ("bwd", backward)):
            host = host_us_per_call(fn)
            bench_ms = do_bench(fn, warmup=25, rep=100, return_mode="median", grad_to_none=[q, k, v])
            span = gpu_span_us(fn)
            print(f"{name:10s} {label}: host {host:7.1f} us per call   do_bench {bench_ms * 1e3:8.1f} us   "
                  f"isolated GPU span {span:8.1f} us", flush=True)
        if name == args.cases.split(",")[0]:
            backward()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    backward()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
            print_timeline(backward)


if __name__ == "__main__":
    main()

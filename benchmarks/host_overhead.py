"""Host (CPU) time per call of flash_ext's forward and backward, beside their do_bench time and GPU span.

Why: triton's do_bench, which bench_features.py and bench_attention.py use, records its start event right after
an L2 flush (a 256 MB fill, ~65 us on an H200) and then calls the function; if the call's host path (autograd,
the custom op, allocations, TMA descriptors, launches) takes longer than that fill, the GPU idles inside the
timed region. That idle time would count against short calls and against relative targets such as issue 5's
window (1024, 0) backward, whose GPU span (~0.87 ms) is a sixth of causal's. Found (H200, stop 32; NOTES): at
16k tokens it does not (the op's do_bench equals its CUDA-graph replay's, and the flush costs ~4 us); the
host path bounds only backwards shorter than it (1 x 512 x 16 x 128).

Per case it prints: host us per call (calls enqueued behind a long torch.cuda._sleep, so that no launch waits
for the GPU), do_bench median, and the GPU span of one isolated call (first kernel start to last kernel end,
torch.profiler: launched onto an idle GPU, so the host's gaps between its launches count, and its L2 holds
what the previous call left); for the first case also torch.profiler's CPU table of ten backwards and the
host / GPU timeline of one (where the host time goes, when each launch happens).

    python benchmarks/host_overhead.py [--cases short,window,causal16k] [--no-table] [--between-calls]
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
        start, length = e.time_range.start - t0, e.time_range.end - e.time_range.start
        print(f"  {where} {start:8.1f} us  {length:8.1f} us  {e.name[:90]}")


def graphed_bwd_us(q, k, v, dout, kwargs, between_calls=False):
    """do_bench median (us) of the backward op called directly and replayed from a CUDA graph (no host work in
    the timed region): their difference is the host time do_bench sees as GPU idle."""
    scale = q.shape[-1] ** -0.5
    causal = kwargs.get("causal", False)
    left, right = kwargs.get("window_size", (-1, -1))
    with torch.no_grad():
        out, lse, _ = torch.ops.flash_ext.fwd(q, k, v, scale, causal, False, left, right)

    def call():
        return torch.ops.flash_ext.bwd(dout, q, k, v, out, lse, scale, causal, False, left, right)

    direct = do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graphed = do_bench(graph.replay, warmup=25, rep=100, return_mode="median") * 1e3
    if between_calls:
        between_calls_study(graph.replay)
    return direct, graphed


def between_calls_study(replay):
    """GPU time (us, median of 30 CUDA-event pairs) of a graph replay after each of: nothing (back to back), a
    256 MB zero fill (triton do_bench's L2 flush), a 256 MB read, 1 ms of a spinning kernel (idle SMs): which
    state left by do_bench's flush makes a call slower than back to back."""
    buffer = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    before = {
        "back to back": lambda: None,
        "256 MB fill": buffer.zero_,
        "256 MB read": lambda: buffer.sum(),
        "1 ms spin": lambda: torch.cuda._sleep(2_000_000),
    }
    for label, prepare in before.items():
        times = []
        for _ in range(35):
            prepare()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        median = sorted(s.elapsed_time(e) for s, e in times[5:])[15] * 1e3
        print(f"    after {label:13s} {median:8.1f} us", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="short,window,causal16k", help="comma list of " + ", ".join(CASES))
    parser.add_argument("--no-table", action="store_true", help="skip the profiler table and timeline")
    parser.add_argument("--between-calls", action="store_true",
                        help="also time the graphed backward after other work (between_calls_study)")
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
        try:
            direct, graphed = graphed_bwd_us(q.detach(), k.detach(), v.detach(), dout, kwargs, args.between_calls)
            print(f"{name:10s} bwd op: do_bench {direct:8.1f} us called, {graphed:8.1f} us replayed from a CUDA graph",
                  flush=True)
        except RuntimeError as error:  # a capture the runtime refuses: report it, go on
            print(f"{name:10s} bwd op: CUDA graph capture failed: {error}", flush=True)
        if name == args.cases.split(",")[0] and not args.no_table:
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

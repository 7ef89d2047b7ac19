"""What a call costs beyond its kernels: for a few shapes, the forward and backward timed three ways.

  bench   triton do_bench median, as bench_attention / bench_features time them (L2 flushed before each
          call, the call made from Python: argument handling, checks, allocations, launches)
  graph   the same call captured in a CUDA graph and replayed (do_bench median): the GPU time alone,
          launch gaps between the call's kernels included, no host work
  host    microseconds of host time per call on a tiny problem (1 x 128 x 16 x 128), where the GPU waits
          for the host: the Python and C++ work before the kernels are queued

If bench exceeds graph by more than the L2 flush's effect, the host's work shows in the timings (a
do_bench call starts its clock after the flush; a call whose host work outlasts the flush's kernel
leaves the GPU idle inside the timed interval).

    python benchmarks/call_overhead.py [--host-profile]
"""
import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import flash_ext

HEADS, HEAD_DIM, DTYPE = 16, 128, torch.bfloat16
CASES = {  # name -> (batch, seqlen, keyword arguments)
    "window (1024, 0) 16k": (1, 16384, dict(window_size=(1024, 0))),
    "window (1024, 1024) 16k": (1, 16384, dict(window_size=(1024, 1024))),
    "causal 16k": (1, 16384, dict(causal=True)),
    "full 2k": (8, 2048, dict()),
}


def graph_of(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench(fn, grads=None):
    return do_bench(fn, warmup=25, rep=100, return_mode="median", grad_to_none=grads)


def bwd_op(kwargs):
    """torch.ops.flash_ext.bwd's arguments after (dout, q, k, v, out, lse), as interface._options gives them."""
    left, right = kwargs.get("window_size", (-1, -1))
    return (HEAD_DIM ** -0.5, kwargs.get("causal", False), False, left, right, 0.0, None, 0.0)


def host_us_per_call(fn, calls=2000):
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--host-profile", action="store_true", help="also list host time by op / CUDA runtime call")
    args = parser.parse_args()
    for name, (batch, seqlen, kwargs) in CASES.items():
        q, k, v = (torch.randn(batch, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True)
                   for _ in range(3))
        with torch.no_grad():
            fwd_bench = bench(lambda: flash_ext.attention(q, k, v, **kwargs))
            fwd_graph = graph_of(lambda: flash_ext.attention(q, k, v, **kwargs))
            fwd_replay = bench(fwd_graph.replay)
        out, lse = flash_ext.attention(q, k, v, return_lse=True, **kwargs)
        dout = torch.randn_like(out)
        bwd_bench = bench(lambda: out.backward(dout, retain_graph=True), grads=[q, k, v])
        bwd_args = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, *bwd_op(kwargs), None)
        bwd_graph = graph_of(lambda: torch.ops.flash_ext.bwd(*bwd_args))
        bwd_replay = bench(bwd_graph.replay)
        print(f"{name:26s} fwd bench {fwd_bench * 1e3:8.1f} us graph {fwd_replay * 1e3:8.1f} us | "
              f"bwd bench {bwd_bench * 1e3:8.1f} us graph {bwd_replay * 1e3:8.1f} us")
    q, k, v = (torch.randn(1, 128, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        fwd_host = host_us_per_call(lambda: flash_ext.attention(q, k, v))
    out = flash_ext.attention(q, k, v)
    dout = torch.randn_like(out)
    bwd_host = host_us_per_call(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    print(f"host per call (1 x 128 x {HEADS} x {HEAD_DIM}): fwd {fwd_host:.1f} us, bwd (autograd.grad) {bwd_host:.1f} us")
    if args.host_profile:
        # Where the host time goes: torch.profiler's CPU ops and CUDA runtime calls, 50 calls each.
        for name, fn in (("fwd", lambda: flash_ext.attention(q.detach(), k.detach(), v.detach())),
                         ("bwd", lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
            print(f"\n{name}: host time by op / runtime call (self CPU us per call)")
            events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:22]
            for e in events:
                print(f"  {e.self_cpu_time_total / 50:8.1f} us  x{e.count / 50:4.1f}  {e.key[:90]}")


if __name__ == "__main__":
    main()

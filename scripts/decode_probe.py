"""Times flash_ext.attention_with_kvcache at a few decode points with the split count forced, to see where a
point's time goes (bf16, head_dim 128, 32 query heads / 8 KV heads, one query token or --seqlen-q of them,
a contiguous cache or --page-size pages).

    python scripts/decode_probe.py --points 1x4k,1x16k --splits 0,8,16,32,64
    python scripts/decode_probe.py --points 1x4k,1x64k --splits 0,16,32,64 --seqlen-q 16   # speculative decoding
    ncu --clock-control none --kernel-name regex:decode python scripts/decode_probe.py --ncu 1x4k

Each time is the median of graph replays of a run of calls over distinct caches (at least 256 MiB in all, so no
call reads a cache the L2 holds), divided by the number of calls. --ncu runs each point a few times, eagerly, for a
profiler to attach kernel times to.
"""
import argparse

import torch

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flash_ext  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def parse_point(text):
    batch, kv = text.split("x")
    return int(batch), int(float(kv[:-1]) * 1024) if kv.endswith("k") else int(kv)


def calls_for(batch, kv_len, splits, seqlen_q=1, page_size=0):
    nbytes = 2 * batch * kv_len * HEADS_KV * HEAD_DIM * 2
    sets = max(1, min(32, -(-(256 << 20) // nbytes)))
    calls = []
    for _ in range(sets):
        q = torch.randn(batch, seqlen_q, HEADS_Q, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
        paged = {}
        if page_size:  # pages in a shuffled order, as bench_decode.py's
            pages = batch * -(-kv_len // page_size)
            k = torch.randn(pages, page_size, HEADS_KV, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            paged["block_table"] = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, -1)
        else:
            k = torch.randn(batch, kv_len, HEADS_KV, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        calls.append(lambda q=q, k=k, v=v, s=seqlens, paged=paged: flash_ext.attention_with_kvcache(
            q, k, v, cache_seqlens=s, causal=True, num_splits=splits, **paged))
    return calls, nbytes


def graph_time_us(calls, reps=50):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[len(times) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="1x4k,1x16k,1x128k,8x4k")
    p.add_argument("--splits", default="0,8,16,32,64,128")
    p.add_argument("--seqlen-q", type=int, default=1, help="query tokens per sequence (speculative decoding: 4, 16)")
    p.add_argument("--page-size", type=int, default=0, help="a paged cache of pages this size (0: contiguous)")
    p.add_argument("--ncu", metavar="POINTS", help="run these points a few times eagerly (for a profiler), then exit")
    args = p.parse_args()
    if args.ncu:
        for point in args.ncu.split(","):
            calls, _ = calls_for(*parse_point(point), 0, args.seqlen_q, args.page_size)
            for _ in range(3):
                calls[0]()
        torch.cuda.synchronize()
        return
    splits = [int(s) for s in args.splits.split(",")]
    print(f"{'point':>8} " + " ".join(f"{'splits ' + str(s):>16}" for s in splits) + "   (us per call, TB/s)")
    for point in args.points.split(","):
        cells = []
        for s in splits:
            calls, nbytes = calls_for(*parse_point(point), s, args.seqlen_q, args.page_size)
            us = graph_time_us(calls)
            cells.append(f"{us:7.1f} {nbytes / us / 1e6:5.2f}  ")
            del calls
            torch.cuda.empty_cache()
        print(f"{point:>8} " + " ".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()

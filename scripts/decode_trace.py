"""Timelines of flash_ext's decode kernels (csrc/decode/decode_trace.cuh): per-warp %globaltimer stamps of the decode
kernel and per-CTA stamps of its combine, inside a CUDA graph of back-to-back calls (bf16, head_dim 128, 32 query
heads / 8 KV heads, contiguous cache, automatic splits), printed per phase as min / median / max microseconds
after the call's first CTA started. Needs a build with the stamps compiled in:

    FLASH_EXT_DECODE_TRACE=1 python setup.py build_ext --inplace
    python scripts/decode_trace.py --points 1x4k,1x16k --seqlen-q 1

(In any other build the kernels write nothing and the script says so.) The globaltimer of an H200 advances in steps
of about 0.26 us, so single stamps are coarse; the medians over hundreds of warps are not.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flash_ext  # noqa: E402

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
SLOTS, COMBINE_BASE, WARPS = 32, 1 << 20, 4  # decode_trace.cuh's kTraceSlots, kTraceCombineBase; launch.h's kWarps
PHASES = {0: "entry", 1: "first copies issued", 2: "length read", 3: "Q landed", 20: "loop done",
          21: "rows in shared memory", 22: "written"}
for _step in range(8):
    PHASES[4 + 2 * _step] = f"step {_step} copies landed"
    PHASES[5 + 2 * _step] = f"step {_step} scored"


def parse_point(text):
    batch, kv = text.split("x")
    return int(batch), int(float(kv[:-1]) * 1024) if kv.endswith("k") else int(kv)


def summary(name, values_ns, t0):
    rel = (values_ns - t0) / 1e3
    return f"  {name:>24}: min {rel.min():7.2f}  median {rel.median():7.2f}  max {rel.max():7.2f} us  ({values_ns.numel()})"


def trace_point(batch, kv_len, seqlen_q):
    nbytes = 2 * batch * kv_len * HEADS_KV * HEAD_DIM * 2
    n_calls = max(2, min(16, (256 << 20) // nbytes))  # distinct caches: no call finds its keys in the L2
    calls = []
    for _ in range(n_calls):
        q = torch.randn(batch, seqlen_q, HEADS_Q, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(batch, kv_len, HEADS_KV, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        lengths = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
        trace = torch.zeros(COMBINE_BASE + (1 << 18), dtype=torch.int64, device="cuda")
        calls.append((q, k, torch.randn_like(k), lengths, trace))

    def run(call):
        q, k, v, lengths, trace = call
        os.environ["FLASH_EXT_DECODE_TRACE_PTR"] = str(trace.data_ptr())  # read when the call is made (captured)
        flash_ext.attention_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            run(call)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            run(call)
    os.environ.pop("FLASH_EXT_DECODE_TRACE_PTR")
    for _ in range(5):
        graph.replay()
    for call in calls:
        call[4].zero_()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    print(f"== {batch} x {kv_len}, seqlen_q {seqlen_q}: {start.elapsed_time(end) * 1e3 / n_calls:.2f} us per call "
          f"(a graph of {n_calls} calls)")
    middle = n_calls // 2  # a call with calls before and after it
    words = calls[middle][4].cpu()
    decode = words[:COMBINE_BASE].view(-1, WARPS, SLOTS)
    decode = decode[decode[:, 0, 0] > 0]
    if decode.shape[0] == 0:
        print("  no stamps: flash_ext was built without FLASH_EXT_DECODE_TRACE=1")
        return
    sms = decode[:, 0, 31]
    stamps = decode[:, :, :31].to(torch.float64)
    t0 = stamps[:, :, 0].min()
    print(f"  call {middle}: {decode.shape[0]} CTAs on {len(set(sms.tolist()))} SMs")
    previous = calls[middle - 1][4].cpu()
    previous_end = previous[COMBINE_BASE:].view(-1, 4)[:, 2].max().item() or previous[:COMBINE_BASE].max().item()
    print(f"  {'previous call ended':>24}: {(previous_end - t0) / 1e3:7.2f} us")
    for slot, name in sorted(PHASES.items()):
        column = stamps[:, :, slot].flatten()
        column = column[column > 0]
        if column.numel():
            print(summary(name, column, t0))
    combine = words[COMBINE_BASE:].view(-1, 4)[:, :3]
    combine = combine[combine[:, 0] > 0].to(torch.float64)
    for j, name in enumerate(("combine started", "combine's wait done", "combine ended")):
        if combine.shape[0]:
            print(summary(name, combine[:, j], t0))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="1x4k,1x16k,8x4k", help="batch x KV length, comma-separated")
    p.add_argument("--seqlen-q", type=int, default=1)
    args = p.parse_args()
    for point in args.points.split(","):
        trace_point(*parse_point(point), args.seqlen_q)


if __name__ == "__main__":
    main()

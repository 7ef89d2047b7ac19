"""Decode benchmark: one new query token per sequence against a KV cache (bf16, head_dim 128, 32 query heads
sharing 8 KV heads), in KV bytes read per second, flash_ext beside PyTorch SDPA's cuDNN backend, eager and as a
CUDA-graph replay, with the device's read bandwidth (a large reduction) measured in the same run.

    python benchmarks/bench_decode.py --json out.json
    python benchmarks/bench_decode.py --kv-lens 4k,16k --batches 1,8

Impls: flash_ext.attention_with_kvcache (cache_seqlens = the KV length), flash_ext.attention (the training
kernels on one query, bottom-right causal), sdpa_cudnn (scaled_dot_product_attention, enable_gqa, the
CUDNN_ATTENTION backend). KV bytes = 2 (K and V) x batch x kv_len x heads_kv x head_dim x 2 bytes.
Timing: triton.testing.do_bench medians (L2 flushed before each run).
"""
import argparse
import datetime
import json
import subprocess
import sys

import torch
import torch.nn.functional as F

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def parse_sizes(text):
    return [int(float(x[:-1]) * 1024) if x.endswith("k") else int(x) for x in text.split(",") if x]


def graph_of(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def impl_calls(impl, batch, kv_len):
    import flash_ext

    dtype, dev = torch.bfloat16, "cuda"
    q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, dtype=dtype, device=dev)
    if impl == "sdpa_cudnn":
        k = torch.randn(batch, HEADS_KV, kv_len, HEAD_DIM, dtype=dtype, device=dev)
        v = torch.randn_like(k)
        qt = q.transpose(1, 2)

        def call():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, k, v, enable_gqa=True)
        return call
    k = torch.randn(batch, kv_len, HEADS_KV, HEAD_DIM, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    if impl == "flash_ext":
        seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device=dev)
        return lambda: flash_ext.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True)
    if impl == "flash_ext_attention":
        return lambda: flash_ext.attention(q, k, v, causal=True)
    raise ValueError(impl)


def read_bandwidth(do_bench):
    x = torch.empty(2 ** 30 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    ms = do_bench(lambda: x.sum(dtype=torch.float32))
    return x.numel() * 2 / (ms * 1e-3) / 1e12


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-lens", default="4k,16k,64k,128k")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--impls", default="flash_ext,flash_ext_attention,sdpa_cudnn")
    p.add_argument("--max-kv-gib", type=float, default=20.0, help="skip points whose cache is larger")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode.py needs a CUDA GPU")
    from triton.testing import do_bench

    rows = []
    bandwidth = read_bandwidth(do_bench)
    print(f"read bandwidth (1 GiB bf16 sum): {bandwidth:.2f} TB/s", flush=True)
    impls = args.impls.split(",")
    print(f"{'kv_len':>7} {'batch':>5} " + " ".join(f"{i + ' eager':>20} {i + ' graph':>20}" for i in impls))
    for kv_len in parse_sizes(args.kv_lens):
        for batch in parse_sizes(args.batches):
            kv_bytes = 2 * batch * kv_len * HEADS_KV * HEAD_DIM * 2
            if kv_bytes > args.max_kv_gib * 2 ** 30:
                continue
            cells = []
            for impl in impls:
                for mode in ("eager", "graph"):
                    try:
                        call = impl_calls(impl, batch, kv_len)
                        fn = call if mode == "eager" else graph_of(call)
                        ms = do_bench(fn)
                        tbs = kv_bytes / (ms * 1e-3) / 1e12
                        rows.append({"impl": impl, "mode": mode, "batch": batch, "kv_len": kv_len, "ms": ms,
                                     "kv_tb_per_s": tbs})
                        cells.append(f"{tbs:14.2f} TB/s ")
                    except Exception as error:  # an impl that cannot run a point is a note, not a failure
                        cells.append(f"{'-':>20}")
                        print(f"  note: {impl} {mode} batch {batch} kv {kv_len}: {type(error).__name__}: "
                              f"{str(error).splitlines()[0][:120]}", flush=True)
                    torch.cuda.empty_cache()
            print(f"{kv_len:>7} {batch:>5} " + " ".join(cells), flush=True)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
                "read_bandwidth_tb_per_s": bandwidth, "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
                "dtype": "bf16", "seqlen_q": 1}
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

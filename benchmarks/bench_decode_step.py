"""One generation step as serving loops call it: attention_with_kvcache with the step's new keys and values
appended (k=, v=; one token, or 16 for speculative decoding), rotary on or off, dense or paged caches; bf16,
32 query / 8 KV heads, hd128, causal. Prints eager and CUDA-graph replay time per call (do_bench medians).
bench_decode.py's grid times the attention alone (no append); this one adds what a step writes.

    python benchmarks/bench_decode_step.py [LABEL] [--json FILE]
"""
import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
import flash_ext  # noqa: E402



def run(label, batch, kv, sq, rotary, page):
    dev, dt, hq, hkv, d = "cuda", torch.bfloat16, 32, 8, 128
    q = torch.randn(batch, sq, hq, d, device=dev, dtype=dt)
    if page:
        nb = batch * kv // page
        kc = torch.randn(nb, page, hkv, d, device=dev, dtype=dt)
        bt = torch.randperm(nb, device=dev).int().view(batch, -1)
    else:
        kc = torch.randn(batch, kv, hkv, d, device=dev, dtype=dt)
        bt = None
    vc = torch.randn_like(kc)
    kn, vn = torch.randn(batch, sq, hkv, d, device=dev, dtype=dt), torch.randn(batch, sq, hkv, d, device=dev, dtype=dt)
    sl = torch.full((batch,), kv - sq, device=dev, dtype=torch.int32)
    kw = {}
    if rotary:
        ang = torch.rand(kv, 64, device=dev) * 6.28
        kw = dict(rotary_cos=ang.cos().to(dt), rotary_sin=ang.sin().to(dt))
    f = lambda: flash_ext.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=sl, block_table=bt, causal=True, **kw)
    f()
    torch.cuda.synchronize()
    eager = do_bench(f, warmup=10, rep=50)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        f()
    graph = do_bench(g.replay, warmup=10, rep=50)
    print(f"step {label:8s} batch {batch} kv {kv} sq {sq} rotary {rotary} page {page}: "
          f"eager {eager * 1000:.1f} us graph {graph * 1000:.1f} us", flush=True)
    return dict(label=label, batch=batch, kv_len=kv, seqlen_q=sq, rotary=rotary, page_size=page,
                eager_us=eager * 1000, graph_us=graph * 1000)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("label", nargs="?", default="flash_ext", help="name printed on each line")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = [run(args.label, *point) for point in [(1, 4096, 1, False, 0), (1, 4096, 1, True, 0), (1, 4096, 1, True, 16),
                                                  (8, 16384, 1, True, 256), (1, 4096, 16, True, 0),
                                                  (64, 4096, 1, True, 16)]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

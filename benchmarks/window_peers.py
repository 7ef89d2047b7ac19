"""Sliding windows beside a peer: flash_ext and FlexAttention (torch.compile'd flex_attention with a block
mask), each timed on a band and on the full attention it is compared against, in the same run.

Issue 5's window target is relative (time <= 1.2 x band area / full area x full time). A kernel whose full
attention is fast makes it harder to meet, so the ratio alone says little about how good a window kernel is;
this script puts the same ratio of another implementation beside ours, with both absolute times.

Cases (bf16, 16 heads, head_dim 128, batch 1, seqlen 16k, as bench_features.py's window group):
  window (1024, 0)    against causal attention
  window (1024, 1024) against full attention
Each implementation's band and full case are timed in turn over 4 rounds, the order reversed every other
round (bench_features.py's --order abba); medians of triton's do_bench (fwd without grad; bwd alone on a
retained graph). FlexAttention's first calls compile (about a minute per mask, fwd and bwd).

    python benchmarks/window_peers.py [--json PATH] [--impls flash_ext,flex]
"""
import argparse
import json

import torch
from bench_features import interleaved, visible_pairs  # the same rounds, timing and pair count

import flash_ext

HEADS, HEAD_DIM, SEQLEN, DTYPE = 16, 128, 16384, torch.bfloat16


def flash_ext_calls(window):
    """(band, full) callables on (batch, seqlen, heads, head_dim) tensors."""
    causal = window[1] == 0
    return (lambda q, k, v: flash_ext.attention(q, k, v, window_size=window),
            lambda q, k, v: flash_ext.attention(q, k, v, causal=causal))


def flex_calls(window):
    """(band, full) callables on (batch, heads, seqlen, head_dim) tensors; block masks built once."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    flex = torch.compile(flex_attention, dynamic=False)
    left, right = window

    def band_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= left) & (kv_idx - q_idx <= right)

    def causal_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    band_mask = create_block_mask(band_mod, None, None, SEQLEN, SEQLEN, device="cuda")
    band = lambda q, k, v: flex(q, k, v, block_mask=band_mask)  # noqa: E731
    if right == 0:
        causal_mask = create_block_mask(causal_mod, None, None, SEQLEN, SEQLEN, device="cuda")
        full = lambda q, k, v: flex(q, k, v, block_mask=causal_mask)  # noqa: E731
    else:
        full = lambda q, k, v: flex(q, k, v)  # noqa: E731
    return band, full


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--impls", default="flash_ext,flex", help="comma list of flash_ext, flex")
    args = parser.parse_args()
    makers = {"flash_ext": flash_ext_calls, "flex": flex_calls}
    impls = args.impls.split(",")
    unknown = [i for i in impls if i not in makers]
    if unknown:
        parser.error(f"--impls: unknown {unknown}; expected a comma list of {','.join(makers)}")

    rows = []
    for window in ((1024, 0), (1024, 1024)):
        full_name = "causal" if window[1] == 0 else "full"
        band_pairs = visible_pairs(SEQLEN, SEQLEN, *window)
        full_pairs = visible_pairs(SEQLEN, SEQLEN, -1, 0 if window[1] == 0 else -1)
        target = 1.2 * band_pairs / full_pairs
        for impl in impls:
            shape = (1, SEQLEN, HEADS, HEAD_DIM) if impl == "flash_ext" else (1, HEADS, SEQLEN, HEAD_DIM)
            inputs = [torch.randn(shape, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(3)]
            band, full = makers[impl](window)
            med = interleaved({"full": full, "band": band}, inputs)  # bench_features' default abba rounds
            for i, op in enumerate(("fwd", "bwd")):
                factor = 1.0 if op == "fwd" else 2.5
                ratio = med["band"][i] / med["full"][i]
                row = dict(impl=impl, op=op, window=list(window), full=full_name, band_ms=med["band"][i],
                           full_ms=med["full"][i], ratio=ratio, target_ratio=target,
                           band_tflops=factor * 4 * HEADS * HEAD_DIM * band_pairs / med["band"][i] / 1e9,
                           full_tflops=factor * 4 * HEADS * HEAD_DIM * full_pairs / med["full"][i] / 1e9)
                rows.append(row)
                print(f"{impl:9s} {op} window {str(window):12s} {row['band_ms']:7.3f} ms ({row['band_tflops']:5.1f} "
                      f"TFLOP/s)  {full_name:6s} {row['full_ms']:7.3f} ms ({row['full_tflops']:5.1f})  "
                      f"ratio {ratio:.3f} (target <= {target:.3f})", flush=True)
            del inputs
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

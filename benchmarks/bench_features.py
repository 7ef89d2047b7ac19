"""Feature benchmark on CUDA: variable-length batches, sliding windows, softcap, ALiBi and dropout, each beside
the plain kernel it should be measured against (targets in parentheses):

  varlen   lengths drawn from 128..4096 summing to 16k tokens, against an equal-length batch of 16k
           tokens whose seqlen gives about the same work (varlen TFLOP/s >= 95% of it)
  window   window_size=(1024, 0) at seqlen 16k against causal attention, and (1024, 1024) against
           full attention (time <= 1.2 x band area / full area x full time)
  softcap  softcap=30 at hd128, seqlen 8k, against plain (<= 15% slower)
  alibi    per-head slopes, same shape (<= 15% slower)
  dropout  dropout_p=0.17, same shape (no target: reported)

bf16, head_dim 128, 16 heads (--head-dim D: heads = 2048 / D; the targets are stated at head_dim 128); fwd and
bwd (deterministic=False) timed with triton's do_bench median.
FLOPs count only the visible (query, key) pairs: 4 * heads * head_dim * pairs (bwd 2.5x).
The window and softcap / ALiBi / dropout comparisons time their variants in turn over several rounds and
report each variant's median over the rounds: the same kernel's time moves by 2-3% between the minutes of
one device call (clocks, temperature), and timed once each, a variant and its baseline could fall on
different sides of such a move. The default order (abba) times them in turn over 4 rounds, the order
reversed every other round, so that neither variant always runs right after the heavier load; --order fixed
(3 rounds, always the same order) runs the baseline (full / causal) right before its band, whose time then
carries that load's clock drop (on an H200 the window (1024, 0) backward's ratio to causal measured 1-3%
higher in fixed order than in abba order, for the same builds in one device call).

    python benchmarks/bench_features.py [--json PATH] [--only GROUPS] [--order fixed|abba] [--head-dim D]
    python benchmarks/bench_features.py --from-json benchmarks/results/h200_features.json --markdown
                                        # the rows as a Markdown table; no GPU needed
"""
import argparse
import datetime
import json
import random
import statistics

import torch

from bench_attention import git_commit, replace_block

# Imported by main() when it measures: --from-json --markdown needs neither a GPU nor a built flash_ext.
do_bench = flash_ext = None

HEADS, HEAD_DIM, DTYPE = 16, 128, torch.bfloat16
ROUNDS = 3
ORDER = "abba"  # or "fixed" (main's --order)


def rounds():
    return 4 if ORDER == "abba" else ROUNDS


def visible_pairs(len_q, len_k, window_left=-1, window_right=-1):
    """Number of (query, key) pairs inside the band (params.h's visible_keys)."""
    rows = torch.arange(len_q, dtype=torch.int64)
    diagonal = rows + len_k - len_q
    begin = (diagonal - window_left).clamp(0, len_k) if window_left >= 0 else torch.zeros_like(rows)
    end = (diagonal + window_right + 1).clamp(0, len_k) if window_right >= 0 else torch.full_like(rows, len_k)
    return int((end - begin).clamp(min=0).sum())


def timed(fn, grads=None):
    return do_bench(fn, warmup=25, rep=100, return_mode="median", grad_to_none=grads)


def time_fwd_bwd(call, inputs):
    """Median ms of the forward (no grad) and of the backward alone (on one retained graph)."""
    with torch.no_grad():
        fwd_ms = timed(lambda: call(*inputs))
    out = call(*inputs)
    dout = torch.randn_like(out)
    bwd_ms = timed(lambda: out.backward(dout, retain_graph=True), grads=list(inputs))
    return fwd_ms, bwd_ms


def interleaved(calls, inputs):
    """{name: (fwd_ms, bwd_ms)}: the median over the rounds, each timing every call in turn (ORDER)."""
    times = {name: [] for name in calls}
    for r in range(rounds()):
        names = list(calls)
        if ORDER == "abba" and r % 2 == 1:
            names.reverse()
        for name in names:
            times[name].append(time_fwd_bwd(calls[name], inputs))
    return {name: tuple(statistics.median(t[i] for t in runs) for i in range(2)) for name, runs in times.items()}


def rows_for(case, label, pairs, fwd_ms, bwd_ms, **extra):
    flops = 4 * HEADS * HEAD_DIM * pairs
    rows = []
    for op, ms, factor in (("fwd", fwd_ms, 1.0), ("bwd", bwd_ms, 2.5)):
        rows.append(dict(op=op, impl="flash_ext", case=case, label=label, dtype="bf16", head_dim=HEAD_DIM,
                         heads=HEADS, ms=ms, tflops=factor * flops / ms / 1e9, **extra))
    print(f"{case:8s} {label:40s} fwd {rows[0]['tflops']:6.1f} TFLOP/s {fwd_ms:8.3f} ms   "
          f"bwd {rows[1]['tflops']:6.1f} TFLOP/s {bwd_ms:8.3f} ms", flush=True)
    return rows


def dense_inputs(batch, seqlen):
    return [torch.randn(batch, seqlen, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True)
            for _ in range(3)]


def bench_varlen(causal):
    rng = random.Random(0)
    lengths = []
    while sum(lengths) < 16384 - 128:
        lengths.append(min(rng.randint(128, 4096), 16384 - sum(lengths)))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    window_right = 0 if causal else -1
    pairs = sum(visible_pairs(n, n, -1, window_right) for n in lengths)
    q, k, v = ([torch.randn(sum(lengths), HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True)
                for _ in range(3)])
    call = lambda q, k, v: flash_ext.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=causal)  # noqa
    rows = rows_for("varlen", f"{len(lengths)} seqs 128..4096 causal={causal}", pairs, *time_fwd_bwd(call, (q, k, v)),
                    causal=causal, lengths=lengths)
    # Equal lengths, same total tokens, seqlen giving the closest total work.
    seqlen = min((1024, 2048, 4096, 8192), key=lambda s: abs((16384 // s) * s * s - sum(n * n for n in lengths)))
    batch = 16384 // seqlen
    pairs_dense = batch * visible_pairs(seqlen, seqlen, -1, window_right)
    call = lambda q, k, v: flash_ext.attention(q, k, v, causal=causal)  # noqa: E731
    rows += rows_for("dense", f"{batch} x {seqlen} causal={causal}", pairs_dense,
                     *time_fwd_bwd(call, dense_inputs(batch, seqlen)), causal=causal, seqlen=seqlen, batch=batch)
    return rows


def bench_window():
    rows = []
    inputs = dense_inputs(1, 16384)
    for window, causal in (((1024, 0), True), ((1024, 1024), False)):
        ms = interleaved({"full": lambda q, k, v: flash_ext.attention(q, k, v, causal=causal),  # noqa: B023
                          "band": lambda q, k, v: flash_ext.attention(q, k, v, window_size=window)},  # noqa: B023
                         inputs)
        full_pairs = visible_pairs(16384, 16384, -1, 0 if causal else -1)
        band_pairs = visible_pairs(16384, 16384, *window)
        full_rows = rows_for("dense", f"seqlen 16k causal={causal}", full_pairs, *ms["full"],
                             causal=causal, seqlen=16384, rounds=rounds(), order=ORDER)
        band_rows = rows_for("window", f"window {window} seqlen 16k", band_pairs, *ms["band"],
                             window=list(window), seqlen=16384, rounds=rounds(), order=ORDER)
        for f, b in zip(full_rows, band_rows):
            b["time_ratio_to_full"] = b["ms"] / f["ms"]
            b["area_ratio"] = band_pairs / full_pairs
            b["target_ratio"] = 1.2 * band_pairs / full_pairs
            print(f"  {b['op']}: time ratio {b['time_ratio_to_full']:.3f}, target <= {b['target_ratio']:.3f}")
        rows += full_rows + band_rows
    return rows


def bench_score_mods():
    rows = []
    inputs = dense_inputs(2, 8192)
    pairs = 2 * visible_pairs(8192, 8192)
    slopes = 2.0 ** (-8.0 * torch.arange(1, HEADS + 1, dtype=torch.float32, device="cuda") / HEADS)
    variants = (("dense", "plain", {}), ("softcap", "softcap=30", dict(softcap=30.0)),
                ("alibi", "alibi per-head slopes", dict(alibi_slopes=slopes)),
                ("dropout", "dropout_p=0.17", dict(dropout_p=0.17)))
    ms = interleaved({case: (lambda q, k, v, kwargs=kwargs: flash_ext.attention(q, k, v, **kwargs))
                      for case, _, kwargs in variants}, inputs)
    plain = None
    for case, label, _ in variants:
        new = rows_for(case, label + " seqlen 8k", pairs, *ms[case], seqlen=8192, rounds=rounds(), order=ORDER)
        if plain is None:
            plain = new
        else:
            for p, r in zip(plain, new):
                r["slowdown_vs_plain"] = r["ms"] / p["ms"] - 1
                target = "no target" if case == "dropout" else "target <= +15%"
                print(f"  {r['op']}: {100 * r['slowdown_vs_plain']:+.1f}% vs plain ({target})")
        rows += new
    return rows


def relative(row, rows):
    """What a row is measured against, in words: its baseline's TFLOP/s share, time ratio or slowdown."""
    if "time_ratio_to_full" in row:
        return (f"{row['time_ratio_to_full']:.3f}x the time of {'causal' if row['window'][1] == 0 else 'full'} "
                f"attention (area {row['area_ratio']:.3f}x, target <= {row['target_ratio']:.3f}x)")
    if "slowdown_vs_plain" in row:
        return f"{100 * row['slowdown_vs_plain']:+.1f}% time vs plain"
    if row["case"] == "varlen":
        dense = [r for r in rows if r["case"] == "dense" and r["op"] == row["op"] and "batch" in r
                 and r.get("causal") == row.get("causal")]
        if dense:
            return f"{100 * row['tflops'] / dense[0]['tflops']:.0f}% of the TFLOP/s of {dense[0]['label'].split(' causal')[0]}"
    return "baseline"


def format_markdown(data):
    """The rows of a bench_features.py JSON as one Markdown table (fwd and bwd of a case on one line)."""
    rows = data["rows"]
    date = str(data["date"])[:10] if data.get("date") else "date not recorded"
    head_dims = sorted({r["head_dim"] for r in rows})
    lines = [f"flash_ext, bf16, head dim {', '.join(map(str, head_dims))} ({data.get('gpu', 'unknown GPU')}, torch "
             f"{data.get('torch', '?')}, {date}, commit `{data.get('commit', 'unknown')}`):", "",
             "| case | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd | bwd |", "|---|---|---|---|---|---|---|"]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    for label in labels:
        by_op = {r["op"]: r for r in rows if r["label"] == label}
        fwd, bwd = by_op.get("fwd"), by_op.get("bwd")
        cells = []
        for r in (fwd, bwd):
            cells += ["-", "-"] if r is None else [f"{r['ms']:.3f}", f"{r['tflops']:.0f}"]
        cells += ["-" if r is None else relative(r, rows) for r in (fwd, bwd)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    global ORDER, HEAD_DIM, HEADS, do_bench, flash_ext
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--from-json", metavar="PATH", help="take the rows from this JSON instead of measuring")
    parser.add_argument("--markdown", action="store_true", help="print the rows as a Markdown table")
    parser.add_argument("--update-doc", metavar="PATH",
                        help="with --markdown: write the table into PATH between the lines "
                             "'<!-- bench_features --markdown -->' and '<!-- /bench_features --markdown -->'")
    groups = {"varlen": lambda: bench_varlen(False) + bench_varlen(True), "window": bench_window,
              "score_mods": bench_score_mods}
    parser.add_argument("--only", default=",".join(groups),
                        help="comma list of " + ",".join(groups) + " (default: all; score_mods: softcap, ALiBi, dropout)")
    parser.add_argument("--order", choices=("abba", "fixed"), default="abba",
                        help="the order of a comparison's variants in its rounds (see above)")
    parser.add_argument("--head-dim", type=int, choices=(64, 128, 256), default=HEAD_DIM,
                        help="head dim of every case; heads = 2048 / head dim (default 128)")
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        if not args.markdown:
            parser.error("--from-json needs --markdown")
        text = format_markdown(data)
        if args.update_doc:
            replace_block(args.update_doc, "bench_features --markdown", text)
        else:
            print(text)
        return
    from triton.testing import do_bench  # noqa: F811  (the measuring functions use the globals)

    import flash_ext  # noqa: F811

    ORDER = args.order
    HEAD_DIM, HEADS = args.head_dim, 2048 // args.head_dim
    chosen = args.only.split(",")
    unknown = [g for g in chosen if g not in groups]
    if unknown:
        parser.error(f"--only: unknown group(s) {unknown}; expected a comma list of {','.join(groups)}")
    rows = [row for name in chosen for row in groups[name]()]
    data = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
    if args.markdown:
        text = format_markdown(data)
        if args.update_doc:
            replace_block(args.update_doc, "bench_features --markdown", text)
        else:
            print(text)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Decode benchmark (issue 35's targets): attention over a KV cache, bf16, head_dim 128, 32 query heads sharing
8 KV heads, flash_ext beside PyTorch SDPA's cuDNN backend and FlashAttention-4, eager and as a CUDA-graph replay,
with the device's read bandwidth measured in the same run. One run measures:

  decode grid   one query token per sequence, KV length x batch (--kv-lens x --batches, default 4k,16k,64k,128k
                x 1,8,64), every impl, the cache contiguous (page size 0) and, for flash_ext (and FA4), paged
                (--page-sizes, default 0,16,256)
  spec decode   seqlen_q 4 and 16 (--seqlens-q; speculative decoding) on the sub-grid --spec-kv-lens x
                --spec-batches (default 4k,64k x 1,8) at --spec-page-sizes (default: --page-sizes), for flash_ext
                and FA4, seqlen_q 1 timed beside them on the same cache
  prefill       2048 new queries against a cache of 30720 keys (a cached prefix of 28672), batch 1, causal, eager:
                flash_ext.attention_with_kvcache contiguous and paged (--prefill-page-sizes, default 0,256), the
                2048 new keys appended through k=, v= ('append') or all keys already in the cache ('cached'),
                and FA4 on the cached one, beside flash_ext.attention on the same shape (--no-prefill: skip)
  read bandwidth  a 1 GiB bf16 sum (torch.sum into fp32)

    python benchmarks/bench_decode.py --json out.json               # all of the above: about 1-2 min on an H200
                                                                    # (more with FA4, which compiles on first use)
    python benchmarks/bench_decode.py --kv-lens 4k,16k --batches 1,8 --page-sizes 0 --seqlens-q 1 --no-prefill
    python benchmarks/bench_decode.py --list                        # the planned points; no GPU needed
    python benchmarks/bench_decode.py --from-json benchmarks/results/h200_decode.json --markdown
    python benchmarks/bench_decode.py --from-json benchmarks/results/h200_decode.json --markdown \\
        --update-doc docs/performance.md                            # the doc's decode block; no GPU needed
    python benchmarks/bench_decode.py --from-json benchmarks/results/h200_decode.json \\
        --plot benchmarks/results/h200_decode.png                   # (or benchmarks/plot.py on the JSON)

Impls (--impls, default all four; one that cannot import or run a point is a printed note, not a failure):
  flash_ext            flash_ext.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=kv_len, block_table=...,
                       causal=True); paged: pages (num_pages, page_size, 8, 128) and a block table of a random
                       permutation of the pages, so that no sequence's pages are adjacent
  sdpa_cudnn           F.scaled_dot_product_attention(q, k, v, enable_gqa=True) under the CUDNN_ATTENTION backend,
                       (batch, heads, seq, dim) tensors, not causal (one query sees every key); seqlen_q 1 and the
                       contiguous cache only (SDPA has no paged cache, and its is_causal is top-left aligned)
  fa4                  FlashAttention-4 (flash_attn.cute, package flash-attn-4): flash_attn_func(q, k, v,
                       causal=True) on the contiguous cache, flash_attn_varlen_func(q, k_pages, v_pages,
                       seqused_k=..., page_table=..., max_seqlen_k=kv_len, causal=True) on the paged one;
                       num_splits=0 (its heuristic), 1 on sm90 where FA4 has no split-KV
  flash_ext_attention  flash_ext.attention(q, k, v, causal=True) on the contiguous cache: the training kernels
                       on one query (a reference column), seqlen_q 1 only
Causal is bottom-right aligned (query i of seqlen_q sees keys j <= kv_len - seqlen_q + i).

Bytes and FLOPs: KV bytes = 2 (K and V) x batch x kv_len x 8 heads x 128 x 2 bytes (the keys attended, block
table reads not counted); KV TB/s = KV bytes / median time. Prefill FLOPs = 4 x batch x 32 heads x 128 x pairs,
pairs = the visible (query, key) pairs = sum over i < seqlen_q of (seqlen_k - seqlen_q + i + 1).

Targets (issue 35, H200; checked by --markdown from the rows, see targets()): 1. at every point of 4k/16k/64k/
128k x 1/8/64 flash_ext >= 1.05x the best of cuDNN and FA4 in KV TB/s; 2. KV >= 256 MiB: >= 90% of the read
bandwidth, contiguous and paged alike, and paged within 5% of contiguous; 3. batch 1, 4k: >= 2 TB/s under graph
replay; 4. seqlen_q 4 and 16 take <= 1.2x the time of seqlen_q 1; 5. the paged prefill (page 256, the 2048 new
keys appended) within 10% of flash_ext.attention's TFLOP/s.

Timing: medians of CUDA-event timed runs, the L2 emptied before each run by reading a 256 MiB buffer (--flush read;
--flush write zeroes it, triton.testing.do_bench's way, which leaves the L2 full of dirty lines that are written
back while the timed call reads: HBM traffic of the benchmark's, not the kernel's), --warmup-ms / --rep-ms per
measurement;
a cache under 256 MiB is timed as one run of calls over as many distinct copies as make 256 MiB (at most 32;
the time per call is reported; eager: the calls back to back, graph: all of them in one graph), so that no call
reads a cache the L2 still holds (with --flush write, the calls also share the flush's write-back);
points whose K + V exceed --max-kv-gib (default 40: 128k x 64 is 32 GiB) are skipped; --time-budget-s stops
starting measurements (rows so far kept; the JSON is rewritten after every point). Before timing, a correctness
smoke compares flash_ext (and FA4) with an fp32 reference at every (page size, seqlen_q) measured and on the
append path; a failing config is not timed.

JSON (--json): the run's meta (gpu, torch, cudnn, date, commit, read_bandwidth_tb_per_s, heads_q, heads_kv,
head_dim, dtype, seqlen_q = 1 (that of rows without the field, as in older files), fa4 (its version or null),
page_sizes, seqlens_q, warmup_ms, rep_ms), rows [{impl, mode (eager / graph), batch, kv_len, page_size (0 =
contiguous), seqlen_q, ms, kv_tb_per_s}], prefill [{impl, variant (full / append / cached), mode, batch, seqlen_q,
seqlen_k, cache_seqlen, page_size, ms, tflops, pairs}] and notes (what was not measured, and why).

Exit status: 0 ok; 2 no GPU; 3 sticky CUDA error (rows so far are written); 4 --time-budget-s cut the run
short; 5 flash_ext failed the correctness smoke.
"""
import argparse
import datetime
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
from bench_attention import (first_line, git_commit, is_fatal_cuda, load_plot_module, make_timer,  # noqa: E402
                             replace_block)

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
KV_BYTES_PER_TOKEN = 2 * HEADS_KV * HEAD_DIM * 2  # K and V, bf16
IMPLS = ("flash_ext", "sdpa_cudnn", "fa4", "flash_ext_attention")
PEERS = ("sdpa_cudnn", "fa4")  # target 1's "best of"
PAGED_IMPLS = ("flash_ext", "fa4")  # impls with a paged (block table) path here
SPEC_IMPLS = ("flash_ext", "fa4")  # impls measured at seqlen_q > 1 (bottom-right causal)
MODES = ("eager", "graph")
TITLES = {"flash_ext": "flash_ext", "sdpa_cudnn": "SDPA cuDNN", "fa4": "FA4",
          "flash_ext_attention": "flash_ext.attention"}
DOC_BLOCK = "bench_decode --markdown"

# Issue 35's targets.
TARGET_KV_LENS, TARGET_BATCHES = (4096, 16384, 65536, 131072), (1, 8, 64)
TARGET_PEER_RATIO = 1.05
TARGET_BW_MIN_BYTES = 256 * 2 ** 20
TARGET_BW_FRACTION = 0.90
TARGET_PAGED_FRACTION = 0.95  # paged KV TB/s >= 95% of contiguous
TARGET_SMALL_TBS = 2.0  # batch 1, 4k, graph replay
TARGET_SPEC_RATIO = 1.2
TARGET_PREFILL_FRACTION = 0.90
ROTATE_BYTES = 256 * 2 ** 20  # smaller caches are timed over distinct copies of at least this much in all
PREFILL_SEQLEN_Q, PREFILL_SEQLEN_K, PREFILL_TARGET_PAGE = 2048, 30720, 256

SMOKE_TOL = 0.02  # max |out - fp32 reference| (outputs of random inputs are ~0.05 in size)


# ---------------------------------------------------------------------------------------------
# Command line, shapes, formulas


def parse_sizes(text):
    values = []
    for item in text.split(","):
        item = item.strip().lower()
        if item:
            values.append(int(float(item[:-1]) * 1024) if item.endswith("k") else int(item))
    return values


def parse_impls(text):
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in IMPLS]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {','.join(IMPLS)}")
    return values


def size_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def page_label(page):
    return f"page {page}" if page else "contiguous"


def smoke_label(key):
    page, what = key
    return f"{page_label(page)} " + ("append" if what == "append" else f"seqlen_q {what}")


def kv_bytes(batch, kv_len):
    return batch * kv_len * KV_BYTES_PER_TOKEN


def visible_pairs(seqlen_q, seqlen_k):
    """(query, key) pairs a bottom-right causal mask leaves visible: sum over i of (seqlen_k - seqlen_q + i + 1),
    each term clamped to [0, seqlen_k]."""
    return sum(min(max(seqlen_k - seqlen_q + i + 1, 0), seqlen_k) for i in range(seqlen_q))


def attention_flops(batch, seqlen_q, seqlen_k):
    return 4 * batch * HEADS_Q * HEAD_DIM * visible_pairs(seqlen_q, seqlen_k)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-lens", type=parse_sizes, default="4k,16k,64k,128k", help="decode grid KV lengths ('k' = 1024)")
    p.add_argument("--batches", type=parse_sizes, default="1,8,64", help="decode grid batch sizes")
    p.add_argument("--impls", type=parse_impls, default=",".join(IMPLS), help="comma list of " + ",".join(IMPLS))
    p.add_argument("--page-sizes", type=parse_sizes, default="0,16,256",
                   help="cache layouts of the grid: 0 = contiguous, N = pages of N keys (flash_ext and fa4 only)")
    p.add_argument("--seqlens-q", type=parse_sizes, default="1,4,16",
                   help="query tokens per sequence; values > 1 (speculative decoding) only on the spec sub-grid")
    p.add_argument("--spec-kv-lens", type=parse_sizes, default="4k,64k", help="KV lengths of the seqlen_q > 1 points")
    p.add_argument("--spec-batches", type=parse_sizes, default="1,8", help="batches of the seqlen_q > 1 points")
    p.add_argument("--spec-page-sizes", type=parse_sizes, default=None,
                   help="page sizes of the seqlen_q > 1 points (default: --page-sizes)")
    p.add_argument("--prefill", action=argparse.BooleanOptionalAction, default=True,
                   help=f"(default on) the prefill points: seqlen_q {PREFILL_SEQLEN_Q} against {PREFILL_SEQLEN_K} "
                        "keys, batch 1")
    p.add_argument("--prefill-page-sizes", type=parse_sizes, default=f"0,{PREFILL_TARGET_PAGE}",
                   help="cache layouts of the prefill points (0 = contiguous)")
    p.add_argument("--prefill-rounds", type=int, default=3,
                   help="interleaved rounds of the prefill points; each row keeps its median (default 3)")
    p.add_argument("--max-kv-gib", type=float, default=40.0, help="skip points whose K + V cache is larger (GiB)")
    p.add_argument("--flush", choices=("read", "write"), default="read",
                   help="how the L2 is emptied before each timed run (default read: see Timing above)")
    p.add_argument("--warmup-ms", type=float, default=10.0, help="warmup per measurement (default 10)")
    p.add_argument("--rep-ms", type=float, default=50.0, help="timed runs' total per measurement (default 50)")
    p.add_argument("--time-budget-s", type=float, default=220.0,
                   help="stop starting measurements after this many seconds (default 220; rows so far are kept)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="(default on) the correctness smoke before timing")
    p.add_argument("--json", metavar="PATH", help="write the results here (rewritten after every point)")
    p.add_argument("--from-json", metavar="PATH", help="take the results from this JSON instead of measuring (no GPU)")
    p.add_argument("--markdown", action="store_true",
                   help="print the Markdown tables and the targets (after a run, or with --from-json)")
    p.add_argument("--update-doc", metavar="PATH",
                   help=f"with --markdown: write the Markdown into PATH between the lines '<!-- {DOC_BLOCK} -->' "
                        f"and '<!-- /{DOC_BLOCK} -->'")
    p.add_argument("--plot", metavar="PATH", help="PNG of KV TB/s vs KV length per batch (benchmarks/plot.py)")
    p.add_argument("--list", action="store_true", help="print the planned points and exit (no GPU)")
    return p


def plan(args):
    """[(kv_len, batch, [(page_size, [seqlen_q, ...]), ...])] in run order, and the points over the cap."""
    spec_pages = args.spec_page_sizes if args.spec_page_sizes is not None else args.page_sizes
    extra_q = [s for s in args.seqlens_q if s != 1]
    grid = [(k, b) for k in args.kv_lens for b in args.batches]
    spec = [(k, b) for k in args.spec_kv_lens for b in args.spec_batches] if extra_q else []
    points, skipped = [], []
    for kv_len, batch in sorted(set(grid) | set(spec)):
        if kv_bytes(batch, kv_len) > args.max_kv_gib * 2 ** 30:
            skipped.append((kv_len, batch))
            continue
        in_grid, in_spec = (kv_len, batch) in grid, (kv_len, batch) in spec
        layouts = []
        for page in dict.fromkeys((args.page_sizes if in_grid else []) + (spec_pages if in_spec else [])):
            spec_here = in_spec and page in spec_pages
            qs = [1] + (extra_q if spec_here else [])  # seqlen_q 1 is also the baseline of the spec points
            layouts.append((page, qs))
        points.append((kv_len, batch, layouts))
    return points, skipped


def measurements_of(impl, page, seqlens_q):
    """The seqlen_q values impl measures on a layout (empty: impl has no such layout)."""
    if page and impl not in PAGED_IMPLS:
        return []
    return [s for s in seqlens_q if s == 1 or impl in SPEC_IMPLS]


# ---------------------------------------------------------------------------------------------
# Results -> Markdown, targets


def load_results(path):
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise SystemExit(f"{path}: not a bench_decode.py JSON (expected an object with a 'rows' list)")
    return data


def decode_rows(data):
    """The rows with page_size and seqlen_q filled in (results older than these fields: contiguous, the file's
    seqlen_q)."""
    default_q = data.get("seqlen_q", 1)
    return [dict(r, page_size=r.get("page_size", 0), seqlen_q=r.get("seqlen_q", default_q)) for r in data["rows"]]


class Cells:
    def __init__(self, rows):
        self.by_key = {(r["impl"], r["mode"], r["batch"], r["kv_len"], r["page_size"], r["seqlen_q"]): r for r in rows}

    def get(self, impl, mode, batch, kv_len, page=0, seqlen_q=1, field="kv_tb_per_s"):
        r = self.by_key.get((impl, mode, batch, kv_len, page, seqlen_q))
        return None if r is None else r[field]


def fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def pair(values, digits=2):
    return " / ".join(fmt(v, digits) for v in values)


def ratio(a, b):
    return a / b if a is not None and b else None


def header_line(data):
    date = str(data["date"])[:10] if data.get("date") else "date not recorded"
    cudnn = data.get("cudnn")
    cudnn = f", cuDNN {cudnn // 10000}.{cudnn // 100 % 100}" if isinstance(cudnn, int) else ""
    fa4 = f", FA4 {data['fa4']}" if data.get("fa4") else ""
    bw = data.get("read_bandwidth_tb_per_s")
    bw = f"; the device's read bandwidth in the same run (a 1 GiB bf16 sum): {bw:.2f} TB/s" if bw else ""
    # Runs before the field existed emptied the L2 by writing (do_bench).
    flush = {"read": "; L2 emptied by a read",
             "write": "; L2 emptied by a write (do_bench)"}[data.get("l2_flush", "write")]
    return (f"bf16, head dim {data.get('head_dim', HEAD_DIM)}, {data.get('heads_q', HEADS_Q)} query heads sharing "
            f"{data.get('heads_kv', HEADS_KV)} KV heads ({data.get('gpu', 'unknown GPU')}, torch "
            f"{data.get('torch', '?')}{cudnn}{fa4}, {date}, commit `{data.get('commit', 'unknown')}`){bw}{flush}.")


def targets(data):
    """[(number, met: True / False / None (not measured), text)] of issue 35's targets, from the rows."""
    cells = Cells(decode_rows(data))
    keys = cells.by_key
    bw = data.get("read_bandwidth_tb_per_s")
    out = []

    # 1. flash_ext >= 1.05x the best peer at every grid point, eager and graph.
    peers = [p for p in PEERS if any(k[0] == p for k in keys)]
    worst, missing = {}, 0
    for mode in MODES:
        for kv_len in TARGET_KV_LENS:
            for batch in TARGET_BATCHES:
                best = max([v for v in (cells.get(p, mode, batch, kv_len) for p in peers) if v], default=None)
                r = ratio(cells.get("flash_ext", mode, batch, kv_len), best)
                if r is None:
                    missing += 1
                elif mode not in worst or r < worst[mode][0]:
                    worst[mode] = (r, f"{size_label(kv_len)} x {batch}")
    absent = [TITLES[p] for p in PEERS if p not in peers]
    bad = any(w[0] < TARGET_PEER_RATIO for w in worst.values())
    met = False if bad else (True if worst and not missing and not absent else None)
    text = (f"flash_ext >= {TARGET_PEER_RATIO:.2f}x the best of {' and '.join(TITLES[p] for p in PEERS)} at every "
            f"point of {'/'.join(size_label(k) for k in TARGET_KV_LENS)} x {'/'.join(map(str, TARGET_BATCHES))}: "
            + ("; ".join(f"{m} worst {worst[m][0]:.2f} ({worst[m][1]})" for m in MODES if m in worst)
               or "no point measured"))
    if absent:
        text += f" ({', '.join(absent)} not in the results: against {', '.join(TITLES[p] for p in peers) or 'nothing'})"
    if missing:
        text += f"; {missing} of {len(MODES) * len(TARGET_KV_LENS) * len(TARGET_BATCHES)} (point, mode) not measured"
    out.append((1, met, text))

    # 2. KV >= 256 MiB: >= 90% of the read bandwidth at every page size; paged >= 95% of contiguous.
    big = [(k, b) for k in TARGET_KV_LENS for b in TARGET_BATCHES if kv_bytes(b, k) >= TARGET_BW_MIN_BYTES]
    pages = (0, 16, 256)
    worst_bw, worst_paged = {}, None  # worst_bw: mode -> (fraction, where)
    missing = 0
    for kv_len, batch in big:
        for mode in MODES:
            base = cells.get("flash_ext", mode, batch, kv_len, 0)
            for page in pages:
                v = cells.get("flash_ext", mode, batch, kv_len, page)
                if v is None or not bw:
                    missing += 1
                    continue
                where = f"{size_label(kv_len)} x {batch} {page_label(page)}"
                if mode not in worst_bw or v / bw < worst_bw[mode][0]:
                    worst_bw[mode] = (v / bw, where)
                if page and base and (worst_paged is None or v / base < worst_paged[0]):
                    worst_paged = (v / base, f"{where} {mode}")
    if not worst_bw:
        out.append((2, None,
                    f"KV >= 256 MiB at >= {100 * TARGET_BW_FRACTION:.0f}% of the read bandwidth: not measured"))
    else:
        bad = any(w[0] < TARGET_BW_FRACTION for w in worst_bw.values())
        bad = bad or (worst_paged is not None and worst_paged[0] < TARGET_PAGED_FRACTION)
        met = False if bad else (True if not missing else None)
        text = (f"KV >= 256 MiB ({len(big)} points): >= {100 * TARGET_BW_FRACTION:.0f}% of the read bandwidth "
                f"({bw:.2f} TB/s), contiguous and pages of 16 and 256 alike: "
                + "; ".join(f"{m} worst {100 * worst_bw[m][0]:.0f}% ({worst_bw[m][1]})"
                            for m in MODES if m in worst_bw))
        text += (f"; paged within {100 * (1 - TARGET_PAGED_FRACTION):.0f}% of contiguous: worst "
                 f"{worst_paged[0]:.3f}x ({worst_paged[1]})" if worst_paged else "; no paged point measured")
        if missing:
            text += f"; {missing} of {len(big) * len(pages) * len(MODES)} (point, page size, mode) not measured"
        out.append((2, met, text))

    # 3. batch 1, 4k, graph replay >= 2 TB/s.
    v = cells.get("flash_ext", "graph", 1, 4096)
    out.append((3, None if v is None else v >= TARGET_SMALL_TBS,
                f"batch 1, 4k, graph replay >= {TARGET_SMALL_TBS:.1f} TB/s: "
                + ("not measured" if v is None else f"{v:.2f} TB/s")))

    # 4. seqlen_q 4 and 16 <= 1.2x the time of seqlen_q 1 (flash_ext, every spec point, page size and mode).
    worst = None
    for (impl, mode, batch, kv_len, page, sq), r in keys.items():
        if impl != "flash_ext" or sq == 1:
            continue
        base = cells.get(impl, mode, batch, kv_len, page, 1, "ms")
        t = ratio(r["ms"], base)
        if t is not None and (worst is None or t > worst[0]):
            worst = (t, f"seqlen_q {sq}, {size_label(kv_len)} x {batch}, "
                        f"{'page ' + str(page) if page else 'contiguous'}, {mode}")
    out.append((4, None if worst is None else worst[0] <= TARGET_SPEC_RATIO,
                f"seqlen_q 4 and 16 <= {TARGET_SPEC_RATIO}x the time of seqlen_q 1: "
                + ("not measured" if worst is None else f"worst {worst[0]:.2f}x ({worst[1]})")))

    # 5. the paged prefill (page 256, appended) within 10% of flash_ext.attention's TFLOP/s.
    pre = data.get("prefill") or []
    ref = next((r for r in pre if r["impl"] == "flash_ext_attention" and r.get("variant") != "varlen"), None)
    mine = next((r for r in pre if r["impl"] == "flash_ext" and r.get("variant") == "append"
                 and r.get("page_size") == PREFILL_TARGET_PAGE), None)
    r = ratio(mine and mine["tflops"], ref and ref["tflops"])
    shape = mine or ref or {"seqlen_q": PREFILL_SEQLEN_Q, "seqlen_k": PREFILL_SEQLEN_K}
    out.append((5, None if r is None else r >= TARGET_PREFILL_FRACTION,
                f"prefill (seqlen_q {shape['seqlen_q']} against {shape['seqlen_k']} keys, page {PREFILL_TARGET_PAGE}, "
                f"the new keys appended) >= {100 * TARGET_PREFILL_FRACTION:.0f}% of flash_ext.attention's TFLOP/s: "
                + ("not measured" if r is None else f"{100 * r:.0f}% ({mine['tflops']:.0f} / {ref['tflops']:.0f})")))
    return out


def format_markdown(data):
    """The results of a bench_decode.py JSON as Markdown: the decode grid, paged caches, speculative decoding,
    prefill, and which of issue 35's targets are met."""
    rows = decode_rows(data)
    cells = Cells(rows)
    keys = cells.by_key
    present = [i for i in IMPLS if any(k[0] == i for k in keys)]
    bw = data.get("read_bandwidth_tb_per_s")
    lines = [f"Decode, {header_line(data)}"]
    if bw and rows:
        top = max(rows, key=lambda r: r["kv_tb_per_s"])
        lines[0] += (f" The highest KV rate of the run: {top['kv_tb_per_s']:.2f} TB/s "
                     f"({TITLES.get(top['impl'], top['impl'])}, {size_label(top['kv_len'])} x {top['batch']}, "
                     f"{page_label(top['page_size'])}, {top['mode']}), "
                     f"{100 * top['kv_tb_per_s'] / bw:.0f}% of that bandwidth.")
    lines.append("")

    # Decode grid: contiguous cache, one query token.
    grid = sorted({(k[3], k[2]) for k in keys if k[4] == 0 and k[5] == 1})
    peers = [p for p in PEERS if p in present]
    lines.append("**Decode grid**: one query token per sequence, contiguous cache; KV TB/s (2 x batch x KV length x "
                 f"{HEADS_KV} x {HEAD_DIM} x 2 bytes over the median time), eager / graph replay.")
    lines.append("")
    head = ["KV length", "batch", "KV MiB"] + [TITLES[i] for i in present]
    if "flash_ext" in present and peers:
        head.append("flash_ext / best of " + " and ".join(TITLES[p] for p in peers))
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kv_len, batch in grid:
        cols = [size_label(kv_len), str(batch), f"{kv_bytes(batch, kv_len) / 2 ** 20:.0f}"]
        cols += [pair([cells.get(i, m, batch, kv_len) for m in MODES]) for i in present]
        if "flash_ext" in present and peers:
            rs = []
            for m in MODES:
                best = max([v for v in (cells.get(p, m, batch, kv_len) for p in peers) if v], default=None)
                rs.append(ratio(cells.get("flash_ext", m, batch, kv_len), best))
            cols.append(pair(rs))
        lines.append("| " + " | ".join(cols) + " |")
    missing = [TITLES[i] for i in IMPLS if i not in present]
    if missing:
        lines += ["", f"Not in the results: {', '.join(missing)}."]

    # Paged caches.
    paged = sorted({k[4] for k in keys if k[4] and k[5] == 1})
    for impl in [i for i in PAGED_IMPLS if any(k[0] == i and k[4] for k in keys)]:
        points = sorted({(k[3], k[2]) for k in keys if k[0] == impl and k[5] == 1})
        lines += ["", f"**Paged caches, {TITLES[impl]}**: one query token; pages in a shuffled order through "
                      "`block_table`; KV TB/s eager / graph replay"
                  + (", and graph replay's share of the read bandwidth." if bw else "."), ""]
        head = ["KV length", "batch", "contiguous"] + [f"page {p}" for p in paged]
        head += [f"page {p} / contiguous" for p in paged]
        if bw:
            head.append("% of read bandwidth: " + " / ".join(["contiguous"] + [f"page {p}" for p in paged]))
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for kv_len, batch in points:
            cols = [size_label(kv_len), str(batch)]
            cols += [pair([cells.get(impl, m, batch, kv_len, p) for m in MODES]) for p in [0] + paged]
            cols += [pair([ratio(cells.get(impl, m, batch, kv_len, p), cells.get(impl, m, batch, kv_len, 0))
                           for m in MODES], 3) for p in paged]
            if bw:
                shares = [cells.get(impl, "graph", batch, kv_len, p) for p in [0] + paged]
                cols.append(" / ".join("-" if s is None else f"{100 * s / bw:.0f}" for s in shares))
            lines.append("| " + " | ".join(cols) + " |")

    # Speculative decoding.
    spec = sorted({(k[0], k[4], k[3], k[2]) for k in keys if k[5] > 1},
                  key=lambda k: (IMPLS.index(k[0]), k[1], k[2], k[3]))
    if spec:
        qs = sorted({k[5] for k in keys if k[5] > 1})
        lines += ["", "**Speculative decoding**: seqlen_q query tokens per sequence (bottom-right causal); median ms "
                      "eager / graph replay, and the time over that of seqlen_q 1 on the same cache.", ""]
        head = ["impl", "cache", "KV length", "batch", "seqlen_q 1 ms"] + [f"seqlen_q {s} ms" for s in qs]
        head += [f"{s} / 1" for s in qs]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for impl, page, kv_len, batch in spec:
            cols = [TITLES[impl], f"page {page}" if page else "contiguous", size_label(kv_len), str(batch)]
            base = [cells.get(impl, m, batch, kv_len, page, 1, "ms") for m in MODES]
            cols.append(pair(base, 4))
            for s in qs:
                cols.append(pair([cells.get(impl, m, batch, kv_len, page, s, "ms") for m in MODES], 4))
            for s in qs:
                cols.append(pair([ratio(cells.get(impl, m, batch, kv_len, page, s, "ms"), b)
                                  for m, b in zip(MODES, base)]))
            lines.append("| " + " | ".join(cols) + " |")

    # Prefill against a cached prefix.
    pre = data.get("prefill") or []
    if pre:
        p0 = pre[0]
        sq, sk, batch = p0["seqlen_q"], p0["seqlen_k"], p0["batch"]
        pairs = visible_pairs(sq, sk)
        lines += ["", f"**Prefill against a cached prefix**: batch {batch}, {sq} new queries against {sk} keys "
                      f"({sk - sq} cached + {sq} new), bottom-right causal, eager; TFLOP/s = 4 x batch x "
                      f"{HEADS_Q} x {HEAD_DIM} x {pairs} visible pairs / median time.", ""]
        head = ["impl", "cache", "ms", "TFLOP/s", "/ flash_ext.attention"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        ref = next((r for r in pre if r["impl"] == "flash_ext_attention" and r.get("variant") != "varlen"), None)
        for r in pre:
            where = f"page {r['page_size']}" if r.get("page_size") else "contiguous"
            how = {"append": f", the {sq} new keys appended (k=, v=)",
                   "cached": f", all {sk} keys already in the cache",
                   "varlen": ", packed (no gather)"}.get(r.get("variant"), "")
            label = "flash_ext.attention_with_kvcache" if r["impl"] == "flash_ext" else TITLES.get(r["impl"], r["impl"])
            if r.get("variant") == "varlen":
                label = "flash_ext.attention_varlen"
            lines.append(f"| {label} | {where}{how} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                         f"{fmt(ratio(r['tflops'], ref and ref['tflops']))} |")

    # Notes and targets.
    notes = data.get("notes") or []
    if notes:
        lines += ["", "Notes of the run: " + "; ".join(notes) + "."]
    lines += ["", "**Targets** (issue 35; computed from these rows):", ""]
    results = targets(data)
    for number, met, text in results:
        mark = {True: "met", False: "**not met**", None: "not measured"}[met]
        lines.append(f"- {number}. {mark}: {text}")
    met = [str(n) for n, m, _ in results if m]
    not_met = [str(n) for n, m, _ in results if m is False]
    unknown = [str(n) for n, m, _ in results if m is None]
    summary = f"Targets met: {len(met)} of {len(results)}"
    summary += f" ({', '.join(met)})" if met else ""
    summary += f"; not met: {', '.join(not_met)}" if not_met else ""
    summary += f"; not measured: {', '.join(unknown)}" if unknown else ""
    lines += ["", summary + "."]
    return "\n".join(lines)


def write_json(path, data):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def report(args, data):
    """--markdown / --update-doc / --plot of a results dict."""
    if args.markdown:
        text = format_markdown(data)
        if args.update_doc:
            replace_block(args.update_doc, DOC_BLOCK, text)
        else:
            print(text)
    if args.plot:
        try:
            load_plot_module().plot_decode(data, args.plot)
            print(f"plot: {args.plot}")
        except Exception as e:  # a missing matplotlib must not lose the numbers
            print(f"note: plot failed: {first_line(e)}")


# ---------------------------------------------------------------------------------------------
# Measuring


def graph_of(torch, fn):
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


class CutShort(Exception):
    """The time budget is spent."""


class FatalCudaError(RuntimeError):
    """A sticky CUDA error: nothing after it can be measured."""


class Bench:
    def __init__(self, args, torch):
        self.args, self.torch = args, torch
        self.dev = "cuda"
        self.timer = make_timer(torch, flush=args.flush)
        self.start = time.time()
        self.notes = []  # for the JSON (and the doc): what was not measured, and why
        self.failures = {}  # (what, error) -> [where]
        self.disabled = {}  # (impl, page_size, seqlen_q or "append") -> reason
        self.smoke_failures = []
        self.flash_ext = self.fa4 = None
        self.fa4_splits = 0
        self.data = None

    # -- helpers ------------------------------------------------------------------------------
    def note(self, text, record=True):
        print(f"  note: {text}", flush=True)
        if record and text not in self.notes:
            self.notes.append(text)

    def failed(self, what, where, error):
        """A measurement that raised: printed now, and in the notes once per (what, error) with where it happened."""
        text = first_line(error)
        print(f"  note: {what} at {where}: {text}", flush=True)
        self.failures.setdefault((what, text), []).append(where)

    def all_notes(self):
        notes = list(self.notes)
        for (what, text), wheres in self.failures.items():
            more = f" and {len(wheres) - 3} more" if len(wheres) > 3 else ""
            notes.append(f"{what}: {text} (at {', '.join(wheres[:3])}{more})")
        return notes

    def check_budget(self):
        if time.time() - self.start > self.args.time_budget_s:
            raise CutShort()

    def measure(self, fn, mode):
        self.check_budget()
        run = fn if mode == "eager" else graph_of(self.torch, fn)
        ms = self.timer(run, self.args.warmup_ms, self.args.rep_ms)
        del run
        return ms

    def measure_or_note(self, fn, mode, fatal_label, what, where):
        """(ms, None), or (None, the error) after noting it as failed(what, where); a sticky CUDA error ends the run
        (FatalCudaError naming fatal_label), and so does the time budget (CutShort)."""
        try:
            return self.measure(fn, mode), None
        except CutShort:
            raise
        except Exception as e:  # noqa: BLE001
            if is_fatal_cuda(e):
                raise FatalCudaError(f"{fatal_label}: {first_line(e)}") from e
            self.failed(what, where, e)
            return None, e

    def save(self):
        if self.args.json and self.data is not None:
            self.data["notes"] = self.all_notes()
            write_json(self.args.json, self.data)

    def imports(self):
        torch = self.torch
        if any(i.startswith("flash_ext") for i in self.args.impls):
            if REPO not in sys.path:
                sys.path.insert(0, REPO)
            try:
                import flash_ext

                self.flash_ext = flash_ext
                print(f"flash_ext: {flash_ext.__file__}")
            except Exception as e:  # noqa: BLE001
                self.note(f"flash_ext not importable ({first_line(e)})")
                self.args.impls = [i for i in self.args.impls if not i.startswith("flash_ext")]
        if "fa4" in self.args.impls:
            try:
                import flash_attn.cute as fa4

                self.fa4 = fa4
                version = getattr(fa4, "__version__", None)
                if not version or version == "0.0.0":
                    from importlib.metadata import version as dist_version

                    for dist in ("flash-attn-4", "fa4", "flash-attn4"):
                        try:
                            version = dist_version(dist)
                            break
                        except Exception:  # noqa: BLE001
                            continue
                self.fa4_version = version or "unknown version"
                # FA4 has no split-KV kernel on sm90 (it asserts); elsewhere num_splits=0 picks its heuristic.
                self.fa4_splits = 1 if torch.cuda.get_device_capability()[0] == 9 else 0
                print(f"fa4: {fa4.__file__} ({self.fa4_version}), num_splits={self.fa4_splits}")
            except Exception as e:  # noqa: BLE001
                self.note(f"fa4 (flash_attn.cute, FlashAttention-4) not importable ({first_line(e)})")
                self.args.impls = [i for i in self.args.impls if i != "fa4"]

    # -- inputs and calls -------------------------------------------------------------------------
    def cache(self, layout, batch, kv_len):
        """Random K and V caches: layout 'bshd' (batch, kv_len, heads, dim), 'bhsd' (SDPA's), or a page size:
        pages (batch * ceil(kv_len / page), page, heads, dim) and a block table of a random permutation of them.
        Returns (k, v, block_table or None, cache_seqlens int32 (batch,) = kv_len)."""
        torch = self.torch
        dev, dtype = self.dev, torch.bfloat16
        if layout == "bshd":
            shape, table = (batch, kv_len, HEADS_KV, HEAD_DIM), None
        elif layout == "bhsd":
            shape, table = (batch, HEADS_KV, kv_len, HEAD_DIM), None
        else:
            per_seq = -(-kv_len // layout)
            shape = (batch * per_seq, layout, HEADS_KV, HEAD_DIM)
            table = torch.randperm(batch * per_seq, device=dev).to(torch.int32).view(batch, per_seq)
        k = torch.randn(shape, dtype=dtype, device=dev)
        v = torch.randn(shape, dtype=dtype, device=dev)
        seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device=dev)
        return k, v, table, seqlens

    def call(self, impl, q, k, v, table, seqlens, kv_len, k_new=None, v_new=None):
        """A no-argument callable of impl on these tensors (flash_ext layout q (batch, seqlen_q, heads, dim))."""
        torch = self.torch
        if impl == "flash_ext":
            ext = self.flash_ext
            return lambda: ext.attention_with_kvcache(q, k, v, k_new, v_new, cache_seqlens=seqlens,
                                                      block_table=table, causal=True)
        if impl == "flash_ext_attention":
            ext = self.flash_ext
            return lambda: ext.attention(q, k, v, causal=True)
        if impl == "sdpa_cudnn":
            F, backend = torch.nn.functional, torch.nn.attention.SDPBackend.CUDNN_ATTENTION
            qt = q.transpose(1, 2)

            def sdpa():
                with torch.nn.attention.sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, k, v, enable_gqa=True)
            return sdpa
        if impl == "fa4":
            fa4, splits = self.fa4, self.fa4_splits
            if table is None:
                return lambda: fa4.flash_attn_func(q, k, v, causal=True, num_splits=splits)
            seqlen_q = q.shape[1]
            return lambda: fa4.flash_attn_varlen_func(q, k, v, max_seqlen_q=seqlen_q, max_seqlen_k=kv_len,
                                                      seqused_k=seqlens, page_table=table, causal=True,
                                                      num_splits=splits)
        raise ValueError(impl)

    @staticmethod
    def layout_of(impl, page):
        return page if page else ("bhsd" if impl == "sdpa_cudnn" else "bshd")

    # -- correctness smoke ------------------------------------------------------------------------
    def reference(self, q, k, v):
        """fp32 attention of q (b, sq, hq, d) over k, v (b, sk, hkv, d), bottom-right causal."""
        torch = self.torch
        sq, sk = q.shape[1], k.shape[1]
        rep = q.shape[2] // k.shape[2]
        qf = q.float().transpose(1, 2)
        kf = k.float().repeat_interleave(rep, dim=2).transpose(1, 2)
        vf = v.float().repeat_interleave(rep, dim=2).transpose(1, 2)
        s = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > sk - sq + i, float("-inf"))
        return (s.softmax(-1) @ vf).transpose(1, 2)

    def smoke_one(self, impl, key, fn, ref):
        try:
            out = fn()
            out = out[0] if isinstance(out, (tuple, list)) else out
            diff = (out.float() - ref).abs().max().item()
        except Exception as e:  # noqa: BLE001
            if is_fatal_cuda(e):
                raise FatalCudaError(first_line(e)) from e
            self.disabled[(impl,) + key] = first_line(e)
            return f"{smoke_label(key)}: {first_line(e)}"
        if not diff <= SMOKE_TOL:  # also NaN
            self.disabled[(impl,) + key] = f"correctness smoke: max |out - fp32 reference| {diff:.3g} > {SMOKE_TOL}"
            if impl == "flash_ext":
                self.smoke_failures.append(f"{smoke_label(key)}: max diff {diff:.3g}")
            return f"{smoke_label(key)}: max diff {diff:.3g} FAILED"
        return None

    def smoke(self, pages, seqlens_q, prefill_pages):
        """flash_ext (and fa4) against an fp32 reference: batch 2, 1333 keys (not a page multiple), every page size
        and seqlen_q to be timed; and the append path (300 new keys after 1024 cached, seqlen_q 300)."""
        torch = self.torch
        impls = [i for i in ("flash_ext", "fa4") if i in self.args.impls]
        batch, length, cap = 2, 1333, 1536
        k_full = torch.randn(batch, cap, HEADS_KV, HEAD_DIM, dtype=torch.bfloat16, device=self.dev)
        v_full = torch.randn_like(k_full)

        def paged(page, k, v):
            per_seq = cap // page
            table = torch.randperm(batch * per_seq, device=self.dev).to(torch.int32).view(batch, per_seq)
            kp = torch.empty(batch * per_seq, page, HEADS_KV, HEAD_DIM, dtype=k.dtype, device=self.dev)
            vp = torch.empty_like(kp)
            kp[table.long()] = k.view(batch, per_seq, page, HEADS_KV, HEAD_DIM)
            vp[table.long()] = v.view(batch, per_seq, page, HEADS_KV, HEAD_DIM)
            return kp, vp, table

        for impl in impls:
            problems, checked = [], 0
            for page in pages:
                for sq in measurements_of(impl, page, seqlens_q):
                    q = torch.randn(batch, sq, HEADS_Q, HEAD_DIM, dtype=torch.bfloat16, device=self.dev)
                    ref = self.reference(q, k_full[:, :length], v_full[:, :length])
                    if page:
                        k, v, table = paged(page, k_full, v_full)
                    else:
                        k, v, table = k_full[:, :length].contiguous(), v_full[:, :length].contiguous(), None
                    seqlens = torch.full((batch,), length, dtype=torch.int32, device=self.dev)
                    fn = self.call(impl, q, k, v, table, seqlens, length)
                    problem = self.smoke_one(impl, (page, sq), fn, ref)
                    checked += 1
                    if problem:
                        problems.append(problem)
            if impl == "flash_ext" and self.args.prefill:
                cached, new = 1024, 300
                q = torch.randn(1, new, HEADS_Q, HEAD_DIM, dtype=torch.bfloat16, device=self.dev)
                ref = self.reference(q, k_full[:1, :cached + new], v_full[:1, :cached + new])
                for page in prefill_pages:
                    k0 = k_full[:1].clone()
                    v0 = v_full[:1].clone()
                    k0[:, cached:] = 0  # the appended keys must come from k=, v=
                    v0[:, cached:] = 0
                    if page:
                        per_seq = cap // page
                        table = torch.randperm(per_seq, device=self.dev).to(torch.int32).view(1, per_seq)
                        k = torch.empty(per_seq, page, HEADS_KV, HEAD_DIM, dtype=k0.dtype, device=self.dev)
                        v = torch.empty_like(k)
                        k[table.long()] = k0.view(1, per_seq, page, HEADS_KV, HEAD_DIM)
                        v[table.long()] = v0.view(1, per_seq, page, HEADS_KV, HEAD_DIM)
                    else:
                        k, v, table = k0, v0, None
                    seqlens = torch.full((1,), cached, dtype=torch.int32, device=self.dev)
                    fn = self.call("flash_ext", q, k, v, table, seqlens, cached + new,
                                   k_full[:1, cached:cached + new], v_full[:1, cached:cached + new])
                    problem = self.smoke_one("flash_ext", (page, "append"), fn, ref)
                    checked += 1
                    if problem:
                        problems.append(problem)
            print(f"  smoke {impl}: {checked} configs, " + ("all ok" if not problems else "; ".join(problems)),
                  flush=True)
            if impl == "fa4" and problems:
                self.note(f"fa4 failed the correctness smoke, not timed there: {'; '.join(problems)}")
        self.torch.cuda.empty_cache()

    # -- the decode points ------------------------------------------------------------------------
    def run_point(self, kv_len, batch, layouts, rows):
        torch = self.torch
        impls = [i for i in IMPLS if i in self.args.impls]
        layout_impls = {}  # cache layout -> [(impl, page, seqlens_q)]
        for page, qs in layouts:
            for impl in impls:
                wanted = measurements_of(impl, page, qs)
                if wanted:
                    layout_impls.setdefault(self.layout_of(impl, page), []).append((impl, page, wanted))
        nbytes = kv_bytes(batch, kv_len)
        point = f"{size_label(kv_len)} x {batch}"
        # Caches smaller than ROTATE_BYTES are timed as a run of calls over distinct copies (the time per call
        # reported): one cache would be served from the 60 MB L2 after its first call.
        sets = max(1, min(32, -(-ROTATE_BYTES // nbytes)))
        for layout, entries in layout_impls.items():
            try:
                caches = [self.cache(layout, batch, kv_len) for _ in range(sets)]
            except torch.cuda.OutOfMemoryError as e:
                for impl, page, _ in entries:
                    self.failed(f"{impl} {page_label(page)}", point, e)
                torch.cuda.empty_cache()
                continue
            for impl, page, qs in entries:
                for sq in qs:
                    if (impl, page, sq) in self.disabled:
                        continue
                    calls = [self.call(impl, torch.randn(batch, sq, HEADS_Q, HEAD_DIM, dtype=torch.bfloat16,
                                                         device=self.dev), k, v, table, seqlens, kv_len)
                             for k, v, table, seqlens in caches]
                    fn = calls[0] if sets == 1 else (lambda calls=calls: [call() for call in calls])
                    cells = []
                    for mode in MODES:
                        t0 = time.time()
                        ms, e = self.measure_or_note(fn, mode, f"{impl} {mode} {point}", f"{impl} {page_label(page)}",
                                                     f"{point} seqlen_q {sq} {mode}")
                        if e is not None:
                            if impl == "fa4" and not isinstance(e, torch.cuda.OutOfMemoryError):
                                self.disabled[(impl, page, sq)] = first_line(e)  # FA4 recompiles: no retries
                            cells.append(f"{mode} -")
                            torch.cuda.empty_cache()
                            break  # what failed eager fails as a graph too
                        ms /= sets
                        if impl == "fa4" and time.time() - t0 > 10:
                            print(f"  (fa4 {mode} took {time.time() - t0:.0f} s: compiling)", flush=True)
                        tbs = nbytes / (ms * 1e-3) / 1e12
                        rows.append({"impl": impl, "mode": mode, "batch": batch, "kv_len": kv_len, "page_size": page,
                                     "seqlen_q": sq, "ms": ms, "kv_tb_per_s": tbs})
                        cells.append(f"{mode} {tbs:5.2f} TB/s {ms:8.4f} ms")
                    print(f"{point:>10} {impl:20s} {page_label(page):10s} seqlen_q {sq:<3} " + "  ".join(cells),
                          flush=True)
                    del fn, calls
            del caches
            torch.cuda.empty_cache()

    # -- prefill ----------------------------------------------------------------------------------
    def run_prefill(self, out):
        """Prefill rows: flash_ext.attention on (q, k, v) contiguous, then attention_with_kvcache on caches holding
        the prefix with the new keys appended (variant 'append') or all keys in place ('cached'), and fa4."""
        torch = self.torch
        sq, sk, batch = PREFILL_SEQLEN_Q, PREFILL_SEQLEN_K, 1
        flops = attention_flops(batch, sq, sk)
        dev, dtype = self.dev, torch.bfloat16
        q = torch.randn(batch, sq, HEADS_Q, HEAD_DIM, dtype=dtype, device=dev)
        k_new = torch.randn(batch, sq, HEADS_KV, HEAD_DIM, dtype=dtype, device=dev)
        v_new = torch.randn_like(k_new)
        plans = []
        if "flash_ext_attention" in self.args.impls or "flash_ext" in self.args.impls:
            plans.append(("flash_ext_attention", 0, "full"))
            plans.append(("flash_ext_attention", 0, "varlen"))  # the packed varlen forward alone: the gather's share
        for page in self.args.prefill_page_sizes:
            if "flash_ext" in self.args.impls:
                plans += [("flash_ext", page, "append"), ("flash_ext", page, "cached")]
            if "fa4" in self.args.impls:
                plans.append(("fa4", page, "cached"))
        # Every plan's call is built first, then timed in --prefill-rounds interleaved rounds (the median kept): the
        # first-timed call of a run can catch different clocks than the rest, and the rows are compared to each other.
        calls = []
        for impl, page, variant in plans:
            if self.disabled.get((impl, page, "append" if variant == "append" else sq)):
                continue
            if impl == "flash_ext_attention" and self.flash_ext is None:
                continue
            k, v, table, _ = self.cache(page or "bshd", batch, sk)
            cached = sk - sq if variant == "append" else sk
            seqlens = torch.full((batch,), cached, dtype=torch.int32, device=dev)
            if variant == "append":
                fn = self.call(impl, q, k, v, table, seqlens, sk, k_new, v_new)
            elif variant == "varlen":
                ext, q_packed = self.flash_ext, q.view(batch * sq, HEADS_Q, HEAD_DIM)
                k_packed, v_packed = k.view(batch * sk, HEADS_KV, HEAD_DIM), v.view(batch * sk, HEADS_KV, HEAD_DIM)
                cu_q = torch.tensor([0, sq], dtype=torch.int32, device=dev)
                cu_k = torch.tensor([0, sk], dtype=torch.int32, device=dev)
                fn = lambda: ext.attention_varlen(q_packed, k_packed, v_packed, cu_q, cu_k, sq, sk,  # noqa: E731
                                                  causal=True)
            else:
                fn = self.call(impl, q, k, v, table, seqlens, sk)
            calls.append(((impl, page, variant, cached), fn))
        times = {key: [] for key, _ in calls}
        for _ in range(self.args.prefill_rounds):
            for key, fn in calls:
                impl, page, variant, _ = key
                if self.disabled.get((impl, page, variant)):
                    continue
                ms, e = self.measure_or_note(fn, "eager", f"prefill {impl}",
                                             f"prefill {impl} {page_label(page)} {variant}", f"{sq} queries, {sk} keys")
                if e is None:
                    times[key].append(ms)
                else:
                    self.disabled[(impl, page, variant)] = first_line(e)
        del calls
        for (impl, page, variant, cached), measured in times.items():
            if not measured:
                continue
            ms = sorted(measured)[len(measured) // 2]
            tflops = flops / (ms * 1e-3) / 1e12
            out.append({"impl": impl, "variant": variant, "mode": "eager", "batch": batch, "seqlen_q": sq,
                        "seqlen_k": sk, "cache_seqlen": cached, "page_size": page, "ms": ms, "tflops": tflops,
                        "pairs": visible_pairs(sq, sk), "rounds_ms": measured})
            print(f"prefill {impl:20s} {page_label(page):10s} {variant:7s} "
                  f"{ms:8.3f} ms {tflops:6.1f} TFLOP/s  (rounds: {', '.join(f'{t:.3f}' for t in measured)})",
                  flush=True)
        torch.cuda.empty_cache()

    def read_bandwidth(self):
        x = self.torch.empty(2 ** 30 // 2, dtype=self.torch.bfloat16, device=self.dev).normal_()
        ms = self.timer(lambda: x.sum(dtype=self.torch.float32), 25, 100)
        return x.numel() * 2 / (ms * 1e-3) / 1e12


def print_plan(args):
    points, skipped = plan(args)
    n = 0
    for kv_len, batch, layouts in points:
        parts = []
        for page, qs in layouts:
            impls = [i for i in IMPLS if i in args.impls and measurements_of(i, page, qs)]
            n += sum(len(measurements_of(i, page, qs)) * len(MODES) for i in impls)
            parts.append(f"{'page ' + str(page) if page else 'contiguous'} seqlen_q {','.join(map(str, qs))} "
                         f"[{','.join(impls)}]")
        print(f"{size_label(kv_len):>5} x {batch:<3} KV {kv_bytes(batch, kv_len) / 2 ** 30:6.2f} GiB: "
              + "; ".join(parts))
    for kv_len, batch in skipped:
        print(f"{size_label(kv_len):>5} x {batch:<3} KV {kv_bytes(batch, kv_len) / 2 ** 30:6.2f} GiB: skipped "
              f"(over --max-kv-gib {args.max_kv_gib})")
    if args.prefill:
        print(f"prefill: seqlen_q {PREFILL_SEQLEN_Q}, keys {PREFILL_SEQLEN_K}, page sizes "
              f"{','.join(map(str, args.prefill_page_sizes))}")
    print(f"{len(points)} points, {n} decode measurements (impls {','.join(args.impls)}; warmup {args.warmup_ms} ms, "
          f"rep {args.rep_ms} ms each)")


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if any(p < 0 for p in args.page_sizes + args.prefill_page_sizes) or any(s < 1 for s in args.seqlens_q):
        parser.error("page sizes must be >= 0 and seqlens_q >= 1")
    if args.update_doc and not args.markdown:
        parser.error("--update-doc needs --markdown")
    if args.from_json:
        report(args, load_results(args.from_json))
        return 0
    if args.list:
        print_plan(args)
        return 0

    import torch

    if not torch.cuda.is_available():
        print("error: bench_decode.py needs a CUDA GPU (use --list or --from-json here)")
        return 2
    torch.manual_seed(0)
    bench = Bench(args, torch)
    bench.imports()
    points, skipped = plan(args)
    rows, prefill = [], []
    bench.data = data = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": git_commit(),
        "read_bandwidth_tb_per_s": None, "heads_q": HEADS_Q, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
        "dtype": "bf16", "seqlen_q": 1, "fa4": getattr(bench, "fa4_version", None),
        "page_sizes": args.page_sizes, "seqlens_q": args.seqlens_q, "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms,
        "l2_flush": args.flush, "rows": rows, "prefill": prefill, "notes": [],
    }
    for kv_len, batch in skipped:
        bench.note(f"{size_label(kv_len)} x {batch} not measured: its KV ({kv_bytes(batch, kv_len) / 2 ** 30:.0f} GiB) "
                   f"is over --max-kv-gib {args.max_kv_gib:g}")
    print(f"gpu {data['gpu']}  torch {data['torch']}  cudnn {data['cudnn']}  commit {data['commit']}  "
          f"impls {','.join(args.impls)}")
    status = 0
    with torch.no_grad():
        try:
            data["read_bandwidth_tb_per_s"] = bw = bench.read_bandwidth()
            print(f"read bandwidth (1 GiB bf16 sum): {bw:.2f} TB/s", flush=True)
            if args.check and (bench.flash_ext is not None or bench.fa4 is not None):
                print("correctness smoke (fp32 reference):")
                all_q = sorted({q for _, _, layouts in points for _, qs in layouts for q in qs})
                all_pages = sorted({p for _, _, layouts in points for p, _ in layouts})
                bench.smoke(all_pages, all_q, args.prefill_page_sizes)
            if args.prefill:  # first: short, and safe from a late point's failure or the time budget
                bench.run_prefill(prefill)
                bench.save()
            for kv_len, batch, layouts in points:  # the largest caches last
                bench.run_point(kv_len, batch, layouts, rows)
                bench.save()
        except CutShort:
            bench.note(f"the time budget of {args.time_budget_s:g} s cut the run short")
            status = 4
        except FatalCudaError as e:
            bench.note(f"sticky CUDA error, run stopped: {e}")
            status = 3
        except KeyboardInterrupt:
            print("interrupted")
            status = 130
    if bench.smoke_failures:
        bench.note("flash_ext FAILED the correctness smoke (not timed there): " + "; ".join(bench.smoke_failures))
        status = status or 5
    print(f"\nbenchmark time {time.time() - bench.start:.0f} s")
    data["notes"] = bench.all_notes()
    bench.save()
    if args.json:
        print(f"json: {args.json}")
    if not args.markdown:  # the tables and the targets, always, after a run
        print()
        print(format_markdown(data))
    report(args, data)
    return status


if __name__ == "__main__":
    sys.exit(main())

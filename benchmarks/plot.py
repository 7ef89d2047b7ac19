#!/usr/bin/env python3
"""Plot a benchmark JSON.

bench_attention.py's: one subplot per (op, head_dim, causal), TFLOP/s vs seqlen, one line per implementation.
Rows of another case or dtype than dense/bf16 get their own subplots (named in the title).

bench_decode.py's (recognised by its rows' kv_tb_per_s): one subplot per batch, KV TB/s vs KV length at one
query token; flash_ext, SDPA cuDNN and FA4 on the contiguous cache (solid: CUDA-graph replay, dashed: eager),
flash_ext on paged caches (graph replay; bench_decode.py --markdown's tables have the rest), and the device's
read bandwidth (and 90% of it) as horizontal lines.

    python benchmarks/plot.py bench.json -o bench.png [--ops fwd,bwd] [--impls flash_ext,sdpa_cudnn]
    python benchmarks/plot.py benchmarks/results/h200_decode.json -o benchmarks/results/h200_decode.png \
        [--impls flash_ext,sdpa_cudnn,fa4,flash_ext_attention]
"""
import argparse
import json
import os

OPS = ("fwd", "bwd", "fwd_bwd")
IMPL_ORDER = ("flash_ext", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flash_ext_deterministic", "flash_ext_sm80")
# Fixed colours so an impl looks the same in every plot; flash_ext stands out.
IMPL_STYLE = {
    "flash_ext": dict(color="tab:red", marker="o", linewidth=2.2),
    "sdpa_flash": dict(color="tab:blue", marker="s", linewidth=1.4),
    "sdpa_cudnn": dict(color="tab:green", marker="^", linewidth=1.4),
    "sdpa_efficient": dict(color="tab:purple", marker="v", linewidth=1.4),
    "flash_ext_deterministic": dict(color="tab:orange", marker="o", linewidth=1.4, linestyle="--"),
    "flash_ext_sm80": dict(color="tab:brown", marker="o", linewidth=1.4, linestyle=":"),
    "fa4": dict(color="black", marker="D", linewidth=1.4),
    "flash_ext_attention": dict(color="tab:cyan", marker="v", linewidth=1.2),
}
DECODE_IMPLS = ("flash_ext", "sdpa_cudnn", "fa4", "flash_ext_attention")
DECODE_DEFAULT_IMPLS = ("flash_ext", "sdpa_cudnn", "fa4")  # flash_ext_attention only when asked for
DECODE_TITLES = {"flash_ext": "flash_ext", "sdpa_cudnn": "SDPA cuDNN", "fa4": "FA4",
                 "flash_ext_attention": "flash_ext.attention"}
PAGE_STYLE = {16: dict(color="darkred", marker="x"), 256: dict(color="lightcoral", marker="+")}


def _seqlen_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_rows(rows, path, meta=None, ops=None, impls=None):
    """Write a PNG of rows (dicts as in the benchmark JSON) to path. Returns the number of subplots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if (ops is None or r["op"] in ops) and (impls is None or r["impl"] in impls)]
    if not rows:
        raise ValueError("no rows to plot")

    def op_rank(op):
        return OPS.index(op) if op in OPS else len(OPS)

    panels = {}  # (op, case, dtype, head_dim, causal) -> impl -> [(seqlen, tflops)]
    for r in rows:
        key = (r["op"], r.get("case", "dense"), r.get("dtype", "bf16"), r["head_dim"], bool(r["causal"]))
        seq = r["seqlen_k"] if r["seqlen_q"] == r["seqlen_k"] else r["seqlen_q"]
        panels.setdefault(key, {}).setdefault(r["impl"], []).append((seq, r["tflops"]))

    # Grid: one row per (op, case, dtype), one column per (head_dim, causal).
    row_keys = sorted({k[:3] for k in panels}, key=lambda k: (op_rank(k[0]), k))
    col_keys = sorted({k[3:] for k in panels})
    nrows, ncols = len(row_keys), len(col_keys)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols + 0.5, 2.9 * nrows + 0.9), squeeze=False)
    all_impls = sorted({r["impl"] for r in rows}, key=lambda i: (IMPL_ORDER.index(i) if i in IMPL_ORDER else 99, i))
    handles = {}
    for ri, rk in enumerate(row_keys):
        for ci, ck in enumerate(col_keys):
            ax = axes[ri][ci]
            key = rk + ck
            op, case, dtype = rk
            head_dim, causal = ck
            if key not in panels:
                ax.set_visible(False)
                continue
            extra = "" if (case, dtype) == ("dense", "bf16") else f" {case} {dtype}"
            ax.set_title(f"{op}{extra}  hd{head_dim}  {'causal' if causal else 'non-causal'}", fontsize=9)
            seqs = set()
            for impl in all_impls:
                pts = sorted(panels[key].get(impl, []))
                if not pts:
                    continue
                xs, ys = zip(*pts)
                seqs.update(xs)
                (line,) = ax.plot(xs, ys, label=impl, markersize=4, **IMPL_STYLE.get(impl, {}))
                handles.setdefault(impl, line)
            ax.set_xscale("log", base=2)
            ticks = sorted(seqs)
            ax.set_xticks(ticks)
            ax.set_xticklabels([_seqlen_label(t) for t in ticks], fontsize=7)
            ax.minorticks_off()
            ax.tick_params(axis="y", labelsize=7)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if ci == 0:
                ax.set_ylabel("TFLOP/s", fontsize=8)
            if ri == nrows - 1:
                ax.set_xlabel("seqlen", fontsize=8)
    title = "attention TFLOP/s (median)"
    if meta:
        title += "  |  " + "  ".join(
            f"{k} {meta[k]}" for k in ("gpu", "torch", "cudnn", "commit", "date") if meta.get(k) is not None
        )
    top_in = 0.6  # inches above the subplots for the title and the legend
    fig.suptitle(title, fontsize=10, y=1 - 0.12 / fig.get_figheight(), va="top")
    ordered = [i for i in all_impls if i in handles]
    fig.legend([handles[i] for i in ordered], ordered, loc="upper center", ncol=len(ordered), fontsize=8,
               frameon=False, bbox_to_anchor=(0.5, 1 - 0.36 / fig.get_figheight()))
    fig.tight_layout(rect=(0, 0, 1, 1 - top_in / fig.get_figheight()))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return len(panels)


def is_decode(data):
    """Whether data (a loaded JSON) is a bench_decode.py result."""
    rows = data.get("rows") or []
    return bool(rows) and "kv_tb_per_s" in rows[0]


def plot_decode(data, path, impls=None):
    """Write a PNG of a bench_decode.py result (a dict as in its JSON) to path: one subplot per batch, KV TB/s vs
    KV length at seqlen_q 1. Returns the number of subplots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = list(impls) if impls else list(DECODE_DEFAULT_IMPLS)
    default_q = data.get("seqlen_q", 1)
    rows = [dict(r, page_size=r.get("page_size", 0), seqlen_q=r.get("seqlen_q", default_q)) for r in data["rows"]]
    rows = [r for r in rows if r["seqlen_q"] == 1 and r["impl"] in impls]
    if not rows:
        raise ValueError("no decode rows to plot")
    batches = sorted({r["batch"] for r in rows})
    series = {}  # (impl, page, mode) -> batch -> [(kv_len, tb/s)]
    for r in rows:
        series.setdefault((r["impl"], r["page_size"], r["mode"]), {}).setdefault(r["batch"], []).append(
            (r["kv_len"], r["kv_tb_per_s"]))
    bw = data.get("read_bandwidth_tb_per_s")
    top = max([r["kv_tb_per_s"] for r in rows] + ([bw] if bw else []))
    fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches) + 0.4, 4.2), squeeze=False)
    handles = {}

    def order(key):
        impl, page, mode = key
        return (DECODE_IMPLS.index(impl) if impl in DECODE_IMPLS else 99, page, mode != "graph")

    for ax, batch in zip(axes[0], batches):
        lens = set()
        for key in sorted(series, key=order):
            impl, page, mode = key
            pts = sorted(series[key].get(batch, []))
            if not pts or (page and (mode != "graph" or impl != "flash_ext")):
                continue  # paged caches: flash_ext's graph replays only, to keep the plot readable
            xs, ys = zip(*pts)
            lens.update(xs)
            title = DECODE_TITLES.get(impl, impl)
            if page:
                style = dict(PAGE_STYLE.get(page, dict(color="gray", marker=".")), linewidth=1.1, linestyle="-")
                label = f"{title} page {page} (graph)"
            else:
                style = dict(IMPL_STYLE.get(impl, {}))
                if mode == "eager":
                    style.update(linestyle="--", linewidth=1.0, alpha=0.55)
                label = f"{title} ({mode})"
            (line,) = ax.plot(xs, ys, label=label, markersize=4, **style)
            handles.setdefault(label, line)
        if bw:
            line = ax.axhline(bw, color="gray", linewidth=1.2)
            handles.setdefault(f"read bandwidth {bw:.2f} TB/s", line)
            line = ax.axhline(0.9 * bw, color="gray", linewidth=1.0, linestyle=":")
            handles.setdefault("90% of it", line)
        ax.set_title(f"batch {batch}", fontsize=9)
        ax.set_xscale("log", base=2)
        ticks = sorted(lens)
        ax.set_xticks(ticks)
        ax.set_xticklabels([_seqlen_label(t) for t in ticks], fontsize=7)
        ax.minorticks_off()
        ax.tick_params(axis="y", labelsize=7)
        ax.set_ylim(0, top * 1.08)
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("KV length", fontsize=8)
    axes[0][0].set_ylabel("KV TB/s", fontsize=8)
    title = (f"decode, one query token: KV bytes / median time (bf16, hd{data.get('head_dim', 128)}, "
             f"{data.get('heads_q', 32)} q / {data.get('heads_kv', 8)} kv heads)")
    meta = "  ".join(f"{k} {data[k]}" for k in ("gpu", "torch", "cudnn", "fa4", "commit", "date")
                     if data.get(k) is not None)
    labels = list(handles)
    ncol = min(len(labels), 5)
    legend_rows = -(-len(labels) // ncol)
    height = fig.get_figheight()
    fig.suptitle(f"{title}\n{meta}", fontsize=9, y=1 - 0.08 / height, va="top")
    fig.legend([handles[k] for k in labels], labels, loc="upper center", ncol=ncol, fontsize=7, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.48 / height))
    top_in = 0.48 + 0.2 * legend_rows + 0.35  # title, legend, the subplots' titles
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.55 / height, top=1 - top_in / height, wspace=0.18)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return len(batches)


def plot_json(json_path, path, ops=None, impls=None):
    with open(json_path) as f:
        data = json.load(f)
    if is_decode(data):
        return plot_decode(data, path, impls=impls)
    meta = {k: v for k, v in data.items() if k != "rows"}
    return plot_rows(data["rows"], path, meta=meta, ops=ops, impls=impls)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="benchmark JSON written by bench_attention.py or bench_decode.py")
    p.add_argument("-o", "--output", help="PNG path (default: the JSON path with .png)")
    p.add_argument("--ops", help="comma list to keep (default all; bench_attention.py JSONs)")
    p.add_argument("--impls", help="comma list to keep (default all; for a bench_decode.py JSON "
                                   + ",".join(DECODE_DEFAULT_IMPLS) + ")")
    args = p.parse_args(argv)
    out = args.output or os.path.splitext(args.json)[0] + ".png"
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()] if s else None  # noqa: E731
    n = plot_json(args.json, out, ops=split(args.ops), impls=split(args.impls))
    print(f"{out}: {n} subplots")


if __name__ == "__main__":
    main()

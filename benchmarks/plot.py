#!/usr/bin/env python3
"""Plot a bench_attention.py JSON: one subplot per (op, head_dim, causal), TFLOP/s vs seqlen,
one line per implementation.

    python benchmarks/plot.py bench.json -o bench.png [--ops fwd,bwd] [--impls flash_ext,sdpa_cudnn]

Rows of another case or dtype than dense/bf16 get their own subplots (named in the title).
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
}


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


def plot_json(json_path, path, ops=None, impls=None):
    with open(json_path) as f:
        data = json.load(f)
    meta = {k: v for k, v in data.items() if k != "rows"}
    return plot_rows(data["rows"], path, meta=meta, ops=ops, impls=impls)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="benchmark JSON written by bench_attention.py")
    p.add_argument("-o", "--output", help="PNG path (default: the JSON path with .png)")
    p.add_argument("--ops", help="comma list to keep (default all)")
    p.add_argument("--impls", help="comma list to keep (default all)")
    args = p.parse_args(argv)
    out = args.output or os.path.splitext(args.json)[0] + ".png"
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()] if s else None  # noqa: E731
    n = plot_json(args.json, out, ops=split(args.ops), impls=split(args.impls))
    print(f"{out}: {n} subplots")


if __name__ == "__main__":
    main()

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

--summary: one figure per head dim for a reader in a hurry, from a bench_attention.py JSON and optionally a
bench_decode.py JSON: forward and backward TFLOP/s vs seqlen (non-causal and causal) of flash_ext, SDPA
FlashAttention-2, SDPA cuDNN (and FA4 where measured), the rows of the file's latest run only (the header's
commit); below, where the decode JSON measured that head dim, KV TB/s vs KV length per batch (contiguous cache,
CUDA-graph replay). Each panel notes the range of flash_ext's speed ratio to each other implementation.

    python benchmarks/plot.py --summary benchmarks/results/h200.json benchmarks/results/h200_decode.json \
        [-o 'benchmarks/results/h200_hd{head_dim}.png'] [--impls flash_ext,sdpa_flash,sdpa_cudnn,fa4]
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


SUMMARY_IMPLS = ("flash_ext", "sdpa_flash", "sdpa_cudnn", "fa4")
SUMMARY_TITLES = {"flash_ext": "flash_ext", "sdpa_flash": "PyTorch SDPA, FlashAttention-2 backend",
                  "sdpa_cudnn": "PyTorch SDPA, cuDNN backend", "fa4": "FlashAttention-4"}
SUMMARY_SHORT = {"sdpa_flash": "FA2", "sdpa_cudnn": "cuDNN", "fa4": "FA4"}
SUMMARY_OPS = (("fwd", "forward"), ("bwd", "backward"))


def _cudnn_label(version):
    """cuDNN's version number (major·10000 + minor·100 + patch, as torch reports it) as text."""
    return f"cuDNN {version // 10000}.{version // 100 % 100}" if isinstance(version, int) else None


def _run_label(data, keys=("torch", "cudnn", "commit", "date")):
    parts = []
    for key in keys:
        value = data.get(key)
        if value is None:
            continue
        if key == "cudnn":
            parts.append(_cudnn_label(value))
        elif key == "fa4":
            parts.append(f"FlashAttention-4 {value}")
        elif key == "commit":
            parts.append(f"flash_ext commit {value}")
        elif key == "date":
            parts.append(str(value)[:10])
        else:
            parts.append(f"{key} {value}")
    return ", ".join(p for p in parts if p)


def latest_run_rows(data):
    """The rows measured by the run that wrote the file's header. A results file merged from several runs
    (bench_attention.py --merge) stamps each row with its commit; older rows stay in the file for the tables
    but would mix kernels of different commits in one line."""
    commit = data.get("commit")
    return [r for r in data["rows"] if r.get("commit", commit) == commit]


def _tokens_label(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def flash_ext_ratios(series, impls):
    """[(impl, [(length, flash_ext / impl)])] for each impl other than flash_ext in series (impl -> [(length,
    rate)]), at the lengths both measured."""
    ours = dict(series.get("flash_ext", []))
    out = []
    for impl in impls:
        if impl == "flash_ext" or impl not in series:
            continue
        theirs = dict(series[impl])
        common = [x for x in sorted(set(ours) & set(theirs)) if theirs[x] > 0]
        if common:
            out.append((impl, [(x, ours[x] / theirs[x]) for x in common]))
    return out


def _ratio_note(ax, series, impls):
    """The range of flash_ext's ratio to each other impl (flash_ext_ratios) in the panel's lower right; returns
    the text ('' if none)."""
    lines = []
    for impl, ratios in flash_ext_ratios(series, impls):
        lo, hi = min(r for _, r in ratios), max(r for _, r in ratios)
        span = f"{lo:.2f}×" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}–{hi:.2f}×"
        lines.append(f"flash_ext / {SUMMARY_SHORT.get(impl, impl)}: {span}")
    if not lines:
        return ""
    text = "\n".join(lines)
    ax.text(0.97, 0.05, text, transform=ax.transAxes, ha="right", va="bottom", fontsize=8.5,
            bbox=dict(boxstyle="round,pad=0.3", facecolor="white", edgecolor="0.8", alpha=0.9))
    return text


def _plot_series(ax, series, impls, handles):
    """One line per impl of series (impl -> [(x, y)]), in impls' order; returns the x values drawn."""
    xs = set()
    for impl in impls:
        if impl in series:
            pts = sorted(series[impl])
            xs.update(x for x, _ in pts)
            (line,) = ax.plot(*zip(*pts), markersize=5, **IMPL_STYLE.get(impl, {}))
            handles.setdefault(impl, line)
    if not series:
        ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center", color="gray")
    return xs


def _log2_axis(ax, xs, label):
    ax.set_xscale("log", base=2)
    ticks = sorted(xs)
    ax.set_xticks(ticks)
    ax.set_xticklabels([_seqlen_label(t) for t in ticks], fontsize=8)
    ax.minorticks_off()
    ax.tick_params(axis="y", labelsize=8)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel(label, fontsize=9)


def plot_summary(training, path_template, decode=None, impls=None):
    """One PNG per head dim of training (a bench_attention.py result as a dict): forward and backward TFLOP/s vs
    seqlen, non-causal and causal, of the latest run's dense bf16 rows; below them, where decode (a
    bench_decode.py result) measured that head dim, KV TB/s vs KV length per batch (one query token, contiguous
    cache, CUDA-graph replay). path_template holds {head_dim}. Returns one dict per figure: path, head_dim,
    panels (each subplot's title -> its note of flash_ext's ratios, '' if none) and labels (the legend's entries)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = [i for i in SUMMARY_IMPLS if i in impls] + [i for i in impls if i not in SUMMARY_IMPLS] if impls \
        else list(SUMMARY_IMPLS)
    rows = [r for r in latest_run_rows(training)
            if r["op"] in dict(SUMMARY_OPS) and r["impl"] in impls and r.get("case", "dense") == "dense"
            and r.get("dtype", "bf16") == "bf16" and r["seqlen_q"] == r["seqlen_k"]]
    if not rows:
        raise ValueError("no dense bf16 fwd/bwd rows of " + ", ".join(impls) + " in the latest run")
    head_dims = sorted({r["head_dim"] for r in rows})
    if len(head_dims) > 1 and "{head_dim}" not in path_template:
        raise ValueError(f"the output path {path_template!r} must contain {{head_dim}}: there are "
                         f"{len(head_dims)} head dims ({', '.join(map(str, head_dims))})")

    decode_rows, decode_hd = [], None
    if decode is not None:
        decode_hd = decode.get("head_dim", 128)
        default_q = decode.get("seqlen_q", 1)
        decode_rows = [r for r in decode["rows"] if r.get("seqlen_q", default_q) == 1 and r.get("page_size", 0) == 0
                       and r["mode"] == "graph" and r["impl"] in impls]

    results = []
    for head_dim in head_dims:
        hd_rows = [r for r in rows if r["head_dim"] == head_dim]
        dec = decode_rows if head_dim == decode_hd else []
        batches = sorted({r["batch"] for r in dec})
        fig = plt.figure(figsize=(16, 9.0 if batches else 5.2))
        top_in = 1.25  # inches above the subplots: the title, the legend, the subplots' titles
        bottom_in = 1.45 if batches else 1.15  # below them: the x labels, the notes on how it was measured
        grid = fig.add_gridspec(2 if batches else 1, 12)
        handles = {}
        notes_by_panel = {}  # panel title -> its ratio note

        # Training: one panel per (op, causal), one y scale for the four so that heights compare.
        top = max(r["tflops"] for r in hd_rows) * 1.1
        train_axes = []
        for col, (op, causal) in enumerate((op, c) for op, _ in SUMMARY_OPS for c in (False, True)):
            ax = fig.add_subplot(grid[0, 3 * col:3 * col + 3], sharey=train_axes[0] if train_axes else None)
            train_axes.append(ax)
            series = {}
            for r in hd_rows:
                if r["op"] == op and bool(r["causal"]) == causal:
                    series.setdefault(r["impl"], []).append((r["seqlen_q"], r["tflops"]))
            _log2_axis(ax, _plot_series(ax, series, impls, handles), "seqlen")
            ax.set_ylim(0, top)
            title = f"{dict(SUMMARY_OPS)[op]}, {'causal' if causal else 'non-causal'}"
            ax.set_title(title, fontsize=10)
            if col == 0:
                ax.set_ylabel("TFLOP/s", fontsize=9)
            else:
                ax.tick_params(axis="y", labelleft=False)
            notes_by_panel[title] = _ratio_note(ax, series, impls)

        # Decode: one panel per batch, KV TB/s.
        bw = decode.get("read_bandwidth_tb_per_s") if batches else None
        if batches:
            top = max([r["kv_tb_per_s"] for r in dec] + ([bw] if bw else [])) * 1.12
            width = 12 // len(batches)
            dec_axes = []
            for i, batch in enumerate(batches):
                ax = fig.add_subplot(grid[1, width * i:width * (i + 1)], sharey=dec_axes[0] if dec_axes else None)
                dec_axes.append(ax)
                series = {}
                for r in dec:
                    if r["batch"] == batch:
                        series.setdefault(r["impl"], []).append((r["kv_len"], r["kv_tb_per_s"]))
                xs = _plot_series(ax, series, impls, handles)
                if bw:
                    line = ax.axhline(bw, color="gray", linewidth=1.1, linestyle="--")
                    handles.setdefault("bandwidth", line)
                _log2_axis(ax, xs, "KV cache length (tokens)")
                ax.set_ylim(0, top)
                title = f"decode, batch {batch}"
                ax.set_title(title, fontsize=10)
                if i == 0:
                    ax.set_ylabel("KV cache read, TB/s", fontsize=9)
                else:
                    ax.tick_params(axis="y", labelleft=False)
                notes_by_panel[title] = _ratio_note(ax, series, impls)

        # The title and legend above, below the notes on what was measured: shapes, FLOP counts, where and when.
        gpu = training.get("gpu", "unknown GPU")
        tokens = sorted({r["batch"] * r["seqlen_q"] for r in hd_rows})
        heads = sorted({r["heads"] for r in hd_rows})
        shape = f"batch × seqlen = {_tokens_label(tokens[0])} tokens" if len(tokens) == 1 else "batch × seqlen varies"
        shape += f", {heads[0]} heads" if len(heads) == 1 else ""
        notes = [f"Training (top{' row' if batches else ''}): {shape}; "
                 "FLOPs: forward 4·batch·heads·seqlen²·head_dim, halved when causal, backward 2.5× the forward; "
                 "median time.",
                 f"    {_run_label(training)}."]
        if batches:
            dec_gpu = decode.get("gpu")
            where = f"{dec_gpu}, " if dec_gpu and dec_gpu != gpu else ""
            notes += [f"Decode (bottom row): one query token, {decode.get('heads_q', '?')} q / "
                      f"{decode.get('heads_kv', '?')} kv heads, contiguous {decode.get('dtype', 'bf16')} KV cache; "
                      "KV bytes read / median time, CUDA-graph replay.",
                      f"    {where}{_run_label(decode, ('torch', 'cudnn', 'fa4', 'commit', 'date'))}."]
        elif decode_hd is not None:
            notes.append(f"Decode: measured at head dim {decode_hd} only.")
        height = fig.get_figheight()
        fig.suptitle(f"Attention speed, head dim {head_dim}, bf16, {gpu} (higher is better)", fontsize=14,
                     y=1 - 0.12 / height, va="top")
        fig.text(0.045, 0.12 / height, "\n".join(notes), ha="left", va="bottom", fontsize=9, color="0.25",
                 linespacing=1.4)
        labels = {i: SUMMARY_TITLES.get(i, i) for i in impls if i in handles}
        if "bandwidth" in handles:
            labels["bandwidth"] = f"the GPU's read rate (a 1 GiB torch.sum, same run): {bw:.2f} TB/s"
        fig.legend([handles[k] for k in labels], list(labels.values()), loc="upper center", ncol=len(labels),
                   fontsize=10, frameon=False, bbox_to_anchor=(0.5, 1 - 0.5 / height))
        fig.subplots_adjust(left=0.045, right=0.99, bottom=bottom_in / height, top=1 - top_in / height, wspace=0.5,
                            hspace=0.45)
        path = path_template.replace("{head_dim}", str(head_dim))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        results.append(dict(path=path, head_dim=head_dim, panels=notes_by_panel, labels=list(labels.values())))
    return results


def plot_json(json_path, path, ops=None, impls=None):
    with open(json_path) as f:
        data = json.load(f)
    if is_decode(data):
        return plot_decode(data, path, impls=impls)
    meta = {k: v for k, v in data.items() if k != "rows"}
    return plot_rows(data["rows"], path, meta=meta, ops=ops, impls=impls)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", help="benchmark JSON written by bench_attention.py or bench_decode.py; with "
                                           "--summary a bench_attention.py JSON and optionally a bench_decode.py one")
    p.add_argument("-o", "--output", help="PNG path (default: the JSON path with .png; with --summary the "
                                          "bench_attention.py JSON's path with _hd{head_dim}.png)")
    p.add_argument("--ops", help="comma list to keep (default all; bench_attention.py JSONs)")
    p.add_argument("--impls", help="comma list to keep (default all; for a bench_decode.py JSON "
                                   + ",".join(DECODE_DEFAULT_IMPLS) + "; with --summary "
                                   + ",".join(SUMMARY_IMPLS) + ")")
    p.add_argument("--summary", action="store_true", help="one figure per head dim: fwd, bwd and decode (see above)")
    args = p.parse_args(argv)
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()] if s else None  # noqa: E731
    if args.summary:
        loaded = {}
        for path in args.json:
            with open(path) as f:
                data = json.load(f)
            kind = "decode" if is_decode(data) else "training"
            if kind in loaded:
                p.error(f"--summary takes one bench_attention.py JSON and at most one bench_decode.py JSON; "
                        f"{loaded[kind][0]} and {path} are both {kind} results")
            loaded[kind] = (path, data)
        if "training" not in loaded:
            p.error("--summary needs a bench_attention.py JSON (the fwd / bwd rows)")
        if args.ops:
            p.error("--ops does not apply to --summary (it plots fwd and bwd)")
        template = args.output or os.path.splitext(loaded["training"][0])[0] + "_hd{head_dim}.png"
        decode = loaded["decode"][1] if "decode" in loaded else None
        for fig in plot_summary(loaded["training"][1], template, decode=decode, impls=split(args.impls)):
            print(f"{fig['path']}: head dim {fig['head_dim']}, {len(fig['panels'])} subplots")
        return
    if len(args.json) != 1:
        p.error("one JSON at a time (several only with --summary)")
    out = args.output or os.path.splitext(args.json[0])[0] + ".png"
    n = plot_json(args.json[0], out, ops=split(args.ops), impls=split(args.impls))
    print(f"{out}: {n} subplots")


if __name__ == "__main__":
    main()

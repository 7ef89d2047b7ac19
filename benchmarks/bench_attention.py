#!/usr/bin/env python3
"""Attention benchmark: flash_ext side by side with PyTorch SDPA's backends, in one run.

Shapes: batch * seqlen = 16384 tokens, hidden 2048 (heads = 2048 / head_dim), head dims
64/128/256, causal and not, seqlen 512..16k, bf16. Ops: fwd (forward under no_grad), bwd
(backward alone, replayed on a retained graph) and fwd_bwd (forward + backward).

    python benchmarks/bench_attention.py                      # full sweep (~2-4 min on an H200)
    python benchmarks/bench_attention.py --quick --json out.json --plot out.png
    python benchmarks/bench_attention.py --head-dims 128 --seqlens 4k --causal true --ops fwd
    python benchmarks/bench_attention.py --merge benchmarks/results/h200.json --from-json out.json
                                                              # merge a device run's rows; no GPU needed
    python benchmarks/bench_attention.py --from-json benchmarks/results/h200_fa4.json --markdown readme --update-doc README.md
                                                              # refresh the README's table; no GPU needed
    python benchmarks/bench_attention.py --impls flash_ext,flash_ext_sm80 --ops fwd
                                                              # the sm80 kernels beside the sm90 ones on Hopper

Timing: triton.testing.do_bench (median, L2 flushed before each run). TFLOP/s counts
fwd = 4*b*h*sq*sk*d (halved when causal), bwd = 2.5x fwd, fwd_bwd = 3.5x fwd.
Before timing flash_ext on a shape its output is checked against SDPA (see --correctness-smoke).

Exit status: 0 ok (unsupported impl/op pairs are notes, not errors); 2 no GPU; 3 sticky CUDA error
(rows so far are written); 4 --time-budget-s cut the sweep short; 5 flash_ext failed a correctness check.
"""
import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

OPS = ("fwd", "bwd", "fwd_bwd")
IMPLS = ("flash_ext", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flash_ext_deterministic", "flash_ext_sm80",
         "fa4", "fa4_deterministic")
# flash_ext_deterministic (deterministic=True), flash_ext_sm80 (the sm80 kernels on a Hopper GPU, under
# flash_ext.testing.sm90_kernels(False)) and FlashAttention-4 (flash_attn.cute.flash_attn_func, package
# flash-attn-4; its deterministic=True too; scripts/fa4_bundle.sh makes it importable on the device) are
# measured only when asked for.
DEFAULT_IMPLS = IMPLS[:4]
SDPA_BACKEND_NAMES = {"sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
ROW_KEY_FIELDS = ("op", "impl", "case", "dtype", "head_dim", "causal", "seqlen_q", "seqlen_k")
FWD_TOL = 0.05  # max |flash_ext - SDPA| of the bf16 output
DTYPES = ("bf16", "fp16")


class FatalCudaError(RuntimeError):
    """A sticky CUDA error (illegal address, device assert): nothing after it can be measured."""


# ---------------------------------------------------------------------------------------------
# Command line


def parse_int_list(text):
    values = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        values.append(int(float(item[:-1]) * 1024) if item.endswith("k") else int(item))
    if not values:
        raise argparse.ArgumentTypeError(f"empty list: {text!r}")
    return values


def parse_choice_list(choices):
    def parse(text):
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(choices)}")
        return values

    return parse


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dims", type=parse_int_list, default=None, help="comma list (default 64,128,256)")
    p.add_argument("--seqlens", type=parse_int_list, default=None,
                   help="comma list, 'k' = 1024 (default 512,1k,2k,4k,8k,16k)")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--ops", type=parse_choice_list(OPS), default=list(OPS), help="comma list of fwd,bwd,fwd_bwd")
    p.add_argument("--impls", type=parse_choice_list(IMPLS), default=list(DEFAULT_IMPLS), help="comma list of " + ",".join(IMPLS))
    p.add_argument("--quick", action="store_true", help="head_dim 128, seqlens 2k,8k (explicit --head-dims/--seqlens win)")
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen (default 16384)")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim (default 2048)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench rep time per measurement (default 100)")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warmup time per measurement (default 25)")
    p.add_argument("--correctness-smoke", action=argparse.BooleanOptionalAction, default=True,
                   help="(default on) per (head_dim, causal): check flash_ext fwd/bwd against SDPA and an fp32 "
                        "reference on a small shape, and before timing each shape compare flash_ext's output to "
                        f"SDPA's; a max abs diff > {FWD_TOL} (or NaN) skips flash_ext for it")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="stop starting new shapes after this many seconds (results so far are kept)")
    p.add_argument("--json", metavar="PATH", help="write this run's rows (overwrites)")
    p.add_argument("--merge", metavar="PATH",
                   help="write rows into PATH, replacing rows with the same (op, impl, case, dtype, head_dim, "
                        "causal, seqlen_q, seqlen_k) and keeping the others")
    p.add_argument("--from-json", metavar="PATH", action="append", default=[],
                   help="take rows from this JSON (repeatable) instead of running: with --merge/--json/--plot, "
                        "no GPU needed")
    p.add_argument("--plot", metavar="PATH", help="PNG of TFLOP/s vs seqlen (see benchmarks/plot.py)")
    p.add_argument("--table", metavar="PATH", help="also write the final table to this text file")
    p.add_argument("--markdown", choices=MARKDOWN_STYLES,
                   help="print the rows as Markdown instead of the text table: 'readme' (fwd and bwd at 2k / 8k / "
                        "16k, flash_ext beside SDPA FA2 and cuDNN) or 'full' (every row); with --from-json, no GPU")
    p.add_argument("--update-doc", metavar="PATH",
                   help="with --markdown STYLE: write the Markdown into PATH between the lines "
                        "'<!-- bench_attention --markdown STYLE -->' and '<!-- /bench_attention --markdown STYLE -->'")
    p.add_argument("--list", action="store_true", help="print the planned shapes and exit")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run of every code path with a wall-clock timer (use tiny --tokens/--hidden); "
                        "its numbers mean nothing")
    return p


def resolve_args(args):
    if args.head_dims is None:
        args.head_dims = [128] if args.quick else [64, 128, 256]
    if args.seqlens is None:
        args.seqlens = [2048, 8192] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    args.causals = {"both": [False, True], "true": [True], "false": [False]}[args.causal]
    for d in args.head_dims:
        if d <= 0 or args.hidden % d:
            raise SystemExit(f"--head-dims: {d} does not divide hidden {args.hidden}")
    for s in args.seqlens:
        if s <= 0 or args.tokens % s:
            raise SystemExit(f"--seqlens: {s} does not divide tokens {args.tokens}")
    return args


def plan_shapes(args):
    """[(head_dim, causal, seqlen, batch, heads)] in sweep order."""
    return [
        (d, c, s, args.tokens // s, args.hidden // d)
        for d in args.head_dims
        for c in args.causals
        for s in args.seqlens
    ]


# ---------------------------------------------------------------------------------------------
# Rows, JSON, table


def flops(op, batch, heads, seqlen_q, seqlen_k, head_dim, causal):
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        f /= 2
    return f * FLOP_FACTOR[op]


def make_row(op, impl, dtype, head_dim, causal, batch, heads, seqlen_q, seqlen_k, ms):
    tflops = flops(op, batch, heads, seqlen_q, seqlen_k, head_dim, causal) / (ms * 1e-3) / 1e12
    return {
        "op": op, "impl": impl, "case": "dense", "dtype": dtype, "head_dim": head_dim, "causal": causal,
        "batch": batch, "heads": heads, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
        "ms": round(ms, 5), "tflops": round(tflops, 2),
    }


def row_key(row):
    return tuple(row[f] for f in ROW_KEY_FIELDS)


def row_sort_key(row):
    op_rank = OPS.index(row["op"]) if row["op"] in OPS else len(OPS)
    impl_rank = IMPLS.index(row["impl"]) if row["impl"] in IMPLS else len(IMPLS)
    return (op_rank, str(row["op"]), str(row["case"]), str(row["dtype"]), row["head_dim"], bool(row["causal"]),
            row["seqlen_q"], row["seqlen_k"], impl_rank, str(row["impl"]))


def merge_rows(old_rows, new_rows):
    """Rows of old_rows whose key is not in new_rows, plus new_rows (later duplicates win), sorted."""
    merged = {}
    for row in list(old_rows) + list(new_rows):
        merged[row_key(row)] = row
    return sorted(merged.values(), key=row_sort_key)


def stamp_commit(rows, commit):
    """Rows that say which commit they were measured at (a merged file mixes commits)."""
    return [row if row.get("commit") else dict(row, commit=commit) for row in rows]


def git_commit():
    env = os.environ.get("FLASH_EXT_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def dist_version_or_none(name):
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001
        return None


def run_metadata(torch, device="cuda"):
    cuda = device == "cuda" and torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name() if cuda else "none",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "fa4": dist_version_or_none("flash-attn-4"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
    }


def load_json(path):
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise SystemExit(f"{path}: not a benchmark JSON (expected an object with a 'rows' list)")
    return data


def write_json(path, meta, rows):
    data = dict(meta)
    data["rows"] = sorted(rows, key=row_sort_key)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


class Outputs:
    """Writes --json (this run) and --merge (merged) after every shape, so a killed run keeps its rows."""

    def __init__(self, args, meta):
        self.args, self.meta = args, meta
        self.merge_base = []
        if args.merge and os.path.exists(args.merge):
            existing = load_json(args.merge)
            self.merge_base = existing["rows"]
            if existing.get("gpu") not in (None, meta.get("gpu")):
                print(f"warning: {args.merge} holds rows from {existing.get('gpu')!r}; this run is on "
                      f"{meta.get('gpu')!r} (the file's header will say the latter)")

    def write(self, rows):
        if self.args.json:
            write_json(self.args.json, self.meta, rows)
        if self.args.merge:
            write_json(self.args.merge, self.meta,
                       merge_rows(self.merge_base, stamp_commit(rows, self.meta.get("commit"))))

    def rows_for_plot(self, rows):
        return merge_rows(self.merge_base, rows) if self.args.merge else rows


def format_table(rows, impls=None):
    """One line per (op, case, dtype, head_dim, causal, seqlen): TFLOP/s of each impl, flash_ext / best SDPA
    (and flash_ext / FA4 where FA4 was measured)."""
    if impls is None:
        present = {r["impl"] for r in rows}
        impls = [i for i in IMPLS if i in present] + sorted(present - set(IMPLS))
    groups = {}
    for r in rows:
        k = (r["op"], r["case"], r["dtype"], r["head_dim"], r["causal"], r["seqlen_q"], r["seqlen_k"])
        groups.setdefault(k, {"batch": r["batch"], "heads": r["heads"]})[r["impl"]] = r["tflops"]
    show_case = any((k[1], k[2]) != ("dense", "bf16") for k in groups)
    width = max([10] + [len(i) for i in impls])
    head = f"{'op':8s} {'hd':>4s} {'causal':>6s} {'seqlen':>6s} {'b x h':>8s}"
    if show_case:
        head = f"{'case':8s} {'dtype':5s} " + head
    with_fa4 = "fa4" in impls
    head += "".join(f" {i:>{width}s}" for i in impls) + f" {'ext/best':>8s}" + (f" {'ext/fa4':>8s}" if with_fa4 else "")
    lines = [head, "-" * len(head)]
    order = sorted(groups, key=lambda k: (OPS.index(k[0]) if k[0] in OPS else 9, k[0], k[1], k[2], k[3], k[4], k[5], k[6]))
    for k in order:
        g = groups[k]
        op, case, dtype, hd, causal, sq, sk = k
        seq = f"{sq}" if sq == sk else f"{sq}/{sk}"
        line = f"{op:8s} {hd:4d} {str(causal):>6s} {seq:>6s} {str(g['batch']) + 'x' + str(g['heads']):>8s}"
        if show_case:
            line = f"{case:8s} {dtype:5s} " + line
        for i in impls:
            line += f" {g[i]:{width}.1f}" if i in g else f" {'-':>{width}s}"
        sdpa = [g[i] for i in g if i.startswith("sdpa")]
        ratio = f"{g['flash_ext'] / max(sdpa):.2f}" if "flash_ext" in g and sdpa and max(sdpa) > 0 else "-"
        line += f" {ratio:>8s}"
        if with_fa4:
            line += f" {g['flash_ext'] / g['fa4']:8.2f}" if "flash_ext" in g and g.get("fa4") else f" {'-':>8s}"
        lines.append(line)
    lines.append("TFLOP/s (median); ext/best = flash_ext / best SDPA backend" + (", ext/fa4 = flash_ext / FA4"
                 if with_fa4 else "") + "; '-' = not run or unsupported")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Markdown tables for the docs (README.md, docs/performance.md), from a results JSON

README_IMPLS = ("flash_ext", "sdpa_flash", "sdpa_cudnn", "fa4")  # those of them in the rows
README_OPS = ("fwd", "bwd")
README_SEQLENS = (2048, 8192, 16384)
IMPL_TITLES = {"flash_ext": "flash_ext", "sdpa_flash": "SDPA FA2", "sdpa_cudnn": "SDPA cuDNN",
               "sdpa_efficient": "SDPA mem-efficient", "flash_ext_deterministic": "flash_ext deterministic",
               "flash_ext_sm80": "flash_ext sm80 kernels", "fa4": "FA4", "fa4_deterministic": "FA4 deterministic"}
MARKDOWN_STYLES = ("readme", "full")


def seqlen_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def run_line(meta, rows):
    """Where the rows come from: GPU, software, date, and the commit(s) of the rows (a merged file mixes
    runs, so each impl's commit is named when they differ)."""
    commits = {}
    for r in rows:
        commits.setdefault(r.get("commit") or meta.get("commit") or "unknown", set()).add(r["impl"])
    order = {impl: i for i, impl in enumerate(IMPLS)}

    def named(commit):
        return f"`{commit}` ({', '.join(sorted(commits[commit], key=lambda i: order.get(i, 99)))})"

    # The file's header (date, torch, cuDNN) is that of its main run, at meta["commit"].
    latest = meta.get("commit") if meta.get("commit") in commits else None
    if len(commits) == 1:
        where = f"commit `{next(iter(commits))}`"
    elif latest:
        where = f"commit {named(latest)}; other runs: " + ", ".join(named(c) for c in commits if c != latest)
    else:
        where = "commits " + ", ".join(named(c) for c in commits)
    date = str(meta["date"])[:10] if meta.get("date") else "date not recorded"
    cudnn = meta.get("cudnn")
    cudnn = f", cuDNN {cudnn // 10000}.{cudnn // 100 % 100}" if isinstance(cudnn, int) else ""
    return f"{meta.get('gpu', 'unknown GPU')}, torch {meta.get('torch', '?')}{cudnn}, {date}, {where}"


def format_markdown(rows, meta, style):
    """Markdown of the rows. readme: one table, fwd and bwd TFLOP/s at seqlen 2k / 8k / 16k for flash_ext
    and those of SDPA FA2, SDPA cuDNN and FA4 in the rows, and flash_ext's ratio to each; full: one table per
    (op, case, dtype), every seqlen and impl in the rows."""
    dense = [r for r in rows if r.get("case", "dense") == "dense"]
    cells = {(r["op"], r.get("dtype", "bf16"), r["head_dim"], bool(r["causal"]), r["seqlen_q"], r["impl"]): r
             for r in dense if r["seqlen_q"] == r["seqlen_k"]}
    lines = []
    if style == "readme":
        used = [r for r in dense if r["op"] in README_OPS and r["impl"] in README_IMPLS
                and r["seqlen_q"] in README_SEQLENS and r.get("dtype", "bf16") == "bf16"]
        impls = ["flash_ext"] + [i for i in README_IMPLS[1:] if any(r["impl"] == i for r in used)]
        seqs = " / ".join(seqlen_label(s) for s in README_SEQLENS)
        lines.append(f"bf16 TFLOP/s at seqlen {seqs} ({run_line(meta, used)}):")
        lines.append("")
        head = ["op", "head dim", "causal"] + [IMPL_TITLES[i] for i in impls]
        head += [f"flash_ext / {IMPL_TITLES[i].replace('SDPA ', '')}" for i in impls[1:]]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for op in README_OPS:
            for hd in sorted({r["head_dim"] for r in used}):
                for causal in (False, True):
                    def value(impl, s):
                        r = cells.get((op, "bf16", hd, causal, s, impl))
                        return r["tflops"] if r else None

                    cols = []
                    for impl in impls:
                        vals = [value(impl, s) for s in README_SEQLENS]
                        cols.append(" / ".join("-" if v is None else f"{v:.0f}" for v in vals))
                    for peer in impls[1:]:
                        ratios = []
                        for s in README_SEQLENS:
                            mine, theirs = value("flash_ext", s), value(peer, s)
                            ratios.append(f"{mine / theirs:.2f}" if mine and theirs else "-")
                        cols.append(" / ".join(ratios))
                    lines.append(f"| {op} | {hd} | {'yes' if causal else 'no'} | " + " | ".join(cols) + " |")
        return "\n".join(lines)

    present = {r["impl"] for r in dense}
    impls = [i for i in IMPLS if i in present] + sorted(present - set(IMPLS))
    lines.append(f"TFLOP/s, median ({run_line(meta, dense)}); '-': not measured or not supported.")
    groups = sorted({(r["op"], r.get("dtype", "bf16")) for r in dense},
                    key=lambda k: (OPS.index(k[0]) if k[0] in OPS else len(OPS), k))
    for op, dtype in groups:
        lines += ["", f"**{op}** ({dtype}):", ""]
        head = ["head dim", "causal", "seqlen", "batch x heads"] + [IMPL_TITLES.get(i, i) for i in impls]
        head.append("flash_ext / best SDPA")
        if "fa4" in impls:
            head.append("flash_ext / FA4")
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        keys = sorted({(r["head_dim"], bool(r["causal"]), r["seqlen_q"]) for r in dense
                       if (r["op"], r.get("dtype", "bf16")) == (op, dtype)})
        for hd, causal, s in keys:
            row = {i: cells.get((op, dtype, hd, causal, s, i)) for i in impls}
            shape = next(r for r in row.values() if r)
            cols = ["-" if row[i] is None else f"{row[i]['tflops']:.1f}" for i in impls]
            sdpa = [row[i]["tflops"] for i in impls if i.startswith("sdpa") and row[i]]
            best = max(sdpa, default=0)
            ratio = f"{row['flash_ext']['tflops'] / best:.2f}" if row.get("flash_ext") and best > 0 else "-"
            if "fa4" in impls:
                both = row.get("flash_ext") and row.get("fa4")
                ratio += f" | {row['flash_ext']['tflops'] / row['fa4']['tflops']:.2f}" if both else " | -"
            lines.append(f"| {hd} | {'yes' if causal else 'no'} | {seqlen_label(s)} | "
                         f"{shape['batch']} x {shape['heads']} | " + " | ".join(cols) + f" | {ratio} |")
    return "\n".join(lines)


def replace_block(path, name, text):
    """Replace the text between the lines `<!-- name -->` and `<!-- /name -->` of path (a doc that shows
    a generated table) with text."""
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    with open(path) as f:
        doc = f.read()
    i, j = doc.find(start), doc.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"{path}: no {start} ... {end} block to replace")
    doc = doc[: i + len(start)] + "\n" + text.rstrip("\n") + "\n" + doc[j:]
    with open(path, "w") as f:
        f.write(doc)
    print(f"{path}: {name} table replaced")


def load_plot_module():
    spec = importlib.util.spec_from_file_location("flash_ext_bench_plot", os.path.join(HERE, "plot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finish(args, meta, rows, outputs):
    table = format_table(rows)
    if args.markdown:
        markdown_rows = outputs.rows_for_plot(rows) if outputs is not None else rows
        text = format_markdown(markdown_rows, meta, args.markdown)
        if args.update_doc:
            replace_block(args.update_doc, f"bench_attention --markdown {args.markdown}", text)
        else:
            print(text)
    else:
        print("\n" + table)
    if args.table:
        with open(args.table, "w") as f:
            f.write(f"# {meta.get('gpu')}  torch {meta.get('torch')}  cudnn {meta.get('cudnn')}  "
                    f"commit {meta.get('commit')}  {meta.get('date')}\n{table}\n")
    if outputs is not None:
        outputs.write(rows)
    for label, path in (("json", args.json), ("merged json", args.merge), ("table", args.table)):
        if path:
            print(f"{label}: {path}")
    if args.plot:
        try:
            plot_rows = outputs.rows_for_plot(rows) if outputs is not None else rows
            load_plot_module().plot_rows(plot_rows, args.plot, meta=meta)
            print(f"plot: {args.plot}")
        except Exception as e:  # a missing matplotlib must not lose the numbers
            print(f"note: plot failed: {type(e).__name__}: {e}")


def main_from_json(args):
    rows, meta = [], {}
    for path in args.from_json:
        data = load_json(path)
        meta = {k: v for k, v in data.items() if k != "rows"}
        rows = merge_rows(rows, stamp_commit(data["rows"], meta.get("commit")))
    outputs = Outputs(args, meta)
    finish(args, meta, rows, outputs)
    return 0


# ---------------------------------------------------------------------------------------------
# Measuring


def first_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}"


def is_fatal_cuda(e):
    text = str(e)
    return any(s in text for s in ("illegal memory access", "illegal instruction", "device-side assert",
                                   "unspecified launch failure", "an illegal", "launch timed out",
                                   "CUDA error: an illegal", "misaligned address", "CUBLAS_STATUS_EXECUTION_FAILED"))


def make_timer(torch, flush="write"):
    """A CUDA timer: fn's median ms, the L2 emptied before each run. flush "write" zeroes a 256 MiB buffer
    (triton's do_bench, where available: the L2 is then full of dirty lines, written back while the timed call
    runs); "read" sums it instead, so that the L2 holds clean lines and the timed call's HBM traffic is its own
    (what a memory-bound kernel's rate should be judged by)."""
    try:
        from triton.testing import do_bench
    except Exception as e:  # noqa: BLE001
        print(f"note: triton.testing unavailable ({first_line(e)}); timing with CUDA events instead")
        do_bench = None
    buffer = []

    def empty_l2():
        if not buffer:
            buffer.append(torch.zeros(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda"))
        if flush == "read":
            buffer[0].sum()
        else:
            buffer[0].zero_()

    def event_timer(fn, warmup, rep, grad_to_none):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            empty_l2()
            fn()
        end.record()
        torch.cuda.synchronize()
        estimate = max(start.elapsed_time(end) / 5, 1e-3)
        for _ in range(max(1, int(warmup / estimate))):
            fn()
        n = max(1, int(rep / estimate))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            for x in grad_to_none or ():
                x.grad = None
            empty_l2()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        return times[len(times) // 2] if n % 2 else 0.5 * (times[n // 2 - 1] + times[n // 2])

    def timer(fn, warmup, rep, grad_to_none=None):
        if do_bench is None or flush == "read":
            return event_timer(fn, warmup, rep, grad_to_none)
        try:
            return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median"))
        except TypeError as e:
            if "return_mode" not in str(e):
                raise
            return float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, quantiles=[0.5])[0])

    return timer


def make_cpu_timer():
    def timer(fn, warmup, rep, grad_to_none=None):
        fn()
        times = []
        deadline = time.perf_counter() + rep / 1e3
        while not times or (time.perf_counter() < deadline and len(times) < 1000):
            for x in grad_to_none or ():
                x.grad = None
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        return times[len(times) // 2]

    return timer


class Bench:
    def __init__(self, args, torch):
        self.args, self.torch = args, torch
        self.F = torch.nn.functional
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self.sdpa_kernel = sdpa_kernel
        self.backends = {impl: getattr(SDPBackend, name) for impl, name in SDPA_BACKEND_NAMES.items()}
        self.math_backend = SDPBackend.MATH
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        self.device = args.device
        self.timer = make_timer(torch) if self.device == "cuda" else make_cpu_timer()
        self.flash_ext = None
        self.fa4 = None
        self.skips = {}  # reason -> list of labels
        self.disabled = {}  # (impl, op, head_dim, causal) -> reason (from the smoke check)
        self.correctness_failures = []

    # -- helpers ------------------------------------------------------------------------------
    def skip(self, impl, op, label, reason):
        """Record an (impl, op, shape) not measured; print the reason the first time it appears for impl."""
        if not any(k[0] == impl and k[2] == reason for k in self.skips):
            print(f"  note: {impl} {op} not measured ({label}): {reason}")
        self.skips.setdefault((impl, op, reason), []).append(label)

    def import_flash_ext(self):
        if REPO not in sys.path:
            sys.path.insert(0, REPO)
        try:
            import flash_ext

            self.flash_ext = flash_ext
            print(f"flash_ext: {flash_ext.__file__}; {flash_ext.info()}")
        except Exception as e:  # noqa: BLE001
            print(f"note: cannot import flash_ext ({first_line(e)}); timing SDPA only")
            self.args.impls = [i for i in self.args.impls if not i.startswith("flash_ext")]

    def import_fa4(self):
        try:
            import flash_attn.cute as fa4

            self.fa4 = fa4
            print(f"fa4: {fa4.__file__} (flash-attn-4 {dist_version_or_none('flash-attn-4')})")
        except Exception as e:  # noqa: BLE001
            print(f"note: cannot import flash_attn.cute (FlashAttention-4: {first_line(e)}); not timing fa4")
            self.args.impls = [i for i in self.args.impls if not i.startswith("fa4")]

    def attn_fn(self, impl, causal):
        """f(q, k, v) -> out, in the impl's own layout (flash_ext, FA4: b s h d; SDPA: b h s d)."""
        if impl.startswith("fa4"):
            fa4_attention = self.fa4.flash_attn_func
            deterministic = impl == "fa4_deterministic"
            return lambda q, k, v: fa4_attention(q, k, v, causal=causal, deterministic=deterministic)[0]
        if impl.startswith("flash_ext"):
            attention = self.flash_ext.attention
            deterministic = impl == "flash_ext_deterministic"
            return lambda q, k, v: attention(q, k, v, causal=causal, deterministic=deterministic)
        F = self.F
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def backend_ctx(self, impl):
        if impl == "flash_ext_sm80":
            # Switches the extension's dispatch for the block (the C++ side reads no environment per call).
            return self.flash_ext.testing.sm90_kernels(False)
        if impl.startswith(("flash_ext", "fa4")):
            return contextlib.nullcontext()
        return self.sdpa_kernel([self.backends[impl]])

    # -- correctness ----------------------------------------------------------------------------
    def smoke(self, head_dim, causal):
        """Small shape: flash_ext vs default SDPA (bf16) and an fp32 math reference, fwd and bwd.
        Fills self.disabled for what must not be timed."""
        torch = self.torch
        b, s, h = 2, 1024, self.args.hidden // head_dim
        label = f"smoke hd{head_dim} causal={causal} b{b} s{s} h{h}"
        q, k, v = (torch.randn(b, s, h, head_dim, device=self.device, dtype=self.dtype) for _ in range(3))
        dout = torch.randn(b, s, h, head_dim, device=self.device, dtype=self.dtype)

        def grads(fn, tensors, layout_sdpa, dtype):
            ins = [t.detach().to(dtype) for t in tensors]
            if layout_sdpa:
                ins = [t.transpose(1, 2).contiguous() for t in ins]
            ins = [t.requires_grad_() for t in ins]
            out = fn(*ins)
            d = dout.to(dtype)
            if layout_sdpa:
                d = d.transpose(1, 2)
            g = torch.autograd.grad(out, ins, d)
            if layout_sdpa:
                out, g = out.transpose(1, 2), [x.transpose(1, 2) for x in g]
            return out.float(), [x.float() for x in g]

        sdpa = self.attn_fn("sdpa_default", causal)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with self.sdpa_kernel([self.math_backend]):
                ref_out, ref_g = grads(sdpa, (q, k, v), True, torch.float32)
            pt_out, pt_g = grads(sdpa, (q, k, v), True, self.dtype)

        def maxdiff(a, b):
            d = (a - b).abs().max().item()
            return d if math.isfinite(d) else float("inf")

        ext = self.attn_fn("flash_ext", causal)
        try:
            with torch.no_grad():
                out = ext(q, k, v).float()
            self.sync()
        except Exception as e:  # noqa: BLE001
            if is_fatal_cuda(e):
                raise FatalCudaError(first_line(e)) from e
            reason = f"forward raised {first_line(e)}"
            print(f"  {label}: {reason}")
            for op in OPS:
                self.disabled[("flash_ext", op, head_dim, causal)] = reason
            return
        d_pt, d_ref, d_pt_ref = maxdiff(out, pt_out), maxdiff(out, ref_out), maxdiff(pt_out, ref_out)
        ok = d_pt <= FWD_TOL
        print(f"  {label}: fwd max|ext-sdpa| {d_pt:.2e}  max|ext-fp32| {d_ref:.2e}  (sdpa-fp32 {d_pt_ref:.2e})"
              f"  {'ok' if ok else 'FAILED'}")
        if not ok:
            reason = f"correctness smoke failed: fwd max|ext-sdpa| {d_pt:.3g} > {FWD_TOL}"
            self.correctness_failures.append(f"{label}: {reason}")
            for op in OPS:
                self.disabled[("flash_ext", op, head_dim, causal)] = reason
            return
        if not {"bwd", "fwd_bwd"} & set(self.args.ops):
            return
        try:
            _, g = grads(ext, (q, k, v), False, self.dtype)
            self.sync()
        except Exception as e:  # noqa: BLE001
            if is_fatal_cuda(e):
                raise FatalCudaError(first_line(e)) from e
            reason = f"backward raised {first_line(e)}"
            print(f"  {label}: {reason}")
            for op in ("bwd", "fwd_bwd"):
                self.disabled[("flash_ext", op, head_dim, causal)] = reason
            return
        bad = []
        parts = []
        for name, mine, pt, ref in zip(("dq", "dk", "dv"), g, pt_g, ref_g):
            err, pt_err = maxdiff(mine, ref), maxdiff(pt, ref)
            tol = 2 * pt_err + 0.01
            parts.append(f"{name} {err:.2e} (sdpa {pt_err:.2e})")
            if not err <= tol:
                bad.append(f"{name} max|ext-fp32| {err:.3g} > 2*sdpa's+0.01 = {tol:.3g}")
        print(f"  {label}: bwd max|grad-fp32|: {', '.join(parts)}  {'ok' if not bad else 'FAILED'}")
        if bad:
            reason = "correctness smoke failed: " + "; ".join(bad)
            self.correctness_failures.append(f"{label}: {reason}")
            for op in ("bwd", "fwd_bwd"):
                self.disabled[("flash_ext", op, head_dim, causal)] = reason

    # -- one shape -------------------------------------------------------------------------------
    def run_shape(self, head_dim, causal, seqlen, batch, heads, rows):
        torch, args = self.torch, self.args
        label = f"hd{head_dim} causal={causal} s{seqlen} b{batch} h{heads}"
        # flash_ext layout (b, s, h, d); SDPA gets its own contiguous (b, h, s, d) copies, made here once.
        q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device=self.device, dtype=self.dtype).requires_grad_()
                   for _ in range(3))
        dout = torch.randn(batch, seqlen, heads, head_dim, device=self.device, dtype=self.dtype)
        sdpa_inputs = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
        sdpa_dout = dout.transpose(1, 2).contiguous()
        new_rows = []

        check_ref = None
        if "flash_ext" in args.impls and args.correctness_smoke:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check_ref = self.attn_fn("sdpa_default", causal)(*sdpa_inputs).transpose(1, 2)

        for impl in args.impls:
            is_ext = impl.startswith("flash_ext")
            fn = self.attn_fn(impl, causal)
            ins, d = ((q, k, v), dout) if is_ext or impl.startswith("fa4") else (sdpa_inputs, sdpa_dout)
            if is_ext and check_ref is not None and ("flash_ext", "fwd", head_dim, causal) not in self.disabled:
                try:
                    with torch.no_grad():
                        diff = (fn(*ins) - check_ref).abs().max().item()
                except Exception as e:  # noqa: BLE001
                    if is_fatal_cuda(e):
                        raise FatalCudaError(f"{impl} fwd {label}: {first_line(e)}") from e
                    for op in args.ops:
                        self.skip(impl, op, label, first_line(e))
                    continue
                if not diff <= FWD_TOL:  # also catches NaN
                    print(f"  {label}: flash_ext output differs from SDPA's by {diff:.3g} > {FWD_TOL}: not timed")
                    self.correctness_failures.append(f"{label}: output max |ext-sdpa| {diff:.3g} > {FWD_TOL}")
                    for op in args.ops:
                        self.skip(impl, op, label, f"output check failed (max |ext-sdpa| {diff:.3g} > {FWD_TOL})")
                    continue
            failed = None  # a forward that raised makes every op of this impl raise: note once, run none
            for op in args.ops:
                reason = self.disabled.get((impl, op, head_dim, causal)) or failed
                if reason:
                    self.skip(impl, op, label, reason)
                    continue
                try:
                    ms = self.time_op(op, fn, ins, d, impl)
                except Exception as e:  # noqa: BLE001
                    if is_fatal_cuda(e):
                        raise FatalCudaError(f"{impl} {op} {label}: {first_line(e)}") from e
                    reason = first_line(e)
                    self.skip(impl, op, label, reason)
                    if op == "fwd":
                        failed = reason
                    elif isinstance(e, NotImplementedError):
                        # A backward that does not exist stays missing for every seqlen of this config.
                        for op2 in ("bwd", "fwd_bwd"):
                            self.disabled.setdefault((impl, op2, head_dim, causal), reason)
                        failed = reason
                    continue
                new_rows.append(make_row(op, impl, args.dtype, head_dim, causal, batch, heads, seqlen, seqlen, ms))
        del q, k, v, dout, sdpa_inputs, sdpa_dout, check_ref
        rows.extend(new_rows)
        self.print_shape(label, new_rows)

    def time_op(self, op, fn, ins, dout, impl):
        torch, args = self.torch, self.args
        warm, rep = args.warmup_ms, args.rep_ms
        with self.backend_ctx(impl), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if op == "fwd":
                with torch.no_grad():
                    ms = self.timer(lambda: fn(*ins), warm, rep)
            elif op == "bwd":
                out = fn(*ins)
                ms = self.timer(lambda: out.backward(dout, retain_graph=True), warm, rep, grad_to_none=list(ins))
                del out
            else:
                ms = self.timer(lambda: fn(*ins).backward(dout), warm, rep, grad_to_none=list(ins))
            for t in ins:
                t.grad = None
        return ms

    def print_shape(self, label, rows):
        parts = [f"{r['op']}:{r['impl']} {r['tflops']:.0f}" for r in rows]
        print(f"{label}: " + ("  ".join(parts) if parts else "nothing measured"), flush=True)

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def free(self):
        gc.collect()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


def main(argv=None):
    args = resolve_args(build_parser().parse_args(argv))
    if args.from_json:
        return main_from_json(args)
    shapes = plan_shapes(args)
    if args.list:
        for d, c, s, b, h in shapes:
            print(f"hd{d} causal={c} seqlen={s} batch={b} heads={h}")
        print(f"{len(shapes)} shapes x ops {','.join(args.ops)} x impls {','.join(args.impls)}")
        return 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch; this benchmark needs a GPU (use --list or --from-json here)")
        return 2
    if args.dtype != "bf16":
        print(f"note: dtype {args.dtype}")
    meta = run_metadata(torch, args.device)
    print(f"gpu {meta['gpu']}  torch {meta['torch']}  cuda {torch.version.cuda}  cudnn {meta['cudnn']}  "
          f"commit {meta['commit']}")
    print(f"{len(shapes)} shapes; ops {','.join(args.ops)}; impls {','.join(args.impls)}; "
          f"warmup {args.warmup_ms} ms, rep {args.rep_ms} ms, median")
    outputs = Outputs(args, meta)
    bench = Bench(args, torch)
    if any(i.startswith("flash_ext") for i in args.impls):
        bench.import_flash_ext()
    if any(i.startswith("fa4") for i in args.impls):
        bench.import_fa4()

    rows = []
    start = time.time()
    status = 0
    try:
        if "flash_ext" in args.impls and args.correctness_smoke:
            print("correctness smoke (flash_ext vs SDPA bf16 and fp32 math):")
            for d in args.head_dims:
                for c in args.causals:
                    try:
                        bench.smoke(d, c)
                    except FatalCudaError:
                        raise
                    except Exception as e:  # noqa: BLE001
                        if is_fatal_cuda(e):
                            raise FatalCudaError(first_line(e)) from e
                        print(f"  smoke hd{d} causal={c}: could not run ({first_line(e)}); flash_ext timed unchecked")
                    bench.free()
        for i, (d, c, s, b, h) in enumerate(shapes):
            if args.time_budget_s is not None and time.time() - start > args.time_budget_s:
                print(f"time budget of {args.time_budget_s:.0f} s reached: {len(shapes) - i} shapes not run")
                status = 4
                break
            bench.run_shape(d, c, s, b, h, rows)
            bench.free()
            outputs.write(rows)
    except FatalCudaError as e:
        print(f"FATAL: sticky CUDA error, stopping the benchmark: {e}")
        status = 3
    except KeyboardInterrupt:
        print("interrupted")
        status = 130
    print(f"\nbenchmark time {time.time() - start:.0f} s")
    if bench.skips:
        print("not measured:")
        for (impl, op, reason), labels in sorted(bench.skips.items()):
            print(f"  {impl} {op}: {len(labels)} shape(s): {reason}")
    if bench.correctness_failures:
        print(f"CORRECTNESS FAILURES ({len(bench.correctness_failures)}); flash_ext was not timed there:")
        for line in bench.correctness_failures:
            print(f"  {line}")
        status = status or 5
    finish(args, meta, rows, outputs)
    return status


if __name__ == "__main__":
    sys.exit(main())

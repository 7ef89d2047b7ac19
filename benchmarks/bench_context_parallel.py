"""Context parallelism benchmark: flash_ext.distributed.context_parallel_attention over W GPUs of one host
(NCCL), beside single-GPU flash_ext.attention on one rank's share, in one run.

    python benchmarks/bench_context_parallel.py                         # 2 GPUs, total seqlen 32k..256k
    python benchmarks/bench_context_parallel.py --json benchmarks/results/h200x2_context_parallel.json
    python benchmarks/bench_context_parallel.py --device cpu --seqlens 256 --heads 2 --head-dim 16
                                                                        # gloo dry run; numbers mean nothing

Shapes: batch 1, causal, zigzag layout, bf16, hidden 2048 (heads = 2048 / head_dim, MHA), total sequence S
split over W ranks (S / W rows each). Each rank times forward and forward + backward with CUDA events
(median of --reps after --warmup, a barrier before each); a step's time is the slowest rank's. Per-GPU
TFLOP/s = FLOPs of causal attention over S (fwd 4*S*S*h*d / 2, bwd 2.5x) / W / time. The single-GPU row is
flash_ext.attention (causal) on S / W rows on rank 0 while the others wait: issue 38's target is per-GPU
TFLOP/s >= 90% of it at S = 128k (S / W = 64k on two GPUs). The ring's transfers are timed on their own
too: K and V of one rank's block (2 * S / W * h * d * 2 bytes) sent to the next rank while receiving from
the previous one, as the ring does, reported in GB/s per direction.

Exit status: 0 ok; 2 fewer devices than --world.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def parse_seqlens(text):
    values = []
    for part in text.split(","):
        part = part.strip().lower()
        values.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
    return values


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--world", type=int, default=2, help="ranks (GPUs) in the ring (default 2)")
    p.add_argument("--seqlens", type=parse_seqlens, default=parse_seqlens("32k,64k,128k,256k"),
                   help="total sequence lengths, comma list, 'k' = 1024 (default 32k,64k,128k,256k)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=None, help="default 2048 / head_dim")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a gloo dry run of every code path (use tiny sizes); its numbers mean nothing")
    p.add_argument("--json", metavar="PATH", help="write the rows and the run's metadata here")
    return p


def git_commit():
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def causal_flops(seqlen, heads, head_dim, op):
    fwd = 4.0 * seqlen * seqlen * heads * head_dim / 2
    return fwd * {"fwd": 1.0, "fwd_bwd": 3.5}[op]


class Timer:
    """Times fn on every rank of the group: the median over reps of the slowest rank's time, in ms."""

    def __init__(self, torch, dist, device):
        self.torch, self.dist, self.device = torch, dist, device

    def __call__(self, fn, warmup, reps, ranks_run=True):
        torch, dist = self.torch, self.dist
        times = []
        for i in range(warmup + reps):
            dist.barrier()
            if self.device == "cuda":
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                if ranks_run:
                    fn()
                end.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(end)
            else:
                import time

                t0 = time.perf_counter()
                if ranks_run:
                    fn()
                ms = (time.perf_counter() - t0) * 1e3
            slowest = torch.tensor([ms], dtype=torch.float64, device=self.device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times.append(slowest.item())
        return statistics.median(times)


def worker(rank, args, init_file, result_file):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, REPO)
    import flash_ext
    from flash_ext.distributed import context_parallel_attention

    world = args.world
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                device_id=device)
        dtype = torch.bfloat16
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        dtype = torch.float32
    timer = Timer(torch, dist, args.device)
    heads = args.heads or 2048 // args.head_dim
    rows = []
    try:
        for seqlen in args.seqlens:
            local = seqlen // world
            shape = (1, local, heads, args.head_dim)
            q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
            dout = torch.randn(shape, device=device, dtype=dtype)

            def forward():
                with torch.no_grad():
                    context_parallel_attention(q, k, v, causal=True, layout=args.layout)

            def forward_backward():
                out = context_parallel_attention(q, k, v, causal=True, layout=args.layout)
                torch.autograd.grad(out, (q, k, v), dout)

            def single(op):
                def run():
                    if op == "fwd":
                        with torch.no_grad():
                            flash_ext.attention(q, k, v, causal=True)
                    else:
                        out = flash_ext.attention(q, k, v, causal=True)
                        torch.autograd.grad(out, (q, k, v), dout)
                return run

            # The ring's K/V transfer of one step, alone: send this rank's block, receive the previous one's.
            def transfer():
                received = [torch.empty_like(k), torch.empty_like(v)]
                nxt, prv = (rank + 1) % world, (rank - 1) % world
                ops = [dist.P2POp(dist.isend, t, nxt) for t in (k.detach(), v.detach())]
                ops += [dist.P2POp(dist.irecv, t, prv) for t in received]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()

            transfer_ms = timer(transfer, args.warmup, args.reps) if world > 1 else float("nan")
            block_bytes = 2 * k.numel() * k.element_size()
            for op, fn in (("fwd", forward), ("fwd_bwd", forward_backward)):
                ms = timer(fn, args.warmup, args.reps)
                single_ms = timer(single(op), args.warmup, args.reps, ranks_run=rank == 0)
                per_gpu = causal_flops(seqlen, heads, args.head_dim, op) / world / (ms * 1e-3) / 1e12
                single_tflops = causal_flops(local, heads, args.head_dim, op) / (single_ms * 1e-3) / 1e12
                rows.append({
                    "op": op, "seqlen": seqlen, "per_gpu_seqlen": local, "world": world, "heads": heads,
                    "head_dim": args.head_dim, "layout": args.layout, "ms": round(ms, 4),
                    "tflops_per_gpu": round(per_gpu, 2), "single_gpu_ms": round(single_ms, 4),
                    "single_gpu_tflops": round(single_tflops, 2),
                    "ratio": round(per_gpu / single_tflops, 3) if single_tflops > 0 else None,
                    "kv_block_bytes": block_bytes, "kv_transfer_ms": round(transfer_ms, 4),
                    "kv_transfer_gbps": round(block_bytes / (transfer_ms * 1e-3) / 1e9, 1) if world > 1 else None,
                })
            del q, k, v, dout
        if rank == 0:
            with open(result_file, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def format_table(rows):
    head = (f"{'op':8s} {'seqlen':>7s} {'per GPU':>7s} {'ms':>9s} {'TFLOP/s/GPU':>11s} {'1-GPU':>7s} {'ratio':>6s} "
            f"{'K/V step ms':>11s} {'GB/s':>6s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        gbps = f"{r['kv_transfer_gbps']:.0f}" if r["kv_transfer_gbps"] is not None else "-"
        lines.append(f"{r['op']:8s} {r['seqlen']:7d} {r['per_gpu_seqlen']:7d} {r['ms']:9.3f} "
                     f"{r['tflops_per_gpu']:11.1f} {r['single_gpu_tflops']:7.1f} {r['ratio']:6.2f} "
                     f"{r['kv_transfer_ms']:11.3f} {gbps:>6s}")
    lines.append("ratio = per-GPU TFLOP/s of the ring / single-GPU flash_ext.attention on S / W rows; "
                 "K/V step = one ring step's K and V transfer alone")
    return "\n".join(lines)


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"needs {args.world} CUDA devices; this machine has {torch.cuda.device_count()}")
        return 2
    if any(s % (2 * args.world) for s in args.seqlens):
        raise SystemExit(f"--seqlens: each must be a multiple of 2 x world = {2 * args.world} (the zigzag chunks)")
    with tempfile.TemporaryDirectory() as tmp:
        result_file = os.path.join(tmp, "rows.json")
        mp.spawn(worker, args=(args, os.path.join(tmp, "store"), result_file), nprocs=args.world, join=True)
        with open(result_file) as f:
            rows = json.load(f)
    print(format_table(rows))
    if args.json:
        meta = {
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "none",
            "gpus": args.world, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "dtype": "bf16" if args.device == "cuda" else "fp32", "causal": True,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

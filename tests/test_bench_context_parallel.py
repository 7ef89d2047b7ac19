"""benchmarks/bench_context_parallel.py's gloo dry run (no GPU): every code path of the two-GPU benchmark,
on two CPU processes with tiny shapes, and the JSON it writes. Run as a script (its workers are spawned
processes that import it by path)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_writes_rows(tmp_path):
    path = tmp_path / "cp.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_context_parallel.py"), "--device",
                             "cpu", "--seqlens", "64", "--heads", "2", "--head-dim", "16", "--warmup", "0", "--reps",
                             "1", "--json", str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "per-GPU TFLOP/s of the ring" in result.stdout
    data = json.loads(path.read_text())
    assert data["gpus"] == 2 and data["causal"] is True
    assert [(r["op"], r["seqlen"], r["per_gpu_seqlen"]) for r in data["rows"]] == [("fwd", 64, 32), ("fwd_bwd", 64, 32)]
    assert all(r["ms"] > 0 and r["single_gpu_ms"] > 0 and r["kv_block_bytes"] == 2 * 32 * 2 * 16 * 4
               for r in data["rows"])

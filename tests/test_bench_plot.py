"""benchmarks/plot.py --summary: one figure per head dim from the committed results JSONs, the rows of the
latest run only, flash_ext's ratios as the JSON's numbers give them, FA4 where a decode JSON measured it, and
clear errors for inputs it cannot plot. Needs matplotlib (skipped without it)."""
import copy
import importlib.util
import json
import os

import pytest

pytest.importorskip("matplotlib")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


@pytest.fixture(scope="module")
def plot():
    spec = importlib.util.spec_from_file_location("flash_ext_bench_plot", os.path.join(ROOT, "benchmarks", "plot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def training_row(commit, impl, seqlen, tflops, head_dim=128, op="fwd", causal=False):
    return dict(op=op, impl=impl, case="dense", dtype="bf16", head_dim=head_dim, causal=causal, batch=16384 // seqlen,
                heads=16, seqlen_q=seqlen, seqlen_k=seqlen, ms=1.0, tflops=tflops, commit=commit)


def test_summary_of_the_committed_results(plot, tmp_path):
    training, decode = load("h200.json"), load("h200_decode.json")
    figures = plot.plot_summary(training, str(tmp_path / "hd{head_dim}.png"), decode=decode)
    head_dims = sorted({r["head_dim"] for r in training["rows"]})
    assert [f["head_dim"] for f in figures] == head_dims
    for fig in figures:
        assert os.path.getsize(fig["path"]) > 10_000
        assert "flash_ext" in fig["labels"] and "PyTorch SDPA, FlashAttention-2 backend" in fig["labels"]
        titles = list(fig["panels"])
        assert titles[:4] == ["forward, non-causal", "forward, causal", "backward, non-causal", "backward, causal"]
        decode_panels = [t for t in titles if t.startswith("decode")]
        if fig["head_dim"] == decode["head_dim"]:
            assert decode_panels == [f"decode, batch {b}" for b in sorted({r["batch"] for r in decode["rows"]})]
        else:
            assert decode_panels == []

    # The forward non-causal note of the decode head dim, against the latest run's rows themselves.
    fig = next(f for f in figures if f["head_dim"] == decode["head_dim"])
    rate = {(r["impl"], r["seqlen_q"]): r["tflops"] for r in training["rows"]
            if r["op"] == "fwd" and not r["causal"] and r["head_dim"] == decode["head_dim"]
            and r["commit"] == training["commit"]}
    ratios = [rate["flash_ext", s] / rate["sdpa_flash", s] for s in {s for _, s in rate}]
    assert f"flash_ext / FA2: {min(ratios):.2f}–{max(ratios):.2f}×" in fig["panels"]["forward, non-causal"]


def test_only_the_latest_run(plot, tmp_path):
    """Rows an older run left in a merged file are not drawn beside the newer ones."""
    training = dict(gpu="GPU X", commit="new", rows=[
        training_row("new", "flash_ext", 2048, 300.0), training_row("new", "sdpa_flash", 2048, 200.0),
        training_row("old", "flash_ext", 1024, 100.0), training_row("old", "sdpa_flash", 1024, 900.0),
    ])
    assert {r["commit"] for r in plot.latest_run_rows(training)} == {"new"}
    (fig,) = plot.plot_summary(training, str(tmp_path / "x.png"))
    assert fig["panels"]["forward, non-causal"] == "flash_ext / FA2: 1.50×"
    assert fig["panels"]["backward, causal"] == ""  # not measured: no note


def test_fa4_where_the_decode_json_measured_it(plot, tmp_path):
    training = load("h200.json")
    decode = copy.deepcopy(load("h200_decode.json"))
    decode["fa4"] = "4.0.0b0"
    extra = [dict(r, impl="fa4", kv_tb_per_s=r["kv_tb_per_s"] / 2) for r in decode["rows"]
             if r["impl"] == "flash_ext" and r.get("page_size", 0) == 0 and r["mode"] == "graph"]
    decode["rows"] += extra
    figures = plot.plot_summary(training, str(tmp_path / "hd{head_dim}.png"), decode=decode)
    fig = next(f for f in figures if f["head_dim"] == decode["head_dim"])
    assert "FlashAttention-4" in fig["labels"]
    assert "flash_ext / FA4: 2.00×" in fig["panels"]["decode, batch 1"]


def test_summary_errors(plot, tmp_path, capsys):
    training = load("h200.json")
    with pytest.raises(ValueError, match=r"must contain \{head_dim\}"):
        plot.plot_summary(training, str(tmp_path / "one.png"))
    with pytest.raises(ValueError, match="no dense bf16 fwd/bwd rows"):
        plot.plot_summary(training, str(tmp_path / "hd{head_dim}.png"), impls=["no_such_impl"])
    decode_json = os.path.join(RESULTS, "h200_decode.json")
    with pytest.raises(SystemExit):
        plot.main(["--summary", decode_json])
    assert "needs a bench_attention.py JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot.main([os.path.join(RESULTS, "h200.json"), decode_json])
    assert "one JSON at a time" in capsys.readouterr().err


def test_summary_command_line(plot, tmp_path, capsys):
    template = str(tmp_path / "h200_hd{head_dim}.png")
    plot.main(["--summary", os.path.join(RESULTS, "h200.json"), os.path.join(RESULTS, "h200_decode.json"),
               "-o", template, "--impls", "flash_ext,sdpa_cudnn"])
    out = capsys.readouterr().out
    for head_dim in sorted({r["head_dim"] for r in load("h200.json")["rows"]}):
        assert os.path.exists(template.replace("{head_dim}", str(head_dim)))
        assert f"head dim {head_dim}" in out

"""examples/train_gpt.py: it trains (the loss falls from ln(vocab)), its flash_ext and SDPA paths compute the
same model, its outputs (loss curve, CSV without matplotlib, sample) are written, and bad options are refused.
The CPU runs use a tiny model; the CUDA tests (marked `cuda`) run the GPU preset for a few steps."""
import importlib.util
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
TINY = ["--device", "cpu", "--batch-size", "8", "--seq-len", "32", "--dim", "32", "--layers", "1", "--heads", "2",
        "--kv-heads", "1", "--quiet"]


@pytest.fixture(scope="module")
def train_gpt():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_loss_falls_on_cpu(train_gpt, tmp_path):
    result = train_gpt.main(TINY + ["--steps", "30", "--lr", "1e-2", "--sample-chars", "40",
                                    "--plot", str(tmp_path / "loss.png")])
    losses = result["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses), losses
    # From about ln(59) = 4.08 (a uniform guess) the first steps learn the character frequencies.
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"the training loss fell from {first:.3f} to {last:.3f} only"
    assert [step for step, _ in result["val"]] == [3 * i for i in range(1, 11)]
    assert result["val"][-1][1] < math.log(59) - 0.5, result["val"]
    assert len(result["sample"]) == 40
    assert os.path.exists(result["output"]) and result["output"].startswith(str(tmp_path))


def test_flash_ext_and_sdpa_train_alike(train_gpt, tmp_path):
    """Same seed, float32: the two attention paths (layouts (b, s, h, d) and (b, h, s, d), GQA through k/v heads
    read in place and through repeated k/v) give the same losses to rounding."""
    runs = {}
    for attention in ("flash_ext", "sdpa"):
        runs[attention] = train_gpt.main(TINY + ["--steps", "4", "--attention", attention, "--sample-chars", "0",
                                                 "--plot", str(tmp_path / f"{attention}.png")])
    ext, sdpa = runs["flash_ext"], runs["sdpa"]
    assert ext["losses"] == pytest.approx(sdpa["losses"], rel=1e-4, abs=1e-5)
    assert [v for _, v in ext["val"]] == pytest.approx([v for _, v in sdpa["val"]], rel=1e-4, abs=1e-5)


def test_losses_as_csv_without_matplotlib(train_gpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    result = train_gpt.main(TINY + ["--steps", "4", "--eval-every", "2", "--sample-chars", "0",
                                    "--plot", str(tmp_path / "loss.png")])
    assert result["output"] == str(tmp_path / "loss.csv")
    assert not (tmp_path / "loss.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().out
    lines = (tmp_path / "loss.csv").read_text().splitlines()
    assert lines[0] == "step,train_loss,val_loss"
    rows = [line.split(",") for line in lines[1:]]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert [float(r[1]) for r in rows] == pytest.approx(result["losses"], abs=1e-6)
    assert [r[2] != "" for r in rows] == [False, True, False, True]


def test_progress_lines_without_tqdm(train_gpt, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` now raises ImportError
    argv = [a for a in TINY if a != "--quiet"] + ["--steps", "40", "--sample-chars", "0",
                                                  "--plot", str(tmp_path / "loss.png")]
    train_gpt.main(argv)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == [f"{2 * i}/40" for i in range(1, 21)]
    assert all("loss " in line and "tok/s " in line for line in lines), lines


@pytest.mark.parametrize("argv, message", [
    (["--heads", "4", "--kv-heads", "3"], "--heads (4) must be a multiple of --kv-heads (3)"),
    (["--dim", "30", "--heads", "4"], "--dim (30) must be a multiple of --heads (4)"),
    (["--steps", "0"], "--steps must be at least 1"),
    (["--dropout", "1.0"], "--dropout must be in [0, 1)"),
    (["--device", "cuda", "--dtype", "float32"], "flash_ext's CUDA kernels take float16 or bfloat16"),
])
def test_bad_options_are_refused(train_gpt, argv, message, capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_args(argv)
    assert message in capsys.readouterr().err


def test_short_text_is_refused(train_gpt, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("abc" * 20)
    with pytest.raises(ValueError, match="fewer than --seq-len"):
        train_gpt.main(TINY + ["--steps", "1", "--text", str(text)])


def test_command_line(tmp_path):
    """The script as a user runs it (its own process, progress output on)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    argv = [a for a in TINY if a != "--quiet"] + ["--steps", "2", "--sample-chars", "10",
                                                  "--plot", str(tmp_path / "loss.png")]
    proc = subprocess.run([sys.executable, SCRIPT, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "final loss: training" in proc.stdout and "attention: flash_ext: cpu" in proc.stdout, proc.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("extra", [[], ["--compile"], ["--dtype", "float16"], ["--attention", "sdpa"]],
                         ids=["bf16", "compile", "fp16", "sdpa"])
def test_trains_on_cuda(train_gpt, tmp_path, extra):
    result = train_gpt.main(["--device", "cuda", "--steps", "60", "--quiet", "--sample-chars", "20",
                             "--plot", str(tmp_path / "loss.png"), *extra])
    losses = result["losses"]
    assert all(math.isfinite(x) for x in losses), losses
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"the training loss fell from {first:.3f} to {last:.3f} only"

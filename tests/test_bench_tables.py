"""benchmarks/bench_attention.py's tables from rows (no GPU): the ratio columns, FA4's included."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("flash_ext_bench_attention",
                                                  os.path.join(ROOT, "benchmarks", "bench_attention.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(bench, times_ms):
    return [bench.make_row("bwd", impl, "bf16", 128, False, 2, 16, 8192, 8192, ms) for impl, ms in times_ms.items()]


def test_text_table_ratios(bench):
    table = bench.format_table(rows(bench, {"flash_ext": 10.0, "sdpa_flash": 20.0, "sdpa_cudnn": 12.5, "fa4": 8.0}))
    header, _, line = table.splitlines()[:3]
    assert header.split()[-2:] == ["ext/best", "ext/fa4"]
    assert line.split()[-2:] == ["1.25", "0.80"]  # 12.5 / 10 and 8 / 10 (TFLOP/s go as 1 / ms)
    assert "ext/fa4 = flash_ext / FA4" in table


def test_text_table_without_fa4(bench):
    table = bench.format_table(rows(bench, {"flash_ext": 10.0, "sdpa_cudnn": 12.5}))
    assert "ext/fa4" not in table
    assert table.splitlines()[2].split()[-1] == "1.25"


def test_markdown_full_names_fa4(bench):
    text = bench.format_markdown(rows(bench, {"flash_ext": 10.0, "sdpa_cudnn": 12.5, "fa4": 8.0}),
                                 {"gpu": "H200", "torch": "2.11", "commit": "abc"}, "full")
    header = next(line for line in text.splitlines() if line.startswith("| head dim"))
    assert header.rstrip(" |").split(" | ")[-3:] == ["FA4", "flash_ext / best SDPA", "flash_ext / FA4"]
    row = next(line for line in text.splitlines() if line.startswith("| 128 |"))
    assert row.rstrip(" |").split(" | ")[-2:] == ["1.25", "0.80"]

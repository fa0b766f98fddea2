"""`fastft bench kernels`: byte counts, table formatting, the CLI surface, and the refusal without a GPU."""

from __future__ import annotations

import math

import pytest
import torch

from fastft.bench import BENCHMARKS
from fastft.bench import kernel_costs as costs
from fastft.bench import kernel_tables as tables
from fastft.bench import kernel_timing as timing
from fastft.bench import kernels as bench


def test_byte_counts_are_the_minimal_reads_and_writes_of_each_op():
    # RMSNorm 16384 x 4096 bf16: forward x + y + w, backward x + dy + dx + w + dw.
    act = 16384 * 4096 * 2
    assert costs.rms_norm_bytes(16384, 4096) == {"forward": 2 * act + 8192, "backward": 3 * act + 2 * 8192}
    assert costs.rms_norm_bytes(3, 5, element_size=4) == {"forward": 2 * 60 + 20, "backward": 3 * 60 + 40}
    # RoPE: q [1, 32, 16384, 128] + k [1, 8, 16384, 128] read and written, cos and sin [1, 16384, 128] read.
    qk = 40 * 16384 * 128 * 2
    rope = costs.rope_bytes(1, 32, 8, 16384, 128)
    assert rope["forward"] == rope["backward"] == 2 * qk + 2 * 16384 * 128 * 2 == 343_932_928
    assert costs.rope_bytes(2, 3, 1, 5, 4, element_size=4, cos_batch=2)["forward"] == 2 * (
        2 * 4 * 5 * 4 * 4
    ) + 2 * (2 * 5 * 4 * 4)
    # SwiGLU [16384, 14336]: 3 tensors forward, 5 backward.
    one = 16384 * 14336 * 2
    assert costs.swiglu_bytes(16384, 14336) == {"forward": 3 * one, "backward": 5 * one}
    # Copy: read and write.
    assert costs.copy_bytes(2**30) == 2**31


def test_nf4_byte_count_covers_packing_absmax_and_output():
    n = 4096 * 14336
    blocks = n // 64
    nested = costs.nf4_bytes(n)["forward"]
    assert nested == n // 2 + blocks + 4 * math.ceil(blocks / 256) + 4 + 2 * n
    assert costs.nf4_bytes(n, nested=False)["forward"] == n // 2 + 4 * blocks + 2 * n
    # An odd count rounds the packed bytes and the blocks up: 129 values, blocksize 64 -> 65 bytes, 3 blocks.
    assert costs.nf4_bytes(129, 64, nested=False, out_element_size=4)["forward"] == 65 + 12 + 4 * 129


def test_flops_count_the_matmuls_of_forward_and_backward():
    assert costs.flce_flops(16384, 128256, 4096, weight_trains=False) == 2 * 2 * 16384 * 128256 * 4096
    assert costs.flce_flops(2, 3, 5, weight_trains=True) == 3 * 2 * 30
    assert costs.lora_mlp_flops(4, 8, 16, 2) == 12 * 4 * 8 * 16 + 18 * 4 * 2 * 24


def test_kernel_row_gives_bandwidth_share_of_copy_and_time_ratios():
    row = tables.kernel_row(
        "swiglu", "forward", "s", 4_000_000_000, 5000.0, {"fastft": 1.0, "eager": 4.0, "liger": 1.25}, 0.5
    )
    assert row["fastft_gbs"] == pytest.approx(4000.0)
    assert row["fastft_pct_copy"] == pytest.approx(80.0)
    assert row["liger_gbs"] == pytest.approx(3200.0) and row["liger_pct_copy"] == pytest.approx(64.0)
    assert row["fastft_over_eager"] == pytest.approx(0.25)
    assert row["fastft_over_liger"] == pytest.approx(0.8)
    assert row["bitsandbytes_ms"] is None and row["fastft_over_bitsandbytes"] is None
    assert row["max_abs_diff_vs_eager"] == 0.5
    failed = tables.kernel_row("rope", "backward", "s", 10, 1.0, {"fastft": None, "eager": 2.0})
    assert failed["fastft_gbs"] is None and failed["fastft_over_eager"] is None


def test_memory_row_gives_shares_of_eager():
    row = tables.memory_row("flce", "fastft", 50.0, 2**30, 10**12, 100.0, 16 * 2**30)
    assert row["tflops"] == pytest.approx(20.0)
    assert row["time_over_eager"] == pytest.approx(0.5)
    assert row["memory_over_eager"] == pytest.approx(1 / 16)
    assert tables.memory_row("flce", "fastft", None, None, 1, 100.0, None)["memory_over_eager"] is None


def _result() -> dict:
    rows = [
        tables.kernel_row("rms_norm", "forward", "s", 3_600_000_000, 4300.0, {"fastft": 1.0, "eager": 3.125}),
        tables.kernel_row(
            "nf4",
            "dequantize",
            "s",
            1_000_000_000,
            4300.0,
            {"fastft": 0.4, "eager": 4.0, "bitsandbytes": 0.5},
        ),
    ]
    flce = "flce 16384x128256x4096, weight frozen"
    memory_rows = [
        tables.memory_row(flce, "fastft", 90.0, 2**30, 36 * 10**12, 100.0, 24 * 2**30),
        tables.memory_row(flce, "eager", 100.0, 24 * 2**30, 36 * 10**12, 100.0, 24 * 2**30),
    ]
    environment = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-11-30"}
    return {
        "environment": environment,
        "copy": {"bytes": 2**31, "gbs": 4300.0},
        "rows": rows,
        "memory_rows": memory_rows,
        "notes": ["liger_kernel.transformers.functional not importable"],
    }


def test_report_formats_tables_and_checks_the_issue_bars():
    text = tables.report(_result())
    assert (
        "| op | direction | fastft ms | GB/s | % of copy | kernel alone % of copy | eager ms | liger ms |"
        in text
    )
    # 3.6e9 bytes in 1 ms = 3,600 GB/s = 83.7 % of 4,300; a missing Liger time shows as a dash.
    assert "| rms_norm | forward | 1.000 | 3,600 | 83.7 % | – | 3.125 | – | – | – | 0.32 | – | – |" in text
    assert (
        "| nf4 | dequantize | 0.400 | 2,500 | 58.1 % | – | 4.000 | – | – | 0.500 | 0.10 | – | 0.80 |" in text
    )
    assert "| flce 16384x128256x4096, weight frozen | fastft | 90.0 | 400 | 1.00 | 0.90 | 0.04 |" in text
    assert "copy_ of 2 GiB" in text and "4,300 GB/s" in text
    assert "- rms_norm forward: 83.7 % of copy through autograd (meets 80 %)" in text
    assert "- nf4 dequantize: 58.1 % of copy through autograd (BELOW 80 %)" in text
    assert (
        "peak extra memory 0.042 x eager (meets <= 1/8)" in text and "time 0.90 x eager (meets <= 1)" in text
    )
    assert "- liger_kernel.transformers.functional not importable" in text


def test_the_bench_is_registered_and_help_lists_its_options(capsys):
    assert BENCHMARKS["kernels"] == "fastft.bench.kernels"
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    printed = capsys.readouterr().out
    assert "--quick" in printed and "--ops" in printed and "benchmarks/kernels.json" in printed


def test_without_cuda_main_refuses_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "kernels.json"
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", str(out)])
    assert "needs a CUDA GPU" in str(exit_info.value.code)
    assert not out.exists()


def test_a_tiny_cpu_run_times_fastft_beside_eager(monkeypatch, request):
    """The measuring path itself, interpreted on the CPU at toy sizes (speed is meaningless here)."""
    monkeypatch.setattr(bench, "environment", lambda: {"device": "cpu", "date": "today", "torch": "x"})
    sizes = timing.Sizes(tokens=6, hidden=32, intermediate=48, copy_bytes=2**12)
    result = bench.run(["rms_norm", "swiglu"], timing.Timing(0, 1, 0, 1), sizes, torch.device("cpu"))
    assert [(r["op"], r["direction"]) for r in result["rows"]] == [
        ("rms_norm", "forward"),
        ("rms_norm", "backward"),
        ("swiglu", "forward"),
        ("swiglu", "backward"),
    ]
    for row in result["rows"]:
        assert row["fastft_ms"] > 0 and row["eager_ms"] > 0, result["notes"]
    assert result["rows"][0]["max_abs_diff_vs_eager"] == 0.0  # RMSNorm follows LlamaRMSNorm's casts exactly
    assert result["copy"]["bytes_moved"] == 2**13
    assert all(row["fastft_kernel_ms"] is None for row in result["rows"])  # no Triton here: nothing to time

    request.getfixturevalue("interpreted")  # interpreted, the launchers run alone too
    result = bench.run(["rms_norm", "swiglu", "rope"], timing.Timing(0, 1, 0, 1), sizes, torch.device("cpu"))
    assert all(row["fastft_kernel_ms"] > 0 for row in result["rows"]), result["notes"]
    text = tables.report(result)
    assert "the kernel alone" in text

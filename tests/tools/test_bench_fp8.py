"""`fastft bench fp8-error` and `fastft bench fp8-quality` on the CPU (the FP8 GEMMs emulated: the rows
quantised as on a GPU, the products of the dequantised operands in fp32), on the tiny preset."""

from __future__ import annotations

import json

import pytest
import torch

from fastft.bench import BENCHMARKS, fp8_error, fp8_quality
from fastft.kernels import fp8


def test_both_are_registered():
    assert BENCHMARKS["fp8-error"] == "fastft.bench.fp8_error"
    assert BENCHMARKS["fp8-quality"] == "fastft.bench.fp8_quality"


def test_an_exactly_representable_gemm_has_no_fp8_error_and_a_rounded_one_has_some():
    # entries on e4m3's grid in every row's scale: quantised exactly (the scales, amax / 448, round in fp32)
    weight = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.5, 0.5, -0.125, -0.25]] * 8)
    x = torch.tensor([[2.0, 1.0, -0.5, 0.25], [-1.0, 0.5, 0.5, 1.0]] * 3)
    dy = torch.tensor([[1.0, -2.0] * 8, [0.5, 0.25] * 8])
    exact = fp8_error.forward_errors(x, weight)
    assert exact["path"] == "emulated"
    assert max(exact["forward_rel"], exact["forward_max_abs"], exact["weight_only_rel"]) < 1e-6
    grad = fp8_error.grad_errors(dy, weight)
    assert max(grad["grad_rel"], grad["grad_max_abs"]) < 1e-6
    generator = torch.Generator().manual_seed(0)
    off = weight + 0.01 * torch.randn(weight.shape, generator=generator)  # off the grid: e4m3 rounds
    rounded = fp8_error.forward_errors(x + 0.01 * torch.randn(x.shape, generator=generator), off)
    assert 1e-4 < rounded["weight_only_rel"] < rounded["forward_rel"] < 2**-4
    assert (
        1e-4
        < fp8_error.grad_errors(dy + 0.01 * torch.randn(dy.shape, generator=generator), off)["grad_rel"]
        < 2**-4
    )


def test_fp8_error_reports_every_projection_forward_and_input_gradient(tmp_path):
    out = tmp_path / "error.json"
    assert fp8_error.main(["--model", "tiny-llama", "--rows", "1", "--seq-len", "128", "--device", "cpu",
                           "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    records = result["layers_measured"]
    kinds = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert len(records) == 4 * len(kinds)  # tiny-llama: 4 layers, one row
    assert {r["name"].rsplit(".", 1)[-1] for r in records} == kinds
    for record in records:
        assert record["path"] == "emulated"
        # measured on tiny-llama: 1–4 % forward and input gradient, the weights alone less
        assert 0.002 < record["forward_rel"] < 0.08 and 0.002 < record["grad_rel"] < 0.08
        assert record["bf16_rel"] < record["weight_only_rel"] < record["forward_rel"]
    assert {row["projection"] for row in result["summary"]} == kinds
    assert "| q_proj |" in out.with_suffix(".md").read_text()


def test_emulated_gemms_switch_the_cpu_path_to_the_fp8_function_and_back():
    q, scale = fp8.quantize_weight(torch.randn(24, 40))
    x = torch.randn(3, 40, requires_grad=True)
    assert not fp8.fp8_gemm_runs(x, q)
    with fp8.emulated_gemms():
        assert fp8.fp8_gemm_runs(x, q)
        y = fp8.fp8_linear(x, q, scale)
        assert "FP8LinearFunction" in type(y.grad_fn).__name__
    assert not fp8.fp8_gemm_runs(x, q) and not fp8.EMULATE_ON_CPU


def test_compare_measures_the_spread_the_paired_distance_and_the_range():
    bf16 = [[3.0, 2.0, 1.0], [3.5, 1.5, 1.2], [2.5, 2.5, 0.9]]
    fp8_runs = [[3.1, 2.6, 1.0]]
    result = fp8_quality.compare(bf16, fp8_runs)
    assert result["spread_median"] == pytest.approx(1.0) and result["spread_min"] == pytest.approx(0.3)
    assert result["paired_max"] == pytest.approx(0.6) and result["steps_paired_above_spread"] == 0
    assert result["steps_inside_range"] == [2]  # step 2's 2.6 lies above the 16-bit runs' 2.5
    assert fp8_quality.smooth([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]
    assert fp8_quality.run_order([1, 2, 3], 2) == [
        ("16bit", 1),
        ("fp8", 1),
        ("16bit", 2),
        ("16bit", 3),
        ("fp8", 2),
    ]


@pytest.mark.slow  # three short runs of the demo's job on the preset and two accuracy passes each
@pytest.mark.filterwarnings("ignore::fastft.kernels.capability.KernelFallbackWarning")
def test_fp8_quality_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFT_NO_TRITON", "1")
    out = tmp_path / "quality.json"
    argv = ["--device", "cpu", "--steps", "2", "--seeds", "1,2", "--fp8-seeds", "1", "--accuracy-at", "1",
            "--eval-samples", "2", "--out", str(out)]  # fmt: skip
    assert fp8_quality.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["compute"] == "fp32" and result["fp8_gemm"] == "emulated" and "partial" not in result
    assert [r["seed"] for r in result["runs"]["16bit"]] == [1, 2] and len(result["runs"]["fp8"]) == 1
    for run in result["runs"]["16bit"] + result["runs"]["fp8"]:
        assert len(run["losses"]) == 2 and run["accuracy"]["step"] == 1
    fp8_run, bf16_run = result["runs"]["fp8"][0], result["runs"]["16bit"][0]
    assert fp8_run["losses"][0] != bf16_run["losses"][0]  # the FP8 numbers, not the 16-bit run again
    assert abs(fp8_run["losses"][0] - bf16_run["losses"][0]) < 0.05 * bf16_run["losses"][0]
    assert result["raw"]["steps"] == 2 and "| FP8 |" in out.with_suffix(".md").read_text()


@pytest.mark.gpu
def test_gpu_fp8_error_runs_scaled_mm_where_the_widths_allow(tmp_path):
    if not torch.cuda.is_available() or not fp8.fp8_supported(torch.device("cuda")):
        pytest.skip("needs a CUDA card with FP8 tensor cores (sm89+)")
    out = tmp_path / "error.json"
    assert fp8_error.main(["--rows", "1", "--seq-len", "128", "--device", "cuda", "--out", str(out)]) == 0
    for record in json.loads(out.read_text())["layers_measured"]:
        attention = record["name"].rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj")
        assert record["path"] == ("scaled_mm" if attention else "emulated")  # tiny-llama's MLP is 344 wide
        assert 0.002 < record["forward_rel"] < 0.08 and 0.002 < record["grad_rel"] < 0.08


def test_fp8_quality_summarises_a_saved_record_from_each_runs_last_steps(tmp_path):
    def one(seed, losses):
        return {"seed": seed, "losses": losses, "eval_loss": 1.0, "accuracy": None, "seconds": 1.0}

    record = {"bench": "fp8-quality", "steps": 2, "window": 2, "partial": True, "runs": {
        "16bit": [one(1, [9.0, 3.0, 2.0]), one(2, [2.5, 1.5])], "fp8": [one(1, [2.9, 1.9])]}}  # fmt: skip
    source, out = tmp_path / "partial.json", tmp_path / "whole.json"
    source.write_text(json.dumps(record))
    assert fp8_quality.main(["--from-json", str(source), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "partial" not in result and result["runs"]["16bit"][0]["losses"] == [3.0, 2.0]
    assert result["raw"]["steps_inside_range"] == [2] and result["raw"]["paired_max"] == pytest.approx(0.1)
    record["runs"]["fp8"] = []
    source.write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="at least one 16-bit and one FP8 run"):
        fp8_quality.main(["--from-json", str(source), "--out", str(out)])

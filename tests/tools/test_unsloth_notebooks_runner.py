"""benchmarks/scripts/unsloth_notebooks.py: the three notebooks' call sequence through fastft.unsloth on tiny
presets (the CPU run of what the device runs at real size beside Unsloth), and the loss-curve verdict."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scripts" / "unsloth_notebooks.py"


def _runner():
    spec = importlib.util.spec_from_file_location("unsloth_notebooks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(system, losses, tokens_per_s=100.0):
    return dict(system=system, notebook="nb", losses=losses, tokens_per_s=tokens_per_s, peak_gib=None)


def test_the_verdict_takes_curves_within_rounding_and_refuses_one_that_drifts():
    runner = _runner()
    base = [11.76, 11.70, 11.52]
    same = runner.compare([_result("unsloth", base), _result("fastft", [x * 1.003 for x in base], 150.0)])[0]
    assert same["same_curve"] and same["speed_ratio"] == pytest.approx(1.5)
    first = runner.compare([_result("unsloth", base), _result("fastft", [base[0] * 1.02, *base[1:]])])[0]
    assert not first["same_curve"]  # the first step differs by more than bf16 rounding can
    drift = runner.compare([_result("unsloth", base), _result("fastft", [*base[:2], base[2] * 1.05])])[0]
    assert not drift["same_curve"] and drift["max_step_relative"] == pytest.approx(0.05)
    short = runner.compare([_result("unsloth", base), _result("fastft", base[:2])])[0]
    assert not short["same_curve"]  # a run that stopped early is not the same curve


@pytest.mark.slow
def test_the_three_notebooks_run_through_fastft_unsloth_on_tiny_presets(tmp_path):
    # the call sequence, not the kernels (their own tests run them): fastft's PyTorch paths, no Triton interpreter
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    command = [
        sys.executable, str(SCRIPT), "--tiny", "--systems", "fastft", "--steps", "2", "--warmup", "1",
        "--rows", "16", "--length-scale", "0.05", "--device", "cpu", "--timeout", "600",
        "--folder", str(tmp_path / "weights"), "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True, capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "out" / "notebooks.json").read_text())
    assert [r["notebook"] for r in report["results"]] == ["llama31-alpaca", "qwen3-chat", "zephyr-dpo"]
    for result in report["results"]:
        assert "error" not in result, result
        assert len(result["losses"]) == 2 and all(x is not None and x > 0 for x in result["losses"])
        assert all(t > 0 for t in result["tokens"]) and result["tokens_per_s"] > 0
    chat = report["results"][1]
    assert all(
        0 < trained < tokens for trained, tokens in zip(chat["trained_tokens"], chat["tokens"], strict=True)
    )
    assert "| qwen3-chat | fastft |" in (tmp_path / "out" / "notebooks.md").read_text()

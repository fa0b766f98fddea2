"""`fastft demo` end to end (few steps), and the CLI's help."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields

import pytest
from peft import PeftModel

import fastft
from fastft.cli import build_parser, main
from fastft.demo import DemoConfig, run_demo


def test_demo_trains_evaluates_saves_and_reports(tmp_path):
    config = DemoConfig(
        steps=12, eval_every=6, eval_samples=16, output_dir=str(tmp_path), name="small", progress=False
    )
    result = run_demo(config, log=lambda message: None)
    run_dir = tmp_path / "small"
    assert result.run_dir == run_dir
    assert len(result.train.steps) == 12
    assert result.summary["final_eval_loss"] < result.summary["first_eval_loss"]
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert "fastft demo" in page and "tiny-llama" in page and page.count("plotly") > 3
    data = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    assert len(data["steps"]) == 12 and data["accuracy_after"]["all"] == result.accuracy_after.overall
    assert (
        data["summary"]["held-out accuracy"].endswith("(16 questions)")
        and "→" in data["summary"]["eval loss"]
    )
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["steps"] == 12 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert (run_dir / "checkpoints" / "checkpoint-12").is_dir()
    base, _ = fastft.load_model("tiny-llama")
    PeftModel.from_pretrained(base, run_dir / "adapter")
    text = result.text()
    for needle in ("loss", "accuracy", "trained tokens/s", "report", str(run_dir / "report.html")):
        assert needle in text
    # the attention the run resolved to is said, in the text, the summary and the report (CPU: masked SDPA)
    assert result.train.attention == "sdpa_masked (SDPA with a block-diagonal causal mask)"
    assert f"attention             {result.train.attention}" in text
    assert summary["attention"] == data["summary"]["attention"] == result.train.attention


def test_every_demo_option_is_a_documented_flag():
    help_text = build_parser()._subparsers._group_actions[0].choices["demo"].format_help()
    for f in fields(DemoConfig):
        flag = "--" + f.name.replace("_", "-")
        assert flag in help_text, flag
    assert "report.html" in help_text


def test_cli_without_a_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_models_command_lists_presets_and_catalog(capsys):
    assert main(["models", "qwen3"]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama" in out and "Qwen/Qwen3-30B-A3B" in out and "active" in out


@pytest.mark.slow
def test_fastft_demo_command_runs_as_a_user_types_it(tmp_path):
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastft",
            "demo",
            "--steps",
            "4",
            "--eval-every",
            "2",
            "--eval-samples",
            "8",
            "--output-dir",
            str(tmp_path),
            "--name",
            "cli",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        # a user's shell has no TRITON_INTERPRET (conftest sets it for the kernel tests): the demo takes the
        # plain-PyTorch paths on a CPU, not the ~100x slower interpreter
        env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert "accuracy" in completed.stdout and (tmp_path / "cli" / "report.html").exists()

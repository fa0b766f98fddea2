"""The `fastft` command answers at once: its parser and its light commands never import the training stack,
each default is printed once, an offline hub id fails fast with its fix, and "did you mean" only for near
names. Imports are checked through `sys.modules` in a fresh interpreter, not by timing (a busy machine
makes timings flaky); the timing each check stands for is in the issue (< 1.5 s)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from fastft.cli import build_parser
from fastft.models.catalog import CATALOG, close_names
from fastft.models.presets import PRESETS

HEAVY = ("torch", "transformers", "datasets", "plotly", "peft", "bitsandbytes", "numpy")


def _heavy_modules_after(code: str, env: dict | None = None) -> list[str]:
    """Runs `code` in a fresh interpreter and returns which heavy packages it left imported."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    completed = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _subparsers():
    return build_parser()._subparsers._group_actions[0].choices


def test_building_the_parser_imports_no_heavy_package():
    code = (
        "import contextlib, io\n"
        "from fastft.cli import build_parser, main\n"
        "build_parser().format_help()\n"
        "for argv in (['--version'], ['demo', '--help'], ['estimate', '--help']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "        main(argv)"
    )
    assert _heavy_modules_after(code) == []


def test_models_and_estimate_on_a_catalog_model_run_without_torch(capsys):
    code = (
        "import contextlib, io\n"
        "from fastft.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    assert main(['models']) == 0\n"
        "    assert main(['estimate', 'meta-llama/Llama-3.1-8B-Instruct', '--gpu', 'h100', '--max-context']) == 0\n"
        "    assert main(['estimate', 'tiny-moe', '--gpu', 't4']) == 0\n"
        "assert 'Fits: needs' in out.getvalue() and 'Longest context' in out.getvalue(), out.getvalue()"
    )
    assert _heavy_modules_after(code) == []


def test_each_default_is_printed_once():
    for name, parser in _subparsers().items():
        help_text = " ".join(parser.format_help().split())
        assert "(default: None)" not in help_text, name
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.dest == "help" or not action.option_strings:
                continue
            has_default = action.default not in (None, argparse.SUPPRESS)
            assert action.help or not has_default, f"{name} {action.dest}: a default but no help to show it"
            if not action.help:
                continue
            described = formatter._expand_help(action)
            assert described.count("default") <= 1, (name, action.dest, described)
            if has_default:
                assert described.count("(default") == 1, (name, action.dest, described)
    demo = " ".join(_subparsers()["demo"].format_help().split())
    assert demo.count("demo-<date>-<time>") == 1


@pytest.mark.parametrize(("typed", "near"), [("tiny-lama", "tiny-llama"), ("Qwen/Qwen3-8b", "Qwen/Qwen3-8B")])
def test_suggestions_are_made_for_near_names(typed, near):
    assert near in close_names(typed, list(PRESETS) + list(CATALOG))


def test_no_suggestion_for_a_far_name():
    assert close_names("not-a/model", list(PRESETS) + list(CATALOG)) == []
    from fastft.models.loading import UnknownModelError, load_model

    with pytest.raises(UnknownModelError) as error:
        load_model("not-a-model-at-all")
    assert "Did you mean" not in str(error.value) and "Presets:" in str(error.value)


def test_offline_hub_id_fails_at_once_naming_the_fix(tmp_path):
    """HF_HUB_OFFLINE unset and the hub out of reach (a closed loopback port stands for no network): one
    connection attempt, then only the local cache; no retries, and the error says what to do."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") and not k.lower().endswith("_proxy")
    }
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))
    started = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "fastft", "estimate", "not-a/model"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    elapsed = time.perf_counter() - started
    assert completed.returncode == 2, completed.stderr
    assert "Retrying" not in completed.stderr and "Retry" not in completed.stderr
    assert "127.0.0.1:9 cannot be reached" in completed.stderr
    assert "hf download not-a/model config.json" in completed.stderr
    assert "Did you mean" not in completed.stderr and "tiny-moe" not in completed.stderr
    # the retries took ~30 s; what is left is the interpreter and transformers' import
    assert elapsed < 120, elapsed


def test_offline_mode_is_named_in_the_error():
    from fastft.models.loading import ModelLoadError, load_model
    from fastft.vram import estimate_vram

    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # tests/conftest.py
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set") as error:
        estimate_vram("not-a/model")
    assert "hf download not-a/model config.json" in str(error.value)
    with pytest.raises(ModelLoadError, match="offline here") as error:
        load_model("not-a/model")
    assert "hf download not-a/model`" in str(error.value)


def test_reachability_is_checked_once_and_through_the_proxy(monkeypatch):
    from fastft.data import hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "https://huggingface.co")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # requests would go through it: test it
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    hub._unreachable.cache_clear()
    attempts = []
    real = hub.socket.create_connection
    monkeypatch.setattr(
        hub.socket, "create_connection", lambda *a, **k: attempts.append(a[0]) or real(*a, **k)
    )
    try:
        assert "127.0.0.1:9 cannot be reached" in hub.offline_reason()
        assert "127.0.0.1:9 cannot be reached" in hub.offline_reason()
        assert attempts == [("127.0.0.1", 9)]  # one connection per process, not one per call
        monkeypatch.setenv("NO_PROXY", "huggingface.co")
        assert hub._proxy_for("huggingface.co") is None
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert hub.offline_reason() == "HF_HUB_OFFLINE is set"
    finally:
        hub._unreachable.cache_clear()

"""Packaging: fastft.kernels lives in fastft/kernels/, data ships in the wheel, README and CI agree."""

from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_package_is_fastft_kernels_not_a_top_level_module(tmp_path):
    kernels = importlib.import_module("fastft.kernels")
    assert Path(kernels.__file__).resolve().parent == ROOT / "fastft" / "kernels"
    # From anywhere, the source tree's root included (``python -m`` / ``-c`` put it first on sys.path), the
    # name `kernels` is not ours: it is Hugging Face's, which transformers >= 5.25 imports.
    code = "import importlib.util as u; s = u.find_spec('kernels'); print(s.origin if s else None)"
    for cwd in (tmp_path, ROOT):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=cwd
        )
        assert str(ROOT / "fastft" / "kernels") not in out.stdout


def test_public_api_names_resolve():
    import fastft

    for name in fastft.__all__:
        assert getattr(fastft, name) is not None, name


def test_import_fastft_is_light():
    code = "import sys, fastft; print('transformers' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_bitsandbytes_cpu_kernel_notice_is_dropped_and_nothing_else(tmp_path):
    """bitsandbytes warns at import on AVX512-BF16 CPUs about a hub package fastft never uses; fastft drops
    that one message (the warning fires only on such CPUs, so the filter is checked directly too)."""
    import logging

    import fastft

    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    notice = [f for f in logger.filters if isinstance(f, fastft._BitsandbytesCpuKernelNotice)]
    assert len(notice) == 1

    def record(message):
        return logging.LogRecord(logger.name, logging.WARNING, __file__, 1, message, ("No module",), None)

    assert not notice[0].filter(record("Failed to load CPU gemm_4bit_forward from kernels-community: %s."))
    assert notice[0].filter(record("something else went wrong: %s"))
    if importlib.util.find_spec("bitsandbytes") is None:
        return  # nothing to import; the filter itself is checked above
    code = "import fastft, peft, bitsandbytes"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert "gemm_4bit_forward" not in out.stderr


def _readme_command(kind: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    matching = [b.strip() for b in blocks if kind in b]
    assert matching, f"README has no bash block with {kind!r}"
    return matching[0]


def test_ci_runs_the_readme_test_command():
    test_command = _readme_command("pytest")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for line in test_command.splitlines():
        assert line.strip() in ci, line


def test_readme_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first_blocks = text.split("```bash")[1:3]
    assert any("fastft demo" in b for b in first_blocks) and any("pytest" in b for b in first_blocks)


@pytest.mark.slow
def test_wheel_contains_kernels_data_and_assets(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("fastft-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "fastft/kernels/__init__.py",
        "fastft/data/bundled/skills.jsonl",
        "fastft/data/bundled/skills-eval.jsonl",
        "fastft/models/assets/tokenizer.json",
        "fastft/models/assets/tiny-llama.safetensors",
        "fastft/report/html.py",
    ):
        assert required in names, required
    assert not any(name.startswith("kernels/") for name in names)

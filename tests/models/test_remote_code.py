"""A model's own Python code (``auto_map``) never runs, and is never one keypress away, unless the user passed
``trust_remote_code=True`` (`fastft.models.remote_code`): every way in (the CLI's estimate, `estimate_vram`,
`load_model`, the Unsloth layer) refuses with an error that names the folder and the fix, even with "y" on
stdin, where transformers asked "Do you wish to run the custom code? [y/N]" and ran the folder's code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _folder_with_code(folder: Path, marker: Path) -> Path:
    """A model folder whose config needs its own code; importing that code writes `marker`."""
    folder.mkdir()
    config = {
        "model_type": "fastft-test-custom",
        "auto_map": {
            "AutoConfig": "configuration_custom.CustomConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomModel",
        },
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
    }
    (folder / "config.json").write_text(json.dumps(config))
    ran = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    (folder / "configuration_custom.py").write_text(
        ran + "from transformers import LlamaConfig\n\n\nclass CustomConfig(LlamaConfig):\n"
        "    model_type = 'fastft-test-custom'\n"
    )
    (folder / "modeling_custom.py").write_text(
        ran
        + "from transformers import LlamaForCausalLM\n\nfrom .configuration_custom import CustomConfig\n\n\n"
        "class CustomModel(LlamaForCausalLM):\n    config_class = CustomConfig\n"
    )
    return folder


CHILD = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from pathlib import Path

    import fastft
    from fastft.cli import main

    folder, marker = sys.argv[1], Path(sys.argv[2])
    out = {}

    def cli(argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        return code, err.getvalue()

    out["cli"] = cli(["estimate", folder])
    for label, call in (
        ("estimate_vram", lambda: fastft.estimate_vram(folder)),
        ("load_model", lambda: fastft.load_model(folder)),
        ("FastLanguageModel", lambda: fastft.FastLanguageModel.from_pretrained(folder)),
    ):
        try:
            call()
            out[label] = "no error"
        except ValueError as error:
            out[label] = f"{type(error).__name__}: {error}"
    out["ran_before_consent"] = marker.exists()
    out["trusted_cli"] = cli(["estimate", folder, "--trust-remote-code", "--gpu", "h100"])
    out["ran_with_consent"] = marker.exists()
    print(json.dumps(out))
    """
)


def test_remote_code_never_runs_without_consent_even_answering_yes(tmp_path):
    marker = tmp_path / "MARKER"
    folder = _folder_with_code(tmp_path / "custom-model", marker)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_MODULES_CACHE=str(tmp_path / "modules"))
    completed = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), str(marker)],
        input="y\n" * 8,  # what a user answers to "Do you wish to run the custom code? [y/N]"
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = json.loads(completed.stdout.strip().splitlines()[-1])
    assert out["ran_before_consent"] is False
    assert "Do you wish to run the custom code" not in completed.stdout + completed.stderr
    code, stderr = out["cli"]
    assert code == 2 and str(folder) in stderr and "--trust-remote-code" in stderr, stderr
    for label in ("estimate_vram", "load_model", "FastLanguageModel"):
        message = out[label]
        assert message.startswith("RemoteCodeError: "), (label, message)
        assert str(folder) in message and "trust_remote_code=True" in message, (label, message)
        assert "modeling_custom.CustomModel" in message, (label, message)
    # the flag is the consent: the folder's code runs, and the estimate is made from its model
    code, stderr = out["trusted_cli"]
    assert code == 0, stderr
    assert out["ran_with_consent"] is True


def test_trust_remote_code_takes_only_a_bool():
    from fastft.checks import SettingError
    from fastft.models.loading import load_model
    from fastft.vram.inventory import inventory_of

    for value in (None, "yes", 1):
        with pytest.raises(SettingError, match="trust_remote_code must be True or False"):
            load_model("tiny-llama", trust_remote_code=value)
        with pytest.raises(SettingError, match="trust_remote_code must be True or False"):
            inventory_of("tiny-llama", trust_remote_code=value)

"""Where connections to the hub hang (a firewall that drops packets, not a refused port), fastft's imports
and loads must not wait on them: bitsandbytes' CPU backend asks the hub for a kernel when peft imports it.
Measured on this machine before the fix: a plain ``import peft`` behind such a black hole took 143 s."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time

import pytest

IMPORT_LIMIT_S = 60  # the import takes 5-10 s on 2 busy cores; the hang took 143 s

SCRIPT = """
import time
started = time.monotonic()
import fastft.models.lora  # peft, and bitsandbytes under it
import huggingface_hub.constants as constants
print("seconds", round(time.monotonic() - started, 1), "offline-after", constants.HF_HUB_OFFLINE)
"""


@pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None or importlib.util.find_spec("kernels") is None,
    reason="needs bitsandbytes and the kernels package (the dev extra has both)",
)
def test_importing_the_lora_layer_does_not_wait_on_a_hub_whose_connections_hang(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(0)  # one queued connection, taken below: every further SYN is dropped, connects hang
        port = hole.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
            env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"))
            started = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-c", SCRIPT],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=IMPORT_LIMIT_S + 60,
            )
            took = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    assert took < IMPORT_LIMIT_S, f"the import waited on the hub: {took:.0f} s\n{done.stderr[-2000:]}"
    assert "offline-after False" in done.stdout  # huggingface_hub's switch is put back after the import
    assert "publisher trust" not in done.stderr  # the kernels package's offline notice is not shown

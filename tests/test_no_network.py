"""Offline by design: nothing opens a socket unless the user asked for something remote. With the network
black-holed (every connection or name lookup that is not loopback is recorded and refused) and
``HF_HUB_OFFLINE`` unset, ``import fastft``, a preset, the bundled data, LoRA, two training steps and saving the adapter (fastft's
`save_adapter`, and ``model.save_pretrained(dir)`` of the Unsloth layer, PEFT's own method) make no attempt.
They made three: a reachability probe of the hub when peft (so bitsandbytes) was imported, and two hub look-ups
by PEFT's ``save_pretrained`` for the base "tiny-llama"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BLACK_HOLE = textwrap.dedent(
    """
    import socket, traceback

    ATTEMPTS = []
    LOOPBACK = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::")

    def _remote(host):
        return isinstance(host, (str, bytes)) and (host.decode() if isinstance(host, bytes) else host) not in LOOPBACK and not str(host).startswith("127.")

    def _refuse(kind, target):
        ATTEMPTS.append([kind, str(target), "".join(traceback.format_stack(limit=12)[:-2])])
        raise OSError(101, f"network black-holed by the test ({kind} {target})")

    _connect, _connect_ex, _getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo
    _create_connection = socket.create_connection

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and _remote(address[0]):
            _refuse("connect", address)
        return _connect(self, address)

    def connect_ex(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and _remote(address[0]):
            ATTEMPTS.append(["connect_ex", str(address), "".join(traceback.format_stack(limit=12)[:-1])])
            return 101
        return _connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if _remote(host):
            ATTEMPTS.append(["getaddrinfo", str(host), "".join(traceback.format_stack(limit=12)[:-1])])
            raise socket.gaierror(socket.EAI_NONAME, "network black-holed by the test")
        return _getaddrinfo(host, *args, **kwargs)

    def create_connection(address, *args, **kwargs):
        if _remote(address[0]):
            _refuse("create_connection", address)
        return _create_connection(address, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
    socket.getaddrinfo, socket.create_connection = getaddrinfo, create_connection
    """
)

RUN = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    out = Path(sys.argv[1])
    import fastft

    steps = {}
    steps["import fastft"] = len(ATTEMPTS)
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=64)
    model = fastft.add_lora(model, r=4, alpha=8)
    rows = fastft.load_dataset("bundled:skills").select(range(16))
    fastft.train(model, tokenizer, fastft.pack(rows, tokenizer, 64), max_steps=2, progress=False)
    steps["preset, LoRA, two steps"] = len(ATTEMPTS)
    fastft.save_adapter(model, out / "adapter", tokenizer)
    model.save_pretrained(out / "peft")
    steps["save_adapter, save_pretrained"] = len(ATTEMPTS)
    model, tokenizer = fastft.FastLanguageModel.from_pretrained("tiny-llama", max_seq_length=64)
    model = fastft.FastLanguageModel.get_peft_model(model, r=4)
    model.save_pretrained(out / "unsloth")
    tokenizer.save_pretrained(out / "unsloth")
    steps["Unsloth layer's save_pretrained"] = len(ATTEMPTS)
    assert (out / "unsloth" / "adapter_model.safetensors").is_file()
    print(json.dumps({"steps": steps, "attempts": ATTEMPTS}))
    """
)


def test_a_preset_run_and_its_saves_open_no_connection(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    }
    env.update(PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf"))
    completed = subprocess.run(
        [sys.executable, "-c", BLACK_HOLE + RUN, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert report["attempts"] == [], json.dumps(report, indent=1)[-6000:]
    assert set(report["steps"].values()) == {0}


def test_save_pretrained_keeps_a_resized_vocabulary_without_asking_the_hub(tmp_path):
    """PEFT's "auto" looked the base up on the hub to see whether the vocabulary was resized; fastft answers it
    from the preset, folder or local cache: a resized vocabulary saves the embeddings, an unchanged one does
    not (HF_HUB_OFFLINE is set here, where PEFT's look-up gave up and dropped resized embeddings)."""
    from safetensors import safe_open

    import fastft

    def saved_keys(model, folder):
        model.save_pretrained(folder)
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as file:
            return list(file.keys())

    model, _ = fastft.load_model("tiny-llama", max_seq_length=64)
    model = fastft.add_lora(model, r=4)
    assert not any("embed_tokens" in key for key in saved_keys(model, tmp_path / "same"))
    model.get_base_model().resize_token_embeddings(model.config.vocab_size + 8)
    keys = saved_keys(model, tmp_path / "resized")
    assert any("embed_tokens" in key for key in keys) and any("lm_head" in key for key in keys), keys

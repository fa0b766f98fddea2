"""Atomic checkpoints: a run can always be resumed, and a crash never leaves half a checkpoint.

A checkpoint folder holds the PEFT adapter (``adapter_model.safetensors`` + ``adapter_config.json``,
loadable with plain `peft`), ``optimizer.pt`` and ``scheduler.pt`` (tensors and numbers only, read
back with ``weights_only=True``), ``rng.pt`` (torch RNG states) and ``trainer_state.json``.
Everything is written into a temporary sibling folder, fsynced, then renamed into place.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from fastft.atomic import replace_folder_atomically

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(RuntimeError):
    pass


def rng_state() -> tuple[dict, dict]:
    """(tensors for ``rng.pt``, JSON-able python/numpy states)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    version, state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    plain = {
        "python": [version, list(state), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    return tensors, plain


def set_rng_state(tensors: dict, plain: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(tensors["cuda"]))
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def save_checkpoint(folder, model, optimizer, scheduler, state: dict) -> Path:
    """Write a resumable checkpoint of a PEFT model's adapters and the optimisation state."""
    tensors, plain = rng_state()

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, save_embedding_layers=False)  # no hub lookup of the base (save_adapter)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(tensors, tmp / "rng.pt")
        with open(tmp / "trainer_state.json", "w", encoding="utf-8") as f:
            json.dump(dict(state, rng=plain), f)

    return replace_folder_atomically(write, folder)


def load_checkpoint(folder, model, optimizer, scheduler) -> dict:
    """Restore adapters, optimizer, scheduler and RNG from `folder`; return the trainer state."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    folder = Path(folder)
    needed = ["adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json"]
    missing = [name for name in needed if not (folder / name).exists()]
    if missing:
        raise CheckpointError(f"{folder} is not a complete fastft checkpoint: missing {missing}.")
    device = next(p.device for p in model.parameters() if p.requires_grad)
    weights = load_file(folder / "adapter_model.safetensors", device=str(device))
    result = set_peft_model_state_dict(model, weights)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise CheckpointError(
            f"{folder} holds adapter weights this model does not have ({unexpected[:3]} …): it was "
            "written for another model or LoRA configuration."
        )
    optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True, map_location=device))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
    with open(folder / "trainer_state.json", encoding="utf-8") as f:
        state = json.load(f)
    set_rng_state(torch.load(folder / "rng.pt", weights_only=True), state.pop("rng"))
    return state


def list_checkpoints(output_dir) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest step first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name))]
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def prune_checkpoints(output_dir, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints."""
    for path in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)

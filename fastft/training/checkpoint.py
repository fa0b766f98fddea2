"""Atomic checkpoints: a run can always be resumed, and a crash never leaves half a checkpoint.

A checkpoint folder holds the PEFT adapter (``adapter_model.safetensors`` + ``adapter_config.json``,
loadable with plain `peft`), ``optimizer.pt`` and ``scheduler.pt`` (tensors and numbers only, read
back with ``weights_only=True``), ``rng.pt`` (torch RNG states) and ``trainer_state.json`` (the step, the
run's settings and signature: `fastft.training.resume_check`; the run's id: `fastft.training.run_folder`).
Everything is written into a temporary sibling folder, fsynced, then renamed into place; old checkpoints are
renamed to a hidden name before they are deleted, so a name ``checkpoint-N`` always holds a whole checkpoint.
Loading reads and checks every file before it changes the model, and names the file that is broken.
"""

from __future__ import annotations

import json
import pickle
import random
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from fastft.atomic import expand, recover_folder, remove_leftovers, remove_tree, replace_folder_atomically

# Function-local imports: peft imports bitsandbytes, which asks the hub for a kernel: peft loads first under
# `fastft.data.hub.hub_offline_while_importing` (fastft.models.lora); torch.distributed's checkpoint and FSDP
# modules load only in a distributed run.

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
CHECKPOINT_FILES = (
    "adapter_model.safetensors",
    "adapter_config.json",
    "optimizer.pt",
    "scheduler.pt",
    "rng.pt",
    "trainer_state.json",
)


class CheckpointError(RuntimeError):
    pass


class ResumeMismatchError(CheckpointError):
    """The checkpoint is whole but was written by a run this one is not the continuation of (another adapter,
    other data or settings); the message lists what differs and how to go on."""


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


def save_checkpoint(
    folder, model, optimizer, scheduler, state: dict, model_state=None, optimizer_state=None
) -> Path:
    """Write a resumable checkpoint of a PEFT model's adapters and the optimisation state. `model_state` and
    `optimizer_state`, when given, are written instead of the model's and the optimizer's own (a sharded run's
    gathered full tensors: `fastft.training.distributed.Distributed.save_once`)."""
    tensors, plain = rng_state()

    def write(tmp: Path) -> None:
        # no hub lookup of the base (save_adapter); PEFT keeps the adapter's keys of `model_state`
        model.save_pretrained(tmp, save_embedding_layers=False, state_dict=model_state)
        optimizer_dict = optimizer.state_dict() if optimizer_state is None else optimizer_state
        torch.save(optimizer_dict, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(tensors, tmp / "rng.pt")
        with open(tmp / "trainer_state.json", "w", encoding="utf-8") as f:
            json.dump(dict(state, rng=plain), f)

    folder = expand(folder)
    # a checkpoint of an earlier run (fastft's, from before folders carried a marker) may be replaced too
    return replace_folder_atomically(
        write, folder, overwrite=(folder / "trainer_state.json").is_file(), kind="checkpoint"
    )


def load_checkpoint(folder, model, optimizer, scheduler, restore_optimizer: bool = True) -> dict:
    """Restore adapters, optimizer, scheduler and RNG from `folder`; return the trainer state.

    Every file is read and checked first (`read_checkpoint`), so a broken checkpoint raises
    `CheckpointError` naming its file and leaves the model as it was. With ``restore_optimizer=False``
    the optimizer and scheduler keep their fresh state (a resume with new hyperparameters)."""
    device = next(p.device for p in model.parameters() if p.requires_grad)
    contents = read_checkpoint(folder, device)
    return apply_checkpoint(expand(folder), contents, model, optimizer, scheduler, restore_optimizer)


def apply_checkpoint(
    folder: Path,
    contents: dict,
    model,
    optimizer,
    scheduler,
    restore_optimizer: bool = True,
    sharded: bool = False,
):
    """Put what `read_checkpoint` read into the model, optimizer, scheduler and RNG; return the trainer state.
    `sharded`: the model is FSDP2-sharded (its optimizer's state is keyed by parameter name)."""
    from peft import set_peft_model_state_dict

    check_adapter_matches(folder, model, contents["adapter"])
    if sharded:  # FSDP2: full tensors from the files, each rank keeps its shard
        load_sharded(model, optimizer if restore_optimizer else None, contents)
    else:
        set_peft_model_state_dict(model, contents["adapter"])
        if restore_optimizer:
            optimizer.load_state_dict(contents["optimizer"])
    if restore_optimizer:
        scheduler.load_state_dict(contents["scheduler"])
    state = dict(contents["state"])
    set_rng_state(contents["rng"], state.pop("rng"))
    return state


def gather_sharded(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """An FSDP2 model's trainable weights and its optimizer's state as full CPU tensors, keyed by parameter
    name, on rank 0 (empty on the others): a collective every rank calls. The checkpoint is then the one a
    single process writes: a PEFT adapter beside the optimizer state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(model, options=options), get_optimizer_state_dict(
        model, optimizer, options=options
    )


def load_sharded(model: torch.nn.Module, optimizer, contents: dict) -> None:
    """A checkpoint's full adapter (PEFT keys) and optimizer state (parameter names) into an FSDP2 model and
    its optimizer, each rank keeping its shard; `optimizer` None leaves the optimizer fresh."""
    from peft import get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # PEFT's keys drop the adapter's name: map them back to the parameters' names through PEFT itself
    placeholders = {name: torch.empty(0) for name, p in model.named_parameters() if p.requires_grad}
    names = {id(tensor): name for name, tensor in placeholders.items()}
    renamed = get_peft_model_state_dict(model, state_dict=placeholders, save_embedding_layers=False)
    by_name = {names[id(tensor)]: contents["adapter"][key].cpu() for key, tensor in renamed.items()}
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, by_name, options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, optim_state_dict=contents["optimizer"], options=options)


def read_checkpoint(folder, device: torch.device | str = "cpu") -> dict:
    """Every file of a checkpoint, read safely (safetensors, ``weights_only=True``, JSON); `CheckpointError`
    names the missing or unreadable file (torch's advice to load unsafely never reaches the user)."""

    folder = recover_folder(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} does not exist (or is not a folder): it is not a checkpoint.")
    missing = [name for name in CHECKPOINT_FILES if not (folder / name).exists()]
    if missing:
        raise CheckpointError(f"{folder} is not a complete fastft checkpoint: missing {missing}.")
    contents = {}
    for key, name, read in (
        ("adapter", "adapter_model.safetensors", lambda path: load_file(path, device=str(device))),
        ("adapter_config", "adapter_config.json", _read_json),
        ("optimizer", "optimizer.pt", lambda path: torch.load(path, weights_only=True, map_location=device)),
        ("scheduler", "scheduler.pt", lambda path: torch.load(path, weights_only=True)),
        ("rng", "rng.pt", lambda path: torch.load(path, weights_only=True)),
        ("state", "trainer_state.json", _read_json),
    ):
        try:
            contents[key] = read(folder / name)
        except Exception as error:  # any reader's failure (safetensors has its own error type): damaged
            raise CheckpointError(
                f"{folder / name} cannot be read ({_first_line(error)}): this checkpoint is damaged or was not "
                "written by fastft. Resume from another checkpoint (resume_from='latest' skips damaged ones)."
            ) from None
    if (
        not isinstance(contents["state"], dict)
        or "rng" not in contents["state"]
        or "step" not in contents["state"]
    ):
        raise CheckpointError(f"{folder / 'trainer_state.json'} lacks the trainer state fastft writes.")
    if not isinstance(contents["adapter_config"], dict) or not {"r", "lora_alpha"} <= set(
        contents["adapter_config"]
    ):
        raise CheckpointError(
            f"{folder / 'adapter_config.json'} lacks the LoRA settings PEFT writes (r, lora_alpha): this checkpoint "
            "is damaged. Resume from another checkpoint (resume_from='latest' skips damaged ones)."
        )
    return contents


def check_adapter_matches(folder: Path, model, weights: dict) -> None:
    """Raise `CheckpointError` when the checkpoint's adapter is not this model's: other targets (keys) or
    another rank (shapes), before any weight is loaded, so nothing is half-loaded."""
    from peft import get_peft_model_state_dict

    expected = get_peft_model_state_dict(model, save_embedding_layers=False)  # no hub lookup of the base
    unexpected = sorted(set(weights) - set(expected))
    missing = sorted(set(expected) - set(weights))
    if unexpected or missing:
        raise ResumeMismatchError(
            f"{folder} holds an adapter for other LoRA targets than this model's (only in the checkpoint: "
            f"{unexpected[:3]}, only in the model: {missing[:3]}): add_lora with the target_modules of the run "
            "that wrote it, or start a new run in another output_dir."
        )
    for key, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ResumeMismatchError(
                f"{folder} holds {key} of shape {tuple(tensor.shape)}, this model's is {tuple(expected[key].shape)}: "
                "the checkpoint was written with another LoRA rank r. add_lora with the r of the run that wrote "
                "it, or start a new run in another output_dir."
            )


def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _first_line(error: BaseException) -> str:
    """What went wrong, in one line; never torch's advice to retry with ``weights_only=False`` (loading a
    checkpoint unsafely runs whatever code it holds)."""
    if isinstance(error, pickle.UnpicklingError) or "weights_only" in str(error):
        return "it holds Python objects other than tensors and numbers, which fastft never unpickles"
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def list_checkpoints(output_dir) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest step first."""
    output_dir = expand(output_dir)
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if (m := CHECKPOINT_PATTERN.match(p.name))]
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir) -> Path | None:
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def prune_checkpoints(output_dir, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints, each renamed to a hidden name before it is deleted."""
    for path in list_checkpoints(output_dir)[:-keep] if keep > 0 else []:
        remove_tree(path)


def clean_output_dir(output_dir) -> list[Path]:
    """Finish or undo saves a killed run left half-done in `output_dir` and remove its temporary folders."""
    return remove_leftovers(output_dir)

"""Keep the result: a PEFT adapter folder, or a merged 16-bit model that plain transformers loads.

Both are written atomically (into a temporary sibling folder, renamed into place) and never over a
folder fastft did not write, unless ``overwrite=True`` (`fastft.atomic`). Merging
never touches the trained model: merged weights W + (alpha/r)·B·A are computed into a fresh
state dict, so training or generation can go on after saving.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from peft import PeftModel

from fastft.atomic import check_destination, recover_folder, replace_folder_atomically


def save_adapter(model: PeftModel, path: str | os.PathLike, tokenizer=None, overwrite: bool = False) -> Path:
    """Write the LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``), and the
    tokenizer if given; the folder loads with ``peft.PeftModel.from_pretrained(base, path)``.

    An existing `path` is replaced only if fastft wrote it (or it is empty); ``overwrite=True`` replaces
    any folder. A file at `path` is never touched."""
    if not isinstance(model, PeftModel):
        raise TypeError("save_adapter needs a model with LoRA adapters (from fastft.add_lora).")
    check_destination(recover_folder(path), overwrite)

    def write(folder: Path) -> None:
        # fastft never resizes embeddings, so PEFT's "auto" check (which looks the recorded base up on the
        # hub, e.g. "tiny-llama") has nothing to find; modules_to_save are saved either way
        model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    return replace_folder_atomically(write, path, overwrite=overwrite, kind="adapter")


def merged_state_dict(model: PeftModel, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA delta added in fp32, cast to `dtype`."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
        raise ValueError(
            "Merging into a 4/8-bit base is lossy and not supported: load the base in 16-bit with "
            "load_model(name, load_in_4bit=False), attach the saved adapter with "
            "peft.PeftModel.from_pretrained(base, adapter_folder), then merge."
        )
    deltas: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            delta = None
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    d = module.get_delta_weight(adapter).float()
                    delta = d if delta is None else delta + d
            if delta is not None:
                # a PEFT ParamWrapper (LoRA on stacked expert weights) adapts one parameter of the module
                # it wraps, possibly under further wrappers: the key names the innermost one
                deltas[_clean(f"{name}.base_layer.{getattr(module, 'parameter_name', 'weight')}")] = delta
    merged: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        key = _clean(key)
        if key in deltas:
            value = value.float() + deltas[key]
        merged[key] = value.detach().to(dtype=dtype, device="cpu")
    return merged


def _clean(key: str) -> str:
    """A state-dict key without PEFT's ``base_layer`` levels (nested for several wrapped parameters)."""
    return ".".join(part for part in key.split(".") if part != "base_layer")


def save_merged(
    model: PeftModel,
    path: str | os.PathLike,
    tokenizer=None,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """Write the merged model in `dtype` (16-bit by default) as safetensors that plain
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads, plus the tokenizer.
    `overwrite` as in `save_adapter`."""
    from transformers import AutoModelForCausalLM

    if not isinstance(model, PeftModel):
        raise TypeError("save_merged needs a model with LoRA adapters (from fastft.add_lora).")
    check_destination(recover_folder(path), overwrite)  # before the merge's work, not after
    state = merged_state_dict(model, dtype)
    config = model.get_base_model().config
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(config, dtype=dtype)
    clean.load_state_dict(state, strict=False, assign=True)
    clean.tie_weights()
    missing = [name for name, p in clean.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"merging left parameters without weights: {missing[:5]}")
    clean.generation_config = model.get_base_model().generation_config

    def write(folder: Path) -> None:
        clean.save_pretrained(folder, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    return replace_folder_atomically(write, path, overwrite=overwrite, kind="merged")

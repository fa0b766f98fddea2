"""Keep the result: a PEFT adapter folder, or a merged 16-bit model that plain transformers loads.

Both are written atomically (into a temporary sibling folder, renamed into place) and never over a
folder fastft did not write, unless ``overwrite=True``; in a folder fastft saved before, they replace only
the files fastft wrote there (its manifest lists them), keeping what the user added (`fastft.atomic`). Merging
never touches the trained model: merged weights W + (alpha/r)·B·A are computed into a fresh
state dict, so training or generation can go on after saving.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import fastft.weight_formats as weight_formats
from fastft.atomic import check_destination, recover_folder, replace_folder_atomically
from fastft.data.hub import hub_offline_while_importing
from fastft.runtime.model_state import base_model

# Function-local imports: peft imports bitsandbytes, which asks the hub for a kernel: peft loads first under
# `fastft.data.hub.hub_offline_while_importing` (fastft.models.lora).
from fastft.weight_formats import frozen_state

with hub_offline_while_importing("bitsandbytes"):  # peft imports it; it asks the hub for a kernel
    from peft import PeftModel


def save_adapter(model: PeftModel, path: str | os.PathLike, tokenizer=None, overwrite: bool = False) -> Path:
    """Write the LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``), and the
    tokenizer if given; the folder loads with ``peft.PeftModel.from_pretrained(base, path)``.

    An existing `path` is saved into only if fastft wrote it (or it is empty), and then only the files
    fastft wrote there (unchanged since) are replaced: the user's own files stay, and a file of theirs that
    this save would replace is refused by name (`fastft.atomic`). ``overwrite=True`` replaces any folder
    whole. A file at `path` is never touched."""
    if not isinstance(model, PeftModel):
        raise TypeError("save_adapter needs a model with LoRA adapters (from fastft.add_lora).")
    check_destination(recover_folder(path), overwrite)

    def write(folder: Path) -> None:
        # fastft never resizes embeddings, so PEFT's "auto" check (which looks the recorded base up on the
        # hub, e.g. "tiny-llama") has nothing to find; modules_to_save are saved either way
        model.save_pretrained(folder, safe_serialization=True, save_embedding_layers=False)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)

    return replace_folder_atomically(write, path, overwrite=overwrite, kind="adapter", by="save_adapter")


def merged_state_dict(
    model: PeftModel, dtype: torch.dtype = torch.bfloat16, dequantize: bool = False
) -> dict[str, torch.Tensor]:
    """The base model's state dict with every LoRA delta added in fp32, cast to `dtype`. A 4-bit base is
    refused unless `dequantize`: then each NF4 weight is dequantised exactly and its delta added to that
    (what Unsloth's ``save_pretrained_merged`` does; the original 16-bit weights are not recovered)."""
    base = model.get_base_model()
    merge = weight_formats.of_model(base).merge
    if merge == "refuse" or (merge == "dequantize" and not dequantize):
        raise ValueError(
            "Merging into a 4/8-bit base is lossy and not supported: load the base in 16-bit with "
            "load_model(name, load_in_4bit=False), attach the saved adapter with "
            "peft.PeftModel.from_pretrained(base, adapter_folder), then merge; or, for a 4-bit base, pass "
            "dequantize=True to merge into its dequantised weights."
        )
    return {key: value.to(dtype) for key, value in merged_tensors(model)}


def merged_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged weights one tensor at a time, in state-dict order: (key without PEFT's levels, CPU tensor).
    An adapted weight comes as fp32 W + the active adapters' (alpha/r)·B·A, a module trained whole
    (``modules_to_save``) as its trained copy; any other tensor as stored (the
    model's own tensor, not a copy, on a CPU model). A quantised base weight (NF4) is dequantised exactly
    (its format's dense view, bit-exact with bitsandbytes') before its delta is added. Only one merged tensor exists at a time,
    so a caller that writes each before asking for the next never holds a second copy of the model.

    `model` may also be a plain transformers model (no adapters): its own weights come out."""
    from peft.tuners.lora import LoraLayer

    base = base_model(model)
    weight_format = weight_formats.of_model(base)
    if weight_format.merge == "refuse":
        raise ValueError(
            f"Merging into an {weight_format.label} base is not supported: load the base in 16-bit "
            f"({weight_format.load_flag}=False), attach the saved adapter with "
            "peft.PeftModel.from_pretrained(base, adapter_folder), then export."
        )
    lora_of: dict[str, LoraLayer] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            lora_of[_clean(f"{name}.base_layer.{getattr(module, 'parameter_name', 'weight')}")] = module
    # imported here: fastft.models.fp8 imports triton, which a machine without it (macOS) cannot
    from fastft.models.fp8 import dequantized_weight, fp8_scales

    fp8_scale = {_clean(key): scale for key, scale in fp8_scales(base).items()}
    for key, value in merged_keys(model):
        weight_format, state = frozen_state(value)
        if key in fp8_scale:  # an FP8 projection (fastft.models.fp8): e4m3 times its channel scales
            value = dequantized_weight(value.detach(), fp8_scale[key])
        elif state is not None:  # the exact dense view, in the dtype the weight was quantised from
            value = weight_format.dense_view(value.data, state, None)
        value = value.detach().to(device="cpu")
        module = lora_of.get(key)
        if module is not None:
            value = value.float()
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    value = value + module.get_delta_weight(adapter).detach().to("cpu", torch.float32)
        yield key, value


def merged_keys(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The base's state-dict tensors that the merged model keeps, as stored (NF4 packed, no delta added), under
    their merged keys: without PEFT's levels, without LoRA's and bitsandbytes' own tensors, and a module trained
    whole (``modules_to_save``) as its active trained copy under the module's own key."""
    base = base_model(model)
    state = base.state_dict(keep_vars=True)
    # a PeftModel's active adapters (a property there; on a plain transformers model a method of its own)
    active = set(model.active_adapters) if isinstance(model, PeftModel) else {"default"}
    for key, value in state.items():
        if "lora_" in key or _QUANT_STATE.search(key) or _is_fp8_scale(key, state):
            continue
        whole = _MODULES_TO_SAVE.search(key)
        if whole is not None:
            if whole.group(1) not in active:
                continue
            key = key.replace(whole.group(0), ".")
        elif ".original_module." in key:
            if any(key.replace(".original_module.", f".modules_to_save.{name}.") in state for name in active):
                continue
            key = key.replace(".original_module.", ".")
        yield _clean(key), value


# PEFT's trained copy of a module trained whole (ModulesToSaveWrapper): ".modules_to_save.<adapter>."
_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.([^.]+)\.")
# the keys bitsandbytes adds beside a 4-bit weight (absmax, quant_map, nested_*, quant_state.*)
_QUANT_STATE = re.compile(r"\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|quant_state\..*)$")


def _is_fp8_scale(key: str, state: dict) -> bool:
    """Whether `key` is an FP8 weight's scales (`fastft.models.fp8`: a projection's ``weight_scale``, stacked
    experts' ``gate_up_proj_scale`` / ``down_proj_scale``), which the merged 16-bit weight takes in: left out
    of the merged model."""
    if not key.endswith("_scale"):
        return False
    weight = state.get(key.removesuffix("_scale"))
    return weight is not None and weight.dtype == torch.float8_e4m3fn


def _clean(key: str) -> str:
    """A state-dict key without PEFT's ``base_layer`` levels (nested for several wrapped parameters)."""
    return ".".join(part for part in key.split(".") if part != "base_layer")


def save_merged(
    model: PeftModel,
    path: str | os.PathLike,
    tokenizer=None,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
    dequantize: bool = False,
    beside: bool = False,
) -> Path:
    """Write the merged model in `dtype` (16-bit by default) as safetensors that plain
    ``transformers.AutoModelForCausalLM.from_pretrained(path)`` loads, plus the tokenizer.
    `overwrite` as in `save_adapter`; `dequantize` as in `merged_state_dict` (a 4-bit base); `beside` writes
    into a folder fastft did not write, keeping every file there (`fastft.atomic.replace_folder_atomically`)."""

    if not isinstance(model, PeftModel):
        raise TypeError("save_merged needs a model with LoRA adapters (from fastft.add_lora).")
    check_destination(recover_folder(path), overwrite, beside)  # before the merge's work, not after
    state = merged_state_dict(model, dtype, dequantize=dequantize)
    config = model.get_base_model().config
    if getattr(config, "quantization_config", None) is not None:  # the merged weights are 16-bit
        import copy

        config = copy.deepcopy(config)
        del config.quantization_config
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

    return replace_folder_atomically(
        write, path, overwrite=overwrite, kind="merged", by="save_merged", beside=beside
    )

"""`ModelState`: everything fastft installs on one model, in one object with one slot per part.

A model carries one attribute, ``base.fastft_state`` on the base transformers model (under a PEFT model,
``peft_model.get_base_model()``), created on demand by `model_state`. Each part of fastft that installs
something on the model puts its object in its own slot and empties the slot when it is undone; nothing
else hangs on the model. The decoder layers reach the state through their `fastft.runtime.context.LayerContext`,
so two models in one process (or one trained on a background thread) never see each other's state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import fastft.weight_formats as weight_formats
from fastft.runtime.routing import RouterCollector

ATTRIBUTE = "fastft_state"  # the one attribute on the base model


@dataclass
class PackedAttentionState:
    """A model's packed attention (its ``model_state(model).attention``): the backend asked for (a name, or
    a backend function), the implementation to restore, and the backend resolved from it (its name and
    function), once known."""

    requested: str | Callable
    previous_implementation: str
    resolved: str | None = None  # the backend actually used, once known
    function: Callable | None = None  # and its function
    hook: object = None  # the decoder's pre-hook for padding-free Hugging Face inputs (`_padding_free_hook`)
    repad_hook: object = None  # its forward hook, giving unpadded batches their padded rows back (`fastft.runtime.unpadding.repad`)


@dataclass(eq=False)
class ModelState:
    """What fastft installed on one model; None in a slot means that part is not installed.

    ``lora``: the `fastft.models.lora.LoraSettings` `add_lora` used for the model's adapters.
    ``kernels``: the state of `fastft.models.patch.patch` (fused kernels, their report; `is_fused`).
    ``attention``: `PackedAttentionState` (packed attention and its backend, `fastft.runtime.attention`).
    ``offload``: the `fastft.runtime.offload.ActivationOffloader` of offloaded checkpointing.
    ``profile``: the `fastft.training.timing.StepProfile` whose hooks the model carries (one at a time).
    ``routers``: the `fastft.runtime.routing.RouterCollector` the model's MoE layers record their router
    logits into while the loss collects them (always present: it holds nothing between forwards).
    ``decode_graphs``: whether GRPO's rollouts replay their decode steps as CUDA graphs
    (`fastft.training.objectives.decode`); False once a capture failed on this model, so later rollouts do not retry.
    """

    lora: Any = None  # fastft.models.lora.LoraSettings (a higher layer's type)
    kernels: Any = None  # fastft.models.patch._PatchState (a higher layer's type)
    attention: PackedAttentionState | None = None
    offload: Any = None  # fastft.runtime.offload.ActivationOffloader (offload.py imports this module)
    profile: Any = None  # fastft.training.timing.StepProfile (a higher layer's type)
    routers: RouterCollector = field(default_factory=RouterCollector)
    decode_graphs: bool = True


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT model (``get_base_model()``), or `model` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def is_quantised(model: torch.nn.Module) -> bool:
    """Whether `model` (or the transformers model under a PEFT model) has a quantised base (NF4, int8:
    `fastft.weight_formats`)."""
    return weight_formats.of_model(model).quantized


def state_of(model: torch.nn.Module | None) -> ModelState | None:
    """The model's `ModelState`, or None when fastft never installed anything on it, or `model` is None
    (creates nothing)."""
    return getattr(base_model(model), "__dict__", {}).get(ATTRIBUTE)


def model_state(model: torch.nn.Module) -> ModelState:
    """The model's `ModelState`, created (empty) on first use."""
    base = base_model(model)
    state = vars(base).get(ATTRIBUTE)
    if state is None:
        state = ModelState()
        setattr(base, ATTRIBUTE, state)
    return state


__all__ = ["ModelState", "base_model", "model_state", "state_of"]

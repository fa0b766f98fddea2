"""Per-layer runtime state: each decoder layer's `LayerContext`, and the tensors one call keeps by name.

A decoder layer's modules (its attention, o_proj, MLP or MoE block) share one `LayerContext`, referenced
from each of them as ``module.fastft_layer`` (`attach_layer_contexts`, run by whatever installs something
that needs it: `fastft.runtime.offload.enable_offload`, `fastft.runtime.attention.patch_packed_attention`,
`fastft.models.patch.patch`). The context points at the model's `fastft.runtime.model_state.ModelState` (its
packed-attention backend, its router collector) and has one slot per layer call, ``kept``, which the
offloader fills for the duration of one call, forward or recompute, and empties after it. Nothing here is
global or thread-local: each model, and each of its layers, has its own.

Kept tensors (`KeptTensors`, on by default under offloaded checkpointing): the layer's attention output
and log-sum-exp travel with its input (one more device→host copy in the forward, in the same buffer on the
way back), and the recompute hands them to the attention kernel's backward instead of running the
attention forward again (`fastft.runtime.attention`): the kernel's own backward on the output the forward
really produced (bit-identical gradients on the CPU; on the GPU within bf16 rounding, see there). It saves
the attention forward of every layer's recompute (FLOPs quadratic in sequence length) for one attention
output per buffer of device memory (Llama-3.1-8B at 4,096 tokens: 2 × 33 MiB). The fused o_proj keeps its
output after it (`fastft.models.patch`), so the recompute skips that GEMM too, for as much again. An MoE
layer keeps its routing order the same way (int32 sorted slots and expert offsets: 4 bytes per routed
slot, at any length), so the recompute rebuilds the forward's routing plan without a top-k or a sort
(`fastft.models.moe`): the plan is built once per layer and step. Each keep has a name (`KEEPS`), so what
one module keeps can never be handed to another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch

from fastft.runtime.model_state import base_model, model_state

if TYPE_CHECKING:
    from fastft.runtime.model_state import ModelState

ATTRIBUTE = "fastft_layer"  # on a decoder layer and each of its modules
ATTENTION, OUTPUT_PROJECTION, ROUTING = "attention", "o_proj", "routing"
# What a layer call may keep for its recompute: the attention output and log-sum-exp, o_proj's output (kept
# only with the attention output: the recompute needs o_proj's input for its backward), an MoE routing order
KEEPS = (ATTENTION, OUTPUT_PROJECTION, ROUTING)


def keep_names(keep: bool | Collection[str]) -> frozenset[str]:
    """`keep` as a set of `KEEPS` names: True is all of them, False none."""
    if keep is True:
        return frozenset(KEEPS)
    if keep is False or keep is None:
        return frozenset()
    names = frozenset(keep)
    for name in names:
        _check(name)
    return names


def _check(name: str) -> None:
    if name not in KEEPS:
        raise ValueError(f"unknown kept-tensor name {name!r}: use one of {KEEPS}")


class KeptTensors:
    """Tensors one offloaded layer call keeps beside its input, by name, so that its recompute need not
    compute them again (the attention output and its log-sum-exp: `fastft.runtime.attention`; the fused
    o_proj's output: `fastft.models.patch`; an MoE layer's routing order: `fastft.models.moe`).

    In the forward (`recording`), ``keep(name, tensors, what)`` copies the tensors to host memory with the
    layer input and says whether it did (False when the offloader declines: that name is not kept, the host
    budget is reached, or a layout it cannot restore); `wants` says beforehand whether a name is kept at
    all. In the recompute, ``take(name)`` hands back ``(tensors, what)``, device tensors with their shapes
    and strides, or None where the forward kept nothing under that name: the caller then computes it, as
    it would without keeping. `kept` says whether a name was kept in this call."""

    __slots__ = ("_names", "_store", "entries", "_views", "_count", "from_length")

    def __init__(
        self,
        names: frozenset[str],
        store: Callable[[str, tuple[torch.Tensor, ...]], bool] | None = None,
        entries: dict | None = None,
        views: list[torch.Tensor] | None = None,
        from_length: int = 0,
    ):
        self._names, self._store, self._views = names, store, views
        # the attention output is kept for sequences this long and longer (and `KEEP_FROM_LENGTH`'s)
        self.from_length = from_length
        # name -> (what, index of its first tensor among the call's kept tensors, how many)
        self.entries: dict[str, tuple[object, int, int]] = {} if entries is None else dict(entries)
        self._count = sum(count for _, _, count in self.entries.values())

    @classmethod
    def recording_into(
        cls,
        names: frozenset[str],
        store: Callable[[str, tuple[torch.Tensor, ...]], bool],
        from_length: int = 0,
    ) -> KeptTensors:
        """For a layer's forward: `store(name, tensors)` copies them beside its input (False: declined);
        the attention output only for sequences of `from_length` tokens and more (and never below
        `fastft.runtime.activation_checkpointing.KEEP_FROM_LENGTH`)."""
        return cls(names, store=store, from_length=from_length)

    @classmethod
    def replaying(cls, forward: KeptTensors, views: list[torch.Tensor]) -> KeptTensors:
        """For the recompute of the call whose forward kept `forward`: its tensors, now `views` on the
        device (in the order they were kept)."""
        return cls(
            forward._names, entries=forward.entries, views=list(views), from_length=forward.from_length
        )

    @property
    def recording(self) -> bool:
        return self._views is None

    def wants(self, name: str) -> bool:
        """Whether this call keeps tensors under `name` at all (before computing what `keep` would get)."""
        _check(name)
        return name in self._names

    def keep(self, name: str, tensors: tuple[torch.Tensor, ...], what=None) -> bool:
        _check(name)
        if not self.recording:
            raise RuntimeError(f"keep({name!r}) in a recompute: keep in the forward, take in the recompute")
        if name in self.entries:
            raise RuntimeError(f"{name!r} was kept twice in one layer call: each name is kept once")
        if name not in self._names or not self._store(name, tensors):
            return False
        self.entries[name] = (what, self._count, len(tensors))
        self._count += len(tensors)
        return True

    def kept(self, name: str) -> bool:
        _check(name)
        return name in self.entries

    def take(self, name: str) -> tuple[tuple[torch.Tensor, ...], object] | None:
        _check(name)
        if self.recording:
            raise RuntimeError(f"take({name!r}) in a forward: keep in the forward, take in the recompute")
        entry = self.entries.pop(name, None)  # once: a second take computes
        if entry is None:
            return None
        what, first, count = entry
        return tuple(self._views[first : first + count]), what


class LayerContext:
    """One decoder layer's runtime state, shared by its modules (module docstring): ``model_state``, the
    model's `ModelState`, and ``kept``, the `KeptTensors` of the layer call running now (None outside an
    offloaded call, or when its offloader keeps nothing)."""

    __slots__ = ("model_state", "kept")

    def __init__(self, state: ModelState):
        self.model_state = state
        self.kept: KeptTensors | None = None

    @contextlib.contextmanager
    def running(self, kept: KeptTensors | None):
        """Fill the per-call slot for one layer call (forward or recompute)."""
        previous, self.kept = self.kept, kept
        try:
            yield self
        finally:
            self.kept = previous


def layer_context(module: torch.nn.Module) -> LayerContext | None:
    """The `LayerContext` of the decoder layer `module` belongs to, if one was attached."""
    return vars(module).get(ATTRIBUTE)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: transformers' `GradientCheckpointingLayer` modules, else
    ``get_decoder().layers``."""
    base = base_model(model)
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers < 4.52
        GradientCheckpointingLayer = None  # noqa: N806
    if GradientCheckpointingLayer is not None:
        layers = [m for m in base.modules() if isinstance(m, GradientCheckpointingLayer)]
        if layers:
            return layers
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    return list(getattr(decoder, "layers", None) or [])


def attach_layer_contexts(model: torch.nn.Module, layers=None) -> list[LayerContext]:
    """Give each decoder layer of `model` (or each of `layers`) a `LayerContext` on the model's
    `ModelState`, referenced from the layer and every module in it (idempotent: a layer keeps its context;
    a module added since gets it)."""
    state = model_state(model)
    layers = decoder_layers(model) if layers is None else list(layers)
    listed = {id(layer) for layer in layers}
    contexts = []
    for layer in layers:
        if any(id(inner) in listed for inner in layer.modules() if inner is not layer):
            continue  # a module holding layers (a decoder with checkpointing on) is no layer itself
        context = layer_context(layer)
        if context is None or context.model_state is not state:
            context = LayerContext(state)
        for module in layer.modules():
            if layer_context(module) is not context:
                setattr(module, ATTRIBUTE, context)
        contexts.append(context)
    return contexts


__all__ = [
    "ATTENTION",
    "KEEPS",
    "OUTPUT_PROJECTION",
    "ROUTING",
    "KeptTensors",
    "LayerContext",
    "attach_layer_contexts",
    "decoder_layers",
    "keep_names",
    "layer_context",
]

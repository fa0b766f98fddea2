"""Hooks that time a decoder-only model's modules, registered on the instance (never on classes).

Found by shape, not by class: the backbone is the first module with ``embed_tokens`` and a
``layers`` ModuleList (Llama, Qwen, Mistral, Gemma, MoE variants, PEFT-wrapped or not); per layer
the attention (``self_attn`` / ``attention`` / ``attn``), the MLP or MoE block (``mlp`` /
``block_sparse_moe`` / ``feed_forward``; a block with ``experts`` is timed as ``moe``) and every
direct child whose name contains ``norm``; then the final ``norm``. What is not found is not timed.

Forward: a pre-hook marks the start, the post-hook the end of ``layers.N.attention`` and so on.
The same hooks fire again when activation checkpointing recomputes a layer during backward: then
they count as ``layers.N.recompute``. Backward per layer: each layer's pre-hook (and the final
norm's) puts a gradient hook on the hidden state entering it. That gradient is complete exactly when
the backward of everything above has run, so each hook ends one span and starts the next:
``loss_backward`` (loss, head, final norm) until the last layer's input, then ``layers.N.backward``
(recompute included) until layer N's input; layer 0 (whose input needs no gradient under a frozen
embedding) runs until the end of backward. The spans come from the gradients themselves, so
they tile the backward pass whatever ran inside it.

Each function takes the `fastft.training.timing.StepProfile` that the hooks report to (``profile``; that
module imports this one). A model carries the hooks of at most one `StepProfile`: attaching another removes the first's. While it is
attached, the model's offloaded checkpointing (`fastft.runtime.offload`) times its waits through the profile's
`StepProfile.span` (an explicit hand-over: no global says which profile is running).
"""

from __future__ import annotations

import warnings

import torch

from fastft.runtime.model_state import model_state, state_of
from fastft.runtime.offload import no_span, offloader_of

# The pass a `fastft.training.timing.StepProfile` is in (its ``_state``): what a hook that fires times.
IDLE, FORWARD, BACKWARD = 0, 1, 2

_ATTENTION = ("self_attn", "attention", "attn")
_MLP = ("mlp", "block_sparse_moe", "feed_forward", "moe")
_FINAL_NORM = ("norm", "final_layernorm", "final_norm")


def find_backbone(model: torch.nn.Module) -> torch.nn.Module | None:
    """The module holding ``embed_tokens`` and the decoder ``layers`` (None for other shapes)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) and hasattr(module, "embed_tokens"):
            return module
    return None


def _child(module: torch.nn.Module, names: tuple[str, ...]) -> tuple[str, torch.nn.Module] | None:
    for name in names:
        child = getattr(module, name, None)
        if isinstance(child, torch.nn.Module):
            return name, child
    return None


def _module_hooks(profile, name: str, recompute: str | None, *, on_input=None, after=None):
    """Pre/post hooks timing one module: `name` in forward, `recompute` when it runs again in backward.

    `on_input(args)` runs in the forward pre-hook, `after()` after the forward span is recorded.
    """
    start = [-1]

    def pre(module, args):
        state = profile._state
        if state == FORWARD:
            label = name
            if on_input is not None:
                on_input(args)
        elif state == BACKWARD and recompute is not None:
            label = recompute
        else:
            return
        start[0] = profile._now()
        if profile._ranges:
            profile._push(label)

    def post(module, args, output):
        begun, start[0] = start[0], -1
        if begun < 0:
            return
        state = profile._state
        if state == FORWARD:
            profile._spans.append((name, begun, profile._now(), 1))
        elif state == BACKWARD:
            profile._spans.append((recompute, begun, profile._now(), 2))
        else:
            return
        if profile._ranges:
            profile._pop()
        if after is not None and state == FORWARD:
            after()

    return pre, post


def _first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _boundary(profile, following: str | None):
    """A function that puts a gradient hook on a hidden state: when its gradient is complete, the
    backward span running ends and `following` (the layer below's backward, or None) starts."""

    def on_grad(*grads):
        profile._boundary(following)

    def watch(hidden) -> None:
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            node = hidden.grad_fn
            # A pre-hook on the node that made the hidden state fires when its gradient is complete,
            # like a tensor hook, at a fifth of the cost (3 µs against 15 µs per call on a CPU).
            if node is not None:
                node.register_prehook(on_grad)
            else:
                hidden.register_hook(on_grad)

    return watch


def _layer_input_hook(profile, following: str | None):
    watch = _boundary(profile, following)

    def pre(module, args, kwargs):
        if profile._state == FORWARD:
            watch(args[0] if args else kwargs.get("hidden_states"))

    return pre


def instrument(model: torch.nn.Module, profile) -> tuple[list, list[str]]:
    """Register `profile`'s hooks on `model` (removing another profile's first); returns (handles, phase names).

    A model of another shape gets no hooks (top-level phases only); should registering fail half-way,
    the hooks registered so far are removed and a warning says so: timing never stops a run.
    """
    backbone = find_backbone(model)
    if backbone is None:
        return [], []
    previous = state_of(model).profile if state_of(model) is not None else None
    if previous is not None and previous is not profile:
        previous.detach()
    handles: list = []
    names: list[str] = []
    try:
        _register(backbone, profile, handles, names)
    except Exception as error:  # an architecture we did not foresee: time the top level only
        for handle in handles:
            handle.remove()
        warnings.warn(
            f"fastft.profile: could not hook {type(backbone).__name__} ({error}); only data, forward, "
            "backward and optimizer are timed.",
            stacklevel=3,
        )
        return [], []
    model_state(model).profile = profile
    offloader = offloader_of(model)
    if offloader is not None:
        offloader.span = profile.span
    return handles, names


def _register(backbone: torch.nn.Module, profile, handles: list, names: list[str]) -> None:
    def time_module(module: torch.nn.Module, name: str, recompute: str | None, **extra) -> None:
        pre, post = _module_hooks(profile, name, recompute, **extra)
        handles.append(module.register_forward_pre_hook(pre))
        # always_call: recompute under non-reentrant checkpointing stops early by raising out of the
        # module that produced the last tensor it needs; the post-hook still closes the span there.
        handles.append(module.register_forward_hook(post, always_call=True))
        names.append(name)

    embed = backbone.embed_tokens
    if isinstance(embed, torch.nn.Module):
        time_module(embed, "embed", None)
    layers = list(backbone.layers)
    for index, layer in enumerate(layers):
        prefix, recompute = f"layers.{index}.", f"layers.{index}.recompute"
        for child_name, child in layer.named_children():
            if "norm" in child_name.lower():
                time_module(child, prefix + "norm", recompute)
        attention = _child(layer, _ATTENTION)
        if attention is not None:
            time_module(attention[1], prefix + "attention", recompute)
        mlp = _child(layer, _MLP)
        if mlp is not None:
            kind = "moe" if hasattr(mlp[1], "experts") or "moe" in mlp[0] else "mlp"
            time_module(mlp[1], prefix + kind, recompute)
        # The input of layer N is the output of layer N-1: one boundary ends N's backward and starts N-1's.
        below = f"layers.{index - 1}.backward" if index else None
        handles.append(layer.register_forward_pre_hook(_layer_input_hook(profile, below), with_kwargs=True))
        names.append(prefix + "backward")
    top = f"layers.{len(layers) - 1}.backward"
    final = _child(backbone, _FINAL_NORM)
    if final is not None:
        watch = _boundary(profile, top)
        time_module(
            final[1],
            "final_norm",
            None,
            on_input=lambda args: watch(args[0] if args else None),
            after=lambda: profile._handoff("forward", "loss"),
        )
    else:  # the last layer's output then marks where the loss's backward ends
        watch = _boundary(profile, top)
        handles.append(
            layers[-1].register_forward_hook(
                lambda module, args, output: (
                    watch(_first_tensor(output)) if profile._state == FORWARD else None
                )
            )
        )


def release(model: torch.nn.Module, profile) -> None:
    """Forget that `model` carries `profile`'s hooks (after they were removed)."""
    state = state_of(model)
    if state is not None and state.profile is profile:
        state.profile = None
    offloader = offloader_of(model)
    if offloader is not None and getattr(offloader.span, "__self__", None) is profile:
        offloader.span = no_span


def detach_profile(model: torch.nn.Module) -> None:
    """Remove the hooks any `StepProfile` registered on `model` (a no-op when there are none)."""
    state = state_of(model)
    owner = state.profile if state is not None else None
    if owner is not None:
        owner.detach()

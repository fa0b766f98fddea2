"""Offloaded checkpointing: each decoder layer's input waits in pinned host memory, not on the GPU.

Plain recompute (``gradient_checkpointing=True``) keeps one tensor per layer on the device, the layer's
input hidden state, ``layers × tokens × hidden × bytes`` in all (Llama-3.1-8B at 32k tokens: 8 GiB).
Here that tensor goes to the host instead and comes back just before the layer's backward:

forward, layer i (compute stream S, copy stream C)::

    S: ──[layer i, no_grad: nothing saved]──[layer i+1]──▶
    C:   └wait(x_i ready on S)─[x_i → pinned host h_i]─▶      x_i.record_stream(C): its memory is not
                                                               reused until C has read it
backward, layer i (two device buffers A, B, allocated once and sized to the largest layer input)::

    C: ─[h_i → A]──(ready_i)─wait(free_B)─[h_{i-1} → B]──(ready_{i-1})─────────────────▶
    S: ─wait(ready_i)─[recompute layer i from A, backward]─(free_A)─wait(ready_{i-1})─[layer i-1 from B]

Protocol (all ordering through events; the host never blocks):
- S waits for ``ready`` (recorded on C after the host→device copy) before reading a buffer.
- C waits for ``free`` (recorded on S after the layer's backward) before writing a buffer again.
- Every access to a pinned host buffer is a copy on C, so stream order alone keeps a host buffer from
  being overwritten before its device→host copy landed or before it was read back.
- Prefetch (double buffering) copies the next layer's input while this layer recomputes, into the buffer
  this layer is not reading. With one buffer (``double_buffer=False``, "offload-single") each copy starts
  when its layer's backward starts and S stalls for all of it: the ablation.
Extra device memory is the two buffers, whatever the number of layers. When the pinned budget
(`fastft.runtime.host_budget`) cannot hold every layer's input, each forward offloads the first layers'
inputs that fit and runs the later layers as plain recompute, their inputs on the device (one
`OffloadBudgetWarning` per length), rather than none: `max_context` under an 80 GiB cap with 96 GiB to
pin answers 465,920 tokens on Llama-3.1-8B QLoRA r=32 (the estimator counts the same split and the same
power-of-two slabs, `fastft.runtime.host_budget.pinned_bytes`).

The pieces, one module each: the copy stream and its events (`fastft.runtime.copies`; ``copies=`` takes
another engine), the pinned host slabs and the budget (`fastft.runtime.host_memory`), one layer call's
autograd node, RNG and autocast replay (`fastft.runtime.offload_layer`), and what a layer keeps beside
its input for the recompute, by name (`fastft.runtime.context`: the attention output and log-sum-exp,
o_proj's output, an MoE routing order). This module holds the offloader, which owns the buffers and
the protocol above, and installs it.

fastft plugs this in through transformers' per-layer checkpointing hook (the instance attribute
``_gradient_checkpointing_func`` of each decoder layer, set by `enable_offload`), so a model stays a plain
`transformers`/`peft` model and `activation_checkpointing_disable()` undoes it. Use it through
``fastft.add_lora(model, gradient_checkpointing="offload")`` or
`fastft.models.lora.set_gradient_checkpointing`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from fastft.runtime import keep_fit
from fastft.runtime.activation_checkpointing import KEEP_QUANTISED_FROM_LENGTH
from fastft.runtime.context import ATTENTION, ROUTING, attach_layer_contexts, keep_names, layer_context
from fastft.runtime.copies import CudaCopies
from fastft.runtime.host_budget import layers_that_fit, pinned_bytes
from fastft.runtime.host_memory import HOST_BUDGET_FRACTION, HostSlabs, host_memory_available, pinnable_bytes
from fastft.runtime.model_state import base_model, is_quantised, model_state, state_of
from fastft.runtime.offload_layer import (
    Call,
    OffloadedLayer,
    Part,
    Saved,
    contiguous_strides,
    dense,
    module_of,
    needs_grad,
    storage_order,
    unflatten,
)


class KeepPolicy:
    """What an offloaded layer call keeps beside its input for the recompute, and when.

    `names`: `fastft.runtime.context.KEEPS` names. `from_length`: the attention output is kept only for
    sequences of at least this many tokens (and `KEEP_FROM_LENGTH`: `fastft.runtime.attention`).
    `fits_for`: when given (a model), a forward keeps anything only when its layer calls carry at least
    `from_length` tokens and the VRAM estimate for that many tokens with the attention kept still fits the
    device (`fastft.vram.estimate_vram` with ``keep_attention=None`` decides, as it does for
    `max_context`): the quantised bases' default (`default_keep`, and the measurements in
    `fastft.runtime.activation_checkpointing`). Each token count is estimated once (host arithmetic, no device sync)."""

    def __init__(
        self,
        names: bool | Collection[str],
        from_length: int = 0,
        fits_for: torch.nn.Module | None = None,
    ):
        self.names = keep_names(names)
        self.from_length = from_length
        self._model = None if fits_for is None else weakref.ref(fits_for)
        self._answers: dict[int, bool] = {}

    @property
    def conditional(self) -> bool:
        return self._model is not None

    def settings(self) -> tuple:
        return (self.names, self.from_length, self.conditional)

    def names_for(self, tokens: int, device: torch.device | None) -> frozenset[str]:
        """What a forward whose layer calls carry `tokens` tokens keeps."""
        if not self.conditional or not self.names:
            return self.names
        if tokens < self.from_length:
            return frozenset()
        if tokens not in self._answers:
            model = self._model()
            self._answers[tokens] = model is not None and _fits_keeping(model, tokens, device)
        return self.names if self._answers[tokens] else frozenset()


def _fits_keeping(model: torch.nn.Module, tokens: int, device: torch.device | None) -> bool:
    """Whether `estimate_vram` keeps the attention outputs for `tokens` tokens on this device (it does only
    where they fit): `fastft.vram.keeping.keeping_fits`, registered from above (`fastft.runtime.keep_fit`).
    Nothing is kept off CUDA or while a CUDA graph is captured (the estimate reads the device's free memory)."""
    if device is None or device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return False
    return keep_fit.keeping_fits(model, tokens, device)


class OffloadBudgetWarning(UserWarning):
    """Host memory cannot hold every layer's input (the first layers offload as many as fit, the others run
    as plain recompute), or pinning failed (every layer then runs as plain recompute)."""


@dataclass(frozen=True)
class OffloadStats:
    """What the offloader did since it was created (or last reset).

    ``bytes_offloaded``: device→host bytes; ``bytes_loaded``: host→device bytes. ``prefetched`` layers were
    copied back while the layer after them ran its backward; ``loaded_on_demand`` only when their own
    backward began. With timing on (CUDA): ``d2h_ms`` / ``h2d_ms`` are copy-stream times from CUDA events and
    ``wait_ms`` is how long the compute stream stood waiting for host→device copies; otherwise None.
    ``pinned_bytes`` is host memory held, ``device_buffer_bytes`` the device buffers (constant in depth).
    ``fallback_calls``: layer calls that ran as plain recompute (no offloading possible for that call).
    ``bytes_kept``: of ``bytes_offloaded``, what layers kept beside their inputs so that the recompute
    skips computing it (attention and o_proj outputs, MoE routing orders:
    `fastft.runtime.context.KeptTensors`).
    """

    layers_offloaded: int
    bytes_offloaded: int
    bytes_loaded: int
    prefetched: int
    loaded_on_demand: int
    fallback_calls: int
    bytes_kept: int
    pinned_bytes: int
    device_buffer_bytes: int
    d2h_ms: float | None = None
    h2d_ms: float | None = None
    wait_ms: float | None = None
    disabled: str | None = None

    @property
    def hidden_fraction(self) -> float | None:
        """Share of host→device copy time hidden behind compute: ``1 - wait_ms / h2d_ms``."""
        if self.h2d_ms is None or self.wait_ms is None or self.h2d_ms <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.wait_ms / self.h2d_ms))


def no_span(name: str) -> contextlib.AbstractContextManager:
    """The offloader's span when no step profile is attached: times nothing."""
    return contextlib.nullcontext()


class ActivationOffloader:
    """The checkpoint function installed on each decoder layer: ``offloader(function, hidden, *rest)``.

    `double_buffer`: two device buffers and prefetch ("offload"), or one buffer and no prefetch
    ("offload-single", the ablation). `layers`: how many layers use it (for the pinned-memory check).
    `timing`: record CUDA events for `stats`. `keep`: what a layer call keeps beside its input for the
    recompute, as `fastft.runtime.context.KEEPS` names (True: all of them; False: none; without
    ``"o_proj"`` the fused o_proj recomputes its output), or a `KeepPolicy` (what, and when). `copies`: the
    copy engine (`fastft.runtime.copies`); None: a `CudaCopies` on the first CUDA device a layer input comes from.
    Layer inputs on any other device run as plain recompute.
    """

    def __init__(
        self,
        double_buffer: bool = True,
        layers: int = 0,
        host_budget_bytes: int | None = None,
        timing: bool = False,
        keep: bool | Collection[str] | KeepPolicy = True,
        copies=None,
    ):
        self.double_buffer = double_buffer
        self.policy = keep if isinstance(keep, KeepPolicy) else KeepPolicy(keep)
        self.keeps = self.policy.names
        self.forward_keeps = frozenset() if self.policy.conditional else self.keeps  # this forward's
        self.layers = layers
        self.host_budget_bytes = host_budget_bytes
        self.timing = timing
        self.copies_given = copies
        self.disabled: str | None = None
        self._copies = copies
        self.device: torch.device | None = None if copies is None else torch.device(copies.device)
        count = 2 if double_buffer else 1
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._owners: list[weakref.ref | None] = [None] * count
        self._free: list = [None] * count
        self._host = HostSlabs(pin=True if copies is None else copies.pin_host)
        self._live = 0
        self._last: weakref.ref | None = None
        self._lock = threading.RLock()
        self._keep_room: int | None = None  # host bytes left for `KeptTensors` in this forward
        # layers of this forward whose inputs the pinned budget holds (None: all); the others recompute
        self._forward_limit: int | None = None
        self._limits_told: set[tuple[int, int]] = set()
        # Times a named span of the running step (the step profiler sets it while it is attached to the
        # model: `fastft.training.timing_hooks`); the wait for a host→device copy is timed as "offload_wait".
        self.span = no_span
        self._reset_counts()

    @property
    def mode(self) -> str:
        return "offload" if self.double_buffer else "offload-single"

    def device_tensors(self) -> list[torch.Tensor]:
        """The device buffers the layer inputs (and what they keep) are copied back into, held between steps
        once made (what `fastft.vram.measure.resident_memory` counts)."""
        return [buffer for buffer in self._buffers if buffer is not None]

    @property
    def keep(self) -> bool:
        """Whether layer calls keep anything beside their inputs (`keeps` says what)."""
        return bool(self.keeps)

    def settings(self) -> tuple:
        return (
            self.double_buffer,
            self.host_budget_bytes,
            self.timing,
            self.policy.settings(),
            self.copies_given,
        )

    def _reset_counts(self) -> None:
        self.counts = dict.fromkeys(
            (
                "layers_offloaded",
                "bytes_offloaded",
                "bytes_loaded",
                "prefetched",
                "loaded_on_demand",
                "fallback_calls",
                "bytes_kept",
            ),
            0,
        )
        if self._copies is not None:
            self._copies.drain(block=self._copies.timing)
            self._copies.ms = dict.fromkeys(self._copies.ms, 0.0)

    # -- the checkpoint hook -------------------------------------------------------------------
    def __call__(self, function, *args):
        if not torch.is_grad_enabled():  # nothing to recompute for
            return function(*args)
        hidden = args[0] if args else None
        module = module_of(function)
        usable = (
            self.disabled is None
            and isinstance(hidden, torch.Tensor)
            and hidden.is_floating_point()
            and module is not None
            and self._offloads(hidden.device)
            and not needs_grad(args[1:])
            and not needs_grad(getattr(function, "keywords", None) or {})
        )
        params = [p for p in module.parameters() if p.requires_grad] if usable else []
        if usable and not params and not hidden.requires_grad:  # no backward will come
            return function(*args)
        host = self._host_for(hidden) if usable else None
        if host is None:
            self.counts["fallback_calls"] += 1
            return checkpoint(function, *args, use_reentrant=False)
        call = Call(self, function, args[1:], params, host, layer_context(module))
        flat = OffloadedLayer.apply(call, hidden, *params)
        if call.router_specs:  # hand the layer's router logits, now part of the graph, to the loss
            extra = len(call.router_specs)
            for spec, logits in zip(call.router_specs, flat[len(flat) - extra :], strict=True):
                call.routers.record_logits(logits, spec)
            flat = flat[: len(flat) - extra]
        return unflatten(flat, call.structure)

    def _offloads(self, device: torch.device) -> bool:
        if self._copies is None:  # the default engine, on the first CUDA device seen
            if device.type != "cuda":
                return False
            self.device = device
            self._copies = CudaCopies(device, self.timing)
        return device == self.device

    # -- host memory ---------------------------------------------------------------------------
    def _budget(self) -> int | None:
        return pinnable_bytes(self._host.bytes, self.host_budget_bytes)

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        warnings.warn(reason, OffloadBudgetWarning, stacklevel=4)

    def _host_for(self, hidden: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        nbytes = hidden.numel() * hidden.element_size()
        with self._lock:
            if self._live == 0:  # the first layer of a forward: will the whole forward fit?
                tokens = hidden.numel() // max(1, hidden.shape[-1])
                self.forward_keeps = self.policy.names_for(tokens, hidden.device) & self.keeps
                layers = max(1, self.layers)
                need, budget = pinned_bytes(nbytes, layers), self._budget()
                # what `_keep` may add this forward: layers whose keeps do not fit recompute as before
                self._keep_room = None if budget is None else budget - need
                self._forward_limit = None
                if budget is not None and need > budget:
                    # the first layers' inputs fill the budget; the later layers keep theirs on the device
                    self._forward_limit = layers_that_fit(nbytes, layers, budget)
                    self._keep_room = 0
                    self._tell_limit(hidden, need, budget, layers)
            if self._forward_limit is not None and self._live >= self._forward_limit:
                return None
            try:
                offloading = self.layers if self._forward_limit is None else self._forward_limit
                return self._host.take(nbytes, count=max(1, offloading - self._live))
            except RuntimeError as error:
                self._disable(
                    f"pinning host memory for offloaded checkpointing failed ({error}); layers use plain "
                    "recompute from now on (on WSL, pinned memory is capped: use gradient_checkpointing=True)"
                )
                return None

    def _tell_limit(self, hidden: torch.Tensor, need: int, budget: int, layers: int) -> None:
        """One `OffloadBudgetWarning` per (length, budget) whose layer inputs the pinned budget cannot all hold."""
        if (need, budget) in self._limits_told:
            return
        self._limits_told.add((need, budget))
        tokens, width = hidden.numel() // hidden.shape[-1], hidden.shape[-1]
        held = min(layers, self._forward_limit)
        warnings.warn(
            f"offloaded checkpointing needs {need / 2**30:.1f} GiB of pinned host memory ({layers} layers × "
            f"{tokens} tokens × {width} × {hidden.element_size()} bytes) but may pin {budget / 2**30:.1f} GiB "
            f"({HOST_BUDGET_FRACTION:.0%} of available host memory, or host_budget_bytes): the inputs of the "
            f"first {held} of {layers} layers go to host memory, the other {layers - held} stay on the GPU "
            "(plain recompute). Shorten max_seq_length or free host memory to offload them all.",
            OffloadBudgetWarning,
            stacklevel=5,
        )

    # -- forward: save ----------------------------------------------------------------------------
    def _save(self, call: Call, hidden: torch.Tensor) -> None:
        nbytes = hidden.numel() * hidden.element_size()
        with self._lock:
            last = self._last() if self._last is not None else None
            prev = weakref.ref(last) if last is not None and not last.done else None
            part = Part(call.host, 0, nbytes, hidden.dtype, hidden.shape, contiguous_strides(hidden.shape))
            saved = Saved(self, part, prev)
            self._live += 1
            self._last = weakref.ref(saved)
        self._copies.to_host(part.view(call.host[1]), hidden)
        call.host = None
        call.saved = saved
        self.counts["layers_offloaded"] += 1
        self.counts["bytes_offloaded"] += nbytes

    def _keep(self, call: Call, name: str, tensors: tuple[torch.Tensor, ...]) -> bool:
        """Copy `tensors` to host memory beside the call's layer input, if `name` is kept (see
        `fastft.runtime.context.KeptTensors`)."""
        saved = call.saved
        if saved is None or name not in self.forward_keeps:
            return False
        if not all(t.device == self.device and dense(t) for t in tensors):
            return False
        sizes = [t.numel() * t.element_size() for t in tensors]
        with self._lock:
            if self._keep_room is not None:
                if sum(sizes) > self._keep_room:
                    return False
                self._keep_room -= sum(sizes)
            slots = []
            try:
                for n in sizes:
                    slots.append(self._host.take(n, count=max(1, self.layers - self._live + 1)))
            except RuntimeError:  # pinning failed: keep nothing more, recompute instead
                for slot in slots:
                    self._host.give(slot)
                self.keeps = self.forward_keeps = frozenset()
                return False
            parts = [saved.add(slot, t) for slot, t in zip(slots, tensors, strict=True)]
        for part, tensor in zip(parts, tensors, strict=True):
            host = part.slot[1][: part.nbytes].view(part.dtype)
            self._copies.to_host(host, storage_order(tensor))
        self.counts["bytes_kept"] += sum(sizes)
        self.counts["bytes_offloaded"] += sum(sizes)
        return True

    # -- backward: load, prefetch, release ----------------------------------------------------
    def _owner(self, index: int) -> Saved | None:
        ref = self._owners[index]
        saved = ref() if ref is not None else None
        return saved if saved is not None and not saved.done and saved.buffer == index else None

    def _copy_in(self, saved: Saved, exclude: int | None) -> None:
        """Start copying `saved` into a device buffer other than `exclude` (taking one from a stale
        prefetch if both are held)."""
        choices = [i for i in range(len(self._buffers)) if i != exclude]
        index = next((i for i in choices if self._owner(i) is None), choices[0])
        victim = self._owner(index)
        if victim is not None:
            victim.buffer = victim.ready = None  # it will be copied in again when its turn comes
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < saved.nbytes:
            buffer = torch.empty(saved.nbytes, dtype=torch.uint8, device=self.device)
            self._copies.protect(buffer)
            self._buffers[index] = buffer
            # fresh memory may still be read by kernels queued on the compute stream before it was freed
            self._free[index] = self._copies.mark()
        for part in saved.parts:  # on one stream: the last copy's event marks them all done
            host = part.slot[1][: part.nbytes]
            saved.ready = self._copies.to_device(
                buffer[part.offset : part.offset + part.nbytes], host, self._free[index]
            )
            self.counts["bytes_loaded"] += part.nbytes
        saved.buffer = index
        self._owners[index] = weakref.ref(saved)

    def _load(self, saved: Saved) -> list[torch.Tensor]:
        """The layer input and what it kept, as views of the device buffer they were copied into."""
        with self._lock:
            if saved.buffer is None:
                self._copy_in(saved, exclude=None)
                self.counts["loaded_on_demand"] += 1
            else:
                self.counts["prefetched"] += 1
            index = saved.buffer
        with self.span("offload_wait"):
            self._copies.wait(saved.ready)
        return [part.view(self._buffers[index]) for part in saved.parts]

    def _prefetch(self, current: Saved) -> None:
        if not self.double_buffer or current.prev is None:
            return
        with self._lock:
            following = current.prev()  # the layer whose backward comes next
            if following is not None and not following.done and following.buffer is None:
                self._copy_in(following, exclude=current.buffer)

    def _release(self, saved: Saved, used: bool) -> None:
        with self._lock:
            if saved.done:
                return
            saved.done = True
            self._live -= 1
            if saved.buffer is not None and used:
                self._free[saved.buffer] = self._copies.mark()
            if saved.buffer is not None:
                self._owners[saved.buffer] = None
            saved.buffer = saved.ready = None
            for part in saved.parts:  # later copies into a slot are on the copy stream, after this one's
                self._host.give(part.slot)
            saved.parts = []
        if used and self._copies is not None:
            self._copies.drain(block=False)

    # -- stats ----------------------------------------------------------------------------------
    def stats(self, reset: bool = False) -> OffloadStats:
        """Counts and (with timing, on CUDA) copy and wait times; synchronises the device when timing."""
        timed = self._copies is not None and self._copies.timing
        if timed:
            self._copies.drain(block=True)
        ms = self._copies.ms if timed else {}
        result = OffloadStats(
            **self.counts,
            pinned_bytes=self._host.bytes,
            device_buffer_bytes=sum(b.numel() for b in self._buffers if b is not None),
            d2h_ms=ms.get("d2h"),
            h2d_ms=ms.get("h2d"),
            wait_ms=ms.get("wait"),
            disabled=self.disabled,
        )
        if reset:
            self._reset_counts()
        return result


# -- installing on a model ----------------------------------------------------------------------
def _checkpointed_modules(base: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in base.modules() if getattr(m, "gradient_checkpointing", False) is True]


def _is_layer(module: torch.nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers < 4.52
        return True
    return isinstance(module, GradientCheckpointingLayer)


def default_keep(model: torch.nn.Module) -> bool | KeepPolicy:
    """What offloading keeps unless told otherwise. On 16-bit bases: everything (attention and o_proj
    outputs, routing orders) from `KEEP_FROM_LENGTH` tokens on. On 4- and 8-bit bases, the memory-first
    choice: the attention output and routing orders, only for sequences of `KEEP_QUANTISED_FROM_LENGTH`
    tokens and more and only where the estimate with them still fits the device (`KeepPolicy`). Below that
    the attention forward is cheap and keeping costs two device buffers for a few percent of the step; above
    it the recompute of the attention forward is a sixth of the step (docs/journal.md, "Measurements once quoted in code comments").
    ``enable_offload(keep_attention=True)`` keeps everything on a quantised base too."""
    if not is_quantised(model):
        return True
    return KeepPolicy((ATTENTION, ROUTING), KEEP_QUANTISED_FROM_LENGTH, fits_for=model)


def enable_offload(
    model: torch.nn.Module,
    double_buffer: bool = True,
    host_budget_bytes: int | None = None,
    timing: bool = False,
    keep_attention: bool | Collection[str] | KeepPolicy | None = None,
    copies=None,
) -> ActivationOffloader:
    """Make the model's checkpointed layers offload their inputs (see the module docstring).

    Checkpointing must already be on (``set_gradient_checkpointing(model, "offload")`` does both). Calling
    it again with the same settings keeps the offloader (and its buffers); other settings replace it.
    `timing` records CUDA events for `offload_stats`. `keep_attention`: each layer's attention output and
    log-sum-exp (and the fused o_proj's output) travel with its input, so the recompute skips the attention
    forward and o_proj (`fastft.runtime.context.KeptTensors`; from
    ``fastft.runtime.attention.KEEP_FROM_LENGTH`` tokens on), and so does an MoE layer's routing order, so
    the recompute skips the top-k and the sort; or the `fastft.runtime.context.KEEPS` names to keep (the
    ablations: ``("attention", "routing")`` recomputes o_proj), or a `KeepPolicy`. None (the default):
    `default_keep` (everything on 16-bit bases; on quantised ones the attention output of long sequences
    where it fits). `copies`: the copy engine (`ActivationOffloader`). Each
    checkpointed layer gets its `fastft.runtime.context.LayerContext`. Returns the offloader, also at
    ``model_state(model).offload``.
    """
    base = base_model(model)
    if keep_attention is None:
        keep_attention = default_keep(base)
    modules = _checkpointed_modules(base)
    if not modules:
        raise ValueError(
            "gradient checkpointing is off on this model, so there is nothing to offload: use "
            "fastft.models.lora.set_gradient_checkpointing(model, 'offload')"
        )
    state = model_state(base)
    current = state.offload
    policy = keep_attention if isinstance(keep_attention, KeepPolicy) else KeepPolicy(keep_attention)
    wanted = (double_buffer, host_budget_bytes, timing, policy.settings(), copies)
    if current is None or current.settings() != wanted:
        layers = sum(_is_layer(m) for m in modules) or len(modules)
        current = ActivationOffloader(
            double_buffer, layers, host_budget_bytes, timing, keep=policy, copies=copies
        )
        state.offload = current
    attach_layer_contexts(base, modules)
    for module in modules:
        module._gradient_checkpointing_func = current
    return current


def disable_offload(model: torch.nn.Module) -> None:
    """Back to plain recompute on the layers that offloaded; the offloader and its buffers are dropped."""
    base = base_model(model)
    state = state_of(base)
    offloader = None if state is None else state.offload
    if offloader is None:
        return
    for module in base.modules():
        if getattr(module, "_gradient_checkpointing_func", None) is offloader:
            module._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    state.offload = None


def offloader_of(model: torch.nn.Module) -> ActivationOffloader | None:
    state = state_of(model)
    return None if state is None else state.offload


def offload_stats(model: torch.nn.Module, reset: bool = False) -> OffloadStats | None:
    """The model's `OffloadStats` (None when it does not offload); read between steps."""
    offloader = offloader_of(model)
    return None if offloader is None else offloader.stats(reset)


__all__ = [
    "HOST_BUDGET_FRACTION",
    "ActivationOffloader",
    "OffloadBudgetWarning",
    "OffloadStats",
    "disable_offload",
    "enable_offload",
    "host_memory_available",
    "KeepPolicy",
    "default_keep",
    "no_span",
    "offload_stats",
    "offloader_of",
]

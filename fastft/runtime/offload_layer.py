"""One offloaded layer call: its autograd node, what it saved in host memory, and how it recomputes.

The layer runs inside a `torch.autograd.Function` (like reentrant checkpointing, but gradients of the
layer's trainable parameters are returned to the outer graph rather than accumulated by a nested
``backward``, so ``torch.autograd.grad`` and ``inputs=`` work). RNG state (dropout) and autocast are
restored for the recompute as `torch.utils.checkpoint` does, and stored activations keep their dtype, so
gradients are bit-identical to plain recompute. The hidden-state tensor is offloaded; keyword arguments
(the `PackedBatch`, RoPE cos/sin, masks) are kept by reference.

For the duration of the call, forward and recompute, the layer's `fastft.runtime.context.LayerContext`
holds the call's `KeptTensors` (what the layer keeps beside its input for the recompute, by name), and the
model's router collector collects into a list of the call's own: MoE router logits recorded inside the
layer (for the load-balancing loss) leave the node as extra outputs after the layer's own. The forward
runs without autograd, so this is how their gradient comes back to the recompute, like the hidden
state's. The offloader (`fastft.runtime.offload.ActivationOffloader`) does the copies.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import NamedTuple

import torch

from fastft.runtime.context import KeptTensors, LayerContext
from fastft.runtime.routing import RouterCollector, RouterRecord, watch_unfused_routers

ALIGN = 512  # bytes: where each kept tensor starts in a device buffer


class Part(NamedTuple):
    """One tensor of an offloaded layer call: its host slot, and where it lies in the device buffer
    (``offset``, ``nbytes``) with its dtype, shape and strides (the layout it had on the device)."""

    slot: tuple[int, torch.Tensor]
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        flat = buffer[self.offset : self.offset + self.nbytes].view(self.dtype)
        return flat.as_strided(self.shape, self.stride)


def dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its memory exactly (contiguous after some permutation of its dimensions), so
    copying its bytes in storage order and restoring its strides gives it back as it was."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def storage_order(t: torch.Tensor) -> torch.Tensor:
    return t.as_strided((t.numel(),), (1,))


def contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class Saved:
    """A layer input living in a host buffer, followed by what the layer kept beside it (`add`); `buffer`
    is the device buffer they were copied back into, all parts in one."""

    __slots__ = (
        "offloader",
        "parts",
        "nbytes",
        "prev",
        "buffer",
        "ready",
        "done",
        "__weakref__",
    )

    def __init__(self, offloader, part: Part, prev):
        self.offloader = weakref.ref(offloader)
        self.parts, self.nbytes, self.prev = [part], part.nbytes, prev
        self.buffer: int | None = None
        self.ready = None
        self.done = False

    def add(self, slot, tensor: torch.Tensor) -> Part:
        offset = -(-self.nbytes // ALIGN) * ALIGN
        nbytes = tensor.numel() * tensor.element_size()
        part = Part(slot, offset, nbytes, tensor.dtype, tensor.shape, tensor.stride())
        self.parts.append(part)
        self.nbytes = offset + nbytes
        return part

    def __del__(self):  # the graph was dropped without a backward: give the buffers back
        offloader = self.offloader()
        if offloader is not None and not self.done:
            offloader._release(self, used=False)


class Call:
    """One layer call: what the recompute needs (function, other args, RNG and autocast state), the
    layer's `LayerContext` (None for a module outside a decoder layer: nothing kept, no router records)."""

    __slots__ = (
        "offloader",
        "function",
        "rest",
        "params",
        "host",
        "context",
        "saved",
        "structure",
        "rng",
        "autocast",
        "router_specs",
        "kept",
    )

    def __init__(self, offloader, function, rest, params, host, context: LayerContext | None):
        self.offloader, self.function, self.rest, self.params, self.host = (
            offloader,
            function,
            rest,
            params,
            host,
        )
        self.context = context
        self.saved = self.structure = self.rng = self.autocast = None
        self.router_specs: list = []  # `RouterSpec` of each MoE router this call ran, when collected
        self.kept: KeptTensors | None = None  # what the forward kept (None: it kept nothing)

    @property
    def routers(self) -> RouterCollector | None:
        return None if self.context is None else self.context.model_state.routers

    def stash_state(self, device: torch.device) -> None:
        self.rng = (
            torch.get_rng_state(),
            torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        )
        kinds = [device.type] + (["cpu"] if device.type != "cpu" else [])
        self.autocast = [
            (
                kind,
                torch.is_autocast_enabled(kind),
                torch.get_autocast_dtype(kind),
                torch.is_autocast_cache_enabled(),
            )
            for kind in kinds
        ]

    def recompute(self, hidden: torch.Tensor):
        device = hidden.device
        cuda = device.type == "cuda"
        with torch.random.fork_rng(devices=[device] if cuda else [], device_type="cuda"):
            torch.set_rng_state(self.rng[0])
            if cuda:
                torch.cuda.set_rng_state(self.rng[1], device)
            with torch.enable_grad(), _autocast(self.autocast):
                return self.function(hidden, *self.rest)

    def running(self, kept: KeptTensors | None):
        """The layer's context holding `kept` for the duration of one run of the layer."""
        return contextlib.nullcontext() if self.context is None else self.context.running(kept)


def _autocast(states):
    stack = contextlib.ExitStack()
    for kind, enabled, dtype, cache in states:
        stack.enter_context(torch.autocast(kind, enabled=enabled, dtype=dtype, cache_enabled=cache))
    return stack


_TENSOR = object()  # marks where a tensor goes back when a layer's output is rebuilt


def flatten(outputs):
    """The tensors of a layer's output (a tensor, or a tuple/list holding tensors) and how to rebuild it."""
    if isinstance(outputs, torch.Tensor):
        return (outputs,), None
    if isinstance(outputs, (tuple, list)):
        tensors = tuple(o for o in outputs if isinstance(o, torch.Tensor))
        template = [_TENSOR if isinstance(o, torch.Tensor) else o for o in outputs]
        return tensors, (type(outputs), template)
    raise TypeError(
        f"offloaded checkpointing expects a layer to return tensors, got {type(outputs).__name__}"
    )


def unflatten(tensors, structure):
    if structure is None:
        return tensors[0]
    kind, template = structure
    it = iter(tensors)
    return kind([next(it) if item is _TENSOR else item for item in template])


class OffloadedLayer(torch.autograd.Function):
    """The layer as one autograd node (module docstring): ``apply(call, hidden, *params)`` returns the
    layer's output tensors, then the router logits recorded inside it."""

    @staticmethod
    def forward(ctx, call: Call, hidden: torch.Tensor, *params: torch.Tensor):
        offloader = call.offloader
        offloader._save(call, hidden)
        call.stash_state(hidden.device)
        keeps = offloader.forward_keeps if call.context is not None else frozenset()
        store = functools.partial(offloader._keep, call)
        kept = KeptTensors.recording_into(keeps, store, offloader.policy.from_length) if keeps else None
        routers = call.routers
        collect = routers is not None and routers.collecting
        with _router_records_of(routers, collect) as records, call.running(kept):
            flat, call.structure = flatten(call.function(hidden, *call.rest))  # no_grad: nothing saved
        call.kept = kept if kept is not None and kept.entries else None
        call.router_specs = [r.spec for r in records]
        flat = (*flat, *(r.logits for r in records))
        ctx.mark_non_differentiable(*(t for t in flat if not t.is_floating_point()))
        ctx.call = call
        return flat

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        saved = call.saved
        if saved is None:
            raise RuntimeError(
                "backward ran twice through an offloaded layer; its input is gone (retain_graph=True is "
                "not supported with gradient_checkpointing='offload': use True)"
            )
        offloader = call.offloader
        hidden, *views = offloader._load(saved)
        offloader._prefetch(saved)
        hidden = hidden.detach().requires_grad_(ctx.needs_input_grad[1])
        kept = KeptTensors.replaying(call.kept, views) if call.kept is not None else None
        collect = bool(call.router_specs)
        saved_storages: set[int] = {hidden.untyped_storage().data_ptr()}
        saved_storages.update(v.untyped_storage().data_ptr() for v in views)
        with (
            _router_records_of(call.routers, collect, recompute_of=call) as records,
            call.running(kept),
            _recording_saved(saved_storages),
        ):
            flat, _ = flatten(call.recompute(hidden))
        del views, kept
        flat = [*flat, *(r.logits for r in records)]
        pairs = [(o, g) for o, g in zip(flat, grads, strict=True) if g is not None and o.requires_grad]
        _free_unread_outputs([o for o, _ in pairs], saved_storages)
        wanted = ([hidden] if hidden.requires_grad else []) + list(call.params)
        found = (
            torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
            if pairs and wanted
            else [None] * len(wanted)
        )
        del flat, pairs, wanted
        offloader._release(saved, used=True)  # after every kernel reading the buffer was enqueued
        call.saved = None
        hidden_grad = found[0] if hidden.requires_grad else None
        param_grads = found[1:] if hidden.requires_grad else found
        return (None, hidden_grad, *param_grads)


@contextlib.contextmanager
def _recording_saved(storages: set[int]):
    """Add to `storages` the storage of every tensor autograd saves for backward inside the block (the
    recompute): what `_free_unread_outputs` must not free."""

    def pack(tensor):
        storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def _free_unread_outputs(outputs: list[torch.Tensor], saved: set[int]) -> None:
    """Free the memory of the recompute's outputs that backward never reads, before the backward runs.

    A decoder layer's recompute ends with the residual add, whose output (one ``[tokens, hidden]`` tensor)
    is only the root the layer's gradients are taken from: autograd needs its shape, never its values
    (AddBackward saves nothing). Kept, it stays allocated through the whole layer backward, at the moment
    the layer's MLP backward peaks (Llama-3.1-8B at 4,096 tokens: 32 MiB; at 131,072 tokens: 1 GiB). An
    output whose storage something saved for backward, or the layer input and kept tensors use, keeps its
    memory; so does one that is a view into a larger storage. The tensors keep their shapes (the storage is
    resized to nothing, as FSDP frees its unsharded parameters)."""
    for output in outputs:
        storage = output.untyped_storage()
        if (
            storage.data_ptr() == 0
            or storage.data_ptr() in saved
            or storage.nbytes() != output.numel() * output.element_size()
        ):
            continue
        storage.resize_(0)


@contextlib.contextmanager
def _router_records_of(routers: RouterCollector | None, collect: bool, recompute_of: Call | None = None):
    """The router records (`fastft.runtime.routing.RouterRecord`) of one layer call, when `collect`: in the
    forward when the loss collects them, in the recompute (`recompute_of`) when the forward had some, so
    both give the layer the same extra outputs. Fused MoE blocks record themselves whenever a collection is
    open on the model's `routers`; transformers' blocks were watched by the loss's router hooks in the
    forward, so the recompute watches the layer's routers itself and pairs their logits with the forward's
    specs."""
    if not collect or routers is None:
        yield []
        return
    captured: list[torch.Tensor] = []
    layer = module_of(recompute_of.function) if recompute_of is not None else None
    with routers.collect() as records:
        handles = []
        if layer is not None:
            handles = watch_unfused_routers(layer, captured.append)
        try:
            yield records
        finally:
            for handle in handles:
                handle.remove()
    if captured:
        records.extend(
            RouterRecord(logits, spec)
            for logits, spec in zip(captured, recompute_of.router_specs[len(records) :], strict=True)
        )
    if any(not isinstance(r, RouterRecord) for r in records):
        raise TypeError("an offloaded layer can hand out router logits (RouterCollector.record_logits) only")


def module_of(function) -> torch.nn.Module | None:
    """The layer behind transformers' ``partial(forward, layer, **kwargs)`` (or ``partial(super().__call__)``)."""
    if isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], torch.nn.Module):
            return function.args[0]
        function = function.func
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def needs_grad(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(needs_grad(v) for v in value)
    if isinstance(value, dict):
        return any(needs_grad(v) for v in value.values())
    return False

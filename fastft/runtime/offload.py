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
  this layer is not reading. With one buffer ("offload-single") each copy starts when its layer's backward
  starts and S stalls for all of it: the ablation.
Extra device memory is the two buffers, whatever the number of layers.

The layer runs inside a `torch.autograd.Function` (like reentrant checkpointing, but gradients of the
layer's trainable parameters are returned to the outer graph rather than accumulated by a nested
``backward``, so ``torch.autograd.grad`` and ``inputs=`` work). RNG state (dropout) and autocast are
restored for the recompute as `torch.utils.checkpoint` does, and stored activations keep their dtype, so
gradients are bit-identical to plain recompute. The hidden-state tensor is offloaded; keyword arguments
(the `PackedBatch`, RoPE cos/sin, masks) are kept by reference.

Kept attention (`KeptTensors`, on by default): the layer's attention output and log-sum-exp travel with
its input (one more device→host copy in the forward, in the same buffer on the way back), and the
recompute hands them to the attention kernel's backward instead of running the attention forward again
(`fastft.runtime.attention`): the kernel's own backward on the output the forward really produced
(bit-identical gradients on the CPU; on the GPU within bf16 rounding, see there). It saves the
attention forward of every layer's recompute (FLOPs quadratic in sequence length) for one attention
output per buffer of device memory (Llama-3.1-8B at 4,096 tokens: 2 × 33 MiB). The fused o_proj keeps its
output after it (`fastft.models.patch`), so the recompute skips that GEMM too, for as much again. An MoE
layer keeps its
routing order the same way (int32 sorted slots and expert offsets: 4 bytes per routed slot, at any
length), so the recompute rebuilds the forward's routing plan without a top-k or a sort
(`fastft.models.moe`): the plan is built once per layer and step.

fastft plugs this in through transformers' per-layer checkpointing hook (the instance attribute
``_gradient_checkpointing_func`` of each decoder layer, set by `enable_offload`), so a model stays a plain
`transformers`/`peft` model and `activation_checkpointing_disable()` undoes it. Use it through
``fastft.add_lora(model, gradient_checkpointing="offload")`` or
`fastft.models.lora.set_gradient_checkpointing`.

Pinned-memory budget: before the first layer of each forward the whole forward's need (layers × bytes of
one layer input) is compared with what may be pinned: pinned memory already held plus 75 % of the host's
available memory (``psutil.virtual_memory().available``, else ``MemAvailable`` in /proc/meminfo; no limit
when neither exists), or ``host_budget_bytes``. If it does not fit, or pinning fails (WSL caps pinned
memory), the offloader warns once (`OffloadBudgetWarning`) and every layer uses plain recompute from then on.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.utils.checkpoint import checkpoint

from fastft.runtime.routing import (
    RouterRecord,
    collect_router_stats,
    is_collecting,
    record_router_logits,
    watch_unfused_routers,
)

HOST_BUDGET_FRACTION = 0.75  # of available host memory
_HOST_GRANULE = 2 * 2**20  # host slots are rounded up to 2 MiB so nearby sizes reuse them
_SLAB_BYTES = 2 * 2**30  # largest pinned slab cut into slots (unless one slot is larger)


class OffloadBudgetWarning(UserWarning):
    """Offloading was turned off (host memory too small, or pinning failed); layers use plain recompute."""


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
    skips computing it (attention outputs, MoE routing orders: `KeptTensors`).
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


def host_memory_available() -> int | None:
    """Bytes of host memory available now (psutil, else /proc/meminfo ``MemAvailable``); None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -- copy engines: the CUDA copy stream, and CPU stand-ins that let tests run the same protocol --------
class _Mark(NamedTuple):
    """An ordering event on the compute stream, and whether it was recorded during a graph capture."""

    event: torch.cuda.Event
    captured: bool


class _CudaCopies:
    """A dedicated copy stream on one CUDA device, its events and (optionally) their timings.

    Safe inside a CUDA graph capture (`fastft.training.graph`): no timing events are recorded and none is
    polled while the stream captures, and an ordering event recorded on the other side of a capture's
    boundary (eagerly before it, or inside a graph that has since been replayed) is never waited on: the copy
    stream waits for the whole compute stream instead, which a capture allows and which orders at least as
    strongly. `mark` returns a `_Mark`: the event and whether it was recorded while capturing.
    """

    def __init__(self, device: torch.device, timing: bool):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.timing = timing
        self._pending: dict[str, collections.deque] = {k: collections.deque() for k in ("d2h", "h2d", "wait")}
        self.ms = dict.fromkeys(self._pending, 0.0)

    @staticmethod
    def _capturing() -> bool:
        return torch.cuda.is_current_stream_capturing()

    def _timed(self):
        return torch.cuda.Event(enable_timing=True) if self.timing and not self._capturing() else None

    def _after(self, mark: _Mark | None) -> None:
        """The copy stream waits for `mark`'s event, or for the whole compute stream when the event was
        recorded on the other side of a capture boundary."""
        if mark is None:
            return
        if mark.captured == self._capturing():
            self.stream.wait_event(mark.event)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def to_host(self, host: torch.Tensor, source: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the source is fully written
        start, end = self._timed(), self._timed()
        with torch.cuda.stream(self.stream):
            if start is not None:
                start.record()
            host.copy_(source, non_blocking=True)
            if end is not None:
                end.record()
                self._pending["d2h"].append((start, end))
        source.record_stream(self.stream)  # its memory is not reused by S before C has read it

    def to_device(self, target: torch.Tensor, host: torch.Tensor, free) -> torch.cuda.Event:
        self._after(free)  # S has finished reading the previous contents of `target`
        start, end = self._timed(), self._timed()
        ready = torch.cuda.Event()  # recorded and waited for within one backward pass
        with torch.cuda.stream(self.stream):
            if start is not None:
                start.record()
            target.copy_(host, non_blocking=True)
            if end is not None:
                end.record()
                self._pending["h2d"].append((start, end))
            ready.record()
        return ready

    def wait(self, ready) -> None:
        compute = torch.cuda.current_stream(self.device)
        before, after = self._timed(), self._timed()
        if before is not None:
            before.record(compute)
        compute.wait_event(ready)
        if after is not None:
            after.record(compute)  # completes when the wait is over: after - before = time S stood still
            self._pending["wait"].append((before, after))

    def mark(self) -> _Mark:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return _Mark(event, self._capturing())

    def protect(self, buffer: torch.Tensor) -> None:
        buffer.record_stream(self.stream)  # the allocator waits for C before reusing a dropped buffer

    def drain(self, block: bool) -> None:
        """Fold finished timings into `ms` (all of them, synchronising, when `block`); nothing while a
        graph is being captured (an event may not be queried then)."""
        if self._capturing():
            return
        if block:
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        for name, pending in self._pending.items():
            while pending and (block or pending[0][1].query()):
                start, end = pending.popleft()
                self.ms[name] += start.elapsed_time(end)


class _SyncCopies:
    """CPU stand-in for the copy stream: every copy happens at once, every event is already complete."""

    timing = False

    def __init__(self):
        self.ms = {}

    def to_host(self, host, source):
        host.copy_(source)

    def to_device(self, target, host, free):
        target.copy_(host)
        return None

    def wait(self, ready):
        pass

    def mark(self):
        return None

    def protect(self, buffer):
        pass

    def drain(self, block):
        pass


class _DeferredCopies(_SyncCopies):
    """CPU stand-in for an asynchronous copy stream: a copy runs only when an event recorded after it is
    waited for, in issue order. A missing wait then reads stale data, which the tests see in gradients."""

    def __init__(self):
        super().__init__()
        self._queue: collections.deque = collections.deque()
        self._issued = 0
        self._ran = 0

    def to_host(self, host, source):
        self._queue.append(functools.partial(host.copy_, source.detach()))  # the memory, not the graph
        self._issued += 1

    def to_device(self, target, host, free):
        self._queue.append(functools.partial(target.copy_, host))
        self._issued += 1
        return self._issued

    def wait(self, ready):
        while ready is not None and self._ran < ready:
            self._queue.popleft()()
            self._ran += 1


class _HostSlabs:
    """Host buffers for layer inputs, cut from a few large (pinned) slabs.

    PyTorch's pinned allocator rounds each allocation up to a power of two (one 320 MiB layer input would
    pin 512 MiB), so slabs are allocated at power-of-two sizes, up to 2 GiB and as many slots as the
    forward still needs, and cut into equal slots. When a larger slot is needed, slabs with no slot in
    use are released. A slot handed back may be reused at once: every access to it is a copy on the copy
    stream, so stream order keeps a new write behind the last read.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.bytes = 0
        self._slabs: dict[int, torch.Tensor] = {}
        self._busy: dict[int, int] = {}
        self._free: list[tuple[int, torch.Tensor]] = []
        self._ids = 0

    def take(self, nbytes: int, count: int) -> tuple[int, torch.Tensor]:
        fitting = [slot for slot in self._free if slot[1].numel() >= nbytes]
        if not fitting:
            self._release_idle()
            fitting = [self._allocate(nbytes, count)]
        slot = min(fitting, key=lambda s: s[1].numel())
        self._free.remove(slot)
        self._busy[slot[0]] += 1
        return slot

    def give(self, slot: tuple[int, torch.Tensor]) -> None:
        self._busy[slot[0]] -= 1
        self._free.append(slot)

    def _allocate(self, nbytes: int, count: int) -> tuple[int, torch.Tensor]:
        slot_bytes = -(-nbytes // _HOST_GRANULE) * _HOST_GRANULE
        size = 1 << (max(slot_bytes, min(count * slot_bytes, _SLAB_BYTES)) - 1).bit_length()
        slab = _allocate_host(size, self.pin)
        self._ids += 1
        self._slabs[self._ids], self._busy[self._ids] = slab, 0
        self.bytes += size
        slots = [(self._ids, slab[i * slot_bytes : (i + 1) * slot_bytes]) for i in range(size // slot_bytes)]
        self._free += slots
        return slots[0]

    def _release_idle(self) -> None:
        idle = {key for key, busy in self._busy.items() if busy == 0}
        self._free = [slot for slot in self._free if slot[0] not in idle]
        for key in idle:
            self.bytes -= self._slabs.pop(key).numel()
            del self._busy[key]


# -- one offloaded layer input ------------------------------------------------------------------
_ALIGN = 512  # bytes: where each kept tensor starts in a device buffer


class _Part(NamedTuple):
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


def _dense(t: torch.Tensor) -> bool:
    """Whether `t` covers its memory exactly (contiguous after some permutation of its dimensions), so
    copying its bytes in storage order and restoring its strides gives it back as it was."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _storage_order(t: torch.Tensor) -> torch.Tensor:
    return t.as_strided((t.numel(),), (1,))


class _Saved:
    """A layer input living in a host buffer, followed by what the layer kept beside it (`keep`); `buffer`
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

    def __init__(self, offloader, part: _Part, prev):
        self.offloader = weakref.ref(offloader)
        self.parts, self.nbytes, self.prev = [part], part.nbytes, prev
        self.buffer: int | None = None
        self.ready = None
        self.done = False

    def add(self, slot, tensor: torch.Tensor) -> _Part:
        offset = -(-self.nbytes // _ALIGN) * _ALIGN
        nbytes = tensor.numel() * tensor.element_size()
        part = _Part(slot, offset, nbytes, tensor.dtype, tensor.shape, tensor.stride())
        self.parts.append(part)
        self.nbytes = offset + nbytes
        return part

    def __del__(self):  # the graph was dropped without a backward: give the buffers back
        offloader = self.offloader()
        if offloader is not None and not self.done:
            offloader._release(self, used=False)


class _Call:
    """One layer call: what the recompute needs (function, other args, RNG and autocast state)."""

    __slots__ = (
        "offloader",
        "function",
        "rest",
        "params",
        "host",
        "saved",
        "structure",
        "rng",
        "autocast",
        "router_specs",
        "kept",
    )

    def __init__(self, offloader, function, rest, params, host):
        self.offloader, self.function, self.rest, self.params, self.host = (
            offloader,
            function,
            rest,
            params,
            host,
        )
        self.saved = self.structure = self.rng = self.autocast = None
        self.router_specs: list = []  # `RouterSpec` of each MoE router this call ran, when collected
        self.kept: list = []  # per `KeptTensors.keep` of the forward: (what, count), or None if refused

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


def _autocast(states):
    import contextlib

    stack = contextlib.ExitStack()
    for kind, enabled, dtype, cache in states:
        stack.enter_context(torch.autocast(kind, enabled=enabled, dtype=dtype, cache_enabled=cache))
    return stack


_TENSOR = object()  # marks where a tensor goes back when a layer's output is rebuilt


def _flatten(outputs):
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


def _unflatten(tensors, structure):
    if structure is None:
        return tensors[0]
    kind, template = structure
    it = iter(tensors)
    return kind([next(it) if item is _TENSOR else item for item in template])


class KeptTensors:
    """Tensors a layer call keeps beside its offloaded input, so that its recompute need not compute them
    again (the attention output and its log-sum-exp: `fastft.runtime.attention`; the fused o_proj's output:
    `fastft.models.patch`; an MoE layer's routing order: `fastft.models.moe`).

    In the forward, `keep` copies them to host memory with the layer input (False when the offloader
    declines: keeping off, host budget reached, or a layout it cannot restore); in the recompute `take`
    hands each keep back in the same order, as device tensors with their shapes and strides, with the
    ``what`` given to `keep` (None for a keep that was declined). A layer must make the same sequence of
    calls in both, which code deciding on the same inputs does."""

    __slots__ = ("call", "views", "position")

    def __init__(self, call: _Call, views: list[torch.Tensor] | None):
        self.call, self.views, self.position = call, views, 0

    @property
    def recording(self) -> bool:
        return self.views is None

    def keep(self, tensors: tuple[torch.Tensor, ...], what=None) -> bool:
        kept = self.call.offloader._keep(self.call, tensors)
        self.call.kept.append((what, len(tensors)) if kept else None)
        return kept

    @property
    def last_kept(self) -> bool:
        """Whether this call's latest `keep` (or `decline`) kept its tensors."""
        return bool(self.call.kept) and self.call.kept[-1] is not None

    def decline(self) -> None:
        """Keep nothing for this call (the recompute computes it): `take` will answer None."""
        self.call.kept.append(None)

    def take(self) -> tuple[tuple[torch.Tensor, ...], object] | None:
        if self.position >= len(self.call.kept):  # more calls than the forward made: compute them
            return None
        entry = self.call.kept[self.position]
        self.position += 1
        if entry is None:
            return None
        what, count = entry
        tensors, self.views = tuple(self.views[:count]), self.views[count:]
        return tensors, what


_ACTIVE = threading.local()


def kept_tensors() -> KeptTensors | None:
    """The current offloaded layer call's `KeptTensors` (forward or recompute), when its offloader keeps
    tensors; None anywhere else."""
    return getattr(_ACTIVE, "kept", None)


@contextlib.contextmanager
def _keeping(kept: KeptTensors | None):
    previous = getattr(_ACTIVE, "kept", None)
    _ACTIVE.kept = kept
    try:
        yield
    finally:
        _ACTIVE.kept = previous


class _OffloadedLayer(torch.autograd.Function):
    """The layer as one autograd node. MoE router logits recorded inside it (for the load-balancing loss)
    leave as extra outputs after the layer's own: the forward runs without autograd, so this is how their
    gradient comes back to the recompute, like the hidden state's."""

    @staticmethod
    def forward(ctx, call: _Call, hidden: torch.Tensor, *params: torch.Tensor):
        call.offloader._save(call, hidden)
        call.stash_state(hidden.device)
        kept = KeptTensors(call, None) if call.offloader.keep else None
        with _router_records_of(is_collecting()) as records, _keeping(kept):
            flat, call.structure = _flatten(call.function(hidden, *call.rest))  # no_grad: nothing saved
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
        kept = KeptTensors(call, views) if call.kept else None
        with _router_records_of(bool(call.router_specs), recompute_of=call) as records, _keeping(kept):
            flat, _ = _flatten(call.recompute(hidden))
        del views, kept
        flat = [*flat, *(r.logits for r in records)]
        pairs = [(o, g) for o, g in zip(flat, grads, strict=True) if g is not None and o.requires_grad]
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
def _router_records_of(collect: bool, recompute_of: _Call | None = None):
    """The router records (`fastft.runtime.routing.RouterRecord`) of one layer call, when `collect`: in the
    forward when the loss collects them, in the recompute (`recompute_of`) when the forward had some, so
    both give the layer the same extra outputs. Fused MoE blocks record themselves whenever a collection is
    open; transformers' blocks were watched by the loss's router hooks in the forward, so the recompute
    watches the layer's routers itself and pairs their logits with the forward's specs."""
    if not collect:
        yield []
        return
    captured: list[torch.Tensor] = []
    layer = _module_of(recompute_of.function) if recompute_of is not None else None
    with collect_router_stats() as records:
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
        raise TypeError("an offloaded layer can hand out router logits (record_router_logits) only")


# -- the offloader --------------------------------------------------------------------------------
def _module_of(function) -> torch.nn.Module | None:
    """The layer behind transformers' ``partial(forward, layer, **kwargs)`` (or ``partial(super().__call__)``)."""
    if isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], torch.nn.Module):
            return function.args[0]
        function = function.func
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


def _needs_grad(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, (tuple, list)):
        return any(_needs_grad(v) for v in value)
    if isinstance(value, dict):
        return any(_needs_grad(v) for v in value.values())
    return False


def no_span(name: str) -> contextlib.AbstractContextManager:
    """The offloader's span when no step profile is attached: times nothing."""
    return contextlib.nullcontext()


class ActivationOffloader:
    """The checkpoint function installed on each decoder layer: ``offloader(function, hidden, *rest)``.

    `double_buffer`: two device buffers and prefetch ("offload"), or one buffer and no prefetch
    ("offload-single"). `layers`: how many layers use it (for the pinned-memory check). `timing`: record
    CUDA events for `stats`. `_force`: run the protocol on CPU tensors too ("sync" / True: copies at
    once; "deferred": copies only when waited for) — for tests; without it CPU layers use plain recompute.
    """

    def __init__(
        self,
        double_buffer: bool = True,
        layers: int = 0,
        host_budget_bytes: int | None = None,
        timing: bool = False,
        _force: bool | str | None = None,
        keep: bool = True,
    ):
        self.double_buffer = double_buffer
        self.keep = keep
        self.layers = layers
        self.host_budget_bytes = host_budget_bytes
        self.timing = timing
        self.force = "sync" if _force is True else _force or None
        self.disabled: str | None = None
        self.device: torch.device | None = None
        self._copies = None
        count = 2 if double_buffer else 1
        self._buffers: list[torch.Tensor | None] = [None] * count
        self._owners: list[weakref.ref | None] = [None] * count
        self._free: list = [None] * count
        self._host = _HostSlabs(pin=self.force is None)
        self._live = 0
        self._last: weakref.ref | None = None
        self._lock = threading.RLock()
        self._keep_room: int | None = None  # host bytes left for `KeptTensors` in this forward
        # Times a named span of the running step (the step profiler sets it while it is attached to the
        # model: `fastft.training.timing_hooks`); the wait for a host→device copy is timed as "offload_wait".
        self.span = no_span
        self._reset_counts()

    @property
    def mode(self) -> str:
        return "offload" if self.double_buffer else "offload-single"

    def settings(self) -> tuple:
        return (self.double_buffer, self.host_budget_bytes, self.timing, self.force, self.keep)

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
        module = _module_of(function)
        usable = (
            self.disabled is None
            and isinstance(hidden, torch.Tensor)
            and hidden.is_floating_point()
            and module is not None
            and self._offloads(hidden.device)
            and not _needs_grad(args[1:])
            and not _needs_grad(getattr(function, "keywords", None) or {})
        )
        params = [p for p in module.parameters() if p.requires_grad] if usable else []
        if usable and not params and not hidden.requires_grad:  # no backward will come
            return function(*args)
        host = self._host_for(hidden) if usable else None
        if host is None:
            self.counts["fallback_calls"] += 1
            return checkpoint(function, *args, use_reentrant=False)
        call = _Call(self, function, args[1:], params, host)
        flat = _OffloadedLayer.apply(call, hidden, *params)
        if call.router_specs:  # hand the layer's router logits, now part of the graph, to the loss
            extra = len(call.router_specs)
            for spec, logits in zip(call.router_specs, flat[len(flat) - extra :], strict=True):
                record_router_logits(logits, spec)
            flat = flat[: len(flat) - extra]
        return _unflatten(flat, call.structure)

    def _offloads(self, device: torch.device) -> bool:
        if device.type != ("cpu" if self.force else "cuda"):
            return False
        if self.device is None:
            self.device = device
            if device.type == "cuda":
                self._copies = _CudaCopies(device, self.timing)
            else:
                self._copies = _DeferredCopies() if self.force == "deferred" else _SyncCopies()
        return device == self.device

    # -- host memory ---------------------------------------------------------------------------
    def _budget(self) -> int | None:
        if self.host_budget_bytes is not None:
            return self.host_budget_bytes
        available = host_memory_available()
        return None if available is None else self._host.bytes + int(HOST_BUDGET_FRACTION * available)

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        warnings.warn(reason, OffloadBudgetWarning, stacklevel=4)

    def _host_for(self, hidden: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        nbytes = hidden.numel() * hidden.element_size()
        with self._lock:
            if self._live == 0:  # the first layer of a forward: will the whole forward fit?
                need, budget = max(1, self.layers) * nbytes, self._budget()
                # what `_keep` may add this forward: layers whose keeps do not fit recompute as before
                self._keep_room = None if budget is None else budget - need
                if budget is not None and need > budget:
                    tokens, width = hidden.numel() // hidden.shape[-1], hidden.shape[-1]
                    self._disable(
                        f"offloaded checkpointing needs {need / 2**30:.1f} GiB of pinned host memory "
                        f"({max(1, self.layers)} layers × {tokens} tokens × {width} × {hidden.element_size()} "
                        f"bytes) but may pin {budget / 2**30:.1f} GiB ({HOST_BUDGET_FRACTION:.0%} of available "
                        "host memory, or host_budget_bytes); using plain recompute instead (layer inputs stay "
                        "on the GPU). Shorten max_seq_length or free host memory to offload."
                    )
                    return None
            try:
                return self._host.take(nbytes, count=max(1, self.layers - self._live))
            except RuntimeError as error:
                self._disable(
                    f"pinning host memory for offloaded checkpointing failed ({error}); layers use plain "
                    "recompute from now on (on WSL, pinned memory is capped: use gradient_checkpointing=True)"
                )
                return None

    # -- forward: save ----------------------------------------------------------------------------
    def _save(self, call: _Call, hidden: torch.Tensor) -> None:
        nbytes = hidden.numel() * hidden.element_size()
        with self._lock:
            last = self._last() if self._last is not None else None
            prev = weakref.ref(last) if last is not None and not last.done else None
            part = _Part(call.host, 0, nbytes, hidden.dtype, hidden.shape, _contiguous_strides(hidden.shape))
            saved = _Saved(self, part, prev)
            self._live += 1
            self._last = weakref.ref(saved)
        self._copies.to_host(part.view(call.host[1]), hidden)
        call.host = None
        call.saved = saved
        self.counts["layers_offloaded"] += 1
        self.counts["bytes_offloaded"] += nbytes

    def _keep(self, call: _Call, tensors: tuple[torch.Tensor, ...]) -> bool:
        """Copy `tensors` to host memory beside the call's layer input (see `KeptTensors`)."""
        saved = call.saved
        if saved is None or not self.keep or not all(t.device == self.device and _dense(t) for t in tensors):
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
                self.keep = False
                return False
            parts = [saved.add(slot, t) for slot, t in zip(slots, tensors, strict=True)]
        for part, tensor in zip(parts, tensors, strict=True):
            host = part.slot[1][: part.nbytes].view(part.dtype)
            self._copies.to_host(host, _storage_order(tensor))
        self.counts["bytes_kept"] += sum(sizes)
        self.counts["bytes_offloaded"] += sum(sizes)
        return True

    # -- backward: load, prefetch, release ----------------------------------------------------
    def _owner(self, index: int) -> _Saved | None:
        ref = self._owners[index]
        saved = ref() if ref is not None else None
        return saved if saved is not None and not saved.done and saved.buffer == index else None

    def _copy_in(self, saved: _Saved, exclude: int | None) -> None:
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

    def _load(self, saved: _Saved) -> list[torch.Tensor]:
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

    def _prefetch(self, current: _Saved) -> None:
        if not self.double_buffer or current.prev is None:
            return
        with self._lock:
            following = current.prev()  # the layer whose backward comes next
            if following is not None and not following.done and following.buffer is None:
                self._copy_in(following, exclude=current.buffer)

    def _release(self, saved: _Saved, used: bool) -> None:
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


def _allocate_host(size: int, pin: bool) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=pin)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


# -- installing on a model ----------------------------------------------------------------------
def _base(model: torch.nn.Module) -> torch.nn.Module:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _checkpointed_modules(base: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in base.modules() if getattr(m, "gradient_checkpointing", False) is True]


def _is_layer(module: torch.nn.Module) -> bool:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers < 4.52
        return True
    return isinstance(module, GradientCheckpointingLayer)


def keeps_by_default(model: torch.nn.Module) -> bool:
    """Whether offloading keeps attention and o_proj outputs unless told otherwise: on 16-bit bases yes, on
    4- or 8-bit ones no. A quantised base is the memory-first choice, and keeping costs two device buffers of
    those outputs (on Llama-3.1-8B at 2 x 2,048 tokens +94 MB of peak, about 1.3 % of a QLoRA step's 7 GiB,
    for 3 % of its time; at 16,384 tokens four times the bytes). ``enable_offload(keep_attention=True)``
    keeps them on a quantised base too."""
    return not (getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def enable_offload(
    model: torch.nn.Module,
    double_buffer: bool = True,
    host_budget_bytes: int | None = None,
    timing: bool = False,
    _force: bool | str | None = None,
    keep_attention: bool | None = None,
) -> ActivationOffloader:
    """Make the model's checkpointed layers offload their inputs (see the module docstring).

    Checkpointing must already be on (``set_gradient_checkpointing(model, "offload")`` does both). Calling
    it again with the same settings keeps the offloader (and its buffers); other settings replace it.
    `timing` records CUDA events for `offload_stats`. `keep_attention`: each layer's attention output and
    log-sum-exp (and the fused o_proj's output) travel with its input, so the recompute skips the attention
    forward and o_proj (`KeptTensors`; from ``fastft.runtime.attention.KEEP_FROM_LENGTH`` tokens on), and so
    does an MoE layer's routing order, so the recompute skips the top-k and the sort. None (the default):
    keep on 16-bit bases, not on quantised ones (`keeps_by_default`). Returns the offloader, also at
    ``model.fastft_offload``.
    """
    base = _base(model)
    if keep_attention is None:
        keep_attention = keeps_by_default(base)
    modules = _checkpointed_modules(base)
    if not modules:
        raise ValueError(
            "gradient checkpointing is off on this model, so there is nothing to offload: use "
            "fastft.models.lora.set_gradient_checkpointing(model, 'offload')"
        )
    current = getattr(base, "fastft_offload", None)
    wanted = (
        double_buffer,
        host_budget_bytes,
        timing,
        "sync" if _force is True else _force or None,
        keep_attention,
    )
    if current is None or current.settings() != wanted:
        layers = sum(_is_layer(m) for m in modules) or len(modules)
        current = ActivationOffloader(
            double_buffer, layers, host_budget_bytes, timing, _force, keep_attention
        )
        base.fastft_offload = current
    for module in modules:
        module._gradient_checkpointing_func = current
    return current


def disable_offload(model: torch.nn.Module) -> None:
    """Back to plain recompute on the layers that offloaded; the offloader and its buffers are dropped."""
    base = _base(model)
    offloader = getattr(base, "fastft_offload", None)
    if offloader is None:
        return
    for module in base.modules():
        if getattr(module, "_gradient_checkpointing_func", None) is offloader:
            module._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    del base.fastft_offload


def offloader_of(model: torch.nn.Module) -> ActivationOffloader | None:
    return getattr(_base(model), "fastft_offload", None)


def offload_stats(model: torch.nn.Module, reset: bool = False) -> OffloadStats | None:
    """The model's `OffloadStats` (None when it does not offload); read between steps."""
    offloader = offloader_of(model)
    return None if offloader is None else offloader.stats(reset)

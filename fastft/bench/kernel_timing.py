"""How `fastft bench kernels` times a call: workload sizes, warm-up and timed calls, CUDA-graph replay with
L2 flushed between calls, peak memory beyond the inputs, and one row per forward and backward."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fastft.bench.kernel_tables import kernel_row, memory_row

FLUSH_BYTES = 256 * 2**20  # larger than the H200's L2 (60 MiB) several times over


@dataclass(frozen=True)
class Sizes:
    """Workload shapes; the defaults are the issue's (Llama-3-8B dimensions, 16k tokens)."""

    tokens: int = 16384
    hidden: int = 4096
    intermediate: int = 14336
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 128256
    lora_tokens: int = 4096
    lora_r: int = 16
    nf4_blocksize: int = 64
    copy_bytes: int = 2 * 2**30


@dataclass(frozen=True)
class Timing:
    """Warm-up and timed calls: ``warmup`` / ``reps`` for kernels, ``big_*`` for the matmul-heavy rows."""

    warmup: int = 5
    reps: int = 30
    big_warmup: int = 2
    big_reps: int = 10


FULL_TIMING = Timing()
QUICK_TIMING = Timing(warmup=2, reps=10, big_warmup=1, big_reps=3)


@dataclass
class KernelRun:
    device: torch.device
    sizes: Sizes
    timing: Timing
    liger: object | None  # liger_kernel.transformers.functional
    bnb: object | None  # bitsandbytes.functional
    dtype: torch.dtype = torch.bfloat16
    copy_gbs: float = 0.0
    notes: list[str] = field(default_factory=list)
    flush: torch.Tensor | None = None
    label: str = ""  # what `attempt` is measuring, for notes
    _stream: torch.cuda.Stream | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The side stream every graph is captured on (None on the CPU). A backward row's forward graph is
        built on it too: autograd runs each backward node on its forward's stream, and one built on the
        default stream makes a capture fail ("would make the legacy stream depend on a capturing
        blocking stream")."""
        if self._stream is None and self.cuda:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def on_stream(self, fn: Callable[[], object]) -> object:
        """``fn()`` run on `stream`, ordered after the current stream's work and before its later work."""
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return out

    def time(self, fn: Callable[[], object], big: bool = False, graph: bool = True) -> float:
        """Median ms of ``fn()`` over the timed calls, after the warm-up calls.

        On a GPU the kernel rows (``big=False``) replay ``fn`` from a CUDA graph, so the time is the device
        time of its kernels: a Python call with autograd costs tens of microseconds on the host, as much as
        a 128 MiB RMSNorm pass on an H200, and timed eagerly it would bound the kernel by the host. Every
        system is timed the same way; one that cannot be captured is timed eagerly, with a note.
        """
        warmup = self.timing.big_warmup if big else self.timing.warmup
        reps = self.timing.big_reps if big else self.timing.reps
        for _ in range(warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1000.0)
            return statistics.median(times)
        graph = self._capture(fn) if graph and not big else None
        call = graph.replay if graph is not None else fn
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for start, end in zip(starts, ends, strict=True):
            if self.flush is not None:
                self.flush.zero_()  # evict the inputs from L2; also gives the host a head start
            start.record()
            call()
            end.record()
        torch.cuda.synchronize()
        del graph
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))

    def _capture(self, fn: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
        """``fn`` captured in a CUDA graph (already warmed up eagerly), or None with a note if it cannot be."""
        try:
            self.on_stream(fn)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                fn()
            graph.replay()  # a capture that went wrong fails here, for this row, not at the next capture
            torch.cuda.synchronize()
            return graph
        except Exception as error:  # timed eagerly instead
            first = (str(error).strip().splitlines() or [""])[0][:160]
            self.notes.append(f"{self.label}: timed eagerly (host work included), no CUDA graph: {first}")
            torch.cuda.synchronize()
            return None

    def peak_extra(self, fn: Callable[[], object]) -> int | None:
        """Bytes allocated at the peak of one ``fn()`` beyond those allocated before it (None on the CPU)."""
        if not self.cuda:
            fn()
            return None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    def attempt(self, label: str, measure: Callable[[], float | None]) -> float | None:
        """``measure()``, or None with a note when it raises: one failing system must not lose the run."""
        self.label = label
        try:
            return measure()
        except Exception as error:  # reported in the notes, the run goes on
            first = (str(error).strip().splitlines() or [""])[0][:240]
            self.notes.append(f"{label}: {type(error).__name__}: {first}")
            return None
        finally:
            if self.cuda:
                torch.cuda.empty_cache()

    def randn(self, *shape: int, scale: float = 1.0, requires_grad: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, device=self.device, dtype=self.dtype)
        if scale != 1.0:
            t.mul_(scale)
        return t.requires_grad_(requires_grad)


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _backward_call(run: KernelRun, forward: Callable[[], object], inputs, grads) -> Callable[[], object]:
    """Build the graph once (on the capture stream, `KernelRun.stream`); the returned call runs its backward
    (``autograd.grad``, graph retained)."""
    outs = _outputs(forward() if run.stream is None else run.on_stream(forward))
    return lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True)


@torch.no_grad()
def max_abs_diff(a, b) -> float:
    return max(
        float((x.float() - y.float()).abs().max()) for x, y in zip(_outputs(a), _outputs(b), strict=True)
    )


def forward_backward_rows(
    run: KernelRun,
    op: str,
    shape: str,
    nbytes: dict[str, int],
    systems: dict[str, Callable[[], object]],
    inputs: tuple[torch.Tensor, ...],
    grads: tuple[torch.Tensor, ...],
    launchers: tuple[Callable[[], object], Callable[[], object]] | None = None,
) -> list[dict]:
    """Time each system's forward, then each one's backward (dict order: Liger last, it writes in place).

    `launchers`: fastft's forward and backward host launchers on the same tensors, timed as
    ``fastft_kernel`` (no autograd, no Function): the kernels' own bandwidth beside the path a model runs."""
    diff = run.attempt(f"{op} check", lambda: max_abs_diff(systems["fastft"](), systems["eager"]()))
    forward = {
        name: run.attempt(f"{op} forward {name}", lambda f=f: run.time(f)) for name, f in systems.items()
    }
    backward = {
        name: run.attempt(
            f"{op} backward {name}", lambda f=f: run.time(_backward_call(run, f, inputs, grads))
        )
        for name, f in systems.items()
    }
    if launchers is not None:
        with torch.no_grad():
            forward["fastft_kernel"] = run.attempt(f"{op} forward launcher", lambda: run.time(launchers[0]))
            backward["fastft_kernel"] = run.attempt(f"{op} backward launcher", lambda: run.time(launchers[1]))
    return [
        kernel_row(op, "forward", shape, nbytes["forward"], run.copy_gbs, forward, diff),
        kernel_row(op, "backward", shape, nbytes["backward"], run.copy_gbs, backward),
    ]


def forward_backward_memory_rows(
    run: KernelRun,
    workload: str,
    flops: int,
    systems: dict[str, Callable[[], object]],
    inputs: tuple[torch.Tensor, ...],
    grad: torch.Tensor | None = None,
) -> list[dict]:
    """Per system: median forward + backward ms, and the peak memory of one more call."""

    def step(forward):
        def call():
            out = forward()
            torch.autograd.grad(out, inputs, grad)

        return call

    measured = {}
    for name, forward in systems.items():
        ms = run.attempt(f"{workload} {name}", lambda f=forward: run.time(step(f), big=True))
        peak = run.attempt(f"{workload} {name} memory", lambda f=forward: run.peak_extra(step(f)))
        measured[name] = (ms, peak)
    eager_ms, eager_peak = measured.get("eager", (None, None))
    return [
        memory_row(workload, name, ms, peak, flops, eager_ms, eager_peak)
        for name, (ms, peak) in measured.items()
    ]

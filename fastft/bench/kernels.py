"""`fastft bench kernels`: each fastft kernel beside torch eager and Liger-Kernel, on the GPU it runs on.

Memory-bound kernels are reported as achieved bandwidth, as a share of this device's own copy bandwidth
(a ``Tensor.copy_`` of 2 GiB, bytes read + written over time, measured first in the same run). Bytes are
the minimum each op must read and write (see the ``*_bytes`` helpers), so the figure is a lower bound of
the traffic a kernel really moves. Workloads (bf16, Llama-3-8B shapes):

- ``rms_norm``: 16384 tokens x 4096, forward (y) and backward (dx and dw); eager is LlamaRMSNorm's math.
- ``rope``: q [1, 32, 16384, 128] and k [1, 8, 16384, 128] in transformers' layout (views of
  ``[b, s, heads, d]`` transposed, as ``q_proj(x).view(...).transpose(1, 2)`` gives them), cos / sin
  [1, 16384, 128]; eager is ``apply_rotary_pos_emb``.
- ``swiglu``: gate / up [16384, 14336], ``silu(gate) * up``; eager is LlamaMLP's ``act_fn(gate) * up``.
- ``nf4``: dequantise a 4096 x 14336 weight (double-quantised NF4, blocksize 64) to bf16; eager is the
  plain-PyTorch reference; bitsandbytes' ``dequantize_4bit`` when it imports.
- ``flce``: fused linear cross-entropy, 16384 tokens x vocab 128256 x hidden 4096, forward + backward,
  weight frozen and weight trained; eager is ``F.cross_entropy(F.linear(h, W).float(), t)``. Reports time
  and peak memory beyond the inputs (``max_memory_allocated`` minus the memory allocated before).
- ``lora_mlp``: the fused LoRA MLP (r=16 on gate, up, down) against PEFT's formula in eager autograd,
  4096 tokens x 4096 x 14336, forward + backward time and peak memory.

Timing: CUDA events around each call, a 256 MiB buffer zeroed before every call so no input sits in L2,
warm-up calls first (Triton compiles there), then the median of the timed calls. On a GPU each kernel-row
call is a CUDA graph replay of the system's Python call (see `_Run.time`): device time, host work excluded,
for every system alike; the matmul-heavy rows (flce, lora_mlp) are timed eagerly. Forward and backward are
timed apart: the forward with grad mode on and inputs that require grad, as in training; the backward as
``torch.autograd.grad`` over a graph built once (``retain_graph``). Liger's RoPE and SwiGLU backward and
RMSNorm backward write into their inputs or incoming gradients (their in-place design), so Liger runs last
for each op. Ratios are times, fastft over the baseline: below 1 is fastft faster.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from fastft.bench.common import environment, markdown_table

OPS = ("rms_norm", "rope", "swiglu", "nf4", "flce", "lora_mlp")
# The bar for memory-bound kernels, as a share of the measured copy bandwidth.
TARGET_PERCENT_OF_COPY = 80.0
# The bar for fused linear CE: peak extra memory at most this share of eager's.
TARGET_FLCE_MEMORY_SHARE = 1 / 8
_FLUSH_BYTES = 256 * 2**20  # larger than the H200's L2 (60 MiB) several times over


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


# ----------------------------------------------------------------------------------------------------------
# Byte counts: the least each op must read + write (element_size in bytes; bf16 = 2)
# ----------------------------------------------------------------------------------------------------------


def copy_bytes(nbytes: int) -> int:
    """``dst.copy_(src)``: read ``nbytes``, write ``nbytes``."""
    return 2 * nbytes


def rms_norm_bytes(rows: int, hidden: int, element_size: int = 2) -> dict[str, int]:
    """Forward: read x and w, write y. Backward: read x, dy and w, write dx and dw.

    The per-row rstd a kernel may save (4 bytes a row, 0.05 % at hidden 4096) is not counted: the
    backward can recompute it from x, which it reads anyway.
    """
    act = rows * hidden * element_size
    weight = hidden * element_size
    return {"forward": 2 * act + weight, "backward": 3 * act + 2 * weight}


def rope_bytes(
    batch: int,
    q_heads: int,
    kv_heads: int,
    seq: int,
    head_dim: int,
    element_size: int = 2,
    cos_batch: int = 1,
) -> dict[str, int]:
    """Forward: read q, k, cos, sin, write q_rot, k_rot. Backward: the same with the incoming gradients
    read and dq, dk written. cos / sin are ``[cos_batch, seq, head_dim]`` each, read once."""
    qk = batch * (q_heads + kv_heads) * seq * head_dim * element_size
    cos_sin = 2 * cos_batch * seq * head_dim * element_size
    return {"forward": 2 * qk + cos_sin, "backward": 2 * qk + cos_sin}


def swiglu_bytes(rows: int, cols: int, element_size: int = 2) -> dict[str, int]:
    """Forward: read gate, up, write h. Backward: read dh, gate, up, write d_gate, d_up (act recomputed)."""
    one = rows * cols * element_size
    return {"forward": 3 * one, "backward": 5 * one}


def nf4_bytes(n: int, blocksize: int = 64, nested: bool = True, out_element_size: int = 2) -> dict[str, int]:
    """Dequantise ``n`` NF4 values: read ``ceil(n / 2)`` packed bytes and one absmax per block (uint8 when
    double-quantised, plus one fp32 scale per 256 blocks and the fp32 offset; fp32 otherwise), write ``n``
    outputs. The 16- and 256-entry code tables (1 KiB, constants) are not counted."""
    blocks = math.ceil(n / blocksize)
    absmax = blocks + 4 * math.ceil(blocks / 256) + 4 if nested else 4 * blocks
    return {"forward": math.ceil(n / 2) + absmax + n * out_element_size}


def flce_flops(tokens: int, vocab: int, hidden: int, weight_trains: bool) -> int:
    """Matmul FLOPs of linear + cross-entropy forward and backward: logits, grad_hidden (+ grad_weight)."""
    return (3 if weight_trains else 2) * 2 * tokens * vocab * hidden


def lora_mlp_flops(tokens: int, hidden: int, intermediate: int, r: int) -> int:
    """Matmul FLOPs of a gated MLP with frozen base weights and LoRA on all three projections, forward and
    backward: base forward and dx (2 x 3 x 2 N H I), LoRA forward (2 N r (in + out) per projection) and
    backward (twice that: dB, dxa, dA, dx)."""
    base = 2 * 3 * 2 * tokens * hidden * intermediate
    lora = 3 * 2 * tokens * r * (hidden + intermediate) * 3
    return base + lora


# ----------------------------------------------------------------------------------------------------------
# Rows and tables
# ----------------------------------------------------------------------------------------------------------


def _gbs(nbytes: int, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else nbytes / ms / 1e6


def _ratio(ms: float | None, baseline_ms: float | None) -> float | None:
    return None if ms is None or baseline_ms is None or baseline_ms <= 0 else ms / baseline_ms


def kernel_row(
    op: str,
    direction: str,
    shape: str,
    nbytes: int,
    copy_gbs: float,
    times: dict[str, float | None],
    max_abs_diff: float | None = None,
) -> dict:
    """One memory-bound row: ``times`` maps system (fastft, fastft_kernel, eager, liger, bitsandbytes) to
    median ms or None. ``fastft`` is the autograd path a model runs (the Function and its host work);
    ``fastft_kernel`` the host launcher alone, the kernels' own bandwidth. GB/s are decimal (1e9 bytes/s);
    ``*_pct_copy`` is the share of the measured copy bandwidth."""
    row = {"op": op, "direction": direction, "shape": shape, "bytes": nbytes}
    for system in ("fastft", "fastft_kernel", "eager", "liger", "bitsandbytes"):
        ms = times.get(system)
        gbs = _gbs(nbytes, ms)
        row[f"{system}_ms"] = ms
        row[f"{system}_gbs"] = gbs
        row[f"{system}_pct_copy"] = None if gbs is None else 100.0 * gbs / copy_gbs
    for system in ("eager", "liger", "bitsandbytes"):
        row[f"fastft_over_{system}"] = _ratio(times.get("fastft"), times.get(system))
    row["max_abs_diff_vs_eager"] = max_abs_diff
    return row


def memory_row(
    workload: str,
    system: str,
    ms: float | None,
    peak_bytes: int | None,
    flops: int,
    eager_ms: float | None,
    eager_peak_bytes: int | None,
) -> dict:
    """One forward + backward row: time, TFLOP/s of the matmuls, peak memory beyond the inputs, both as
    shares of eager's."""
    return {
        "workload": workload,
        "system": system,
        "ms": ms,
        "tflops": None if ms is None or ms <= 0 else flops / ms / 1e9,
        "peak_extra_bytes": peak_bytes,
        "time_over_eager": _ratio(ms, eager_ms),
        "memory_over_eager": None
        if peak_bytes is None or not eager_peak_bytes
        else peak_bytes / eager_peak_bytes,
    }


def _fmt(value, kind: str):
    if value is None:
        return None
    if kind == "ms":
        return f"{value:.3f}" if value < 10 else f"{value:,.1f}"
    if kind == "gbs":
        return f"{value:,.0f}"
    if kind == "pct":
        return f"{value:.1f} %"
    if kind == "ratio":
        return f"{value:.2f}"
    if kind == "gib":
        return f"{value / 2**30:.2f}"
    return value


KERNEL_COLUMNS = [
    ("op", "op", None),
    ("direction", "direction", None),
    ("fastft_ms", "fastft ms", "ms"),
    ("fastft_gbs", "GB/s", "gbs"),
    ("fastft_pct_copy", "% of copy", "pct"),
    ("fastft_kernel_pct_copy", "kernel alone % of copy", "pct"),
    ("eager_ms", "eager ms", "ms"),
    ("liger_ms", "liger ms", "ms"),
    ("liger_pct_copy", "liger % of copy", "pct"),
    ("bitsandbytes_ms", "bnb ms", "ms"),
    ("fastft_over_eager", "fastft/eager", "ratio"),
    ("fastft_over_liger", "fastft/liger", "ratio"),
    ("fastft_over_bitsandbytes", "fastft/bnb", "ratio"),
]

MEMORY_COLUMNS = [
    ("workload", "workload", None),
    ("system", "system", None),
    ("ms", "fwd+bwd ms", "ms"),
    ("tflops", "TFLOP/s", "gbs"),
    ("peak_extra_bytes", "peak extra GiB", "gib"),
    ("time_over_eager", "time / eager", "ratio"),
    ("memory_over_eager", "memory / eager", "ratio"),
]


def format_table(rows: list[dict], columns: list[tuple[str, str, str | None]]) -> str:
    """``rows`` as a markdown table, each value formatted by its column's kind (ms, gbs, pct, ratio, gib)."""
    shown = [{key: _fmt(row.get(key), kind) for key, _, kind in columns} for row in rows]
    return markdown_table(shown, [(key, header) for key, header, _ in columns])


def target_lines(result: dict) -> list[str]:
    """The issue's bars, checked: each kernel row at >= 80 % of copy; fused CE memory <= 1/8 and time <= eager."""
    lines = []
    for row in result["rows"]:
        pct = row["fastft_pct_copy"]
        if pct is None:
            continue
        verdict = "meets" if pct >= TARGET_PERCENT_OF_COPY else "BELOW"
        alone = row.get("fastft_kernel_pct_copy")
        kernel = "" if alone is None else f"; the kernel alone {alone:.1f} %"
        lines.append(
            f"{row['op']} {row['direction']}: {pct:.1f} % of copy through autograd ({verdict} "
            f"{TARGET_PERCENT_OF_COPY:.0f} %){kernel}"
        )
    by_workload: dict[str, dict[str, dict]] = {}
    for row in result["memory_rows"]:
        by_workload.setdefault(row["workload"], {})[row["system"]] = row
    for workload, systems in by_workload.items():
        fastft, eager = systems.get("fastft"), systems.get("eager")
        if not workload.startswith("flce") or fastft is None or eager is None:
            continue
        memory, speed = fastft["memory_over_eager"], fastft["time_over_eager"]
        if memory is not None:
            verdict = "meets" if memory <= TARGET_FLCE_MEMORY_SHARE else "MISSES"
            lines.append(f"{workload}: peak extra memory {memory:.3f} x eager ({verdict} <= 1/8)")
        if speed is not None:
            verdict = "meets" if speed <= 1.0 else "MISSES"
            lines.append(f"{workload}: time {speed:.2f} x eager ({verdict} <= 1)")
    return lines


def report(result: dict) -> str:
    """The whole result as text: header, kernel table, memory table, the issue's bars, notes."""
    env, copy = result["environment"], result["copy"]
    versions = ", ".join(
        f"{name} {env[name]}" for name in ("torch", "triton", "liger_kernel", "bitsandbytes") if env.get(name)
    )
    head = (
        f"kernels — {env['device']}, {versions}, {env['date']}\n"
        f"copy bandwidth (copy_ of {copy['bytes'] / 2**30:g} GiB, read + write): {copy['gbs']:,.0f} GB/s; "
        f"kernel ratios are times (fastft / baseline, < 1 = fastft faster)"
    )
    parts = [head]
    if result["rows"]:
        parts.append(format_table(result["rows"], KERNEL_COLUMNS))
    if result["memory_rows"]:
        parts.append(format_table(result["memory_rows"], MEMORY_COLUMNS))
    targets = target_lines(result)
    if targets:
        parts.append("\n".join(f"- {line}" for line in targets))
    if result["notes"]:
        parts.append("notes:\n" + "\n".join(f"- {note}" for note in result["notes"]))
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------------------------------------
# Measuring
# ----------------------------------------------------------------------------------------------------------


@dataclass
class _Run:
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


def _backward_call(run: _Run, forward: Callable[[], object], inputs, grads) -> Callable[[], object]:
    """Build the graph once (on the capture stream, `_Run.stream`); the returned call runs its backward
    (``autograd.grad``, graph retained)."""
    outs = _outputs(forward() if run.stream is None else run.on_stream(forward))
    return lambda: torch.autograd.grad(outs, inputs, grads, retain_graph=True)


@torch.no_grad()
def _max_abs_diff(a, b) -> float:
    return max(
        float((x.float() - y.float()).abs().max()) for x, y in zip(_outputs(a), _outputs(b), strict=True)
    )


def _forward_backward_rows(
    run: _Run,
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
    diff = run.attempt(f"{op} check", lambda: _max_abs_diff(systems["fastft"](), systems["eager"]()))
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


def measure_copy(run: _Run) -> dict:
    """Device copy bandwidth: ``dst.copy_(src)`` of ``sizes.copy_bytes``, read + write over the median time."""
    nbytes = run.sizes.copy_bytes
    src = torch.zeros(nbytes, dtype=torch.uint8, device=run.device)
    dst = torch.empty_like(src)
    ms = run.time(lambda: dst.copy_(src), graph=False)  # a graph's memcpy node: 2.7 of 4.3 TB/s eager
    moved = copy_bytes(nbytes)
    return {"bytes": nbytes, "bytes_moved": moved, "ms": ms, "gbs": _gbs(moved, ms)}


def bench_rms_norm(run: _Run) -> list[dict]:
    from fastft.kernels.rms_norm import rms_norm, rms_norm_backward, rms_norm_forward, rms_norm_reference

    n, h, eps = run.sizes.tokens, run.sizes.hidden, 1e-5
    x = run.randn(n, h, requires_grad=True)
    w = (1.0 + 0.1 * run.randn(h)).requires_grad_(True)
    dy = run.randn(n, h)
    systems = {
        "fastft": lambda: rms_norm(x, w, eps),
        "eager": lambda: rms_norm_reference(x, w, eps),  # LlamaRMSNorm's math and casts
    }
    if run.liger is not None:
        systems["liger"] = lambda: run.liger.liger_rms_norm(x, w, eps)  # llama casting, dY reused for dX
    nbytes = rms_norm_bytes(n, h, x.element_size())
    launchers = None
    if run.cuda or _interpreted():
        with torch.no_grad():
            _, x_rows, rstd = rms_norm_forward(x.detach(), w.detach(), eps)
        launchers = (
            lambda: rms_norm_forward(x.detach(), w.detach(), eps),
            lambda: rms_norm_backward(dy, x_rows, w.detach(), rstd),
        )
    return _forward_backward_rows(run, "rms_norm", f"{n}x{h}", nbytes, systems, (x, w), (dy,), launchers)


def _rope_cos_sin(run: _Run, seq: int, head_dim: int, theta: float = 500000.0):
    """Llama's rotary table for positions 0..seq-1: ``[1, seq, head_dim]`` in the model dtype."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=run.device, dtype=torch.float32) / head_dim
    )
    freqs = torch.outer(torch.arange(seq, device=run.device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(run.dtype), emb.sin().to(run.dtype)


def bench_rope(run: _Run) -> list[dict]:
    from fastft.kernels.rope import apply_rope, rope_backward, rope_forward, rope_reference

    s, d, hq, hk = run.sizes.tokens, run.sizes.head_dim, run.sizes.q_heads, run.sizes.kv_heads

    def heads(n_heads: int, requires_grad: bool) -> torch.Tensor:
        # transformers' layout: proj(x).view(b, s, heads, d).transpose(1, 2)
        return run.randn(1, s, n_heads, d).transpose(1, 2).requires_grad_(requires_grad)

    q, k = heads(hq, True), heads(hk, True)
    dq, dk = heads(hq, False), heads(hk, False)
    cos, sin = _rope_cos_sin(run, s, d)
    systems = {
        "fastft": lambda: apply_rope(q, k, cos, sin),
        "eager": lambda: rope_reference(q, k, cos, sin),  # apply_rotary_pos_emb verbatim
    }
    if run.liger is not None:
        systems["liger"] = lambda: run.liger.liger_rope(q, k, cos, sin)  # rotates q, k in place
    nbytes = rope_bytes(1, hq, hk, s, d, q.element_size())
    shape = f"q[1,{hq},{s},{d}] k[1,{hk},{s},{d}]"
    launchers = None
    if run.cuda or _interpreted():
        launchers = (
            lambda: rope_forward(q.detach(), k.detach(), cos, sin),
            lambda: rope_backward(dq, dk, cos, sin),
        )
    return _forward_backward_rows(run, "rope", shape, nbytes, systems, (q, k), (dq, dk), launchers)


def bench_swiglu(run: _Run) -> list[dict]:
    import torch.nn.functional as F

    from fastft.kernels.swiglu import swiglu

    n, i = run.sizes.tokens, run.sizes.intermediate
    gate = run.randn(n, i, scale=2.0, requires_grad=True)
    up = run.randn(n, i, requires_grad=True)
    dh = run.randn(n, i)
    systems = {
        "fastft": lambda: swiglu(gate, up),
        "eager": lambda: F.silu(gate) * up,  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    }
    if run.liger is not None:
        systems["liger"] = lambda: run.liger.liger_swiglu(gate, up)  # backward overwrites gate, up
    nbytes = swiglu_bytes(n, i, gate.element_size())
    launchers = None
    if run.cuda or _interpreted():
        from fastft.kernels.swiglu import gated_activation_backward, gated_activation_forward

        launchers = (
            lambda: gated_activation_forward(gate.detach(), up.detach(), "swiglu"),
            lambda: gated_activation_backward(dh, gate.detach(), up.detach(), "swiglu"),
        )
    return _forward_backward_rows(run, "swiglu", f"{n}x{i}", nbytes, systems, (gate, up), (dh,), launchers)


def _interpreted() -> bool:
    """Triton runs on this CPU (tests): the launchers can be timed there too."""
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def _nf4_reference_arguments(state) -> dict:
    args = {"shape": state.shape, "blocksize": state.blocksize, "dtype": state.dtype}
    if getattr(state, "state2", None) is not None:
        args.update(
            nested_absmax_code=state.state2.code,
            nested_absmax_scale=state.state2.absmax,
            nested_blocksize=state.state2.blocksize,
            offset=state.offset,
        )
    return args


def bench_nf4(run: _Run) -> list[dict]:
    from fastft.kernels.nf4 import dequantize_nf4_reference, dequantize_quant_state, quantize_nf4_reference

    rows, cols, blocksize = run.sizes.hidden, run.sizes.intermediate, run.sizes.nf4_blocksize
    weight = run.randn(rows, cols, scale=0.02)
    if run.bnb is not None and run.cuda:
        packed, state = run.bnb.quantize_4bit(
            weight, blocksize=blocksize, compress_statistics=True, quant_type="nf4"
        )
        source = "bitsandbytes.functional.quantize_4bit"
    else:
        packed, state = quantize_nf4_reference(weight, blocksize, compress_statistics=True)
        source = "quantize_nf4_reference"
    run.notes.append(f"nf4: weight {rows}x{cols} double-quantised by {source}")
    del weight
    reference_args = _nf4_reference_arguments(state)
    systems = {
        "fastft": lambda: dequantize_quant_state(packed, state),
        "eager": lambda: dequantize_nf4_reference(packed, state.absmax, **reference_args),
    }
    if run.bnb is not None and run.cuda:
        systems["bitsandbytes"] = lambda: run.bnb.dequantize_4bit(packed, state)
    with torch.no_grad():
        diff = run.attempt("nf4 check", lambda: _max_abs_diff(systems["fastft"](), systems["eager"]()))
        times = {
            name: run.attempt(f"nf4 forward {name}", lambda f=f: run.time(f)) for name, f in systems.items()
        }
    nbytes = nf4_bytes(rows * cols, blocksize, nested=True, out_element_size=run.dtype.itemsize)
    return [kernel_row("nf4", "dequantize", f"{rows}x{cols}", nbytes["forward"], run.copy_gbs, times, diff)]


def _forward_backward_memory_rows(
    run: _Run,
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


def bench_flce(run: _Run) -> list[dict]:
    import torch.nn.functional as F

    from fastft.kernels.fused_linear_ce import fused_linear_cross_entropy

    n, v, h = run.sizes.tokens, run.sizes.vocab, run.sizes.hidden
    hidden = run.randn(n, h, requires_grad=True)
    weight = run.randn(v, h, scale=0.02)
    targets = torch.randint(0, v, (n,), device=run.device)
    systems = {
        "fastft": lambda: fused_linear_cross_entropy(hidden, weight, targets, reduction="mean"),
        "eager": lambda: F.cross_entropy(F.linear(hidden, weight).float(), targets),
    }
    if run.liger is not None:
        systems["liger"] = lambda: run.liger.liger_fused_linear_cross_entropy(
            hidden, weight, targets, reduction="mean"
        )
    rows = []
    for trains in (False, True):
        weight.requires_grad_(trains)
        inputs = (hidden, weight) if trains else (hidden,)
        workload = f"flce {n}x{v}x{h}, weight {'trained' if trains else 'frozen'}"
        rows += _forward_backward_memory_rows(run, workload, flce_flops(n, v, h, trains), systems, inputs)
    return rows


def bench_lora_mlp(run: _Run) -> list[dict]:
    import torch.nn.functional as F

    from fastft.kernels.lora import FrozenLinear, lora_mlp

    n, h, i, r = run.sizes.lora_tokens, run.sizes.hidden, run.sizes.intermediate, run.sizes.lora_r
    scale = 2.0  # alpha = 2 r
    x = run.randn(n, h, requires_grad=True)
    w_gate, w_up, w_down = (
        run.randn(i, h, scale=0.02),
        run.randn(i, h, scale=0.02),
        run.randn(h, i, scale=0.02),
    )
    adapters = [
        (
            run.randn(r, d_in, scale=0.02, requires_grad=True),
            run.randn(d_out, r, scale=0.02, requires_grad=True),
        )
        for d_in, d_out in ((h, i), (h, i), (i, h))
    ]
    (a_g, b_g), (a_u, b_u), (a_d, b_d) = adapters
    bases = FrozenLinear(w_gate), FrozenLinear(w_up), FrozenLinear(w_down)
    dy = run.randn(n, h)

    def peft(inp, w, a, b):  # PEFT LoRA Linear: base(x) + lora_B(lora_A(x)) * scaling
        return F.linear(inp, w) + F.linear(F.linear(inp, a), b) * scale

    systems = {
        "fastft": lambda: lora_mlp(x, *bases, (scale, scale, scale), "swiglu", adapters),
        "eager": lambda: peft(F.silu(peft(x, w_gate, a_g, b_g)) * peft(x, w_up, a_u, b_u), w_down, a_d, b_d),
    }
    inputs = (x, *(t for pair in adapters for t in pair))
    workload = f"lora_mlp r={r} {n}x{h}x{i}"
    return _forward_backward_memory_rows(run, workload, lora_mlp_flops(n, h, i, r), systems, inputs, dy)


BENCHES = {
    "rms_norm": bench_rms_norm,
    "rope": bench_rope,
    "swiglu": bench_swiglu,
    "nf4": bench_nf4,
    "flce": bench_flce,
    "lora_mlp": bench_lora_mlp,
}


def _optional(module: str, notes: list[str]):
    import importlib

    try:
        return importlib.import_module(module)
    except Exception as error:  # any import failure means the baseline is skipped
        notes.append(f"{module} not importable ({type(error).__name__}: {error}); its columns are skipped")
        return None


def _versions() -> dict:
    from importlib import metadata

    info = {}
    for name, dist in (
        ("triton", "triton"),
        ("liger_kernel", "liger-kernel"),
        ("bitsandbytes", "bitsandbytes"),
    ):
        try:
            info[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[name] = None
    info["cuda"] = torch.version.cuda
    return info


def run(
    ops: list[str] | tuple[str, ...] = OPS,
    timing: Timing = FULL_TIMING,
    sizes: Sizes | None = None,
    device: torch.device | None = None,
    seed: int = 0,
) -> dict:
    """Measure the copy bandwidth, then each op in ``ops``; returns environment, copy, rows, notes.

    ``device`` defaults to the current CUDA device; a CPU device (with tiny ``sizes`` and
    ``TRITON_INTERPRET=1``) exercises the code paths, not the speed.
    """
    device = device or torch.device("cuda", torch.cuda.current_device())
    sizes = sizes or Sizes()
    notes: list[str] = []
    liger = _optional("liger_kernel.transformers.functional", notes)
    bnb = _optional("bitsandbytes.functional", notes) if "nf4" in ops else None
    bench = _Run(device, sizes, timing, liger, bnb, notes=notes)
    if bench.cuda:
        bench.flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device=device)
    torch.manual_seed(seed)
    copy = measure_copy(bench)
    bench.copy_gbs = copy["gbs"]
    print(f"  copy {copy['gbs']:,.0f} GB/s", flush=True)
    rows, memory_rows = [], []
    for op in ops:
        started = time.perf_counter()
        result = BENCHES[op](bench)
        (memory_rows if op in ("flce", "lora_mlp") else rows).extend(result)
        print(f"  {op:<9} {time.perf_counter() - started:6.1f} s", flush=True)
    return {
        "benchmark": "kernels",
        "environment": {**environment(), **_versions()},
        "sizes": asdict(sizes),
        "timing": asdict(timing),
        "copy": copy,
        "rows": rows,
        "memory_rows": memory_rows,
        "notes": notes,
    }


NO_GPU_MESSAGE = (
    "fastft bench kernels needs a CUDA GPU: it measures kernel bandwidth against the device's own copy "
    "bandwidth, and torch sees no CUDA device here (torch.cuda.is_available() is False)."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fastft bench kernels", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="ops to time (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer warm-up and timed calls")
    parser.add_argument(
        "--out",
        default="benchmarks/kernels.json",
        help="JSON result path (default: %(default)s); the markdown report is written beside it (.md)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of the inputs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(NO_GPU_MESSAGE)
    result = run(args.ops, QUICK_TIMING if args.quick else FULL_TIMING, seed=args.seed)
    text = report(result)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2), encoding="utf-8")
    out.with_suffix(".md").write_text(text + "\n", encoding="utf-8")
    print(f"\nwrote {out} and {out.with_suffix('.md')}")
    return 0

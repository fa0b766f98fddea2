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
call is a CUDA graph replay of the system's Python call (see `KernelRun.time`): device time, host work excluded,
for every system alike; the matmul-heavy rows (flce, lora_mlp) are timed eagerly. Forward and backward are
timed apart: the forward with grad mode on and inputs that require grad, as in training; the backward as
``torch.autograd.grad`` over a graph built once (``retain_graph``). Liger's RoPE and SwiGLU backward and
RMSNorm backward write into their inputs or incoming gradients (their in-place design), so Liger runs last
for each op. Ratios are times, fastft over the baseline: below 1 is fastft faster.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

from fastft.bench.common import environment
from fastft.bench.harness import report_parser, save_record
from fastft.bench.kernel_costs import (
    copy_bytes,
    flce_flops,
    lora_mlp_flops,
    nf4_bytes,
    rms_norm_bytes,
    rope_bytes,
    swiglu_bytes,
)
from fastft.bench.kernel_tables import bandwidth_gbs, kernel_row, report
from fastft.bench.kernel_timing import (
    FLUSH_BYTES,
    FULL_TIMING,
    QUICK_TIMING,
    KernelRun,
    Sizes,
    Timing,
    forward_backward_memory_rows,
    forward_backward_rows,
    max_abs_diff,
)
from fastft.kernels.lora import FrozenLinear, lora_mlp
from fastft.kernels.nf4 import dequantize_nf4_reference, dequantize_quant_state, quantize_nf4_reference
from fastft.kernels.rope import apply_rope, rope_backward, rope_forward, rope_reference
from fastft.kernels.swiglu import swiglu

# Function-local imports: tests replace these names on their modules, so they are looked up when called.

OPS = ("rms_norm", "rope", "swiglu", "nf4", "flce", "lora_mlp")


def measure_copy(run: KernelRun) -> dict:
    """Device copy bandwidth: ``dst.copy_(src)`` of ``sizes.copy_bytes``, read + write over the median time."""
    nbytes = run.sizes.copy_bytes
    src = torch.zeros(nbytes, dtype=torch.uint8, device=run.device)
    dst = torch.empty_like(src)
    ms = run.time(lambda: dst.copy_(src), graph=False)  # a graph's memcpy node: 2.7 of 4.3 TB/s eager
    moved = copy_bytes(nbytes)
    return {"bytes": nbytes, "bytes_moved": moved, "ms": ms, "gbs": bandwidth_gbs(moved, ms)}


def bench_rms_norm(run: KernelRun) -> list[dict]:
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
    return forward_backward_rows(run, "rms_norm", f"{n}x{h}", nbytes, systems, (x, w), (dy,), launchers)


def _rope_cos_sin(run: KernelRun, seq: int, head_dim: int, theta: float = 500000.0):
    """Llama's rotary table for positions 0..seq-1: ``[1, seq, head_dim]`` in the model dtype."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=run.device, dtype=torch.float32) / head_dim
    )
    freqs = torch.outer(torch.arange(seq, device=run.device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[None]
    return emb.cos().to(run.dtype), emb.sin().to(run.dtype)


def bench_rope(run: KernelRun) -> list[dict]:
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
    return forward_backward_rows(run, "rope", shape, nbytes, systems, (q, k), (dq, dk), launchers)


def bench_swiglu(run: KernelRun) -> list[dict]:
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
    return forward_backward_rows(run, "swiglu", f"{n}x{i}", nbytes, systems, (gate, up), (dh,), launchers)


def _interpreted() -> bool:
    """Triton runs on this CPU (tests): the launchers can be timed there too."""

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


def bench_nf4(run: KernelRun) -> list[dict]:
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
        diff = run.attempt("nf4 check", lambda: max_abs_diff(systems["fastft"](), systems["eager"]()))
        times = {
            name: run.attempt(f"nf4 forward {name}", lambda f=f: run.time(f)) for name, f in systems.items()
        }
    nbytes = nf4_bytes(rows * cols, blocksize, nested=True, out_element_size=run.dtype.itemsize)
    return [kernel_row("nf4", "dequantize", f"{rows}x{cols}", nbytes["forward"], run.copy_gbs, times, diff)]


def bench_flce(run: KernelRun) -> list[dict]:
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
        rows += forward_backward_memory_rows(run, workload, flce_flops(n, v, h, trains), systems, inputs)
    return rows


def bench_lora_mlp(run: KernelRun) -> list[dict]:
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
    return forward_backward_memory_rows(run, workload, lora_mlp_flops(n, h, i, r), systems, inputs, dy)


BENCHES = {
    "rms_norm": bench_rms_norm,
    "rope": bench_rope,
    "swiglu": bench_swiglu,
    "nf4": bench_nf4,
    "flce": bench_flce,
    "lora_mlp": bench_lora_mlp,
}


def _optional(module: str, notes: list[str]):
    try:
        return importlib.import_module(module)
    except Exception as error:  # any import failure means the baseline is skipped
        notes.append(f"{module} not importable ({type(error).__name__}: {error}); its columns are skipped")
        return None


def _versions() -> dict:
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
    bench = KernelRun(device, sizes, timing, liger, bnb, notes=notes)
    if bench.cuda:
        bench.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
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
    parser = report_parser("kernels", __doc__)
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
    save_record(out, result, text)
    print(f"\nwrote {out} and {out.with_suffix('.md')}")
    return 0

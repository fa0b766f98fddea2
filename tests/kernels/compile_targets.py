"""Compile every launch of fastft's Triton kernels for each target GPU, without that GPU; report shared memory
and registers per compiled kernel (run by `test_kernel_targets.py` in a process of its own).

How: the public ops run on CPU tensors at the widths real models have (Llama-3.x, Qwen, Gemma; few tokens),
with this process told it is on CUDA (``Tensor.is_cuda`` reads True, so every launcher takes its GPU branch:
GPU block sizes, warps, no interpreter rounding) and every launch recorded instead of run. Each recorded
launch is then bound as Triton's own launcher binds it (`create_function_from_signature`, `_pack_args`:
the same signature, constexprs and alignment attributes) and compiled with ``triton.compile`` for
``GPUTarget("cuda", cc, 32)``; ptxas (shipped with Triton) assembles it, and ``cuobjdump`` (also shipped)
reads the cubin's registers. An autotuned launch compiles every config the capability table gives that
target (`fastft.kernels.capability.gemm_configs`), pruned to the launch's shape as the autotuner prunes.

This process patches torch globally (``is_cuda``, ``torch.cuda.device``): never import it into another.
Usage: ``python tests/kernels/compile_targets.py 75 80 86 89 90 [--only=grouped_mm]`` prints one JSON line per
compiled kernel.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

LAUNCHES: list[tuple[object, tuple, dict, str]] = []  # (kernel or autotuner, args, kwargs, what ran it)
_CURRENT = {"op": ""}


def _record_jit(self, *args, grid, warmup, **kwargs):
    LAUNCHES.append((self, args, kwargs, _CURRENT["op"]))


def _record_autotuned(self, *args, grid, warmup, **kwargs):
    LAUNCHES.append((self, args, kwargs, _CURRENT["op"]))


def _pretend_cuda() -> None:
    JITFunction.run = _record_jit
    Autotuner.run = _record_autotuned
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.device = lambda *args, **kwargs: contextlib.nullcontext()
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda *args: types.SimpleNamespace(multi_processor_count=132)
    import fastft.kernels as kernels
    import fastft.kernels.capability as capability

    kernels.triton_available = lambda: True
    capability.device_capability = lambda device=None: (9, 0)  # every kernel allowed: we record them all


@contextlib.contextmanager
def _op(name: str):
    _CURRENT["op"] = name
    try:
        yield
    finally:
        _CURRENT["op"] = ""


def _exercise(dtypes: tuple[torch.dtype, ...]) -> None:
    """Run each fused op forward and backward at real models' widths (a few tokens each)."""
    # `lora` and `down_combine` launch no kernels of their own: they call these ops' launchers
    from fastft.kernels import fp8, fused_linear_ce, grouped_gemm, nf4, qk_norm_rope, rms_norm, rope, swiglu

    generator = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32, grad=False):
        t = torch.randn(*shape, generator=generator).to(dtype)
        return t.requires_grad_(grad)

    tokens = 8
    for dtype in dtypes:
        for width in (64, 128, 256, 896, 2048, 3584, 4096, 5120, 8192, 16384):
            with _op(f"rms_norm {width} {dtype}"):
                for offset in (0.0, 1.0):
                    x = rand(tokens, width, dtype=dtype, grad=True)
                    rms_norm.rms_norm(x, rand(width, dtype=dtype, grad=True), 1e-6, offset).sum().backward()
        for head_dim, heads, kv_heads in ((64, 32, 8), (128, 32, 8), (128, 64, 8), (256, 8, 4)):
            cos, sin = rand(1, tokens, head_dim, dtype=dtype), rand(1, tokens, head_dim, dtype=dtype)
            with _op(f"rope {head_dim} {dtype}"):
                q = rand(1, heads, tokens, head_dim, dtype=dtype, grad=True)
                k = rand(1, kv_heads, tokens, head_dim, dtype=dtype, grad=True)
                sum(t.float().sum() for t in rope.apply_rope(q, k, cos, sin)).backward()
            with _op(f"qk_norm_rope {head_dim} {dtype}"):
                q = rand(1, heads, tokens, head_dim, dtype=dtype, grad=True)
                k = rand(1, kv_heads, tokens, head_dim, dtype=dtype, grad=True)
                weights = rand(head_dim, dtype=dtype, grad=True), rand(head_dim, dtype=dtype, grad=True)
                out = qk_norm_rope.apply_qk_norm_rope(q, k, *weights, cos, sin, 1e-6)
                sum(t.float().sum() for t in out).backward()
        for intermediate in (512, 8192, 14336, 18944):
            for kind in swiglu.KINDS:
                with _op(f"gated_activation {kind} {intermediate} {dtype}"):
                    gate = rand(tokens, intermediate, dtype=dtype, grad=True)
                    up = rand(tokens, intermediate, dtype=dtype, grad=True)
                    swiglu.gated_activation(gate, up, kind).float().sum().backward()
        for softcap in (
            None,
            30.0,
        ):  # the row kernel's block is fixed (4,096 columns): a small vocab covers it
            with _op(f"fused_linear_ce softcap={softcap} {dtype}"):
                h = rand(tokens, 64, dtype=dtype, grad=True)
                w = rand(5000, 64, dtype=dtype) * 0.01
                targets = torch.randint(0, 5000, (tokens,), generator=generator)
                fused_linear_ce.fused_linear_cross_entropy(h, w, targets, softcap=softcap).backward()
        if dtype != torch.float32:
            with _op(f"nf4 {dtype}"):
                for nested in (False, True):
                    packed, state = nf4.quantize_nf4_reference(
                        rand(256, 512) * 0.02, compress_statistics=nested
                    )
                    extra = {}
                    if nested:
                        extra = dict(nested_absmax_code=state.state2.code, nested_absmax_scale=state.state2.absmax,
                                     offset=state.offset)  # fmt: skip
                    nf4.dequantize_nf4(packed, state.absmax, shape=state.shape, dtype=dtype, **extra)
        if dtype != torch.float32:  # FP8 projections: rows in one block, or (wider) in two passes
            for width in (4096, 14336, 32001):
                with _op(f"fp8_quantize_rows {width} {dtype}"):
                    fp8.quantize_rows(rand(tokens, width, dtype=dtype))
                    fp8.quantize_rows(rand(tokens, width, dtype=dtype), rand(width).abs())
        for n, k in ((1536, 2048), (16, 2048), (2048, 16)):  # the three regimes: wide, skinny_n, small_k
            with _op(f"grouped_mm {n}x{k} {dtype}"):
                experts, top_k, rows = 4, 2, 16
                group_end = torch.tensor([8, 16, 24, 32], dtype=torch.int32)
                a = rand(rows, k, dtype=dtype, grad=True)
                weight = rand(experts, n, k, dtype=dtype, grad=True)
                order = torch.randperm(rows * top_k, generator=generator)
                out = grouped_gemm.grouped_mm(a, weight, group_end, gather_rows=order, top_k=top_k)
                out.float().sum().backward()
                # the down projection's variant: scatter to slot order, add the low-rank term
                h = rand(rows * top_k, k, dtype=dtype, grad=True)
                add = rand(rows * top_k, n, dtype=dtype, grad=True)
                out = grouped_gemm.grouped_mm(h, weight, group_end, scatter_rows=order, add=add)
                out.float().sum().backward()


def _signature_of(kernel: JITFunction, backend, args: tuple, kwargs: dict):
    kwargs = dict(kwargs, debug=False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound, specialization, options)


def _resources(cubin: bytes, scratch: Path) -> dict:
    """Registers per thread and local memory (spills, bytes per thread) from ``cuobjdump`` (shipped with
    Triton); empty without it."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return {}
    scratch.write_bytes(cubin)
    text = subprocess.run(
        [str(tool), "--dump-resource-usage", str(scratch)], capture_output=True, text=True, check=True
    ).stdout
    registers, local = re.search(r"REG:(\d+)", text), re.search(r"LOCAL:(\d+)", text)
    return {
        "registers": int(registers.group(1)) if registers else None,
        "local": int(local.group(1)) if local else None,
    }


def compile_for(capability_code: int, scratch: Path) -> list[dict]:
    """Compile every recorded launch for sm `capability_code`; one dict per distinct kernel binary."""
    from fastft.kernels import capability

    target = GPUTarget("cuda", capability_code, 32)
    backend = make_backend(target)
    results, seen = [], set()
    for launcher, args, kwargs, op in LAUNCHES:
        if isinstance(launcher, Autotuner):
            kernel = launcher.fn
            named = dict(zip(kernel.arg_names, args, strict=False))
            table = capability.gemm_configs(launcher.fastft_table, capability_code)
            configs = [(dict(kwargs, **c.all_kwargs()), c) for c in launcher.fastft_prune(table, named)]
        else:
            kernel, configs = launcher, [(kwargs, None)]
        dtypes = {str(a.dtype) for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        if not capability.supports_dtypes(capability_code, dtypes):
            continue  # bf16 on sm75: fastft runs fp16 there (the reference where asked for bf16)
        for launch_kwargs, config in configs:
            options, signature, constexprs, attrs = _signature_of(kernel, backend, args, launch_kwargs)
            key = (kernel.fn.__qualname__, json.dumps(signature, sort_keys=True), repr(sorted(constexprs.items())),
                   options.num_warps, options.num_stages)  # fmt: skip
            if key in seen:
                continue
            seen.add(key)
            source = ASTSource(kernel, signature, constexprs, attrs)
            entry = dict(kernel=kernel.fn.__qualname__, op=op, cc=capability_code, warps=options.num_warps,
                         stages=options.num_stages, config=None if config is None else str(config))  # fmt: skip
            try:
                compiled = triton.compile(source, target=target, options=options.__dict__)
            except Exception as error:  # noqa: BLE001 - reported, the test names it
                entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                results.append(entry)
                continue
            entry["shared"] = compiled.metadata.shared
            entry.update(_resources(compiled.asm["cubin"], scratch))
            results.append(entry)
    return results


def main(argv: list[str]) -> None:
    _pretend_cuda()
    only = [arg.removeprefix("--only=") for arg in argv if arg.startswith("--only=")]
    codes = [int(code) for code in argv if not code.startswith("--")] or [75, 80, 86, 89, 90]
    _exercise((torch.float16, torch.bfloat16, torch.float32))
    if only:  # a subset, by the op's name (e.g. --only=grouped_mm)
        LAUNCHES[:] = [launch for launch in LAUNCHES if any(part in launch[3] for part in only)]
    print(f"# {len(LAUNCHES)} launches recorded", file=sys.stderr, flush=True)
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"fastft-targets-{os.getpid()}.cubin"
    try:
        for code in codes:
            for entry in compile_for(code, scratch):
                print(json.dumps(entry), flush=True)
    finally:
        scratch.unlink(missing_ok=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""FP8 frozen bases on a CUDA card with FP8 tensor cores (sm89+): the Triton row quantiser against its reference,
the FP8 projection's error against fp32, and the time of forward + input gradient, FP8 against bf16, at
Llama-3.1-8B shapes, per projection and for one fused LoRA layer (q/k/v, o, MLP; r = 16).

Usage: python benchmarks/fp8_projection.py [--tokens 4096] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from fastft.kernels import fp8
from fastft.kernels.lora import FrozenLinear, lora_linears, lora_mlp

# (out, in) of Llama-3.1-8B's projections
SHAPES = {
    "q_proj": (4096, 4096),
    "k_proj": (1024, 4096),
    "v_proj": (1024, 4096),
    "o_proj": (4096, 4096),
    "gate_proj": (14336, 4096),
    "up_proj": (14336, 4096),
    "down_proj": (4096, 14336),
}
QUANTISER_CASES = [  # rows, columns, with a column scale
    (4096, 4096, False),
    (4096, 14336, True),
    (17, 32001, False),
    (5, 4097, True),
    (3, 40000, True),
    (64, 344, False),
]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100)


def quantiser_checks(dev: torch.device) -> list[dict]:
    checks = []
    for rows, cols, with_scale in QUANTISER_CASES:
        x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16) * 3
        x[0] = 0  # an all-zero row
        c = torch.rand(cols, device=dev) * 0.01 if with_scale else None
        q, s = fp8.quantize_rows(x, c)
        rq, rs = fp8.quantize_rows_reference(x, c)
        diff = (q.float() - rq.float()).abs()
        target = x.float() * (c if c is not None else 1)
        checks.append(
            {
                "shape": [rows, cols],
                "column_scale": with_scale,
                "scale_max_rel": float(((s - rs).abs() / rs).max()),
                "q_mismatches": int((diff > 0).sum()),
                "q_within_one_step": bool((diff <= rq.float().abs() * 2**-3 + 2**-9).all()),
                "dequant_rel_err": rel(q.float() * s[:, None], target),
            }
        )
    return checks


def projection(weights, name: str, tokens: int, dev: torch.device) -> tuple[dict, dict]:
    """(accuracy, milliseconds) of one projection's forward + input gradient."""
    w, wq, ws = weights
    out_features, in_features = SHAPES[name]
    x = torch.randn(tokens, in_features, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(tokens, out_features, device=dev, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    y8 = fp8.FP8LinearFunction.apply(xg, wq, ws, None)
    (dx8,) = torch.autograd.grad(y8, xg, dy)
    accuracy = {
        "fwd_rel_vs_fp32": rel(y8, x.float() @ w.float().t()),
        "dx_rel_vs_fp32": rel(dx8, dy.float() @ w.float()),
        "bf16_fwd_rel_vs_fp32": rel(x @ w.t(), x.float() @ w.float().t()),
    }
    wt = fp8.transposed(wq)
    xq, xs = fp8.quantize_rows(x)
    gq, gs = fp8.quantize_rows(dy, ws)
    ones = torch.ones(in_features, device=dev)
    bf16 = torch.bfloat16
    runs = {
        "bf16": lambda: (x @ w.t(), dy @ w),
        "fp8": lambda: (
            fp8.fp8_forward(x, wq, ws, bf16),
            fp8.fp8_input_grad(dy, fp8.transposed(wq), ws, bf16),
        ),
        "fp8_cached_transpose": lambda: (
            fp8.fp8_forward(x, wq, ws, bf16),
            fp8.fp8_input_grad(dy, wt, ws, bf16),
        ),
        "fp8_gemms_only": lambda: (
            fp8.scaled_mm(xq, xs, wq.t(), ws, bf16),
            fp8.scaled_mm(gq, gs, wt.t(), ones, bf16),
        ),
        "quantize_x": functools.partial(fp8.quantize_rows, x),
        "quantize_dy": functools.partial(fp8.quantize_rows, dy, ws),
        "transpose_w": functools.partial(fp8.transposed, wq),
    }
    ms = {key: bench(fn) for key, fn in runs.items()}
    flops = 2 * 2 * tokens * out_features * in_features
    ms["ratio_bf16_over_fp8"] = ms["bf16"] / ms["fp8"]
    ms["bf16_tflops"] = flops / ms["bf16"] / 1e9
    ms["fp8_tflops"] = flops / ms["fp8"] / 1e9
    return accuracy, ms


def fused_layer(weights: dict, fp8_base: bool, tokens: int, dev: torch.device, r: int = 16):
    """One decoder layer's projections through the fused LoRA functions, forward + backward."""
    bases = {
        name: FrozenLinear(wq, scale=ws) if fp8_base else FrozenLinear(w)
        for name, (w, wq, ws) in weights.items()
    }
    adapters = {
        name: (
            (torch.randn(r, i, device=dev, dtype=torch.bfloat16) * 0.01).requires_grad_(True),
            torch.zeros(o, r, device=dev, dtype=torch.bfloat16, requires_grad=True),
        )
        for name, (o, i) in SHAPES.items()
    }
    x = torch.randn(tokens, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    qkv = ("q_proj", "k_proj", "v_proj")

    def run():
        q, k, v = lora_linears(x, [bases[n] for n in qkv], [2.0] * 3, [adapters[n] for n in qkv])
        (o,) = lora_linears(q, [bases["o_proj"]], [2.0], [adapters["o_proj"]])
        mlp = ("gate_proj", "up_proj", "down_proj")
        y = lora_mlp(o, *(bases[n] for n in mlp), [2.0] * 3, "swiglu", [adapters[n] for n in mlp])
        (y.float().sum() + k.float().sum() + v.float().sum()).backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens}
    result["quantize_rows"] = quantiser_checks(dev)
    weights = {}
    for name, (o, i) in SHAPES.items():
        w = torch.randn(o, i, device=dev, dtype=torch.bfloat16) * 0.02
        weights[name] = (w, *fp8.quantize_weight(w))
    accuracy, speed = {}, {}
    for name in SHAPES:
        accuracy[name], speed[name] = projection(weights[name], name, args.tokens, dev)
    result["accuracy"] = accuracy
    result["speed_ms"] = speed
    totals = {
        key: sum(s[key] for s in speed.values())
        for key in ("bf16", "fp8", "fp8_cached_transpose", "fp8_gemms_only")
    }
    totals["ratio"] = totals["bf16"] / totals["fp8"]
    totals["ratio_cached_transpose"] = totals["bf16"] / totals["fp8_cached_transpose"]
    totals["ratio_gemms_only"] = totals["bf16"] / totals["fp8_gemms_only"]
    result["layer_projections_total_ms"] = totals
    layer_bf16 = bench(fused_layer(weights, False, args.tokens, dev))
    layer_fp8 = bench(fused_layer(weights, True, args.tokens, dev))
    result["fused_lora_layer_fwd_bwd_ms"] = {
        "bf16": layer_bf16,
        "fp8": layer_fp8,
        "ratio": layer_bf16 / layer_fp8,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()

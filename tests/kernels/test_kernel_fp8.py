"""FP8 frozen bases (`fastft.kernels.fp8`): e4m3 weights with per-channel scales, rows quantised on the fly,
the FP8 GEMMs and the autograd function against plain-PyTorch references; the LoRA-fused projections and MLP
over FP8 bases against PEFT's formula on the dequantised weight. The Triton quantiser and ``_scaled_mm`` run
on a GPU only (the interpreter's fp8 cast does not round to nearest): those tests are marked ``gpu``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastft.kernels import fp8
from fastft.kernels.lora import (
    FrozenLinear,
    lora_linear_reference,
    lora_linears,
    lora_mlp,
    lora_mlp_reference,
)

E4M3_STEP = 2.0**-3  # relative spacing of e4m3 values (3 mantissa bits)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("shape", [(7, 33), (3, 32001), (1, 1), (5, 4097)])
def test_quantize_weight_round_trips_within_half_an_e4m3_step_per_channel(shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[0]).view(-1, 1)  # channels of very different size
    w[0, :] = 0  # an all-zero channel
    q, scale = fp8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and scale.shape == (shape[0],)
    back = fp8.dequantize_weight(q, scale, torch.float32)
    assert torch.equal(back[0], torch.zeros(shape[1]))
    # each channel's largest value maps to 448 exactly; every value lands within half a step of itself (relative
    # to its magnitude), or within the subnormal spacing of the channel's scale
    assert torch.allclose(q.float().abs().amax(1)[1:], torch.full((shape[0] - 1,), 448.0))
    err = (back - w).abs()
    bound = w.abs() * E4M3_STEP / 2 + scale.view(-1, 1) * 2.0**-9
    assert bool((err <= bound * 1.0001).all())


def test_quantize_weight_refuses_what_it_cannot_quantise():
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_weight(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="16- or 32-bit"):
        fp8.quantize_weight(torch.randn(4, 4).to(torch.float8_e4m3fn))


def test_quantize_rows_folds_the_column_scale_in():
    torch.manual_seed(1)
    x = torch.randn(6, 45, dtype=torch.bfloat16)
    c = torch.rand(45) + 0.1
    q, s = fp8.quantize_rows(x, c)
    want_q, want_s = fp8.quantize_rows_reference(x.float() * c)
    assert torch.equal(q.float(), want_q.float()) and torch.allclose(s, want_s, rtol=1e-6)
    with pytest.raises(ValueError, match="column_scale has 3 entries for 45 columns"):
        fp8.quantize_rows(x, torch.ones(3))


def _fp8_weight(out_features, in_features, seed=0):
    torch.manual_seed(seed)
    w = torch.randn(out_features, in_features) / in_features**0.5
    return w, *fp8.quantize_weight(w)


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_function_matches_the_dequantised_reference_forward_and_input_gradient(bias):
    """The autograd function (on the CPU: quantised rows and fp32 products, the GPU's numbers) against the
    dequantised weight's plain matmul: within the activations' own quantisation error, forward and dx."""
    w, q, scale = _fp8_weight(48, 80)
    b = torch.randn(48) if bias else None
    x = torch.randn(3, 9, 80, requires_grad=True)
    dy = torch.randn(3, 9, 48)
    y = fp8.FP8LinearFunction.apply(x, q, scale, b)
    (dx,) = torch.autograd.grad(y, x, dy)
    xr = x.detach().clone().requires_grad_(True)
    yr = fp8.fp8_linear_reference(xr, q, scale, b)
    (dxr,) = torch.autograd.grad(yr, xr, dy)
    assert y.shape == yr.shape and dx.shape == x.shape
    assert _rel(y, yr) < 0.04 and _rel(dx, dxr) < 0.04
    # and the reference is the dequantised weight's product, itself close to the 16-bit weight's
    assert _rel(yr, torch.nn.functional.linear(x.detach(), w, b)) < 0.04


def test_fp8_linear_runs_the_reference_where_there_are_no_fp8_tensor_cores():
    _, q, scale = _fp8_weight(32, 32)
    x = torch.randn(4, 32)
    assert not fp8.fp8_gemm_runs(x, q)
    assert torch.equal(fp8.fp8_linear(x, q, scale), fp8.fp8_linear_reference(x, q, scale))


def _bases(sizes, fp8_base):
    out = []
    for seed, (o, i) in enumerate(sizes):
        w, q, scale = _fp8_weight(o, i, seed)
        out.append(
            FrozenLinear(q, scale=scale)
            if fp8_base
            else FrozenLinear(fp8.dequantize_weight(q, scale, torch.float32))
        )
    return out


def _adapters(sizes, r=4, seed=10):
    torch.manual_seed(seed)
    return [
        (torch.randn(r, i, requires_grad=True) * 0.1, torch.randn(o, r, requires_grad=True) * 0.1)
        for o, i in sizes
    ]


def _leaves(adapters):
    return [t.detach().clone().requires_grad_(True) for pair in adapters for t in pair]


def test_fused_projections_over_fp8_bases_match_peft_on_the_dequantised_weight():
    sizes = [(24, 40), (8, 40), (8, 40)]
    fp8_bases = _bases(sizes, True)
    flat = _leaves(_adapters(sizes))
    adapters = list(zip(flat[0::2], flat[1::2], strict=True))
    x = torch.randn(2, 5, 40, requires_grad=True)
    outs = lora_linears(x, fp8_bases, [2.0, 2.0, 2.0], adapters)
    ref_flat = _leaves(_adapters(sizes))
    xr = x.detach().clone().requires_grad_(True)
    refs = [
        lora_linear_reference(xr, base, a, b, 2.0)
        for base, a, b in zip(fp8_bases, ref_flat[0::2], ref_flat[1::2], strict=True)
    ]
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    sum(o.square().sum() for o in outs).backward()
    sum(r.square().sum() for r in refs).backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    for got, want in zip(flat, ref_flat, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tile_rows", [None, 3])
def test_fused_mlp_over_fp8_bases_matches_the_reference(tile_rows):
    sizes = [(36, 20), (36, 20), (20, 36)]
    gate, up, down = _bases(sizes, True)
    flat = _leaves(_adapters(sizes))
    x = torch.randn(7, 20, requires_grad=True)
    y = lora_mlp(
        x,
        gate,
        up,
        down,
        (2.0, 2.0, 2.0),
        "swiglu",
        list(zip(flat[0::2], flat[1::2], strict=True)),
        tile_rows=tile_rows,
    )
    ref_flat = _leaves(_adapters(sizes))
    xr = x.detach().clone().requires_grad_(True)
    yr = lora_mlp_reference(xr, gate, up, down, (2.0, 2.0, 2.0), "swiglu", *ref_flat)
    torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    yr.square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-5)
    for got, want in zip(flat, ref_flat, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tile_rows", [None, 3])
def test_the_fp8_gemm_path_of_the_fused_functions_composes_lora_bias_and_tiles(monkeypatch, tile_rows):
    """The fused functions' FP8 branch (taken on FP8 cards) run on the CPU with the GEMMs emulated: the LoRA
    term, the bias, the tiled MLP's row ranges and the input-gradient accumulation come out as the reference
    computes them, within the quantised activations' error."""
    monkeypatch.setattr(fp8, "fp8_gemm_runs", lambda x, weight: True)
    sizes = [(36, 20), (36, 20), (20, 36)]
    gate, up, down = _bases(sizes, True)
    torch.manual_seed(3)
    gate = FrozenLinear(gate.weight, torch.randn(36), scale=gate.scale)
    flat = _leaves(_adapters(sizes))
    x = torch.randn(7, 20, requires_grad=True)
    adapters = list(zip(flat[0::2], flat[1::2], strict=True))
    y = lora_mlp(x, gate, up, down, (2.0, 2.0, 2.0), "swiglu", adapters, tile_rows=tile_rows)
    (q,) = lora_linears(x, [gate], [2.0], adapters[:1])
    ref_flat = _leaves(_adapters(sizes))
    xr = x.detach().clone().requires_grad_(True)
    yr = lora_mlp_reference(xr, gate, up, down, (2.0, 2.0, 2.0), "swiglu", *ref_flat)
    qr = lora_linear_reference(xr, gate, ref_flat[0], ref_flat[1], 2.0)
    assert _rel(y, yr) < 0.05 and _rel(q, qr) < 0.05
    (y.square().sum() + q.sum()).backward()
    (yr.square().sum() + qr.sum()).backward()
    assert _rel(x.grad, xr.grad) < 0.05
    for got, want in zip(flat, ref_flat, strict=True):
        assert _rel(got.grad, want.grad) < 0.05


def test_the_triton_quantiser_compiles_for_hopper():
    """Without a GPU: the quantiser's launches (one-block and two-pass rows, with and without a column scale)
    compiled for sm90 by `compile_targets.py` (its CI default targets, sm75 and sm86, have no FP8; with
    ``FASTFT_EVERY_TARGET=1`` `test_kernel_targets.py` compiles it for sm89 too)."""
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    script = Path(__file__).with_name("compile_targets.py")
    done = subprocess.run(
        [sys.executable, str(script), "90", "--only=fp8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert not [entry for entry in compiled if "error" in entry], compiled[:3]
    assert {(e["kernel"], e["cc"]) for e in compiled} == {("_quantize_rows_kernel", 90)}
    assert len(compiled) >= 4 and all(e.get("local") in (0, None) for e in compiled)  # no spills


# ---------------------------------------------------------------------------------------------- GPU


def _fp8_card():
    if not torch.cuda.is_available() or not fp8.fp8_supported(torch.device("cuda")):
        pytest.skip("needs a CUDA card with FP8 tensor cores (sm89+)")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("rows", "cols", "column_scale"), [(64, 4096, False), (17, 32001, True), (5, 4097, False), (9, 344, True)]
)
def test_gpu_triton_quantiser_matches_its_reference(rows, cols, column_scale):
    dev = _fp8_card()
    torch.manual_seed(0)
    x = torch.randn(rows, cols, device=dev, dtype=torch.bfloat16) * 5
    x[0] = 0
    c = torch.rand(cols, device=dev) + 0.01 if column_scale else None
    q, s = fp8.quantize_rows(x, c)
    rq, rs = fp8.quantize_rows_reference(x, c)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    diff = (q.float() - rq.float()).abs()
    assert bool((diff <= rq.float().abs() * E4M3_STEP + 2.0**-9).all())  # at most one e4m3 step apart
    assert float((diff > 0).float().mean()) < 1e-3


@pytest.mark.gpu
def test_gpu_scaled_mm_matches_the_emulated_product():
    dev = _fp8_card()
    _, q, scale = _fp8_weight(256, 512)
    q, scale = q.to(dev), scale.to(dev)
    x = torch.randn(300, 512, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(300, 256, device=dev, dtype=torch.bfloat16)
    y = fp8.fp8_forward(x, q, scale, torch.bfloat16)
    xq, xs = fp8.quantize_rows(x)
    want = (xq.float() * xs[:, None]) @ (q.float() * scale[:, None]).t()
    assert _rel(y, want) < 4e-3  # the bf16 output's rounding
    dx = fp8.fp8_input_grad(dy, fp8.transposed(q), scale, torch.bfloat16)
    gq, gs = fp8.quantize_rows(dy, scale)
    assert _rel(dx, (gq.float() * gs[:, None]) @ q.float()) < 4e-3
    assert _rel(dx, dy.float() @ (q.float() * scale[:, None])) < 0.04


@pytest.mark.gpu
def test_gpu_fp8_function_forward_and_input_gradient():
    dev = _fp8_card()
    w, q, scale = _fp8_weight(1024, 4096)
    w, q, scale = w.to(dev), q.to(dev), scale.to(dev)
    x = torch.randn(512, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    y = fp8.fp8_linear(x, q, scale)
    assert y.grad_fn is not None and "FP8LinearFunction" in type(y.grad_fn).__name__
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert _rel(y, x.detach().float() @ w.t()) < 0.05
    assert _rel(dx, dy.float() @ w) < 0.05

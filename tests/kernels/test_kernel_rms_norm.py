"""fastft.kernels.rms_norm: Triton RMSNorm (forward, dX, dW) against the PyTorch reference and transformers.

Without a GPU the kernels run on the CPU through the Triton interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported); every CPU test asserts that the Triton autograd Function, not the reference, ran.

Tolerances (``rel`` = ``||a - b|| / ||b||`` over a whole tensor; ``rtol`` / ``atol`` per element, fp32 only):

    | inputs and weight | compared with                      | rel   | rtol | atol |
    | ----------------- | ---------------------------------- | ----- | ---- | ---- |
    | fp32              | reference / transformers, fp32     | 1e-5  | 1e-5 | 1e-6 (dW: x rows summed) |
    | bf16, fp16        | reference / transformers, same dtype | 2e-2  |  -   |  -   |
    | bf16, fp16 (GPU)  | reference run on fp32 copies       | 2e-2  |  -   |  -   |
    | fp32 (GPU)        | reference run on fp32 copies       | 1e-5  |  -   |  -   |

Beyond the table, 16-bit forward outputs must equal the same-dtype reference bit for bit on at least 99% of
elements: that is what pins the cast order (Llama rounds ``x_hat`` before the weight, Gemma after).
"""

from __future__ import annotations

import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402

from fastft.kernels.rms_norm import (  # noqa: E402
    FastRMSNorm,
    RMSNormFunction,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
TOLERANCES = {
    torch.float32: {"rel": 1e-5, "rtol": 1e-5, "atol": 1e-6},
    torch.bfloat16: {"rel": 2e-2, "rtol": None, "atol": None},
    torch.float16: {"rel": 2e-2, "rtol": None, "atol": None},
}
SHAPES = [(1, 96), (3, 1000), (5, 4096)]
OFFSETS = [0.0, 1.0]


@pytest.fixture(autouse=True)
def _interpret_on_cpu(monkeypatch):
    """Keep the dispatch on the Triton path for CPU tensors even if another test changed the environment."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, b = actual.double(), expected.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str, summed_rows: int = 1
) -> None:
    """The table's check; ``summed_rows`` widens ``atol`` for sums over rows (dW), whose terms may cancel."""
    tol = TOLERANCES[dtype]
    assert actual.shape == expected.shape, what
    rel = _rel(actual, expected)
    assert rel <= tol["rel"], f"{what}: relative error {rel:.3e} > {tol['rel']:.0e}"
    if tol["rtol"] is not None:
        torch.testing.assert_close(
            actual, expected, rtol=tol["rtol"], atol=tol["atol"] * summed_rows, msg=lambda m: f"{what}: {m}"
        )


def _inputs(shape, dtype, offset, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * 2.0 + 0.5
    scale = torch.randn(shape[-1], generator=gen) * 0.3 + (0.0 if offset else 1.0)
    dy = torch.randn(shape, generator=gen)
    return x.to(DEVICE, dtype), scale.to(DEVICE, dtype), dy.to(DEVICE, dtype)


def _run(fn, x, w, dy, *args):
    """``(y, dx, dw)`` of ``fn(x, w, *args)`` on fresh leaves."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = fn(x, w, *args)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw


def _assert_triton(y: torch.Tensor) -> None:
    assert y.grad_fn is not None and y.grad_fn.name() == f"{RMSNormFunction.__name__}Backward", (
        f"expected the Triton autograd Function, got {y.grad_fn}"
    )


# ------------------------------------------------------------------------------------------------------------
# Against the reference
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp32_matches_reference(shape, offset):
    x, w, dy = _inputs(shape, torch.float32, offset)
    y, dx, dw = _run(rms_norm, x, w, dy, EPS, offset)
    _assert_triton(y)
    y_ref, dx_ref, dw_ref = _run(rms_norm_reference, x, w, dy, EPS, offset)
    for name, a, b in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert a.dtype == torch.float32
        _check(
            a,
            b,
            torch.float32,
            f"{name} {shape} offset={offset}",
            summed_rows=shape[0] if name == "dw" else 1,
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_half_precision_matches_reference(shape, offset, dtype):
    x, w, dy = _inputs(shape, dtype, offset, seed=1)
    y, dx, dw = _run(rms_norm, x, w, dy, EPS, offset)
    _assert_triton(y)
    y_ref, dx_ref, dw_ref = _run(rms_norm_reference, x, w, dy, EPS, offset)
    for name, a, b in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert a.dtype == dtype, name
        _check(a, b, dtype, f"{name} {shape} offset={offset} {dtype}")
    # The cast order: Llama rounds x_hat to the input dtype before the weight, Gemma only at the end.
    same = (y == y_ref).float().mean().item()
    assert same >= 0.99, f"only {same:.1%} of outputs bit-identical to the reference"


def test_cast_order_is_distinguishable():
    """The bit-identity check above would catch the wrong cast order: the two orders disagree often."""
    x, w, _ = _inputs((3, 1000), torch.bfloat16, 0.0, seed=2)
    x_hat = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS)
    llama = (w * x_hat.to(torch.bfloat16)).to(torch.bfloat16)
    gemma_order = (x_hat * w.float()).to(torch.bfloat16)
    assert (llama == rms_norm_reference(x, w, EPS)).all()
    assert (llama != gemma_order).float().mean().item() > 0.05


# ------------------------------------------------------------------------------------------------------------
# Against transformers' own modules
# ------------------------------------------------------------------------------------------------------------


def _hf_modules():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return {"llama": (LlamaRMSNorm, 0.0), "gemma3": (Gemma3RMSNorm, 1.0)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_matches_transformers(family, dtype):
    module_cls, offset = _hf_modules()[family]
    hidden = 1000
    hf = module_cls(hidden, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(3)) * 0.3 + (1 - offset))
    hf = hf.to(DEVICE, dtype)
    fast = FastRMSNorm.from_module(copy.deepcopy(hf), offset=offset)
    assert fast.eps == 1e-5 and fast.offset == offset and fast.weight.dtype == dtype

    x, _, dy = _inputs((2, 3, hidden), dtype, offset, seed=4)
    outs = {}
    for name, module in (("hf", hf), ("fast", fast)):
        xi = x.detach().clone().requires_grad_(True)
        y = module(xi)
        dx, dw = torch.autograd.grad(y, (xi, module.weight), dy)
        outs[name] = (y, dx, dw)
    _assert_triton(outs["fast"][0])
    for i, what in enumerate(("y", "dx", "dw")):
        a, b = outs["fast"][i], outs["hf"][i]
        assert a.dtype == b.dtype == dtype, what
        _check(a, b, dtype, f"{family} {what} {dtype}", summed_rows=6 if what == "dw" else 1)
    if dtype == torch.float32:
        return  # fp32 outputs differ in the last bit wherever the two sums round differently
    same = (outs["fast"][0] == outs["hf"][0]).float().mean().item()
    assert same >= 0.99, f"only {same:.1%} of outputs bit-identical to {module_cls.__name__}"


def test_from_module_shares_weight_and_reads_eps():
    module_cls, _ = _hf_modules()["llama"]
    hf = module_cls(96, eps=1e-5)
    fast = FastRMSNorm.from_module(hf)
    assert fast.weight is hf.weight and fast.eps == 1e-5 and fast.offset == 0.0
    gemma_cls, _ = _hf_modules()["gemma3"]
    assert FastRMSNorm.from_module(gemma_cls(96, eps=1e-6), offset=1.0).eps == 1e-6
    with pytest.raises(ValueError, match="variance_epsilon"):
        FastRMSNorm.from_module(torch.nn.Linear(96, 96))


# ------------------------------------------------------------------------------------------------------------
# Layouts and reductions
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["column_slice", "transposed"])
def test_non_contiguous_input(layout):
    gen = torch.Generator().manual_seed(5)
    if layout == "column_slice":  # rows with a stride of 160 elements: read in place through the row stride
        base = torch.randn(6, 160, generator=gen).to(DEVICE)
        make = lambda b: b[:, 16:112]  # noqa: E731
    else:  # unit stride across rows, not along them: copied to rows first
        base = torch.randn(96, 6, generator=gen).to(DEVICE)
        make = lambda b: b.t()  # noqa: E731
    w = (torch.randn(96, generator=gen) * 0.3 + 1).to(DEVICE)
    dy = torch.randn(6, 96, generator=gen).to(DEVICE)
    results = []
    for fn in (rms_norm, rms_norm_reference):
        b = base.clone().requires_grad_(True)
        wl = w.clone().requires_grad_(True)
        x = make(b)
        assert not x.is_contiguous()
        y = fn(x, wl, EPS)
        db, dw = torch.autograd.grad(y, (b, wl), dy)
        results.append((y, db, dw))
    _assert_triton(results[0][0])
    for name, a, b in zip(("y", "dbase", "dw"), *results, strict=True):
        _check(a, b, torch.float32, f"{layout} {name}", summed_rows=6 if name == "dw" else 1)


@pytest.mark.parametrize("offset", OFFSETS)
def test_three_dimensional_input(offset):
    x, w, dy = _inputs((2, 3, 96), torch.float32, offset, seed=6)
    y, dx, dw = _run(rms_norm, x, w, dy, EPS, offset)
    _assert_triton(y)
    assert y.shape == dx.shape == (2, 3, 96) and dw.shape == (96,)
    for name, a, b in zip(
        ("y", "dx", "dw"), (y, dx, dw), _run(rms_norm_reference, x, w, dy, EPS, offset), strict=True
    ):
        _check(a, b, torch.float32, f"3-D {name}", summed_rows=6 if name == "dw" else 1)


@pytest.mark.parametrize(
    ("shape", "num_programs"),
    [((40, 96), 3), ((5, 1000), 3), ((5, 4096), None)],  # 16 + 16 + 8 rows; 2 + 2 + 1; default: 2 + 2 + 1
)
def test_dw_reduced_over_several_programs(shape, num_programs):
    x, w, dy = _inputs(shape, torch.float32, 0.0, seed=7)
    y, x_rows, rstd = rms_norm_forward(x, w, EPS)
    dx, dw = rms_norm_backward(dy, x_rows, w, rstd, num_programs=num_programs)
    dx1, dw1 = rms_norm_backward(dy, x_rows, w, rstd, num_programs=1)
    _, dx_ref, dw_ref = _run(rms_norm_reference, x, w, dy, EPS)
    _check(rstd, torch.rsqrt(x.pow(2).mean(-1) + EPS), torch.float32, "rstd")
    assert rstd.dtype == torch.float32 and rstd.shape == (shape[0],)
    for name, a in (("dw", dw), ("dw one program", dw1)):
        _check(a, dw_ref, torch.float32, name, summed_rows=shape[0])
    torch.testing.assert_close(dx, dx1, rtol=0, atol=0)
    _check(dx, dx_ref, torch.float32, "dx")


def test_frozen_weight_skips_dw():
    """LoRA freezes the norm weights: only dX is produced, and it is the same dX."""
    x, w, dy = _inputs((3, 1000), torch.bfloat16, 0.0, seed=8)
    xl = x.clone().requires_grad_(True)
    y = rms_norm(xl, w, EPS)
    _assert_triton(y)
    (dx,) = torch.autograd.grad(y, (xl,), dy)
    _, dx_ref, _ = _run(rms_norm_reference, x, w, dy, EPS)
    _check(dx, dx_ref, torch.bfloat16, "dx with a frozen weight")
    _, dw_none = rms_norm_backward(dy, x, w, torch.ones(3, device=DEVICE), compute_dw=False)
    assert dw_none is None


def test_empty_input_and_reference_fallback(monkeypatch):
    x = torch.empty(0, 96, device=DEVICE, requires_grad=True)
    w = torch.ones(96, device=DEVICE, requires_grad=True)
    y = rms_norm(x, w)
    dx, dw = torch.autograd.grad(y.sum(), (x, w), allow_unused=True)
    assert y.shape == (0, 96) and (dw is None or (dw == 0).all())
    if DEVICE == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        xr = torch.randn(2, 96, requires_grad=True)
        assert rms_norm(xr, w).grad_fn.name() != f"{RMSNormFunction.__name__}Backward"


def test_module_forward():
    module = FastRMSNorm(96, eps=1e-5, offset=1.0, device=DEVICE)
    assert (module.weight == 0).all()  # Gemma stores w with the 1 taken out
    x = torch.randn(4, 96, device=DEVICE)
    torch.testing.assert_close(module(x), rms_norm_reference(x, module.weight, 1e-5, 1.0))
    assert "offset=1.0" in repr(module)


# ------------------------------------------------------------------------------------------------------------
# GPU (H200): full-size rows against fp32, no host sync, bandwidth for information
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [4096, 1000])
def test_gpu_large_against_fp32(hidden, dtype, offset):
    rows = 16384
    x, w, dy = _inputs((rows, hidden), dtype, offset, seed=9)
    x_l = x.clone().requires_grad_(True)
    w_l = w.clone().requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in forward or backward raises
    try:
        y = rms_norm(x_l, w_l, EPS, offset)
        dx, dw = torch.autograd.grad(y, (x_l, w_l), dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_triton(y)
    y_ref, dx_ref, dw_ref = _run(rms_norm_reference, x.float(), w.float(), dy.float(), EPS, offset)
    for name, a, b in (("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert a.dtype == dtype, name
        rel = _rel(a, b)
        assert rel <= TOLERANCES[dtype]["rel"], f"{name} {hidden} {dtype} offset={offset}: {rel:.3e}"
    if dtype != torch.float32:
        y_same = rms_norm_reference(x, w, EPS, offset)
        same = (y == y_same).float().mean().item()
        assert same >= 0.99, f"only {same:.1%} of outputs bit-identical to the {dtype} reference"


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [4096, 1000])
def test_gpu_bandwidth_report(hidden):
    """For information only: effective bandwidth of forward and backward, bf16, 16384 rows."""
    rows, dtype = 16384, torch.bfloat16
    x, w, dy = _inputs((rows, hidden), dtype, 0.0, seed=10)
    y, x_rows, rstd = rms_norm_forward(x, w, EPS)
    fwd_ms = triton.testing.do_bench(lambda: rms_norm_forward(x, w, EPS))
    bwd_ms = triton.testing.do_bench(lambda: rms_norm_backward(dy, x_rows, w, rstd))
    ref_ms = triton.testing.do_bench(lambda: rms_norm_reference(x, w, EPS))
    elem = x.element_size()
    fwd_bytes = 2 * rows * hidden * elem + rows * 4  # read x, write y, write rstd
    bwd_bytes = 3 * rows * hidden * elem + rows * 4  # read x and dy, write dx, read rstd
    print(
        f"\nrms_norm {rows}x{hidden} bf16: forward {fwd_ms * 1e3:.1f} us "
        f"({fwd_bytes / fwd_ms / 1e6:.0f} GB/s), backward {bwd_ms * 1e3:.1f} us "
        f"({bwd_bytes / bwd_ms / 1e6:.0f} GB/s); torch reference forward {ref_ms * 1e3:.1f} us"
    )

"""Gated-activation Triton kernels (fastft.kernels.swiglu) against the reference and transformers' ACT2FN.

Without a GPU the kernels run on the CPU through Triton's interpreter (enabled below, before triton is
imported); with one, the same small cases run on CUDA and the `gpu` tests add full-size shapes and a
bandwidth print. Every kernel test checks that the Triton path ran (the output's ``grad_fn``).
"""

from __future__ import annotations

import os
import shutil

# The interpreter must be on before any @triton.jit function is defined (conftest does the same).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from transformers.activations import ACT2FN  # noqa: E402

from fastft.kernels import use_triton  # noqa: E402
from fastft.kernels.swiglu import (  # noqa: E402
    HIDDEN_ACT_TO_KIND,
    KINDS,
    GatedActivationFunction,
    gated_activation,
    gated_activation_backward,
    gated_activation_forward,
    gated_activation_reference,
    geglu,
    swiglu,
)

# dtype -> (max ‖a − b‖ / ‖b‖, per-element rtol, per-element atol)
TOLERANCES = {
    torch.float32: (1e-5, 1e-5, 1e-6),
    torch.bfloat16: (2e-2, 2e-2, 2e-2),
    torch.float16: (2e-2, 2e-2, 2e-2),
}
DTYPES = list(TOLERANCES)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The transformers activation each kind reproduces (LLaMA's silu, Gemma's gelu_pytorch_tanh).
HF_ACT = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_pytorch_tanh"}
FUNCTION_NAME = "GatedActivationFunctionBackward"


def _rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, b = actual.double(), expected.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    rel_tol, rtol, atol = TOLERANCES[dtype]
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    rel = _rel(actual, expected)
    assert rel <= rel_tol, f"{what}: relative error {rel:.2e} > {rel_tol:.0e}"
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}"
    )


def _hf(kind: str):
    act = ACT2FN[HF_ACT[kind]]
    return lambda gate, up: act(gate) * up


def _kernel(kind: str):
    return lambda gate, up: gated_activation(gate, up, kind)


def _ref(kind: str):
    return lambda gate, up: gated_activation_reference(gate, up, kind)


def _rows(t: torch.Tensor):
    return t[0], t[1]


# layout -> (shape of one leaf tensor, split of the leaf (or of its gradient) into gate and up views)
LAYOUTS = {
    "1x7": ((2, 1, 7), _rows),
    "3x344": ((2, 3, 344), _rows),
    "2x1000": ((2, 2, 1000), _rows),
    "3d_2x5x96": ((2, 2, 5, 96), _rows),
    # a fused gate_up projection split in two: rows strided by 2n, unit-stride columns (no copy)
    "chunked_2x3x100": ((2, 3, 200), lambda t: t.chunk(2, dim=-1)),
    # transposed: strided columns, which the launcher copies
    "transposed_40x12": ((2, 12, 40), lambda t: (t[0].transpose(0, 1), t[1].transpose(0, 1))),
}


def _randn(shape, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def _case(layout: str, dtype: torch.dtype, seed: int = 0, scale: float = 1.0):
    """(leaf holding gate and up, dh, split) for a layout: N(0, scale^2) operands, N(0, 1) dh."""
    shape, split = LAYOUTS[layout]
    dh_shape = split(torch.empty(shape))[0].shape
    return _randn(shape, dtype, seed, scale), _randn(dh_shape, dtype, seed + 1000), split


def _run(fn, leaf: torch.Tensor, dh: torch.Tensor, split=_rows):
    """(h, d_gate, d_up) of fn on the split's gate/up views of a fresh copy of leaf, for gradient dh."""
    x = leaf.detach().clone().requires_grad_()
    gate, up = split(x)
    h = fn(gate, up)
    h.backward(dh)
    d_gate, d_up = split(x.grad)
    return h, d_gate, d_up


# --------------------------------------------------------------------------------------------------
# Forward and backward against the reference and transformers
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_matches_reference_and_transformers(kind, dtype, layout):
    leaf, dh, split = _case(layout, dtype)
    gate, up = split(leaf)
    assert use_triton(gate)
    if layout.startswith(("chunked", "transposed")):
        assert not gate.is_contiguous()

    h, d_gate, d_up = _run(_kernel(kind), leaf, dh, split)
    assert h.grad_fn.name() == FUNCTION_NAME
    assert h.dtype == dtype and d_gate.dtype == dtype and d_up.dtype == dtype
    assert h.shape == gate.shape

    for name, fn in (("reference", _ref(kind)), (f"ACT2FN[{HF_ACT[kind]!r}]", _hf(kind))):
        h_ref, d_gate_ref, d_up_ref = _run(fn, leaf, dh, split)
        assert h_ref.grad_fn.name() != FUNCTION_NAME
        _check(h, h_ref, dtype, f"{kind} {dtype} {layout} h vs {name}")
        _check(d_gate, d_gate_ref, dtype, f"{kind} {dtype} {layout} d_gate vs {name}")
        _check(d_up, d_up_ref, dtype, f"{kind} {dtype} {layout} d_up vs {name}")


@pytest.mark.parametrize("hidden_act", list(HIDDEN_ACT_TO_KIND))
def test_every_mapped_hidden_act_matches_its_kind_in_fp32(hidden_act):
    kind, act = HIDDEN_ACT_TO_KIND[hidden_act], ACT2FN[hidden_act]
    leaf, dh, _ = _case("3x344", torch.float32, seed=5)
    h, d_gate, d_up = _run(_kernel(kind), leaf, dh)
    assert h.grad_fn.name() == FUNCTION_NAME
    expected = _run(lambda g, u: act(g) * u, leaf, dh)
    for what, a, b in zip(("h", "d_gate", "d_up"), (h, d_gate, d_up), expected, strict=True):
        _check(a, b, torch.float32, f"{hidden_act} {what}")


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_kernel_is_within_the_table_of_exact_values_on_wide_inputs(kind):
    """gate, up ~ N(0, 3^2): the fp32 kernel stays within the fp32 table of an fp64 evaluation.

    PyTorch's own fp32 GELUs do not, there: ``1 + erf(x / sqrt 2)`` and ``1 + tanh(u)`` cancel for
    x << 0, so transformers is compared on O(1) inputs only. The kernel's tanh form has no such
    cancellation; its erf form keeps ``1 + erf``, exact enough under the interpreter (whose erf is
    correctly rounded), while on a GPU it gets the budget of libdevice's erff (2 ulp near -1:
    1.2e-7 on Phi(x), times |x up|, |dh up| or |dh x|).
    """
    leaf, dh, _ = _case("2x1000", torch.float32, seed=11, scale=3.0)
    h, d_gate, d_up = _run(_kernel(kind), leaf, dh)
    assert h.grad_fn.name() == FUNCTION_NAME
    exact = _run(_ref(kind), leaf.double(), dh.double())
    if kind != "geglu" or DEVICE == "cpu":
        for what, a, b in zip(("h", "d_gate", "d_up"), (h, d_gate, d_up), exact, strict=True):
            _check(a, b, torch.float32, f"{kind} {what} vs fp64")
        return
    rel_tol, rtol, atol = TOLERANCES[torch.float32]
    x, up = (t.double() for t in _rows(leaf))
    dh64 = dh.double()
    budgets = ((x * up).abs(), (dh64 * up).abs(), (dh64 * x).abs())
    for what, a, b, scale in zip(("h", "d_gate", "d_up"), (h, d_gate, d_up), exact, budgets, strict=True):
        assert _rel(a, b) <= rel_tol, what
        err = (a.double() - b).abs()
        allowed = atol + rtol * b.abs() + 1.2e-7 * scale
        assert (err <= allowed).all(), f"{what}: worst excess {(err - allowed).max().item():.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_single_rounding_is_closer_to_exact_than_the_eager_low_precision_path(kind, dtype):
    """The documented difference: eager rounds act(gate) before the product, the kernel rounds once."""
    leaf, dh, _ = _case("2x1000", dtype, seed=7)
    ours = _run(_kernel(kind), leaf, dh)
    eager = _run(_hf(kind), leaf, dh)
    exact = _run(_ref(kind), leaf.double(), dh.double())
    for what, a, e, x in zip(("h", "d_gate", "d_up"), ours, eager, exact, strict=True):
        assert _rel(a, x) < _rel(e, x), what


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_large_inputs_stay_finite(kind, dtype):
    values = [-1e4, -100.0, -30.0, -20.0, -5.0, -1.0, -0.0, 0.0, 1.0, 5.0, 20.0, 30.0, 100.0, 1e4]
    gate = torch.tensor(values, dtype=dtype, device=DEVICE)
    leaf = torch.stack([gate, torch.ones_like(gate)])
    dh = torch.ones_like(gate)
    h, d_gate, d_up = _run(_kernel(kind), leaf, dh)
    assert h.grad_fn.name() == FUNCTION_NAME
    expected = _run(_ref(kind), leaf, dh)
    for what, a, b in zip(("h", "d_gate", "d_up"), (h, d_gate, d_up), expected, strict=True):
        assert torch.isfinite(a).all(), f"{what}: {a}"
        _check(a, b, dtype, f"{kind} {dtype} {what} at large inputs")


# --------------------------------------------------------------------------------------------------
# Autograd plumbing, dispatch, edge cases
# --------------------------------------------------------------------------------------------------


def test_backward_saves_only_gate_and_up():
    leaf = _case("3x344", torch.float32)[0].requires_grad_()
    gate, up = leaf[0], leaf[1]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        h = swiglu(gate, up)
    assert h.grad_fn.name() == FUNCTION_NAME
    assert len(saved) == 2
    assert {t.data_ptr() for t in saved} == {gate.data_ptr(), up.data_ptr()}


@pytest.mark.parametrize("needs", ["gate", "up"])
def test_only_the_requested_gradient_is_computed(needs):
    leaf, dh, _ = _case("3x344", torch.float32)
    gate, up = (t.clone() for t in _rows(leaf))
    (gate if needs == "gate" else up).requires_grad_()
    h = gated_activation(gate, up, "geglu_tanh")
    assert h.grad_fn.name() == FUNCTION_NAME
    h.backward(dh)
    _, d_gate_ref, d_up_ref = _run(_ref("geglu_tanh"), leaf, dh)
    if needs == "gate":
        assert up.grad is None
        _check(gate.grad, d_gate_ref, torch.float32, "d_gate alone")
    else:
        assert gate.grad is None
        _check(up.grad, d_up_ref, torch.float32, "d_up alone")


def test_broadcast_upstream_gradient():
    """``h.sum().backward()`` hands the backward a stride-0 dh; a row-broadcast dh is read in place."""
    leaf, _, _ = _case("3x344", torch.float16)
    for dh in (
        torch.ones((), dtype=torch.float16, device=DEVICE).expand(3, 344),
        _randn((1, 344), torch.float16, 3).expand(3, 344),
    ):
        ours = _run(_kernel("swiglu"), leaf, dh)
        assert ours[0].grad_fn.name() == FUNCTION_NAME
        expected = _run(_ref("swiglu"), leaf, dh)
        for what, a, e in zip(("h", "d_gate", "d_up"), ours, expected, strict=True):
            _check(a, e, torch.float16, f"{what} with dh strides {dh.stride()}")


def test_launchers_without_autograd_match_the_reference():
    leaf, dh, _ = _case("2x1000", torch.bfloat16)
    gate, up = _rows(leaf)
    h_ref, d_gate_ref, d_up_ref = _run(_ref("swiglu"), leaf, dh)
    _check(gated_activation_forward(gate, up, "swiglu"), h_ref, torch.bfloat16, "forward launcher")
    d_gate, d_up = gated_activation_backward(dh, gate, up, "swiglu")
    _check(d_gate, d_gate_ref, torch.bfloat16, "backward launcher d_gate")
    _check(d_up, d_up_ref, torch.bfloat16, "backward launcher d_up")
    assert gated_activation_backward(dh, gate, up, "swiglu", need_dup=False)[1] is None


def test_functional_api_dispatch(monkeypatch):
    leaf = _case("1x7", torch.float32)[0]
    gate, up = (t.clone().requires_grad_() for t in _rows(leaf))
    for fn, kind in (
        (swiglu, "swiglu"),
        (lambda g, u: geglu(g, u), "geglu"),
        (lambda g, u: geglu(g, u, approximate="tanh"), "geglu_tanh"),
    ):
        h = fn(gate, up)
        assert h.grad_fn.name() == FUNCTION_NAME
        _check(h, gated_activation_reference(gate, up, kind), torch.float32, f"functional {kind}")
    assert GatedActivationFunction.apply(gate, up, "swiglu").grad_fn.name() == FUNCTION_NAME
    if DEVICE == "cpu":  # without the interpreter, CPU tensors take the reference
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        h = swiglu(gate, up)
        assert h.grad_fn.name() != FUNCTION_NAME
        _check(h, gated_activation_reference(gate, up, "swiglu"), torch.float32, "reference dispatch")


@pytest.mark.parametrize("shape", [(0, 16), (3, 0), (2, 0, 5)])
def test_empty_inputs(shape):
    gate = torch.randn(shape, device=DEVICE, requires_grad=True)
    up = torch.randn(shape, device=DEVICE, requires_grad=True)
    h = swiglu(gate, up)
    assert h.shape == shape and h.grad_fn.name() == FUNCTION_NAME
    h.sum().backward()
    assert gate.grad.shape == shape and up.grad.shape == shape


def test_bad_arguments_are_rejected():
    gate = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="same shape"):
        swiglu(gate, torch.randn(2, 7, device=DEVICE))
    with pytest.raises(TypeError, match="same dtype"):
        swiglu(gate, gate.half())
    with pytest.raises(TypeError, match="bfloat16"):
        gated_activation_forward(gate.double(), gate.double())
    with pytest.raises(ValueError, match="unknown gated activation"):
        gated_activation(gate, gate, "relu")
    with pytest.raises(ValueError, match="approximate"):
        geglu(gate, gate, approximate="sigmoid")


# --------------------------------------------------------------------------------------------------
# Full size on the GPU
# --------------------------------------------------------------------------------------------------

GPU_ROWS, GPU_COLS = 16384, 14336


def _gpu_operands(dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate = torch.randn(GPU_ROWS, GPU_COLS, device="cuda", dtype=dtype, generator=gen) * 2
    up = torch.randn(GPU_ROWS, GPU_COLS, device="cuda", dtype=dtype, generator=gen)
    dh = torch.randn(GPU_ROWS, GPU_COLS, device="cuda", dtype=dtype, generator=gen)
    return gate, up, dh


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_full_size_against_fp32_reference(kind, dtype):
    gate, up, dh = _gpu_operands(dtype)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = gated_activation(g, u, kind)
    assert h.grad_fn.name() == FUNCTION_NAME
    h.backward(dh)

    g32, u32 = gate.float().requires_grad_(), up.float().requires_grad_()
    h32 = gated_activation_reference(g32, u32, kind)
    h32.backward(dh.float())
    _check(h, h32, dtype, f"{kind} {dtype} h")
    del h, h32
    _check(g.grad, g32.grad, dtype, f"{kind} {dtype} d_gate")
    _check(u.grad, u32.grad, dtype, f"{kind} {dtype} d_up")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_bandwidth(kind, capsys):
    """Information only: effective bandwidth of both kernels and of the eager transformers path."""
    from triton.testing import do_bench

    dtype = torch.bfloat16
    gate, up, dh = _gpu_operands(dtype)
    n_bytes = gate.numel() * gate.element_size()
    fwd_ms = do_bench(lambda: gated_activation_forward(gate, up, kind))
    bwd_ms = do_bench(lambda: gated_activation_backward(dh, gate, up, kind))
    act = ACT2FN[HF_ACT[kind]]
    eager_ms = do_bench(lambda: act(gate) * up)
    with capsys.disabled():
        print(
            f"\n{kind} {GPU_ROWS}x{GPU_COLS} bf16: forward {fwd_ms:.3f} ms "
            f"({3 * n_bytes / fwd_ms / 1e6:.0f} GB/s), backward {bwd_ms:.3f} ms "
            f"({5 * n_bytes / bwd_ms / 1e6:.0f} GB/s), eager forward {eager_ms:.3f} ms"
        )

"""Fused gated activations of LLaMA/Gemma-style MLPs: ``h = act(gate) * up``, with a manual backward.

The MLP of LLaMA, Mistral, Qwen, Gemma... is ``down_proj(act(gate_proj(x)) * up_proj(x))``. This
module fuses the ``act(gate) * up`` part into one Triton kernel for the forward and one for the
backward. Three activations are covered, chosen by ``kind``:

=============  ======================================  ====================================
``kind``       ``act(x)``                              transformers ``hidden_act``
=============  ======================================  ====================================
swiglu         ``silu(x) = x * sigmoid(x)``            ``silu``, ``swish`` (LLaMA, Qwen...)
geglu          ``gelu(x) = x * Phi(x)`` (exact, erf)   ``gelu``, ``gelu_python``
geglu_tanh     ``gelu(x, approximate="tanh")``         ``gelu_pytorch_tanh`` (Gemma),
                                                       ``gelu_python_tanh``, ``gelu_new``
=============  ======================================  ====================================

(Gemma configs that still say ``hidden_act="gelu"`` are rewritten by transformers to
``gelu_pytorch_tanh``; the activation to use is whatever ``ACT2FN[config.hidden_act]`` resolves to,
see :data:`fastft.kernels.activations.HIDDEN_ACT_TO_KIND`.)

Formulas, with ``sigma(x) = 1 / (1 + exp(-x))``, ``Phi`` the standard normal CDF,
``phi(x) = exp(-x**2 / 2) / sqrt(2 pi)`` its density, ``c = sqrt(2 / pi)``, ``k = 0.044715``::

    silu(x)        = x sigma(x)
    silu'(x)       = sigma(x) (1 + x (1 - sigma(x)))

    gelu(x)        = x Phi(x) = x/2 (1 + erf(x / sqrt 2))
    gelu'(x)       = Phi(x) + x phi(x)

    u(x)           = c (x + k x**3)
    gelu_tanh(x)   = x/2 (1 + tanh u) = x sigma(2u)                      (since 1 + tanh u = 2 sigma(2u))
    gelu_tanh'(x)  = 1/2 (1 + tanh u) + x/2 (1 - tanh(u)**2) c (1 + 3 k x**2)
                   = sigma(2u) + 2 x sigma(2u) (1 - sigma(2u)) c (1 + 3 k x**2)

Forward and backward of ``h = act(g) * u`` (``g`` = gate, ``u`` = up, ``dh`` = dL/dh)::

    h      = act(g) u
    d_gate = dh u act'(g)
    d_up   = dh act(g)

The kernels write ``sigma(2u)`` instead of ``tanh(u)``: the same function, needing only ``exp``.
``sigma`` is evaluated from ``exp(-|x|)``, which never overflows, so it saturates cleanly to 0 or 1 and
inputs of +-30 (or +-1e4) give finite outputs and gradients (``0 * finite``, never ``0 * inf``).

Precision. Both kernels load their operands in the input dtype, compute everything in fp32 and round
once, to nearest even, to the input dtype on store. (Triton's interpreter truncates fp32 -> bf16
casts; under it the kernels round explicitly first, so CPU-interpreted bf16 results are the GPU's.)
The backward saves only ``gate`` and ``up`` and recomputes ``act(gate)``: no activation tensor is kept
between forward and backward.

Difference from transformers' eager path in bf16/fp16. ``LlamaMLP`` / ``GemmaMLP`` evaluate
``self.act_fn(self.gate_proj(x)) * self.up_proj(x)`` with ``act_fn = ACT2FN[hidden_act]`` in the input
dtype: PyTorch computes ``act`` in fp32 internally but rounds it to bf16, and the product is rounded
again. Here (the Triton kernels and :func:`gated_activation_reference` alike) the product is rounded
once. So in bf16/fp16 the two differ by one unit in the last place on roughly a quarter of the
elements, and the single rounding is the closer to the exact value (swiglu, gate ~ N(0, 9), up ~
N(0, 1), bf16: relative error 1.6e-3 here vs 2.2e-3 eager). The same holds for the backward, where
eager autograd rounds ``act(gate)`` and ``dh * up`` to the low precision before the last products.

In fp32 the two paths agree to fp32 rounding (~1e-7 relative, element-wise within rtol 1e-5 / atol
1e-6 for O(1) inputs). For large negative gates PyTorch's fp32 GELUs lose absolute accuracy:
``1 + erf(x / sqrt 2)`` and ``1 + tanh(u)`` cancel, an error of a few 1e-8 times ``|x * up|``. The tanh
form here, written with ``sigma(2u)`` and ``1 - sigma`` taken as ``sigma(-2u)``, has no such
cancellation; the erf form keeps ``1 + erf`` (``tl.math`` has no ``erfc``), so its accuracy there is
that of the backend's ``erf`` (correctly rounded under the interpreter, libdevice's ``erff`` on GPUs).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from . import use_triton
from .activations import HIDDEN_ACT_TO_KIND, KINDS  # Triton-free: the fusion plan reads them too

# Compile-time codes of the three activations (``KIND`` constexpr of the kernels). In the kernels a
# tensor stays the left operand of a constexpr float (``x * _C``, not ``_C * x``): the interpreter
# would otherwise wrap the tensor in a constexpr.
_SWIGLU = tl.constexpr(0)
_GEGLU = tl.constexpr(1)
_GEGLU_TANH = tl.constexpr(2)
_KIND_CODE = {"swiglu": 0, "geglu": 1, "geglu_tanh": 2}

_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1 / sqrt(2 pi)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
_GELU_TANH_K = tl.constexpr(0.044715)

_BLOCK_SIZE_MAX = 1024  # columns per program: 16 B vector accesses for bf16 at 4 warps
_MAX_GRID_Y = 65535  # CUDA limit of the second grid axis (column blocks)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _sigmoid(x):
    """sigma(x) in fp32 from z = exp(-|x|) in (0, 1]: 1 / (1 + z) for x >= 0, z / (1 + z) below.

    ``exp`` never overflows, and sigma(x) keeps full relative precision far into x << 0.
    """
    z = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + z)
    return tl.where(x >= 0, r, z * r)


@triton.jit
def _sigmoid_pair(x):
    """(sigma(x), 1 - sigma(x)) = (sigma(x), sigma(-x)), both to full relative precision (see _sigmoid)."""
    z = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + z)
    zr = z * r
    return tl.where(x >= 0, r, zr), tl.where(x >= 0, zr, r)


@triton.jit
def _round_to_bf16_rtne(x):
    """Round fp32 ``x`` to the nearest bf16 value (ties to even), returned as fp32; nan stays nan.

    Used only under the interpreter (``BF16_RTNE``), whose fp32 -> bf16 cast truncates where the GPU
    cast rounds to nearest even; the then-exact cast afterwards makes interpreted results match the GPU.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))


@triton.jit
def _cast_for_store(x, ptr, BF16_RTNE: tl.constexpr):
    """fp32 ``x`` cast to the element type of ``ptr`` (round to nearest even on every backend)."""
    if BF16_RTNE:
        x = _round_to_bf16_rtne(x)
    return x.to(ptr.dtype.element_ty)


@triton.jit
def _activation(x, KIND: tl.constexpr):
    """act(x) in fp32 for the activation coded by ``KIND``."""
    if KIND == _SWIGLU:
        a = x * _sigmoid(x)
    elif KIND == _GEGLU:
        a = x * 0.5 * (1.0 + tl.math.erf(x * _SQRT1_2))
    else:
        a = x * _sigmoid((x + x * x * x * _GELU_TANH_K) * (2.0 * _SQRT_2_OVER_PI))
    return a


@triton.jit
def _activation_and_derivative(x, KIND: tl.constexpr):
    """(act(x), act'(x)) in fp32; formulas in the module docstring."""
    if KIND == _SWIGLU:
        s, one_minus_s = _sigmoid_pair(x)
        a = x * s
        da = s * (1.0 + x * one_minus_s)
    elif KIND == _GEGLU:
        cdf = 0.5 * (1.0 + tl.math.erf(x * _SQRT1_2))
        pdf = tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
        a = x * cdf
        da = cdf + x * pdf
    else:
        x2 = x * x
        s, one_minus_s = _sigmoid_pair((x + x2 * x * _GELU_TANH_K) * (2.0 * _SQRT_2_OVER_PI))
        a = x * s
        da = s + x * s * one_minus_s * (1.0 + x2 * (3.0 * _GELU_TANH_K)) * (2.0 * _SQRT_2_OVER_PI)
    return a, da


@triton.jit
def _gated_activation_fwd_kernel(
    gate_ptr,
    up_ptr,
    h_ptr,
    n_cols,
    stride_gate_row,
    stride_up_row,
    stride_h_row,
    KIND: tl.constexpr,
    BF16_RTNE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """h[r, c] = act(gate[r, c]) * up[r, c]; program (r, j) covers columns [j BLOCK_SIZE, (j+1) BLOCK_SIZE).

    Rows may be strided (views such as ``gate_up.chunk(2, -1)``); columns are unit-stride.
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols

    g = tl.load(gate_ptr + row * stride_gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up_row + cols, mask=mask, other=0.0).to(tl.float32)
    h = _activation(g, KIND) * u
    tl.store(h_ptr + row * stride_h_row + cols, _cast_for_store(h, h_ptr, BF16_RTNE), mask=mask)


@triton.jit
def _gated_activation_bwd_kernel(
    dh_ptr,
    gate_ptr,
    up_ptr,
    dgate_ptr,
    dup_ptr,
    h_ptr,
    n_cols,
    stride_dh_row,
    stride_gate_row,
    stride_up_row,
    stride_dgate_row,
    stride_dup_row,
    stride_h_row,
    KIND: tl.constexpr,
    NEED_DGATE: tl.constexpr,
    NEED_DUP: tl.constexpr,
    NEED_H: tl.constexpr,
    BF16_RTNE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """d_gate = dh * up * act'(gate), d_up = dh * act(gate), with act recomputed from gate.

    ``NEED_DGATE`` / ``NEED_DUP`` compile away the gradient (and its loads and store) autograd did not
    ask for; the pointer of a skipped gradient is never touched. ``NEED_H`` also stores the recomputed
    ``h = act(gate) * up`` (the fused LoRA MLP needs it for down_proj's LoRA gradient). Every element is
    loaded before any store of the same element, so outputs may alias inputs (``h`` over ``dh``, ``d_gate``
    over ``gate``, ``d_up`` over ``up``).
    """
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols

    dh = tl.load(dh_ptr + row * stride_dh_row + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * stride_gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    if NEED_DGATE or NEED_H:
        u = tl.load(up_ptr + row * stride_up_row + cols, mask=mask, other=0.0).to(tl.float32)
    if NEED_DGATE:
        a, da = _activation_and_derivative(g, KIND)
        dgate = dh * u * da
        tl.store(
            dgate_ptr + row * stride_dgate_row + cols, _cast_for_store(dgate, dgate_ptr, BF16_RTNE), mask=mask
        )
    else:
        a = _activation(g, KIND)
    if NEED_DUP:
        dup = dh * a
        tl.store(dup_ptr + row * stride_dup_row + cols, _cast_for_store(dup, dup_ptr, BF16_RTNE), mask=mask)
    if NEED_H:
        h = a * u
        tl.store(h_ptr + row * stride_h_row + cols, _cast_for_store(h, h_ptr, BF16_RTNE), mask=mask)


# --------------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------------


def _check_kind(kind: str) -> None:
    if kind not in _KIND_CODE:
        raise ValueError(f"unknown gated activation kind {kind!r}; expected one of {KINDS}")


def _check_operands(gate: torch.Tensor, up: torch.Tensor, dtypes=_FLOAT_DTYPES) -> None:
    if gate.shape != up.shape:
        raise ValueError(
            f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    if gate.dtype != up.dtype:
        raise TypeError(f"gate and up must have the same dtype, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate and up must be on the same device, got {gate.device} and {up.device}")
    if gate.dtype not in dtypes:
        raise TypeError(f"gated activations take {', '.join(map(str, dtypes))}, not {gate.dtype}")


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (rows, n) with unit column stride: a view whenever possible (row strides are kept)."""
    n_cols = x.shape[-1] if x.dim() else 1
    x2 = x.reshape(-1, n_cols)
    if x2.stride(1) != 1 and n_cols > 1:
        x2 = x2.contiguous()
    return x2


def _launch_config(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int, int]:
    block = min(_BLOCK_SIZE_MAX, triton.next_power_of_2(n_cols))
    col_blocks = triton.cdiv(n_cols, block)
    if col_blocks > _MAX_GRID_Y:
        raise ValueError(f"rows of {n_cols} columns are too long for the gated activation kernels")
    num_warps = 4 if block >= 512 else (2 if block >= 128 else 1)
    return (n_rows, col_blocks), block, num_warps


def _emulate_bf16_rtne(x: torch.Tensor) -> bool:
    """bf16 stores need explicit rounding under the interpreter only (its fp32 -> bf16 cast truncates)."""
    return x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


def _device_guard(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _launch(kernel, gate: torch.Tensor, kind: str, rows: tuple[torch.Tensor, ...], **flags) -> None:
    """Launch ``kernel`` on the ``[n_rows, n_cols]`` views ``rows`` (its pointers, then ``n_cols``, then each
    view's row stride) with the tile of that shape, ``kind`` and ``gate``'s bf16 rounding."""
    grid, block, num_warps = _launch_config(*rows[0].shape)
    with _device_guard(gate):
        kernel[grid](
            *rows, rows[0].shape[1], *(t.stride(0) for t in rows),
            KIND=_KIND_CODE[kind], BF16_RTNE=_emulate_bf16_rtne(gate), BLOCK_SIZE=block, num_warps=num_warps,
            **flags,
        )  # fmt: skip


def gated_activation_forward(gate: torch.Tensor, up: torch.Tensor, kind: str = "swiglu") -> torch.Tensor:
    """Launch the forward kernel: ``h = act(gate) * up`` in the input dtype (computed in fp32).

    No autograd: use :class:`GatedActivationFunction` (or :func:`swiglu` / :func:`geglu`) for that.
    """
    _check_kind(kind)
    _check_operands(gate, up)
    h = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return h
    g2, u2 = _as_rows(gate), _as_rows(up)
    h2 = h.view(g2.shape)
    _launch(_gated_activation_fwd_kernel, gate, kind, (g2, u2, h2))
    return h


def gated_activation_backward(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    kind: str = "swiglu",
    need_dgate: bool = True,
    need_dup: bool = True,
    *,
    out_dgate: torch.Tensor | None = None,
    out_dup: torch.Tensor | None = None,
    out_h: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel: ``(d_gate, d_up) = (dh * up * act'(gate), dh * act(gate))``.

    ``act`` is recomputed from ``gate``. Gradients come back contiguous, shaped and typed like
    ``gate``; one not asked for (``need_dgate`` / ``need_dup`` false) is ``None`` and is not computed.
    ``out_dgate`` / ``out_dup`` give the buffers to write the gradients into (they may be ``gate`` / ``up``
    themselves); ``out_h`` asks for ``h = act(gate) * up`` as well, written there (it may be ``dh``). Out
    buffers must be contiguous and shaped like ``gate``.
    """
    _check_kind(kind)
    _check_operands(gate, up)
    if dh.shape != gate.shape:
        raise ValueError(f"dh must have the shape of gate, got {tuple(dh.shape)} and {tuple(gate.shape)}")
    for out in (out_dgate, out_dup, out_h):
        if out is not None and (out.shape != gate.shape or not out.is_contiguous()):
            raise ValueError("out buffers must be contiguous tensors shaped like gate")

    def _buffer(out, needed):
        if not needed:
            return None
        return out if out is not None else torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)

    dgate, dup = _buffer(out_dgate, need_dgate), _buffer(out_dup, need_dup)
    need_h = out_h is not None
    if gate.numel() == 0 or not (need_dgate or need_dup or need_h):
        return dgate, dup
    dh2, g2, u2 = _as_rows(dh), _as_rows(gate), _as_rows(up)
    # A gradient not asked for gets a placeholder pointer that the kernel never dereferences.
    dgate2 = dgate.view(g2.shape) if need_dgate else g2
    dup2 = dup.view(g2.shape) if need_dup else g2
    h2 = out_h.view(g2.shape) if need_h else g2
    _launch(
        _gated_activation_bwd_kernel, gate, kind, (dh2, g2, u2, dgate2, dup2, h2),
        NEED_DGATE=need_dgate, NEED_DUP=need_dup, NEED_H=need_h,
    )  # fmt: skip
    return dgate, dup


# --------------------------------------------------------------------------------------------------
# Autograd function, reference and functional API
# --------------------------------------------------------------------------------------------------


class GatedActivationFunction(torch.autograd.Function):
    """``h = act(gate) * up`` through the Triton kernels; saves ``gate`` and ``up`` only.

    ``GatedActivationFunction.apply(gate, up, kind)`` with ``kind`` in :data:`KINDS`. The gradients
    are not themselves differentiable (no double backward). They go to fresh buffers, never in place
    into ``gate`` / ``up``: those may be views of a tensor autograd still needs (a fused ``gate_up``
    projection output, say), and overwriting them would corrupt other gradients.
    """

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, kind: str = "swiglu") -> torch.Tensor:
        h = gated_activation_forward(gate, up, kind)
        ctx.save_for_backward(gate, up)
        ctx.kind = kind
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        dgate, dup = gated_activation_backward(
            dh, gate, up, ctx.kind, need_dgate=ctx.needs_input_grad[0], need_dup=ctx.needs_input_grad[1]
        )
        return dgate, dup, None


def gated_activation_reference(gate: torch.Tensor, up: torch.Tensor, kind: str = "swiglu") -> torch.Tensor:
    """Plain-PyTorch ``act(gate) * up``: computed in fp32 (fp64 for fp64 inputs), cast once to the input dtype.

    Differentiable through autograd; its gradients are likewise rounded once, from fp32. In fp32 it equals transformers' ``ACT2FN[...](gate) * up``; in
    bf16/fp16 it rounds once where the eager path rounds twice (see the module docstring).
    """
    _check_kind(kind)
    _check_operands(gate, up, _FLOAT_DTYPES + (torch.float64,))
    compute_dtype = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g = gate.to(compute_dtype)
    if kind == "swiglu":
        a = F.silu(g)
    elif kind == "geglu":
        a = F.gelu(g)
    else:
        a = F.gelu(g, approximate="tanh")
    return (a * up.to(compute_dtype)).to(gate.dtype)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, kind: str = "swiglu") -> torch.Tensor:
    """``act(gate) * up``: the Triton kernels where :func:`fastft.kernels.use_triton` says so, else the reference."""
    _check_kind(kind)
    if use_triton(gate):
        return GatedActivationFunction.apply(gate, up, kind)
    return gated_activation_reference(gate, up, kind)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (LLaMA, Mistral, Qwen MLPs)."""
    return gated_activation(gate, up, "swiglu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(gate, approximate) * up``: ``"none"`` is the exact erf GELU, ``"tanh"`` Gemma's approximation."""
    if approximate == "none":
        return gated_activation(gate, up, "geglu")
    if approximate == "tanh":
        return gated_activation(gate, up, "geglu_tanh")
    raise ValueError(f"approximate must be 'none' or 'tanh', not {approximate!r}")


__all__ = [
    "HIDDEN_ACT_TO_KIND",
    "KINDS",
    "GatedActivationFunction",
    "gated_activation",
    "gated_activation_backward",
    "gated_activation_forward",
    "gated_activation_reference",
    "geglu",
    "swiglu",
]

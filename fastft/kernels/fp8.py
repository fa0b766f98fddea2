"""FP8 (e4m3) frozen base weights: per-output-channel weight scales, activations and output gradients
quantised per row on the fly (one fused Triton pass: amax, scale, cast), the GEMMs on FP8 tensor cores
(``torch._scaled_mm`` with row-wise scales), each beside a plain-PyTorch reference.

A weight ``W [out, in]`` is stored as ``Wq`` (``float8_e4m3fn``) and ``s_w [out]`` (fp32), ``W ~ diag(s_w) Wq``
with ``s_w = max_j |W[o, j]| / 448``. For rows ``x [N, in]`` and their output gradient ``dy [N, out]``::

    x  ~ diag(s_x) xq                       s_x[n] = max |x[n, :]| / 448
    y  = x W^T  ~ diag(s_x) (xq Wq^T) diag(s_w)          _scaled_mm(xq, Wq^T, s_x, s_w)
    dx = dy W   = (dy diag(s_w)) Wq ~ diag(s_g) (gq Wq)   gq, s_g: the rows of dy * s_w quantised

The input-gradient GEMM contracts over ``out``, the weight's scaled dimension, so its scale cannot stay
outside the product: it is folded into ``dy``'s columns before ``dy`` is quantised per row (the same pass).
``_scaled_mm`` wants its second operand column-major: ``Wq^T`` is ``Wq`` (row-major ``[out, in]``) viewed
transposed, and the input gradient's ``Wq`` is ``Wq^T`` made contiguous (a transpose of one byte per weight,
made in the backward and dropped after it).

Where the FP8 GEMM runs: CUDA cards of compute capability 8.9 and newer (Ada's L4 / RTX 40xx, Hopper,
Blackwell), with both GEMM widths multiples of 16 and a bf16 compute dtype (`fp8_gemm_runs`). Elsewhere (the CPU, for tests and tiny
presets) the reference runs: the weight dequantised to the compute dtype and a plain matmul, activations not
quantised. Loading refuses FP8 on CUDA cards without FP8 tensor cores (`fastft.models.fp8`).

The Triton interpreter's fp32 -> fp8 cast does not round to nearest (measured: -126.7 became -64), so on
the CPU the quantiser always runs its reference; the Triton kernel is tested on a GPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper, Blackwell
_TINY = 1e-12  # an all-zero row gets this amax (its values quantise to 0)
_MAX_SINGLE_BLOCK = 16384  # rows up to this width are read once; wider ones in two passes


# ----------------------------------------------------------------------------------------------- weights


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Wq float8_e4m3fn [out, in], scale fp32 [out])`` with ``W ~ scale[:, None] * Wq``, on `weight`'s
    device. Per output channel: ``scale = max |W[o, :]| / 448`` (an all-zero row gets a tiny scale)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight: expected a 2-D [out, in] weight, got shape {tuple(weight.shape)}")
    if not weight.is_floating_point() or weight.dtype == FP8_DTYPE:
        raise ValueError(f"quantize_weight: expected a 16- or 32-bit weight, got {weight.dtype}")
    return quantize_rows_reference(weight)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale[:, None] * Wq`` in `dtype` (the product in fp32, rounded once)."""
    return (weight.float() * scale.float().view(-1, 1)).to(dtype)


def quantize_experts(weight: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked expert weights quantised per expert and output channel: ``(Wq float8_e4m3fn, scale fp32)`` with
    ``W ~ scale * Wq`` (broadcast). `weight` is ``[E, N, K]`` (out, in: Qwen, Mixtral; ``scale [E, N, 1]``) or,
    `transposed`, ``[E, K, N]`` (gpt-oss; ``scale [E, 1, N]``); ``Wq`` keeps its layout, and the scale's shape
    says which dimension is the output. One expert at a time (no fp32 copy of the whole stack)."""
    if weight.dim() != 3:
        raise ValueError(
            f"quantize_experts: expected a 3-D [E, N, K] weight, got shape {tuple(weight.shape)}"
        )
    if not weight.is_floating_point() or weight.dtype == FP8_DTYPE:
        raise ValueError(f"quantize_experts: expected a 16- or 32-bit weight, got {weight.dtype}")
    experts, outputs = weight.shape[0], weight.shape[2 if transposed else 1]
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scale = torch.empty(experts, outputs, dtype=torch.float32, device=weight.device)
    for expert in range(experts):
        rows = weight[expert].t() if transposed else weight[expert]
        expert_q, scale[expert] = quantize_rows_reference(rows)
        q[expert] = expert_q.t() if transposed else expert_q
    return q, scale.unsqueeze(1 if transposed else 2)


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``scale * Wq`` (`quantize_experts`' broadcast scale) in `dtype` and ``Wq``'s layout: each product in
    fp32, rounded once (as `dequantize_weight`), a few experts at a time (no fp32 copy of the whole stack)."""
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    step = max(1, (1 << 24) // max(1, weight[0].numel()))
    for start in range(0, weight.shape[0], step):
        end = start + step
        out[start:end] = weight[start:end].float() * scale[start:end].float()
    return out


# ----------------------------------------------------------------------------------- row quantisation


def quantize_rows_reference(
    x: torch.Tensor, column_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [N, C], scale fp32 [N])`` with ``x * column_scale ~ scale[:, None] * q``: each row of
    ``x`` (times ``column_scale [C]``, when given) scaled so that its largest magnitude is 448, then cast
    (round to nearest even). Plain PyTorch; the oracle of `quantize_rows`."""
    values = x.float()
    if column_scale is not None:
        values = values * column_scale.float().view(1, -1)
    amax = values.abs().amax(dim=1).clamp(min=_TINY)
    q = (values * (E4M3_MAX / amax).view(-1, 1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q, amax / E4M3_MAX


@triton.jit
def _load_block(x_row, ColScale_ptr, start, n_cols, HAS_COLUMN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """Columns ``[start, start + BLOCK)`` of a row, their mask, and ``x * c`` there in fp32 (0 past the end)."""
    cols = start + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_COLUMN_SCALE:
        x = x * tl.load(ColScale_ptr + cols, mask=mask, other=0.0)
    return cols, mask, x


@triton.jit
def _quantize_rows_kernel(
    X_ptr,
    ColScale_ptr,
    Q_ptr,
    Scale_ptr,
    n_cols,
    stride_x,
    stride_q,
    HAS_COLUMN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
):
    """One program per row: ``amax = max |x * c|``, ``q = x * c * (448 / amax)`` cast to e4m3 (nearest, even),
    ``scale = amax / 448``; both divisions correctly rounded (``div_rn``), as the reference's. ``SINGLE``: the row fits one block and is read once; else it is read twice (the second
    read mostly from L2)."""
    row = tl.program_id(0).to(tl.int64)
    E4M3 = tl.full((), 448.0, tl.float32)
    x_row = X_ptr + row * stride_x
    q_row = Q_ptr + row * stride_q
    if SINGLE:
        cols, mask, x = _load_block(x_row, ColScale_ptr, 0, n_cols, HAS_COLUMN_SCALE, BLOCK)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)
        q = tl.clamp(x * tl.math.div_rn(E4M3, amax), -448.0, 448.0)
        tl.store(q_row + cols, q.to(Q_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols, mask, x = _load_block(x_row, ColScale_ptr, start, n_cols, HAS_COLUMN_SCALE, BLOCK)
            acc = tl.maximum(acc, tl.abs(x))
        amax = tl.maximum(tl.max(acc, axis=0), 1e-12)
        factor = tl.math.div_rn(E4M3, amax)
        for start in range(0, n_cols, BLOCK):
            cols, mask, x = _load_block(x_row, ColScale_ptr, start, n_cols, HAS_COLUMN_SCALE, BLOCK)
            q = tl.clamp(x * factor, -448.0, 448.0)
            tl.store(q_row + cols, q.to(Q_ptr.dtype.element_ty), mask=mask)
    tl.store(Scale_ptr + row, tl.math.div_rn(amax, E4M3))


def quantize_rows(
    x: torch.Tensor, column_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_reference` in one fused Triton launch on CUDA (``x [N, C]`` with unit column stride;
    ``column_scale`` fp32 ``[C]``); on the CPU, the reference (see the module docstring)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: expected a 2-D [rows, columns] tensor, got shape {tuple(x.shape)}")
    if column_scale is not None and column_scale.numel() != x.shape[1]:
        raise ValueError(
            f"quantize_rows: column_scale has {column_scale.numel()} entries for {x.shape[1]} columns"
        )
    if not x.is_cuda or x.numel() == 0:
        return quantize_rows_reference(x, column_scale)
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(cols)
    single = block <= _MAX_SINGLE_BLOCK
    if not single:
        block = 4096
    _quantize_rows_kernel[(rows,)](
        x,
        x if column_scale is None else column_scale.float().contiguous(),
        q,
        scale,
        cols,
        x.stride(0),
        q.stride(0),
        HAS_COLUMN_SCALE=column_scale is not None,
        BLOCK=block,
        SINGLE=single,
        num_warps=8 if block >= 4096 else 4,
    )
    return q, scale


# ------------------------------------------------------------------------------------------------- GEMMs


def fp8_supported(device: torch.device) -> bool:
    """Whether `device` is a CUDA card with FP8 tensor cores (compute capability 8.9 or newer)."""
    if device.type != "cuda":
        return False
    return (
        _capability(torch.cuda.current_device() if device.index is None else device.index) >= MIN_CAPABILITY
    )


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """A card's compute capability, asked once (every FP8 projection asks, each step)."""
    return torch.cuda.get_device_capability(index)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype `x`'s matmuls compute in: the autocast dtype when autocast is on, else `x`'s."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


# The FP8 GEMMs' numbers on the CPU: True makes every FP8 projection on the CPU take the FP8 path with its
# GEMMs emulated (activations and output gradients quantised per row, the products of the dequantised operands
# in fp32: `scaled_mm`'s CPU branch), whatever its widths, instead of the dequantised reference. For measuring
# what FP8 GEMMs do to training on a machine without them (`fastft bench fp8-quality --fp8-gemm emulated`);
# `emulated_gemms` sets it for a block.
EMULATE_ON_CPU = False


@contextlib.contextmanager
def emulated_gemms(on: bool = True):
    """Set `EMULATE_ON_CPU` to `on` inside the block (restored after it)."""
    global EMULATE_ON_CPU
    before, EMULATE_ON_CPU = EMULATE_ON_CPU, on
    try:
        yield
    finally:
        EMULATE_ON_CPU = before


def fp8_gemm_runs(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight^T`` with this FP8 ``weight [out, in]`` runs on FP8 tensor cores: a card with them
    (`fp8_supported`), both widths multiples of 16 and a bf16 output (what ``_scaled_mm`` with row-wise scales
    takes); else the dequantised reference runs. On the CPU with `EMULATE_ON_CPU`: True (emulated GEMMs)."""
    out_features, in_features = weight.shape
    if EMULATE_ON_CPU and x.device.type == "cpu":
        return True
    return (
        x.is_cuda
        and in_features % 16 == 0
        and out_features % 16 == 0
        and compute_dtype(x) == torch.bfloat16
        and fp8_supported(x.device)
    )


def scaled_mm(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``diag(a_scale) (a @ b) diag(b_scale)`` in `dtype`: ``a [M, K]`` fp8 row-major, ``b [K, N]`` fp8
    column-major, scales fp32 ``[M]`` and ``[N]``. ``torch._scaled_mm`` with row-wise scales on CUDA (fp32
    accumulation); elsewhere the same product of the dequantised operands in fp32."""
    if a.is_cuda:
        return torch._scaled_mm(
            a, b, a_scale.view(-1, 1), b_scale.view(1, -1), out_dtype=dtype, use_fast_accum=False
        )
    return ((a.float() @ b.float()) * a_scale.view(-1, 1) * b_scale.view(1, -1)).to(dtype)


def fp8_forward(
    x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``x W^T`` for rows ``x2 [N, in]``: the rows quantised (`quantize_rows`), one FP8 GEMM."""
    xq, x_scale = quantize_rows(x2)
    return scaled_mm(xq, x_scale, weight.t(), scale, dtype)


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """``Wq^T`` contiguous ``[in, out]``: its ``.t()`` is ``Wq`` column-major, the input gradient's operand."""
    return weight.t().contiguous()


def fp8_input_grad(
    dy: torch.Tensor,
    weight_t: torch.Tensor,
    scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``dy W`` for ``dy [N, out]``, with ``weight_t = transposed(Wq)``: ``dy * s_w`` quantised per row in one
    pass, one FP8 GEMM (the second operand's scale is one)."""
    gq, g_scale = quantize_rows(dy, scale)
    ones = torch.ones(weight_t.shape[0], dtype=torch.float32, device=dy.device)
    return scaled_mm(gq, g_scale, weight_t.t(), ones, dtype)


class FP8LinearFunction(torch.autograd.Function):
    """``y = x W^T + b`` over an FP8 frozen weight, on FP8 tensor cores: ``apply(x, weight, scale, bias)``.

    Forward and input gradient only: the weight (and bias) are frozen. Computes in `x`'s dtype (the autocast
    dtype under autocast). The GEMMs go through `scaled_mm`, so on the CPU this emulates the GPU's numbers
    (quantised activations, fp32 products); the model's CPU path is `fp8_linear`'s dequantised reference."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias):
        dtype = compute_dtype(x)
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        y = fp8_forward(x2, weight, scale, dtype)
        if bias is not None:
            y = y + bias.to(dtype)
        ctx.save_for_backward(weight, scale)
        ctx.dtype, ctx.x_dtype, ctx.x_shape = dtype, x.dtype, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        weight, scale = ctx.saved_tensors
        dy = grad.reshape(-1, grad.shape[-1]).to(ctx.dtype)
        dx = fp8_input_grad(dy, transposed(weight), scale, ctx.dtype)
        return dx.view(ctx.x_shape).to(ctx.x_dtype), None, None, None


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The dequantised reference: ``x @ dequantize_weight(W)^T + b`` in the compute dtype (autograd's own
    backward gives the input gradient; the weight is not a leaf that needs one)."""
    dtype = compute_dtype(x)
    dense = dequantize_weight(weight, scale, dtype)
    return F.linear(x.to(dtype), dense, None if bias is None else bias.to(dtype))


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + b`` for an FP8 weight: `FP8LinearFunction` where the FP8 GEMM runs (`fp8_gemm_runs`), else
    `fp8_linear_reference`."""
    if fp8_gemm_runs(x, weight):
        return FP8LinearFunction.apply(x, weight, scale, bias)
    return fp8_linear_reference(x, weight, scale, bias)


__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "FP8LinearFunction",
    "compute_dtype",
    "dequantize_experts",
    "dequantize_weight",
    "emulated_gemms",
    "fp8_forward",
    "fp8_gemm_runs",
    "fp8_input_grad",
    "fp8_linear",
    "fp8_linear_reference",
    "fp8_supported",
    "quantize_rows",
    "quantize_experts",
    "quantize_rows_reference",
    "quantize_weight",
    "scaled_mm",
    "transposed",
]

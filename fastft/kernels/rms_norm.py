"""Fused RMSNorm: Triton forward and manual backward beside a plain-PyTorch reference.

Math (per row ``x`` of length ``N``, all in fp32)::

    rstd  = 1 / sqrt(mean(x^2) + eps)
    x_hat = x * rstd
    y     = x_hat * (offset + w)

``offset=0.0`` is Llama / Qwen / Mistral (``w`` is the scale); ``offset=1.0`` is Gemma's ``(1 + w)``.

Cast order (what ``transformers`` does; the reference and the kernel both follow it, differing only in the
order of their fp32 sums and in the last bit of ``rsqrt``):

* ``offset == 0`` (Llama, ``LlamaRMSNorm``): ``y = (w * x_hat.to(x.dtype)).to(x.dtype)``. The normalised
  row is rounded to the input dtype *before* the weight multiplies it; the product of two 16-bit floats is
  exact in fp32, so computing it in fp32 and rounding once gives the same bits as PyTorch's 16-bit multiply.
* ``offset != 0`` (Gemma, ``GemmaRMSNorm`` / ``Gemma3RMSNorm``):
  ``y = (x_hat * (offset + w.float())).to(x.dtype)``, one rounding at the very end.

The output is always in ``x.dtype``. (Only when ``weight.dtype`` differs from ``x.dtype`` does this differ
from ``LlamaRMSNorm``, whose ``weight * hidden`` follows PyTorch type promotion, e.g. fp32 weight and bf16
input give an fp32 output there; here that same fp32 value is rounded to bf16.)

Backward, the gradient autograd takes through those same expressions (fp32 math)::

    g  = dy * (offset + w)
    dx = rstd * (g - x_hat * mean(g * x_hat))
    dw = sum_rows(dy * x_hat)

with, for ``offset == 0`` only, autograd's roundings through ``w * x_hat.to(x.dtype)`` reproduced: ``g`` is
rounded to ``x.dtype``, ``x_hat`` is rounded to ``x.dtype`` inside ``dw``, and when ``w`` and ``x`` share a
16-bit dtype each product ``dy * x_hat`` is rounded to it before the (fp32) sum. ``dx`` is rounded once to
``x.dtype``, ``dw`` once to ``w.dtype``.

The forward saves only the per-row ``rstd`` (fp32, shape ``[rows]``); the backward recomputes ``x_hat``.
``dw`` is reduced in two stages with no host sync: each program accumulates its rows into one row of an
fp32 ``[num_programs, N]`` buffer, and ``torch.sum`` over that buffer finishes it on the device.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fastft.kernels import use_triton
from fastft.kernels.rounding import round_to

# Largest power-of-two row the kernels hold in registers at once; wider rows fall back to the reference.
MAX_BLOCK_SIZE = 65536
# Elements per program tile: short rows are packed several to a program up to this many elements.
_FORWARD_TILE = 4096
_BACKWARD_TILE = 2048
# Backward programs per SM on a GPU, each writing one fp32 row of dW partials, summed in one launch
# (`_sum_partials_kernel`). Two per SM was the fastest count with the next row block loaded ahead of the
# current one's math (docs/journal.md, "Measurements once quoted in code comments"; BENCHMARKS.md, "Kernels").
_PROGRAMS_PER_SM = 2
_SUM_COLS = 32  # dW columns per program of the partials' sum: 128 programs at hidden 4096
_BACKWARD_WARPS = 16  # for row blocks of 4,096 elements and more (8 warps: 3.35 TB/s above)


# ----------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> torch.Tensor:
    """Plain-PyTorch RMSNorm, ``y = x / sqrt(mean(x^2, -1) + eps) * (offset + weight)``, in ``x.dtype``.

    ``offset == 0``: the Llama cast order, ``(weight * x_hat.to(x.dtype)).to(x.dtype)``, as ``LlamaRMSNorm``.
    ``offset != 0``: the Gemma cast order, ``(x_hat * (offset + weight.float())).to(x.dtype)``, as
    ``Gemma3RMSNorm``. Differentiable through autograd; the oracle for the Triton kernels.
    """
    x_f = x.float()
    x_hat = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + eps)
    if offset == 0.0:
        return (weight * x_hat.to(x.dtype)).to(x.dtype)
    return (x_hat * (offset + weight.float())).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_rows"])  # one compile for every token count
def _rms_norm_forward_kernel(
    Y_ptr,
    y_row_stride,
    X_ptr,
    x_row_stride,
    W_ptr,
    RSTD_ptr,
    n_rows,
    n_cols,
    eps,
    offset,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    LLAMA_CAST: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """One program normalises ``BLOCK_ROWS`` rows: ``rstd = rsqrt(mean(x^2) + eps)``,
    ``y = x * rstd * (offset + w)``, fp32 math.

    ``LLAMA_CAST`` (offset == 0): ``y = w * (x * rstd).to(x.dtype)``; else ``y = (x * rstd) * (offset + w)``.
    Writes ``y`` in ``Y``'s dtype and ``rstd`` (fp32) per row.
    """
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_SIZE)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(X_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)

    mean_sq = tl.sum(x * x, axis=1) / n_cols
    rstd = tl.math.rsqrt(mean_sq + eps)
    tl.store(RSTD_ptr + rows, rstd, mask=row_mask)

    x_hat = x * rstd[:, None]
    if LLAMA_CAST:
        y = round_to(x_hat, X_ptr.dtype.element_ty, EMULATE_RNE).to(tl.float32) * w[None, :]
    else:
        y = x_hat * (offset + w)[None, :]
    y = round_to(y, Y_ptr.dtype.element_ty, EMULATE_RNE)
    tl.store(Y_ptr + rows[:, None] * y_row_stride + cols[None, :], y, mask=mask)


@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])
def _rms_norm_backward_kernel(
    DX_ptr,
    dx_row_stride,
    DY_ptr,
    dy_row_stride,
    X_ptr,
    x_row_stride,
    W_ptr,
    RSTD_ptr,
    DW_ptr,
    dw_row_stride,
    n_rows,
    n_cols,
    offset,
    rows_per_program,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    LLAMA_CAST: tl.constexpr,
    COMPUTE_DW: tl.constexpr,
    ROUND_DW_PRODUCT: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """One program walks ``rows_per_program`` rows, ``BLOCK_ROWS`` at a time, recomputing
    ``x_hat = x * rstd``. The next block's ``x`` and ``dy`` are loaded before this one's math, so their
    latency overlaps it (loop-carried registers; see ``_PROGRAMS_PER_SM`` for what it gained).

    ``g = dy * (offset + w)``, ``dx = rstd * (g - x_hat * mean(g * x_hat))``; with ``COMPUTE_DW`` it also
    sums ``dy * x_hat`` over its rows in fp32 into row ``pid`` of ``DW`` (`_sum_partials_kernel` sums
    those partials).
    ``LLAMA_CAST`` reproduces autograd through ``w * x_hat.to(x.dtype)``: ``g`` is rounded to ``x.dtype``,
    ``x_hat`` is rounded to ``x.dtype`` in ``dw``, and with ``ROUND_DW_PRODUCT`` (``w`` and ``x`` of one
    16-bit dtype) so is each ``dy * x_hat`` product before it is summed.
    """
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_SIZE)
    col_mask = cols < n_cols

    w = tl.load(W_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if not LLAMA_CAST:
        w = w + offset
    dw_acc = tl.zeros((BLOCK_ROWS, BLOCK_SIZE), dtype=tl.float32)
    rows = row_start + tl.arange(0, BLOCK_ROWS)
    mask = (rows < row_end)[:, None] & col_mask[None, :]
    x_next = tl.load(X_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    dy_next = tl.load(DY_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0)

    for block_start in range(row_start, row_end, BLOCK_ROWS):
        rows = block_start + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]

        x, dy = x_next, dy_next  # and the next block's loads go out before this block's math
        ahead = rows + BLOCK_ROWS
        ahead_mask = (ahead < row_end)[:, None] & col_mask[None, :]
        x_next = tl.load(X_ptr + ahead[:, None] * x_row_stride + cols[None, :], mask=ahead_mask, other=0.0)
        dy_next = tl.load(DY_ptr + ahead[:, None] * dy_row_stride + cols[None, :], mask=ahead_mask, other=0.0)
        dy = dy.to(tl.float32)
        rstd = tl.load(RSTD_ptr + rows, mask=row_mask, other=0.0)

        x_hat = x.to(tl.float32) * rstd[:, None]
        g = dy * w[None, :]
        if LLAMA_CAST:
            g = round_to(g, X_ptr.dtype.element_ty, EMULATE_RNE).to(tl.float32)
        c = tl.sum(g * x_hat, axis=1) / n_cols
        dx = rstd[:, None] * (g - x_hat * c[:, None])
        dx = round_to(dx, DX_ptr.dtype.element_ty, EMULATE_RNE)
        tl.store(DX_ptr + rows[:, None] * dx_row_stride + cols[None, :], dx, mask=mask)

        if COMPUTE_DW:
            if LLAMA_CAST:
                prod = dy * round_to(x_hat, X_ptr.dtype.element_ty, EMULATE_RNE).to(tl.float32)
                if ROUND_DW_PRODUCT:
                    prod = round_to(prod, X_ptr.dtype.element_ty, EMULATE_RNE).to(tl.float32)
                dw_acc += prod
            else:
                dw_acc += dy * x_hat

    if COMPUTE_DW:
        tl.store(DW_ptr + pid * dw_row_stride + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


@triton.jit(do_not_specialize=["n_partials"])
def _sum_partials_kernel(
    P_ptr,
    p_row_stride,
    OUT_ptr,
    n_partials,
    n_cols,
    BLOCK_P: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """``OUT[c] = sum_p P[p, c]`` in fp32, cast to ``OUT``'s dtype on the store: the backward's dW from its
    per-program partial rows, in one launch (a ``sum(0)`` then a cast would be two) and a fixed order, so
    dW is the same bit for bit run to run."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    acc = tl.zeros((BLOCK_P, BLOCK_COLS), dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(P_ptr + rows[:, None] * p_row_stride + cols[None, :], mask=mask, other=0.0)
    tl.store(
        OUT_ptr + cols, round_to(tl.sum(acc, axis=0), OUT_ptr.dtype.element_ty, EMULATE_RNE), mask=col_mask
    )


# ----------------------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------------------


def _settings(n_cols: int, tile: int) -> tuple[int, int, int]:
    """``(BLOCK_SIZE, BLOCK_ROWS, num_warps)``: the row padded to a power of two, rows packed to ``tile``."""
    block_size = triton.next_power_of_2(n_cols)
    if block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"rms_norm: hidden size {n_cols} exceeds the fused limit of {MAX_BLOCK_SIZE}")
    block_rows = max(1, tile // block_size)
    numel = block_rows * block_size
    num_warps = 32 if numel >= 32768 else 16 if numel >= 8192 else 8 if numel >= 2048 else 4
    return block_size, block_rows, num_warps


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_programs(device: torch.device) -> int:
    """Programs the backward spreads rows over: ``_PROGRAMS_PER_SM`` per SM on a GPU, 4 when interpreted."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _PROGRAMS_PER_SM * _sm_count(index)
    return 4


def _as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """``t`` as a 2-D ``[rows, n_cols]`` view with unit column stride (a copy only when no view exists)."""
    t2 = t.reshape(-1, n_cols)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def rms_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel. Returns ``(y, x_rows, rstd)``.

    ``y`` has ``x``'s shape and dtype; ``x_rows`` is ``x`` as ``[rows, N]`` with unit column stride (a view
    when possible), to be saved for the backward; ``rstd`` is fp32 ``[rows]``.
    """
    n_cols = x.shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {n_cols}")
    x_rows = _as_rows(x, n_cols)
    n_rows = x_rows.shape[0]
    w = weight.contiguous()
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows > 0:
        block_size, block_rows, num_warps = _settings(n_cols, _FORWARD_TILE)
        grid = (triton.cdiv(n_rows, block_rows),)
        _rms_norm_forward_kernel[grid](
            y,
            y.stride(0),
            x_rows,
            x_rows.stride(0),
            w,
            rstd,
            n_rows,
            n_cols,
            eps,
            offset,
            BLOCK_ROWS=block_rows,
            BLOCK_SIZE=block_size,
            LLAMA_CAST=offset == 0.0,
            EMULATE_RNE=not x.is_cuda,
            num_warps=num_warps,
        )
    return y.view(x.shape), x_rows, rstd


def rms_norm_backward(
    dy: torch.Tensor,
    x_rows: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    offset: float = 0.0,
    compute_dw: bool = True,
    num_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernel. Returns ``(dx, dw)``: ``dx`` in ``dy``'s shape and ``x``'s dtype, ``dw`` in
    ``weight``'s dtype (``None`` unless ``compute_dw``).

    ``num_programs`` (default: ``_PROGRAMS_PER_SM`` per SM) sets how many fp32 partial rows ``dw`` is
    reduced from.
    """
    n_rows, n_cols = x_rows.shape
    dx = torch.empty((n_rows, n_cols), dtype=x_rows.dtype, device=x_rows.device)
    if n_rows == 0:
        dw = torch.zeros_like(weight) if compute_dw else None
        return dx.view(dy.shape), dw
    dy_rows = _as_rows(dy, n_cols)
    w = weight.contiguous()
    block_size, block_rows, num_warps = _settings(n_cols, _BACKWARD_TILE)
    if block_size * block_rows >= 4096:
        num_warps = max(num_warps, _BACKWARD_WARPS)

    programs = num_programs if num_programs is not None else _num_programs(x_rows.device)
    programs = max(1, min(programs, triton.cdiv(n_rows, block_rows)))
    # Whole row blocks per program, so only the last program's last block is ragged.
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, programs), block_rows) * block_rows
    programs = max(1, triton.cdiv(n_rows, rows_per_program))

    if compute_dw:
        dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x_rows.device)
    else:
        dw_partial = rstd  # never written: COMPUTE_DW=False compiles the store away
    _rms_norm_backward_kernel[(programs,)](
        dx,
        dx.stride(0),
        dy_rows,
        dy_rows.stride(0),
        x_rows,
        x_rows.stride(0),
        w,
        rstd,
        dw_partial,
        dw_partial.stride(0) if compute_dw else 0,
        n_rows,
        n_cols,
        offset,
        rows_per_program,
        BLOCK_ROWS=block_rows,
        BLOCK_SIZE=block_size,
        LLAMA_CAST=offset == 0.0,
        COMPUTE_DW=compute_dw,
        ROUND_DW_PRODUCT=weight.dtype == x_rows.dtype and x_rows.dtype != torch.float32,
        EMULATE_RNE=not x_rows.is_cuda,
        num_warps=num_warps,
    )
    dw = None
    if compute_dw:
        dw = torch.empty(n_cols, dtype=weight.dtype, device=x_rows.device)
        _sum_partials_kernel[(triton.cdiv(n_cols, _SUM_COLS),)](
            dw_partial,
            dw_partial.stride(0),
            dw,
            programs,
            n_cols,
            BLOCK_P=32,
            BLOCK_COLS=_SUM_COLS,
            EMULATE_RNE=not x_rows.is_cuda,
        )
    return dx.view(dy.shape), dw


# ----------------------------------------------------------------------------------------------------------
# Autograd and public API
# ----------------------------------------------------------------------------------------------------------


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm with the Triton forward and manual backward; saves only ``x``, ``weight`` and fp32 ``rstd``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
        y, x_rows, rstd = rms_norm_forward(x, weight, eps, offset)
        ctx.save_for_backward(x_rows, weight, rstd)
        ctx.offset = offset
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_rows, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x_rows, weight, rstd, ctx.offset, compute_dw=ctx.needs_input_grad[1])
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, offset: float = 0.0) -> torch.Tensor:
    """``y = x / sqrt(mean(x^2, -1) + eps) * (offset + weight)`` over the last dim, any leading shape.

    Runs the Triton kernels when ``fastft.kernels.use_triton(x)`` says so (and the row fits in one block),
    else :func:`rms_norm_reference`. ``offset=0.0``: Llama cast order; ``offset=1.0``: Gemma's.
    """
    if use_triton(x) and triton.next_power_of_2(x.shape[-1]) <= MAX_BLOCK_SIZE:
        return RMSNormFunction.apply(x, weight, eps, offset)
    return rms_norm_reference(x, weight, eps, offset)


class FastRMSNorm(torch.nn.Module):
    """Drop-in RMSNorm calling :func:`rms_norm`: ``weight``, ``eps``, ``offset`` (0 Llama/Qwen, 1 Gemma)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        init = torch.zeros if offset != 0.0 else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.offset = offset

    @classmethod
    def from_module(cls, module: torch.nn.Module, offset: float = 0.0) -> FastRMSNorm:
        """Wrap an HF RMSNorm (``.weight`` and ``.variance_epsilon`` or ``.eps``), sharing its weight."""
        eps = getattr(module, "variance_epsilon", None)
        if eps is None:
            eps = getattr(module, "eps", None)
        if eps is None:
            raise ValueError(f"{type(module).__name__} has neither .variance_epsilon nor .eps")
        weight = module.weight
        new = cls(weight.shape[0], eps=float(eps), offset=offset, device="meta")
        new.weight = weight
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}"


__all__ = [
    "FastRMSNorm",
    "RMSNormFunction",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "rms_norm_reference",
]

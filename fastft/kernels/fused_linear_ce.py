"""Fused linear cross-entropy: the lm_head matmul and the loss over token chunks, so the full
``[tokens, vocab]`` logits never exist.

Math (per token row ``h`` of ``hidden [N, H]``, target ``t``, ``W [V, H]``, optional bias ``b``)::

    x      = h @ W.T + b                        (logits, in the input dtype, as eager transformers does)
    z      = cap * tanh(x / cap)  if softcap  else  x          (fp32 from here on)
    lse    = log(sum_j exp(z_j))
    loss   = lse - z_t                          (0 for rows with t == ignore_index)

    dloss/dx_j = (softmax(z)_j - [j == t]) * (1 - tanh(x_j / cap)^2  if softcap else 1) * s
    dloss/dh   = dx @ W,   dloss/dW = dx.T @ h,   dloss/db = sum_rows(dx)

with ``s`` the reduction factor: 1 for ``"sum"``, ``1 / max(n_valid, 1)`` for ``"mean"`` (``n_valid`` the
count of rows whose target is not ``ignore_index``, computed on the device), and 0 for ignored rows.
All-ignored input gives loss 0 and zero gradients under every reduction (``F.cross_entropy``'s "mean" gives
NaN there). Softcap is Gemma 2's ``final_logit_softcapping``, applied here in fp32 (transformers applies it
in the logits' dtype); the reference below does the same.

How it runs (the Triton path; :func:`fused_linear_cross_entropy_reference` is the plain-PyTorch oracle):

1. Rows are processed ``chunk_size`` at a time. Per chunk, ``logits = h_chunk @ W.T`` by cuBLAS
   (``torch.mm`` / ``torch.addmm``) into one reused ``[chunk_size, V]`` buffer in the input dtype.
2. ONE Triton kernel per chunk, one program per row: an online (max, sum-exp) pass over the vocab in blocks
   (the tail block masked, so any ``V``: 32001, 128256, 151936), the fp32 row loss, then a second pass that
   overwrites the logits in place with ``dloss/dx`` (rounded to the input dtype, as eager autograd's
   gradient of the 16-bit logits is).
3. ``grad_h[chunk] = dx @ W`` (written into the preallocated ``[N, H]`` gradient), ``grad_W += dx.T @ h``
   (only when ``weight.requires_grad``), ``grad_b += sum_rows(dx)`` (fp32).

For ``"sum"`` / ``"mean"`` the loss is a scalar, so all gradients are computed in the forward and stored; the
backward only multiplies them by ``grad_output`` in place (a device scalar: no ``.item()``, no host sync;
a second backward through the same graph therefore raises autograd's in-place-modification error). For
``"none"`` the per-row ``grad_output`` must scale each row of ``dx`` before ``dx.T @ h``, so the forward
computes only the losses and the backward recomputes each chunk's logits (one extra matmul per chunk) and
runs the kernel with the per-row scale.

No host-device sync anywhere: no ``.item()``, no boolean-mask indexing, no ``nonzero``; chunk bounds come
from the host-known ``N``. Targets outside ``[0, V)`` other than ``ignore_index`` are not checked (that
would need a sync): the kernel never reads outside the row, and such a row's loss is its ``lse``.

Memory (the default chunk). A chunk's logits take at most ``LOGITS_CHUNK_BYTES`` = 256 MiB while the
weight is frozen (LoRA: the loss is the step's memory peak when the chunk is large, and a 1,024-row chunk
still keeps the GEMM efficient), ``TRAINED_WEIGHT_CHUNK_BYTES`` = 1 GiB when it trains (see ``grad_W``
precision): ``max_rows = budget // (V * element_size)``, then the rows are balanced over
``cdiv(N, max_rows)`` chunks. At ``N = 16384``, ``V = 128256``, ``H = 4096`` in bf16 with a trained
weight: ``max_rows = 4186`` -> 4 chunks of 4096 rows, a 1.05 GB logits buffer (frozen: 16 chunks of
1024 rows, 263 MB); plus ``grad_h`` (``N * H * 2`` = 134 MB), the fp32 row losses (64 KB) and, when the
weight trains, ``grad_W`` in the weight's dtype (``V * H * 2`` = 1.05 GB, which eager autograd allocates
too). Eager ``F.cross_entropy(logits.float())`` holds the bf16 logits (4.2 GB), their fp32 copy and
log-softmax (8.4 GB each) and in backward two more fp32 ``[N, V]`` tensors: ~25 GB at its peak.

``grad_W`` precision. ``grad_W`` accumulates across chunks in the weight's dtype with ``addmm_``: cuBLAS
sums each chunk's product in fp32 and adds it to the stored ``grad_W`` in fp32 in its epilogue, so an
element is rounded once per chunk (4 roundings at the sizes above, error <= ~4 * 2**-9 relative worst case,
~2 * 2**-9 typical), against one rounding in eager. An fp32 accumulator would remove that but cost
``V * H * 4`` bytes (2.1 GB at the sizes above, twice the whole logits buffer), so it is not used.
``grad_b`` (``V`` floats) is accumulated in fp32 and rounded once.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from . import use_triton

Reduction = Literal["sum", "mean", "none"]
REDUCTIONS = ("sum", "mean", "none")

# Bytes one chunk's logits may take (the default chunk size is derived from it; see the module docstring):
# 256 MiB while the head is frozen (LoRA), 1 GiB when its weight trains (fewer roundings of grad_W).
LOGITS_CHUNK_BYTES = 2**28
TRAINED_WEIGHT_CHUNK_BYTES = 2**30
# Vocab columns a program holds per step of its two passes over a row (GPU: 4096 x 4 B fp32 in registers
# over 8 warps = 16 elements per thread). Not yet tuned by measurement. The interpreter takes whole rows up
# to 8192 columns: fewer, larger numpy steps.
_BLOCK_SIZE_GPU = 4096
_NUM_WARPS_GPU = 8
_BLOCK_SIZE_INTERPRETED = 8192


# ----------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------


def fused_linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: Reduction = "sum",
) -> torch.Tensor:
    """Plain PyTorch: ``logits = hidden @ weight.T (+ bias)`` in the input dtype, then fp32
    (``softcap * tanh(logits / softcap)`` when set) and ``F.cross_entropy``.

    Materialises the full ``[N, V]`` logits (and their fp32 copy). ``"mean"`` divides the sum by
    ``max(n_valid, 1)``, so all-ignored input gives 0, not NaN. Differentiable through autograd.
    """
    _check_reduction(reduction)
    logits = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1).long(),
        ignore_index=ignore_index,
        reduction="none",
    )
    if reduction == "none":
        return losses.view(targets.shape)
    total = losses.sum()
    if reduction == "mean":
        total = total / _valid_count(targets, ignore_index)
    return total


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    """tanh in fp32 from ``e = exp(-2|x|)`` in (0, 1]: ``sign(x) (1 - e) / (1 + e)``; never overflows."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _cast_for_store(x, ptr, EMULATE_RNE: tl.constexpr):
    """fp32 ``x`` cast to ``ptr``'s element type, rounding to nearest even on every backend.

    ``EMULATE_RNE`` (bf16 under the interpreter only, whose fp32 -> bf16 cast truncates): round with integer
    ops first, so the cast afterwards is exact and interpreted results are the GPU's.
    """
    if EMULATE_RNE:
        u = x.to(tl.uint32, bitcast=True)
        u = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16) << 16
        x = tl.where(x != x, x, u.to(tl.float32, bitcast=True))
    return x.to(ptr.dtype.element_ty)


@triton.jit
def _cross_entropy_rows_kernel(
    X_ptr,
    x_row_stride,
    T_ptr,
    LOSS_ptr,
    SCALE_ptr,
    scale_stride,
    n_cols,
    ignore_index,
    softcap,
    BLOCK_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """One program per row of logits ``X``: ``LOSS[row] = lse(z) - z[t]`` (fp32; 0 when ``t`` is ignored),
    with ``lse = m + log(s)``, ``m`` the row max and ``s = sum(exp(z - m))``.

    Pass 1 is an online (max, sum-exp) over ``BLOCK_SIZE`` columns at a time. With ``COMPUTE_GRAD``, pass 2
    overwrites the row in place with ``(softmax(z) - onehot(t)) * dz/dx * SCALE[row * scale_stride]``
    (``scale_stride`` 0: one shared scale), zero for ignored rows.
    """
    row = tl.program_id(0).to(tl.int64)
    x_row = X_ptr + row * x_row_stride
    target = tl.load(T_ptr + row).to(tl.int64)
    valid = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    cols = tl.arange(0, BLOCK_SIZE)

    m = tl.full((), float("-inf"), tl.float32)
    s = tl.full((), 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK_SIZE):
        offs = start + cols
        mask = offs < n_cols
        z = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            z = _tanh(z / softcap) * softcap
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    # lse = m + log_s is never formed: at |z| ~ 1e4 its rounding (half an ulp, 5e-4) would be a 5e-4 relative
    # error in every softmax value; (z - m) - log_s is exact up to the last term's own rounding.
    log_s = tl.log(s)

    z_t = tl.load(x_row + target, mask=valid & in_range, other=0.0).to(tl.float32)
    if SOFTCAP:
        z_t = _tanh(z_t / softcap) * softcap
    tl.store(LOSS_ptr + row, tl.where(valid, (m - z_t) + log_s, 0.0))

    if COMPUTE_GRAD:
        scale = tl.load(SCALE_ptr + row * scale_stride).to(tl.float32)
        for start in range(0, n_cols, BLOCK_SIZE):
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if SOFTCAP:
                th = _tanh(x / softcap)
                z = th * softcap
            else:
                z = x
            g = tl.exp((z - m) - log_s) - tl.where(offs == target, 1.0, 0.0)
            if SOFTCAP:
                g = g * ((1.0 - th) * (1.0 + th))
            g = tl.where(valid, g * scale, 0.0)
            tl.store(x_row + offs, _cast_for_store(g, X_ptr, EMULATE_RNE), mask=mask)


# ----------------------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------------------


def cross_entropy_chunk_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    losses: torch.Tensor,
    grad_scale: torch.Tensor | None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    block_size: int | None = None,
) -> None:
    """Launch the row kernel on one chunk: ``losses[r]`` (fp32) for every row of ``logits [R, V]``; with a
    ``grad_scale`` (fp32, 1 element or ``R``), ``logits`` is overwritten in place with ``dloss/dlogits``
    times that scale (per row when it has ``R`` elements).

    ``logits`` needs unit column stride; ``targets`` is ``[R]`` (int64 or int32).
    """
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError(
            "cross_entropy_chunk_: logits must have unit column stride (they are written in place)"
        )
    if block_size is None:
        block_size = _BLOCK_SIZE_GPU if logits.is_cuda else _BLOCK_SIZE_INTERPRETED
    block_size = min(block_size, triton.next_power_of_2(n_cols))
    compute_grad = grad_scale is not None
    scale = grad_scale if compute_grad else losses  # never read: COMPUTE_GRAD=False compiles the load away
    scale_stride = 1 if compute_grad and grad_scale.numel() == n_rows and n_rows > 1 else 0
    _cross_entropy_rows_kernel[(n_rows,)](
        logits,
        logits.stride(0),
        targets,
        losses,
        scale,
        scale_stride,
        n_cols,
        ignore_index,
        float(softcap) if softcap is not None else 1.0,
        BLOCK_SIZE=block_size,
        SOFTCAP=softcap is not None,
        COMPUTE_GRAD=compute_grad,
        EMULATE_RNE=not logits.is_cuda and logits.dtype == torch.bfloat16,
        num_warps=_NUM_WARPS_GPU,
    )


def default_chunk_size(n_rows: int, vocab: int, element_size: int, weight_trained: bool = False) -> int:
    """Rows per chunk: as many as keep a chunk's logits within ``LOGITS_CHUNK_BYTES`` (or
    ``TRAINED_WEIGHT_CHUNK_BYTES`` when the weight trains), balanced over the chunks that takes (16384 rows
    at V=128256 bf16, frozen head: 16 chunks of 1024 rows rather than 15 x 1046 + 694)."""
    budget = TRAINED_WEIGHT_CHUNK_BYTES if weight_trained else LOGITS_CHUNK_BYTES
    max_rows = max(1, budget // (vocab * element_size))
    n_chunks = triton.cdiv(max(n_rows, 1), max_rows)
    return max(1, triton.cdiv(n_rows, n_chunks))


@torch.no_grad()
def linear_cross_entropy_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    ignore_index: int,
    softcap: float | None,
    chunk_size: int,
    grad_scale: torch.Tensor | None,
    needs_grad: tuple[bool, bool, bool] = (False, False, False),
    block_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The chunk loop. Returns ``(losses [N] fp32, grad_hidden, grad_weight, grad_bias)``.

    ``grad_scale`` (fp32; 1 element, or ``N`` for a per-row scale) multiplies ``dloss/dlogits``; ``None``
    computes the losses only. ``needs_grad`` says which of ``(hidden, weight, bias)`` get a gradient:
    ``grad_hidden`` in ``hidden``'s dtype, ``grad_weight`` in ``weight``'s dtype (accumulated across chunks
    with ``addmm_``), ``grad_bias`` in fp32; ``None`` where not needed.
    """
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    need_h, need_w, need_b = needs_grad if grad_scale is not None else (False, False, False)
    losses = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_h else None
    grad_weight = torch.zeros_like(weight) if need_w and n_rows == 0 else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if need_b else None
    per_row = grad_scale is not None and grad_scale.numel() == n_rows and n_rows > 1
    rows = max(1, min(chunk_size, n_rows))
    buffer = torch.empty((rows, vocab), dtype=hidden.dtype, device=hidden.device)
    w_t = weight.t()
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        h = hidden[start:end]
        logits = buffer[: end - start]
        if bias is None:
            torch.mm(h, w_t, out=logits)
        else:
            torch.addmm(bias, h, w_t, out=logits)
        cross_entropy_chunk_(
            logits,
            targets[start:end],
            losses[start:end],
            grad_scale[start:end] if per_row else grad_scale,
            ignore_index=ignore_index,
            softcap=softcap,
            block_size=block_size,
        )
        if need_h:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if need_w:
            if grad_weight is None:
                grad_weight = torch.mm(logits.t(), h)
            else:
                grad_weight.addmm_(logits.t(), h)
        if need_b:
            grad_bias += logits.sum(0, dtype=torch.float32)
    return losses, grad_hidden, grad_weight, grad_bias


# ----------------------------------------------------------------------------------------------------------
# Autograd and public API
# ----------------------------------------------------------------------------------------------------------


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """``hidden [N, H]``, ``weight [V, H]``, ``targets [N]``, ``bias [V] | None`` -> fp32 loss (scalar for
    ``"sum"`` / ``"mean"``, ``[N]`` for ``"none"``).

    ``"sum"`` / ``"mean"``: gradients computed in the forward, scaled by ``grad_output`` in the backward (in
    place). ``"none"``: the backward recomputes the chunks with the per-row ``grad_output``.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        bias: torch.Tensor | None,
        ignore_index: int,
        softcap: float | None,
        reduction: Reduction,
        chunk_size: int,
    ) -> torch.Tensor:
        needs_grad = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[3],
        )
        ctx.reduction = reduction
        ctx.needs_grad = needs_grad
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.chunk_args = dict(ignore_index=ignore_index, softcap=softcap, chunk_size=chunk_size)
        if reduction == "none":  # losses only: the backward recomputes with the per-row grad_output
            scale = None
        elif reduction == "mean":
            scale = (1.0 / _valid_count(targets, ignore_index)).reshape(1)
        else:
            scale = torch.ones(1, dtype=torch.float32, device=hidden.device)
        losses, grad_hidden, grad_weight, grad_bias = linear_cross_entropy_chunks(
            hidden, weight, targets, bias, **ctx.chunk_args, grad_scale=scale, needs_grad=needs_grad
        )
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, targets, bias)
            return losses
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return losses.sum() * scale[0]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.reduction == "none":
            hidden, weight, targets, bias = ctx.saved_tensors
            scale = grad_output.float().contiguous()
            _, grad_hidden, grad_weight, grad_bias = linear_cross_entropy_chunks(
                hidden, weight, targets, bias, **ctx.chunk_args, grad_scale=scale, needs_grad=ctx.needs_grad
            )
        else:
            grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
            for grad in (grad_hidden, grad_weight, grad_bias):
                if grad is not None:
                    grad.mul_(grad_output)
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.bias_dtype)
        return grad_hidden, grad_weight, None, grad_bias, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: Reduction = "sum",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets`` without materialising the logits.

    ``hidden [..., H]`` and ``weight [V, H]`` of one dtype (``weight`` may be a tied embedding matrix),
    ``targets [...]`` int64 (or int32) class ids, ``ignore_index`` rows masked. Returns fp32: a scalar for
    ``"sum"`` / ``"mean"`` (mean over non-ignored rows, 0 when there are none), ``targets``' shape for
    ``"none"``. ``chunk_size``: rows per chunk (default: logits chunk <= ``LOGITS_CHUNK_BYTES``).

    Runs the chunked Triton path when ``fastft.kernels.use_triton(hidden)`` says so, else
    :func:`fused_linear_cross_entropy_reference` (full logits).
    """
    _check_reduction(reduction)
    n_cols = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != n_cols:
        raise ValueError(
            f"fused_linear_cross_entropy: weight shape {tuple(weight.shape)} does not match hidden size {n_cols}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"fused_linear_cross_entropy: hidden is {hidden.dtype} but weight is {weight.dtype}; cast one of them"
        )
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"fused_linear_cross_entropy: targets shape {tuple(targets.shape)} does not match hidden "
            f"{tuple(hidden.shape)} without its last dim"
        )
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != hidden.dtype):
        raise ValueError(
            f"fused_linear_cross_entropy: bias is {tuple(bias.shape)} {bias.dtype}, expected "
            f"({weight.shape[0]},) {hidden.dtype}"
        )
    if softcap is not None and not softcap > 0:
        raise ValueError(f"fused_linear_cross_entropy: softcap must be positive or None, got {softcap}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    if not use_triton(hidden) or targets.numel() == 0:
        return fused_linear_cross_entropy_reference(
            hidden,
            weight,
            targets,
            bias=bias,
            ignore_index=ignore_index,
            softcap=softcap,
            reduction=reduction,
        )

    h2 = hidden.reshape(-1, n_cols)
    t1 = targets.reshape(-1).contiguous()
    if chunk_size is None:
        chunk_size = default_chunk_size(
            h2.shape[0], weight.shape[0], hidden.element_size(), weight_trained=weight.requires_grad
        )
    requires_grad = hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and requires_grad:
        loss = FusedLinearCrossEntropyFunction.apply(
            h2, weight, t1, bias, ignore_index, softcap, reduction, chunk_size
        )
    else:  # evaluation: losses only, no gradient work
        losses, *_ = linear_cross_entropy_chunks(
            h2,
            weight,
            t1,
            bias,
            ignore_index=ignore_index,
            softcap=softcap,
            chunk_size=chunk_size,
            grad_scale=None,
        )
        if reduction == "none":
            loss = losses
        else:
            loss = losses.sum()
            if reduction == "mean":
                loss = loss / _valid_count(t1, ignore_index)
    return loss.view(targets.shape) if reduction == "none" and loss.shape != targets.shape else loss


def lm_head_loss(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    reduction: Reduction = "sum",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """:func:`fused_linear_cross_entropy` with ``weight`` and ``bias`` read from an ``nn.Linear``-like head."""
    return fused_linear_cross_entropy(
        hidden,
        lm_head.weight,
        targets,
        bias=getattr(lm_head, "bias", None),
        ignore_index=ignore_index,
        softcap=softcap,
        reduction=reduction,
        chunk_size=chunk_size,
    )


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def _valid_count(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``max(#(targets != ignore_index), 1)`` as an fp32 device scalar (no host sync)."""
    return (targets != ignore_index).sum().clamp_min(1).to(torch.float32)


def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"fused_linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}"
        )


__all__ = [
    "FusedLinearCrossEntropyFunction",
    "LOGITS_CHUNK_BYTES",
    "TRAINED_WEIGHT_CHUNK_BYTES",
    "cross_entropy_chunk_",
    "default_chunk_size",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_reference",
    "linear_cross_entropy_chunks",
    "lm_head_loss",
]

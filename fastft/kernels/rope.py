"""Rotary position embedding (RoPE) for Llama / Qwen / Mistral, as Triton kernels with a manual backward.

Layout: the "half" (GPT-NeoX) layout of transformers' ``apply_rotary_pos_emb``. With ``x = [x1, x2]``
split at ``h = head_dim / 2`` and ``cos = [c1, c2]``, ``sin = [s1, s2]`` split the same way::

    rotate_half(x) = [-x2, x1]
    y = x * cos + rotate_half(x) * sin
      = [x1 * c1 - x2 * s1,  x2 * c2 + x1 * s2]

Backward is the adjoint (transpose) of that linear map::

    dx = dy * cos + rotate_half^T(dy * sin),   rotate_half^T(u) = [u2, -u1]
       = [dy1 * c1 + dy2 * s2,  dy2 * c2 - dy1 * s1]

For the cos / sin a rotary embedding builds (``emb = cat(freqs, freqs)``, so ``c1 == c2`` and
``s1 == s2``) that is the same rotation by ``-theta`` (``sin -> -sin``); the kernel uses the exact adjoint, so
it stays correct for any cos / sin the caller passes.

Shapes: ``q [batch, q_heads, seq, head_dim]``, ``k [batch, kv_heads, seq, head_dim]`` (GQA: the head counts
may differ), ``cos`` / ``sin`` ``[batch or 1, seq, head_dim]`` (or ``[seq, head_dim]``), as the model's
rotary embedding returns them from ``position_ids``. The kernel reads cos / sin per token, so packed
sequences whose ``position_ids`` restart at 0 need nothing special. Every tensor is addressed through its
strides: q / k may be ``proj(h).view(b, s, heads, d).transpose(1, 2)`` views.

One launch rotates Q and K together: program ``(token, head_block)`` loads that token's cos / sin once and
rotates up to ``BLOCK_H`` heads of Q and of K. Math is fp32 in registers, rounded once on store.

In-place policy. ``apply_rope`` / ``RoPEFunction`` never write into their inputs or into incoming
gradients: the forward writes a fresh output (the same memory as the "clone, then rotate in place"
recipe, at half the traffic), and the backward writes fresh dq / dk. Incoming gradients are NOT safe to
overwrite: autograd hands one tensor to several consumers (``AddBackward`` returns the same ``grad`` for both
operands, so ``q_rot + k_rot`` gives ``dq_rot is dk_rot``, and ``q_rot + x`` shares ``dq_rot`` with ``x``'s
gradient), and ``loss = q_rot.sum()`` gives a stride-0 expanded gradient. Writing out of place costs the
same bandwidth (one read, one write) and one allocation. The kernels do support ``out is input``:
``rope_inplace_`` is the in-place entry point, for tensors nothing else needs (inference, no autograd).

The fused Qwen3 per-head RMSNorm + rotation, ``apply_qk_norm_rope``, is `fastft.kernels.qk_norm_rope`; it
shares this module's cos / sin loads, head blocks and shape checks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from . import use_triton

# Elements of one half-tile a program holds (BLOCK_H heads x BLOCK_HALF lanes): bounds registers per program
# when a model has many heads. 32 heads x 64 lanes (head_dim 128) is one block per token.
_MAX_TILE = 4096


# --------------------------------------------------------------------------------------------- references


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half``: ``[x1, x2] -> [-x2, x1]`` over the last dim."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` verbatim: ``x * cos + rotate_half(x) * sin`` (new tensors)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _token_cos_sin(
    cos_ptr, sin_ptr, seq_len, half, stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """This program's token ``(b, s)`` (``program_id(0) = b * seq_len + s``) and its cos / sin halves
    ``(c1, c2, s1, s2)`` as fp32 ``[1, BLOCK_HALF]`` rows."""
    token = tl.program_id(0).to(tl.int64)
    b = token // seq_len
    s = token % seq_len
    offs_d = tl.arange(0, BLOCK_HALF).to(tl.int64)
    d_mask = offs_d < half
    cos_row = cos_ptr + b * stride_cb + s * stride_cs
    sin_row = sin_ptr + b * stride_sb + s * stride_ss
    c1 = tl.load(cos_row + offs_d * stride_cd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_row + (offs_d + half) * stride_cd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_row + offs_d * stride_sd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_row + (offs_d + half) * stride_sd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return b, s, c1, c2, s1, s2


@triton.jit
def _head_tile(head_start, n_heads, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Head offsets ``[BLOCK_H]``, lane offsets ``[BLOCK_HALF]``, the lane mask and the ``[BLOCK_H, BLOCK_HALF]``
    mask of heads ``[head_start, head_start + BLOCK_H)``."""
    offs_h = head_start + tl.arange(0, BLOCK_H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF).to(tl.int64)
    d_mask = offs_d < half
    mask = (offs_h < n_heads)[:, None] & d_mask[None, :]
    return offs_h, offs_d, d_mask, mask


@triton.jit
def _load_halves(x_ptr, b, s, offs_h, offs_d, half, mask, stride_b, stride_h, stride_s, stride_d):
    """The ``(x1, x2)`` halves of a head tile as fp32 ``[BLOCK_H, BLOCK_HALF]``."""
    row = x_ptr + b * stride_b + s * stride_s + offs_h[:, None] * stride_h
    x1 = tl.load(row + offs_d[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + (offs_d[None, :] + half) * stride_d, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _store_halves(o_ptr, o1, o2, b, s, offs_h, offs_d, half, mask, stride_b, stride_h, stride_s, stride_d):
    """Store ``[o1, o2]`` into a head tile, rounded to ``o_ptr``'s dtype."""
    row = o_ptr + b * stride_b + s * stride_s + offs_h[:, None] * stride_h
    tl.store(row + offs_d[None, :] * stride_d, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(row + (offs_d[None, :] + half) * stride_d, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    x_ptr, o_ptr,
    b, s, head_start, n_heads, half,
    stride_xb, stride_xh, stride_xs, stride_xd,
    stride_ob, stride_oh, stride_os, stride_od,
    c1, c2, sa, sb,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """``o = [x1 * c1 - x2 * sa, x2 * c2 + x1 * sb]`` for heads ``[head_start, head_start + BLOCK_H)``.

    All loads happen before any store, and no other program touches these elements, so ``o_ptr`` may be
    ``x_ptr`` (in place).
    """
    offs_h, offs_d, d_mask, mask = _head_tile(head_start, n_heads, half, BLOCK_H, BLOCK_HALF)
    x1, x2 = _load_halves(x_ptr, b, s, offs_h, offs_d, half, mask, stride_xb, stride_xh, stride_xs, stride_xd)
    o1 = x1 * c1 - x2 * sa
    o2 = x2 * c2 + x1 * sb
    _store_halves(o_ptr, o1, o2, b, s, offs_h, offs_d, half, mask, stride_ob, stride_oh, stride_os, stride_od)


@triton.jit(do_not_specialize=["seq_len"])  # one compile for every padded length
def _rope_kernel(
    q_ptr, q_out_ptr, k_ptr, k_out_ptr, cos_ptr, sin_ptr,
    seq_len, n_q_heads, n_k_heads, half,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_qob, stride_qoh, stride_qos, stride_qod,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_kob, stride_koh, stride_kos, stride_kod,
    stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DO_Q: tl.constexpr,
    DO_K: tl.constexpr,
    BACKWARD: tl.constexpr,
):  # fmt: skip
    """Rotate Q and K of one token (``program_id(0) = b * seq_len + s``) and one head block (``program_id(1)``).

    Forward: ``[x1 * c1 - x2 * s1, x2 * c2 + x1 * s2]``. BACKWARD (adjoint): ``[x1 * c1 + x2 * s2,
    x2 * c2 - x1 * s1]``, i.e. the forward with ``(s1, s2) -> (-s2, -s1)``: rotation by ``-theta``.
    """
    head_start = tl.program_id(1).to(tl.int64) * BLOCK_H
    b, s, c1, c2, s1, s2 = _token_cos_sin(
        cos_ptr, sin_ptr, seq_len, half,
        stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd, BLOCK_HALF,
    )  # fmt: skip
    if BACKWARD:
        sa = -s2
        sb = -s1
    else:
        sa = s1
        sb = s2

    if DO_Q:
        _rotate_heads(
            q_ptr, q_out_ptr, b, s, head_start, n_q_heads, half,
            stride_qb, stride_qh, stride_qs, stride_qd,
            stride_qob, stride_qoh, stride_qos, stride_qod,
            c1, c2, sa, sb, BLOCK_H, BLOCK_HALF,
        )  # fmt: skip
    if DO_K:
        _rotate_heads(
            k_ptr, k_out_ptr, b, s, head_start, n_k_heads, half,
            stride_kb, stride_kh, stride_ks, stride_kd,
            stride_kob, stride_koh, stride_kos, stride_kod,
            c1, c2, sa, sb, BLOCK_H, BLOCK_HALF,
        )  # fmt: skip


# ------------------------------------------------------------------------------------------ host launchers


def _blocks(n_heads: int, half: int) -> tuple[int, int, int]:
    """``(BLOCK_H, BLOCK_HALF, num_warps)``: padded half width, heads per program capped by ``_MAX_TILE``."""
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(n_heads, 1)), max(1, _MAX_TILE // block_half))
    num_warps = 4 if block_h * block_half <= 2048 else 8
    return block_h, block_half, num_warps


def _cos_sin_strides(
    cos: torch.Tensor, sin: torch.Tensor, batch: int, seq: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Strides of cos / sin viewed as ``[batch, seq, head_dim]`` (a batch of 1 broadcasts: stride 0)."""
    strides = []
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() == 2:
            t = t.unsqueeze(0)
        if t.dim() != 3 or t.shape[1] != seq or t.shape[2] != head_dim or t.shape[0] not in (1, batch):
            raise ValueError(
                f"{name} must be [batch or 1, seq, head_dim] = [{batch}, {seq}, {head_dim}], got {tuple(t.shape)}"
            )
        strides.append(tuple(t.expand(batch, seq, head_dim).stride()))
    return strides[0], strides[1]


def _check_qk(q: torch.Tensor | None, k: torch.Tensor | None) -> tuple[int, int, int]:
    """``(batch, seq, head_dim)`` shared by q and k, both 4-D ``[batch, heads, seq, head_dim]``, head_dim even."""
    present = [t for t in (q, k) if t is not None]
    for t in present:
        if t.dim() != 4:
            raise ValueError(f"q / k must be [batch, heads, seq, head_dim], got {tuple(t.shape)}")
    batch, _, seq, head_dim = present[0].shape
    for t in present[1:]:
        if (t.shape[0], t.shape[2], t.shape[3]) != (batch, seq, head_dim):
            raise ValueError(
                f"q and k disagree on batch / seq / head_dim: {tuple(q.shape)} vs {tuple(k.shape)}"
            )
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for the half-rotation layout, got {head_dim}")
    return batch, seq, head_dim


def _out_dtype(x: torch.Tensor, *others: torch.Tensor) -> torch.dtype:
    """The dtype PyTorch's elementwise ops give the reference: ``x``'s promoted with each of ``others``."""
    dtype = x.dtype
    for t in others:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _launch_rope(
    q: torch.Tensor | None,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_out: torch.Tensor | None,
    k_out: torch.Tensor | None,
    backward: bool,
) -> None:
    """One kernel launch rotating ``q -> q_out`` and ``k -> k_out`` (either may be None; out may be input)."""
    batch, seq, head_dim = _check_qk(q, k)
    half = head_dim // 2
    n_q = q.shape[1] if q is not None else 0
    n_k = k.shape[1] if k is not None else 0
    n_tokens = batch * seq
    if n_tokens == 0 or max(n_q, n_k) == 0 or half == 0:
        return
    cos_strides, sin_strides = _cos_sin_strides(cos, sin, batch, seq, head_dim)
    block_h, block_half, num_warps = _blocks(max(n_q, n_k), half)
    dummy = q if q is not None else k  # never dereferenced: DO_Q / DO_K are off for a missing tensor
    q_, q_out_ = (q, q_out) if q is not None else (dummy, dummy)
    k_, k_out_ = (k, k_out) if k is not None else (dummy, dummy)
    grid = (n_tokens, triton.cdiv(max(n_q, n_k), block_h))
    _rope_kernel[grid](
        q_, q_out_, k_, k_out_, cos, sin,
        seq, n_q, n_k, half,
        *q_.stride(), *q_out_.stride(), *k_.stride(), *k_out_.stride(), *cos_strides, *sin_strides,
        BLOCK_H=block_h, BLOCK_HALF=block_half,
        DO_Q=q is not None, DO_K=k is not None, BACKWARD=backward,
        num_warps=num_warps,
    )  # fmt: skip


def rope_forward(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` into fresh tensors, one launch.

    Outputs keep the input's memory layout (``empty_like``) and the reference's promoted dtype.
    """
    q_out = torch.empty_like(q, dtype=_out_dtype(q, cos, sin))
    k_out = torch.empty_like(k, dtype=_out_dtype(k, cos, sin))
    _launch_rope(q, k, cos, sin, q_out, k_out, backward=False)
    return q_out, k_out


def rope_backward(
    dq_rot: torch.Tensor | None,
    dk_rot: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_dtype: torch.dtype | None = None,
    k_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Adjoint rotation ``dx = dy * cos + rotate_half^T(dy * sin)`` (rotation by ``-theta``) into fresh tensors.

    Never writes into ``dq_rot`` / ``dk_rot``: autograd may share them with other consumers (see module doc).
    """
    dq = torch.empty_like(dq_rot, dtype=q_dtype or dq_rot.dtype) if dq_rot is not None else None
    dk = torch.empty_like(dk_rot, dtype=k_dtype or dk_rot.dtype) if dk_rot is not None else None
    if dq is not None or dk is not None:
        _launch_rope(dq_rot, dk_rot, cos, sin, dq, dk, backward=True)
    return dq, dk


def rope_inplace_(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place (one launch) and return them. No autograd: for tensors nothing else needs.

    Dispatches like :func:`apply_rope` (``use_triton(q)``); the fallback writes the reference result back.
    Rejects tensors that require grad while grad mode is on, and internally overlapping tensors
    (e.g. stride-0 broadcasts), where an in-place write would be wrong.
    """
    for t in (q, k):
        if torch.is_grad_enabled() and t.requires_grad:
            raise RuntimeError("rope_inplace_ is for tensors outside autograd; use apply_rope")
        if torch._debug_has_internal_overlap(t) != 0:
            raise RuntimeError("rope_inplace_ needs tensors whose elements do not overlap in memory")
    if _out_dtype(q, cos, sin) != q.dtype or _out_dtype(k, cos, sin) != k.dtype:
        raise TypeError("rope_inplace_ needs cos / sin whose dtype does not promote q / k")
    if use_triton(q):
        _launch_rope(q, k, cos, sin, q, k, backward=False)
    else:
        q_rot, k_rot = rope_reference(q, k, cos, sin)
        q.copy_(q_rot)
        k.copy_(k_rot)
    return q, k


# ------------------------------------------------------------------------------------------------ autograd


class RoPEFunction(torch.autograd.Function):
    """``(q, k, cos, sin) -> (q_rot, k_rot)`` with the Triton kernels; no gradient for cos / sin.

    Forward writes fresh outputs (inputs untouched, so whatever autograd saved for the projection stays
    valid); saves only cos / sin. Backward writes fresh dq / dk (incoming gradients may be shared).
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q_rot, k_rot = rope_forward(q, k, cos, sin)
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = (q.dtype, k.dtype)
        ctx.set_materialize_grads(False)
        return q_rot, k_rot

    @staticmethod
    @once_differentiable
    def backward(ctx, dq_rot: torch.Tensor | None, dk_rot: torch.Tensor | None):
        cos, sin = ctx.saved_tensors
        dq_rot = dq_rot if ctx.needs_input_grad[0] else None
        dk_rot = dk_rot if ctx.needs_input_grad[1] else None
        dq, dk = rope_backward(dq_rot, dk_rot, cos, sin, *ctx.dtypes)
        return dq, dk, None, None


# ---------------------------------------------------------------------------------------------- functional


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for transformers' ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)``: ``(q_rot, k_rot)``.

    ``unsqueeze_dim=1``: ``[batch, heads, seq, head_dim]``; ``unsqueeze_dim=2``: ``[batch, seq, heads, head_dim]``.
    Triton when ``use_triton(q)``; the reference otherwise, or when cos / sin require grad (the kernel gives
    them none). Inputs are never modified.
    """
    if not use_triton(q) or cos.requires_grad or sin.requires_grad or unsqueeze_dim not in (1, 2):
        return rope_reference(q, k, cos, sin, unsqueeze_dim)
    if unsqueeze_dim == 2:
        q_rot, k_rot = RoPEFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_rot.transpose(1, 2), k_rot.transpose(1, 2)
    return RoPEFunction.apply(q, k, cos, sin)


__all__ = [
    "RoPEFunction",
    "apply_rope",
    "rope_backward",
    "rope_forward",
    "rope_inplace_",
    "rope_reference",
    "rotate_half",
]

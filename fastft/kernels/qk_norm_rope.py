"""Qwen3's per-head q / k RMSNorm fused with RoPE, as Triton kernels with a manual backward.

Qwen3 attention runs ``apply_rotary_pos_emb(q_norm(q), k_norm(k), cos, sin)``, ``q_norm`` / ``k_norm`` an
RMSNorm over head_dim with its own weight. ``apply_qk_norm_rope`` applies the norm and then the rotation in
one pass, with a manual backward for q, k and the two norm weights. The rotation, its layout, shapes and
strides are those of `fastft.kernels.rope` (whose cos / sin loads, head blocks and shape checks this module
shares); per head vector ``x`` (all in fp32, rounded once on store)::

    y = w * x * rsqrt(mean(x^2) + eps)          o = rope(y)

Backward, with ``dy = rope^T(g)`` and ``xhat = x * rstd`` (rstd recomputed from the saved pre-norm x)::

    dx = rstd * (dy * w - xhat * mean(dy * w * xhat))      dw = sum over tokens and heads of dy * xhat

the weight gradients as per-program fp32 partials summed on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from . import use_triton
from .rope import (
    _blocks,
    _check_qk,
    _cos_sin_strides,
    _head_tile,
    _load_halves,
    _out_dtype,
    _store_halves,
    _token_cos_sin,
    rope_reference,
)

# --------------------------------------------------------------------------------------------- references


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Qwen3RMSNorm.forward``: ``weight * (x / sqrt(mean(x^2) + eps))`` with its dtype casts."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def qk_norm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3 attention's ``apply_rotary_pos_emb(q_norm(q), k_norm(k), cos, sin)``."""
    return rope_reference(
        rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps), cos, sin, unsqueeze_dim
    )


# ------------------------------------------------------------------------------------------------ kernels


@triton.jit
def _norm_rotate_heads_fwd(
    x_ptr, w_ptr, o_ptr,
    b, s, head_start, n_heads, half, eps,
    stride_xb, stride_xh, stride_xs, stride_xd,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_w,
    c1, c2, s1, s2,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """``y = w * x * rsqrt(mean(x^2) + eps)`` per head (mean over head_dim), then ``o = rope(y)``."""
    offs_h, offs_d, d_mask, mask = _head_tile(head_start, n_heads, half, BLOCK_H, BLOCK_HALF)
    x1, x2 = _load_halves(x_ptr, b, s, offs_h, offs_d, half, mask, stride_xb, stride_xh, stride_xs, stride_xd)
    w1 = tl.load(w_ptr + offs_d * stride_w, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + (offs_d + half) * stride_w, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half)
    rstd = tl.rsqrt(mean_sq + eps)[:, None]
    y1 = x1 * rstd * w1
    y2 = x2 * rstd * w2
    o1 = y1 * c1 - y2 * s1
    o2 = y2 * c2 + y1 * s2
    _store_halves(o_ptr, o1, o2, b, s, offs_h, offs_d, half, mask, stride_ob, stride_oh, stride_os, stride_od)


@triton.jit
def _norm_rotate_heads_bwd(
    g_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr,
    b, s, head_start, n_heads, half, eps,
    stride_gb, stride_gh, stride_gs, stride_gd,
    stride_xb, stride_xh, stride_xs, stride_xd,
    stride_dxb, stride_dxh, stride_dxs, stride_dxd,
    stride_w,
    c1, c2, s1, s2,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DO_X: tl.constexpr,
    DO_W: tl.constexpr,
):  # fmt: skip
    """Backward of :func:`_norm_rotate_heads_fwd` for one head block.

    ``dy = rope^T(g)``; with ``xhat = x * rstd``: ``dw_partial = sum_heads(dy * xhat)`` (written to the
    ``dw_ptr`` row of this program, summed on the host) and
    ``dx = rstd * (dy * w - xhat * mean(dy * w * xhat))``. rstd is recomputed from x.
    """
    offs_h, offs_d, d_mask, mask = _head_tile(head_start, n_heads, half, BLOCK_H, BLOCK_HALF)
    g1, g2 = _load_halves(g_ptr, b, s, offs_h, offs_d, half, mask, stride_gb, stride_gh, stride_gs, stride_gd)
    dy1 = g1 * c1 + g2 * s2
    dy2 = g2 * c2 - g1 * s1
    x1, x2 = _load_halves(x_ptr, b, s, offs_h, offs_d, half, mask, stride_xb, stride_xh, stride_xs, stride_xd)
    mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half)
    rstd = tl.rsqrt(mean_sq + eps)[:, None]
    xhat1 = x1 * rstd
    xhat2 = x2 * rstd
    if DO_W:
        tl.store(dw_ptr + offs_d, tl.sum(dy1 * xhat1, axis=0), mask=d_mask)
        tl.store(dw_ptr + half + offs_d, tl.sum(dy2 * xhat2, axis=0), mask=d_mask)
    if DO_X:
        w1 = tl.load(w_ptr + offs_d * stride_w, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + (offs_d + half) * stride_w, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        dn1 = dy1 * w1
        dn2 = dy2 * w2
        proj = ((tl.sum(dn1 * xhat1, axis=1) + tl.sum(dn2 * xhat2, axis=1)) / (2 * half))[:, None]
        dx1 = rstd * (dn1 - xhat1 * proj)
        dx2 = rstd * (dn2 - xhat2 * proj)
        _store_halves(
            dx_ptr, dx1, dx2, b, s, offs_h, offs_d, half, mask, stride_dxb, stride_dxh, stride_dxs, stride_dxd
        )


@triton.jit(do_not_specialize=["seq_len"])  # one compile for every padded length
def _qk_norm_rope_fwd_kernel(
    q_ptr, k_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr,
    seq_len, n_q_heads, n_k_heads, half, eps,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_qob, stride_qoh, stride_qos, stride_qod,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_kob, stride_koh, stride_kos, stride_kod,
    stride_qw, stride_kw,
    stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Qwen3: ``q_out = rope(q_norm(q))``, ``k_out = rope(k_norm(k))`` for one token and head block."""
    head_start = tl.program_id(1).to(tl.int64) * BLOCK_H
    b, s, c1, c2, s1, s2 = _token_cos_sin(
        cos_ptr, sin_ptr, seq_len, half,
        stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd, BLOCK_HALF,
    )  # fmt: skip
    _norm_rotate_heads_fwd(
        q_ptr, qw_ptr, q_out_ptr, b, s, head_start, n_q_heads, half, eps,
        stride_qb, stride_qh, stride_qs, stride_qd,
        stride_qob, stride_qoh, stride_qos, stride_qod, stride_qw,
        c1, c2, s1, s2, BLOCK_H, BLOCK_HALF,
    )  # fmt: skip
    _norm_rotate_heads_fwd(
        k_ptr, kw_ptr, k_out_ptr, b, s, head_start, n_k_heads, half, eps,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_kob, stride_koh, stride_kos, stride_kod, stride_kw,
        c1, c2, s1, s2, BLOCK_H, BLOCK_HALF,
    )  # fmt: skip


@triton.jit(do_not_specialize=["seq_len"])
def _qk_norm_rope_bwd_kernel(
    gq_ptr, gk_ptr, q_ptr, k_ptr, qw_ptr, kw_ptr, dq_ptr, dk_ptr, dqw_ptr, dkw_ptr, cos_ptr, sin_ptr,
    seq_len, n_q_heads, n_k_heads, half, eps,
    stride_gqb, stride_gqh, stride_gqs, stride_gqd,
    stride_gkb, stride_gkh, stride_gks, stride_gkd,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_dqb, stride_dqh, stride_dqs, stride_dqd,
    stride_dkb, stride_dkh, stride_dks, stride_dkd,
    stride_qw, stride_kw,
    stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DO_Q: tl.constexpr,
    DO_K: tl.constexpr,
    DO_QW: tl.constexpr,
    DO_KW: tl.constexpr,
):  # fmt: skip
    """Backward of :func:`_qk_norm_rope_fwd_kernel`; weight-gradient partials go to row ``pid`` of
    ``dqw_ptr`` / ``dkw_ptr`` (``[n_programs, head_dim]`` fp32)."""
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1).to(tl.int64)
    head_start = block * BLOCK_H
    dw_row = (token * tl.num_programs(1) + block) * (2 * half)
    b, s, c1, c2, s1, s2 = _token_cos_sin(
        cos_ptr, sin_ptr, seq_len, half,
        stride_cb, stride_cs, stride_cd, stride_sb, stride_ss, stride_sd, BLOCK_HALF,
    )  # fmt: skip
    if DO_Q or DO_QW:
        _norm_rotate_heads_bwd(
            gq_ptr, q_ptr, qw_ptr, dq_ptr, dqw_ptr + dw_row, b, s, head_start, n_q_heads, half, eps,
            stride_gqb, stride_gqh, stride_gqs, stride_gqd,
            stride_qb, stride_qh, stride_qs, stride_qd,
            stride_dqb, stride_dqh, stride_dqs, stride_dqd, stride_qw,
            c1, c2, s1, s2, BLOCK_H, BLOCK_HALF, DO_Q, DO_QW,
        )  # fmt: skip
    if DO_K or DO_KW:
        _norm_rotate_heads_bwd(
            gk_ptr, k_ptr, kw_ptr, dk_ptr, dkw_ptr + dw_row, b, s, head_start, n_k_heads, half, eps,
            stride_gkb, stride_gkh, stride_gks, stride_gkd,
            stride_kb, stride_kh, stride_ks, stride_kd,
            stride_dkb, stride_dkh, stride_dks, stride_dkd, stride_kw,
            c1, c2, s1, s2, BLOCK_H, BLOCK_HALF, DO_K, DO_KW,
        )  # fmt: skip


# ------------------------------------------------------------------------------------------ host launchers


def _launch_qk_norm_rope_fwd(q, k, q_weight, k_weight, cos, sin, eps):
    batch, seq, head_dim = _check_qk(q, k)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_dim,):
            raise ValueError(f"{name} must be [head_dim] = [{head_dim}], got {tuple(w.shape)}")
    q_out = torch.empty_like(q, dtype=_out_dtype(q, q_weight, cos, sin))
    k_out = torch.empty_like(k, dtype=_out_dtype(k, k_weight, cos, sin))
    half, n_q, n_k = head_dim // 2, q.shape[1], k.shape[1]
    if batch * seq == 0 or max(n_q, n_k) == 0 or half == 0:
        return q_out, k_out
    cos_strides, sin_strides = _cos_sin_strides(cos, sin, batch, seq, head_dim)
    block_h, block_half, num_warps = _blocks(max(n_q, n_k), half)
    grid = (batch * seq, triton.cdiv(max(n_q, n_k), block_h))
    _qk_norm_rope_fwd_kernel[grid](
        q, k, q_weight, k_weight, q_out, k_out, cos, sin,
        seq, n_q, n_k, half, eps,
        *q.stride(), *q_out.stride(), *k.stride(), *k_out.stride(),
        q_weight.stride(0), k_weight.stride(0), *cos_strides, *sin_strides,
        BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=num_warps,
    )  # fmt: skip
    return q_out, k_out


def _launch_qk_norm_rope_bwd(gq, gk, q, k, q_weight, k_weight, cos, sin, eps, needs):
    """Returns ``(dq, dk, dq_weight, dk_weight)``; ``needs`` = which of the four to compute."""
    do_q, do_k, do_qw, do_kw = needs
    do_q_side = (do_q or do_qw) and gq is not None
    do_k_side = (do_k or do_kw) and gk is not None
    batch, seq, head_dim = q.shape[0], q.shape[2], q.shape[3]
    half, n_q, n_k = head_dim // 2, q.shape[1], k.shape[1]
    dq = torch.empty_like(q) if do_q and do_q_side else None
    dk = torch.empty_like(k) if do_k and do_k_side else None
    block_h, block_half, num_warps = _blocks(max(n_q, n_k), half)
    grid = (batch * seq, triton.cdiv(max(n_q, n_k), block_h))
    n_programs = grid[0] * grid[1]
    dqw_part = q.new_empty((n_programs, head_dim), dtype=torch.float32) if do_qw and do_q_side else None
    dkw_part = q.new_empty((n_programs, head_dim), dtype=torch.float32) if do_kw and do_k_side else None
    if n_programs and half and (do_q_side or do_k_side):
        cos_strides, sin_strides = _cos_sin_strides(cos, sin, batch, seq, head_dim)
        gq_ = gq if gq is not None else q
        gk_ = gk if gk is not None else k
        dq_ = dq if dq is not None else q
        dk_ = dk if dk is not None else k
        dqw_ = dqw_part if dqw_part is not None else q_weight
        dkw_ = dkw_part if dkw_part is not None else k_weight
        _qk_norm_rope_bwd_kernel[grid](
            gq_, gk_, q, k, q_weight, k_weight, dq_, dk_, dqw_, dkw_, cos, sin,
            seq, n_q, n_k, half, eps,
            *gq_.stride(), *gk_.stride(), *q.stride(), *k.stride(), *dq_.stride(), *dk_.stride(),
            q_weight.stride(0), k_weight.stride(0), *cos_strides, *sin_strides,
            BLOCK_H=block_h, BLOCK_HALF=block_half,
            DO_Q=dq is not None, DO_K=dk is not None, DO_QW=dqw_part is not None, DO_KW=dkw_part is not None,
            num_warps=num_warps,
        )  # fmt: skip
    # A side with no incoming gradient (or no tokens) contributes zeros, which autograd also accepts as None.
    if do_q and dq is None:
        dq = torch.zeros_like(q)
    if do_k and dk is None:
        dk = torch.zeros_like(k)
    dqw = dkw = None
    if do_qw:
        dqw = dqw_part.sum(0).to(q_weight.dtype) if dqw_part is not None else torch.zeros_like(q_weight)
    if do_kw:
        dkw = dkw_part.sum(0).to(k_weight.dtype) if dkw_part is not None else torch.zeros_like(k_weight)
    return dq, dk, dqw, dkw


# ------------------------------------------------------------------------------------------------ autograd


class QKNormRoPEFunction(torch.autograd.Function):
    """Qwen3 ``(q, k, q_weight, k_weight, cos, sin, eps) -> (rope(q_norm(q)), rope(k_norm(k)))``.

    Saves the pre-norm q / k (as the unfused RMSNorm does) and recomputes rstd in backward. Weight gradients
    (only when a norm weight requires grad) are per-program fp32 partials summed on the host.
    """

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps: float):
        q_out, k_out = _launch_qk_norm_rope_fwd(q, k, q_weight, k_weight, cos, sin, eps)
        ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)
        ctx.eps = eps
        ctx.set_materialize_grads(False)
        return q_out, k_out

    @staticmethod
    @once_differentiable
    def backward(ctx, gq, gk):
        q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
        needs = tuple(ctx.needs_input_grad[:4])
        dq, dk, dqw, dkw = _launch_qk_norm_rope_bwd(
            gq, gk, q, k, q_weight, k_weight, cos, sin, ctx.eps, needs
        )
        return dq, dk, dqw, dkw, None, None, None


# ---------------------------------------------------------------------------------------------- functional


def apply_qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's ``apply_rotary_pos_emb(q_norm(q), k_norm(k), cos, sin)`` fused (q / k pre-norm, ``[b, h, s, d]``).

    ``q_norm(x) = q_weight * x * rsqrt(mean(x^2, over head_dim) + eps)``; the rotation as :func:`apply_rope`.
    Triton when ``use_triton(q)``; the reference otherwise, or when cos / sin require grad.
    """
    if not use_triton(q) or cos.requires_grad or sin.requires_grad:
        return qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps)
    return QKNormRoPEFunction.apply(q, k, q_weight, k_weight, cos, sin, float(eps))


__all__ = ["QKNormRoPEFunction", "apply_qk_norm_rope", "qk_norm_rope_reference", "rms_norm_reference"]

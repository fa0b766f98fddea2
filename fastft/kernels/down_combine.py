"""The MoE down projection and the top-k combine as one autograd node, on the grouped GEMM's kernels.

After the experts' activation ``h [M, I]`` (expert-sorted rows, as `fastft.kernels.grouped_gemm` documents
them), an MoE layer runs::

    out = grouped_mm(h, down_proj, group_end, scatter_rows=sorted_slots)                  # slot order
    y   = (out.view(T, top_k, H) * routing_weights[..., None]).sum(1)

``down_combine`` runs those two lines (with the experts' bias and LoRA pair) as one node that saves ``h``
but not ``out``: the routing weights' gradient is taken from ``h`` and the unweighted ``dh``. It also skips
both when activation checkpointing re-runs a layer whose output it discards (`DownCombineFunction`).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import grouped_gemm, use_triton
from .grouped_gemm import _compute_dtype, grouped_mm_dw_launch, grouped_mm_launch, grouped_mm_reference


def _check_bias(bias, sorted_experts) -> None:
    if bias is not None and sorted_experts is None:
        raise ValueError(
            "down_combine: a bias needs sorted_experts (the routing plan's expert of each sorted row)"
        )


def down_combine_reference(
    h, weight, group_end, sorted_slots, route_weights, bias=None, lora=None, *, sorted_experts=None, mm=None
):
    """Plain PyTorch: ``y = h W_e^T (+ b_e) (+ s (h A_e^T) B_e^T)`` scattered to slot order, then
    ``out[t] = sum_j route_weights[t, j] * y[t * k + j]``. ``h [M, I]`` expert-sorted, ``weight [E, H, I]``,
    ``route_weights [T, k]``, ``bias [E, H]`` (with ``sorted_experts [M]``, each sorted row's expert),
    ``lora = (A [E, r, I], B [E, H, r], s)``. Returns ``[T, H]``. ``mm`` is the grouped GEMM to compose
    (default `grouped_mm_reference`)."""
    _check_bias(bias, sorted_experts)
    mm = mm or grouped_mm_reference
    tokens, top_k = route_weights.shape
    add = None
    if bias is not None:  # in slot order, where the GEMM scatters its rows
        rows = bias[sorted_experts]
        add = torch.empty_like(rows).index_copy(0, sorted_slots.long(), rows).to(h.dtype)
    y = mm(h, weight, group_end, scatter_rows=sorted_slots, add=add)
    if lora is not None:
        a, b, scale = lora
        low = mm(h, a, group_end) * scale
        y = mm(low, b, group_end, scatter_rows=sorted_slots, add=y)
    return torch.bmm(route_weights.to(y.dtype).unsqueeze(1), y.view(tokens, top_k, -1)).squeeze(1)


class DownCombineFunction(torch.autograd.Function):
    """The experts' down projection and the weighted top-k sum, whose backward never reads ``y``.

    ``apply(h, weight, bias, lora_a, lora_b, scale, group_end, sorted_slots, sorted_experts, route_weights,
    skip)``; shapes as in `down_combine_reference` (``bias`` with ``sorted_experts``, ``lora_a``/``lora_b``
    may be None). The gradient of a routing
    weight is ``<dout[t], y[slot]> = <dout[t] W_e + s (dout[t] B_e) A_e, h[m]> (+ <dout[t], b_e>)``: the
    unweighted ``dh`` the backward computes anyway, dotted with the saved ``h``. So ``y [T * k, H]`` is
    never saved (the combine in PyTorch saved it), and ``skip`` -- set by a caller whose output is
    discarded when activation checkpointing re-runs the layer -- leaves the down GEMMs and the combine out
    of that re-run; the output is then uninitialised memory of the right shape.

    Backward, with ``w_m`` the routing weight of sorted row ``m`` and ``t(m)`` its token::

        u[m]      = dout[t(m)] B_e                                   [M, r]  (LoRA)
        dh_u[m]   = dout[t(m)] W_e + s u[m] A_e                      [M, I]  gathered like the gate/up GEMM
        dw[slot]  = <dh_u[m], h[m]> (+ <dout[t(m)], b_e>)            fp32
        dh[m]     = w_m dh_u[m]
        dA_e      = sum_m (s w_m u[m])^T h[m];   dB_e^T = sum_m (w_m low[m])^T dout[t(m)]
        dW_e^T    = sum_m (w_m h[m])^T dout[t(m)];  db_e = sum_m w_m dout[t(m)]   (when trained)

    Every reduction is a per-expert grouped kernel or a fixed-order row sum: deterministic.
    """

    @staticmethod
    def forward(
        ctx,
        h,
        weight,
        bias,
        lora_a,
        lora_b,
        scale,
        group_end,
        sorted_slots,
        sorted_experts,
        route_weights,
        skip,
    ):
        dtype = _compute_dtype(h)
        tokens, top_k = route_weights.shape
        m, hidden = sorted_slots.shape[0], weight.shape[1]
        h_c, w_c = h.to(dtype), weight.to(dtype)
        a_c = b_c = low = None
        if lora_a is not None:
            a_c, b_c = lora_a.to(dtype), lora_b.to(dtype)
            low = torch.empty((m, a_c.shape[1]), dtype=dtype, device=h.device)
            grouped_mm_launch(h_c, a_c, group_end, low)
            low.mul_(scale)
        if skip:
            out = torch.empty((tokens, hidden), dtype=dtype, device=h.device)
        else:
            add = None
            if bias is not None:
                add = torch.empty((m, hidden), dtype=dtype, device=h.device)
                add[sorted_slots] = bias.to(dtype)[sorted_experts]
            y = torch.empty((m, hidden), dtype=dtype, device=h.device)
            grouped_mm_launch(h_c, w_c, group_end, y, scatter_rows=sorted_slots, add=add)
            if low is not None:
                y_lora = torch.empty_like(y)
                grouped_mm_launch(low, b_c, group_end, y_lora, scatter_rows=sorted_slots, add=y)
                y = y_lora
            out = torch.bmm(route_weights.to(dtype).unsqueeze(1), y.view(tokens, top_k, hidden)).squeeze(1)
        ctx.scale, ctx.top_k, ctx.dtypes = scale, top_k, (h.dtype, weight.dtype, route_weights.dtype)
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.lora_dtypes = None if lora_a is None else (lora_a.dtype, lora_b.dtype)
        ctx.save_for_backward(
            h_c, w_c, None if bias is None else bias.to(dtype), a_c, b_c, low, group_end, sorted_slots,
            None if bias is None else sorted_experts, route_weights,
        )  # fmt: skip
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        h, w, bias, a, b, low, group_end, slots, sorted_experts, route_weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        h_dtype, w_dtype, route_dtype = ctx.dtypes
        top_k, scale = ctx.top_k, ctx.scale
        m = slots.shape[0]
        dout = dout.to(h.dtype).contiguous()
        gathered = dict(gather_rows=slots, top_k=top_k)  # row m reads dout[slots[m] // top_k]
        row_weight = route_weights.reshape(-1).float()[slots]  # [M] fp32, sorted order
        dh_u = torch.empty((m, h.shape[1]), dtype=h.dtype, device=h.device)
        grouped_mm_launch(dout, w.transpose(1, 2), group_end, dh_u, **gathered)
        u = None
        if a is not None:
            u = torch.empty((m, a.shape[1]), dtype=h.dtype, device=h.device)
            grouped_mm_launch(dout, b.transpose(1, 2), group_end, u, **gathered)
            dh_lora = torch.empty_like(dh_u)
            grouped_mm_launch(u * scale, a.transpose(1, 2), group_end, dh_lora, add=dh_u)
            dh_u = dh_lora
        d_route = None
        if need[9]:
            # products in the compute dtype, summed in fp32: no [M, I] fp32 temporaries (the combine's own
            # backward, a 16-bit bmm, rounded the same way)
            dots = (dh_u * h).sum(1, dtype=torch.float32)
            if bias is not None:  # <dout[t], b_e> for every (token, expert): [T, E], then each row's pair
                token_bias = torch.mm(dout.float(), bias.float().t())
                dots += token_bias[slots // top_k, sorted_experts]
            d_route = torch.empty(m, dtype=torch.float32, device=h.device).index_copy_(0, slots, dots)
            d_route = d_route.view(route_weights.shape).to(route_dtype)
        dh = dh_u.mul_(row_weight.to(dh_u.dtype)[:, None]).to(h_dtype) if need[0] else None
        d_weight = d_bias = d_a = d_b = None
        if need[1]:  # dW_e^T = sum_m (w_m h[m])^T dout[t(m)], written through a transposed view
            d_weight = torch.empty(w.shape, dtype=w_dtype, device=h.device)
            weighted = h * row_weight.to(h.dtype)[:, None]
            grouped_mm_dw_launch(weighted, dout, group_end, d_weight.transpose(1, 2), **gathered)
        if need[2]:
            d_bias = torch.empty((bias.shape[0], 1, bias.shape[1]), dtype=ctx.bias_dtype, device=h.device)
            grouped_mm_dw_launch(row_weight[:, None].to(h.dtype), dout, group_end, d_bias, **gathered)
            d_bias = d_bias.squeeze(1)
        if need[3]:
            d_a = torch.empty(a.shape, dtype=ctx.lora_dtypes[0], device=h.device)
            grouped_mm_dw_launch((u.float() * (scale * row_weight)[:, None]).to(h.dtype), h, group_end, d_a)
        if need[4]:
            d_b = torch.empty(b.shape, dtype=ctx.lora_dtypes[1], device=h.device)
            low_w = (low.float() * row_weight[:, None]).to(h.dtype)
            grouped_mm_dw_launch(low_w, dout, group_end, d_b.transpose(1, 2), **gathered)
        return dh, d_weight, d_bias, d_a, d_b, None, None, None, None, d_route, None


def down_combine(
    h,
    weight,
    group_end,
    sorted_slots,
    route_weights,
    bias=None,
    lora=None,
    *,
    sorted_experts=None,
    skip=False,
):
    """`DownCombineFunction` where the Triton kernels run (CUDA, or the interpreter), else the reference.
    ``skip``: the caller's output is discarded in an activation-checkpointing re-run (see the Function)."""
    _check_bias(bias, sorted_experts)
    if use_triton(h):
        a, b, scale = lora if lora is not None else (None, None, 1.0)
        return DownCombineFunction.apply(
            h, weight, bias, a, b, float(scale), group_end, sorted_slots, sorted_experts, route_weights, skip
        )
    # `grouped_gemm.grouped_mm` (looked up at call time): the reference off the GPU
    return down_combine_reference(
        h,
        weight,
        group_end,
        sorted_slots,
        route_weights,
        bias,
        lora,
        sorted_experts=sorted_experts,
        mm=grouped_gemm.grouped_mm,
    )


__all__ = ["DownCombineFunction", "down_combine", "down_combine_reference"]

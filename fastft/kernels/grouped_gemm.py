"""Grouped GEMM for mixture-of-experts layers: one launch multiplies every expert's rows by its weight.

Rows arrive sorted by expert (see ``fastft.runtime.routing.RoutingPlan``): the ``M = tokens * top_k``
routed slots, stably sorted by expert id, so expert ``e`` owns sorted rows
``group_end[e - 1] .. group_end[e] - 1`` (``group_end`` is the inclusive cumulative count, int32 or int64,
on the device, with ``group_end[E - 1] == M``; an expert that receives no token owns an empty range).
Weights are stored as transformers stores expert weights, ``weight[e]`` of shape ``[N, K]`` (out features
x in features), with any strides (``lora_B.transpose(1, 2)`` of an ``[E, r, N]`` tensor is fine)::

    y[m]       = add[dst(m)] + a[src(m)] @ weight[e(m)].T        (add optional, beta = 1)
    src(m)     = gather_rows[m] // top_k   if gather_rows is given, else m // top_k
    out[dst(m)] = y[m]                      dst(m) = scatter_rows[m] if given, else m

``gather_rows`` fuses the token permutation into the first GEMM's loads: the MoE gate/up projection passes
the sorted slot ids (``slot = token * top_k + j``) and ``top_k``, and reads ``x[slot // top_k]`` without
materialising the permuted copy. ``scatter_rows`` (a permutation of ``0..M-1``) fuses the un-permutation
into the second GEMM's stores: the down projection writes each row back to its slot, token-major, so
combining the top-k outputs is a deterministic reshape-and-sum, never an atomic add.

Backward (``dy = dL/dout``, ``dy_s[m] = dy[dst(m)]`` the gradient in sorted order)::

    da_s[m]       = dy_s[m] @ weight[e(m)]                   [M, K]   the forward kernel on weight^T
    da[r]         = sum over m with src(m) = r of da_s[m]
    dweight[e]    = sum over m in e of dy_s[m]^T a[src(m)]   [N, K]   a per-expert reduction over rows
    dadd          = dy

``da``, deterministic (no atomics anywhere). With ``top_k > 1`` the slots ``gather_rows`` are distinct
(each routed slot once), so the kernel stores ``da_s[m]`` at row ``gather_rows[m]`` of a ``[R * top_k, K]``
buffer (slot order) and ``da = buffer.view(R, top_k, K).sum(1)``: a fixed-order sum, rounded once. With
``top_k == 1`` and no gather the rows map one to one. With ``top_k == 1`` and a ``gather_rows`` that may
repeat rows (a caller passing ``slots // top_k`` itself), ``da_s`` is accumulated with
``index_put_(accumulate=True)``, which sorts the indices and sums duplicates in a fixed order on CUDA (a
determinism test pins it); passing the slots with ``top_k`` is faster and needs no ``[M, K]`` temporary.

``dweight`` runs one program per (expert, N tile, K tile), each looping over its expert's rows in a fixed
order; experts with no rows get zeros. Only the gradients autograd asks for are computed: with a frozen
expert weight (LoRA) the backward is one dA launch.

Usage in an MoE layer (routing plan: ``sorted_slots`` [T * top_k], ``group_end`` [E])::

    gate_up = grouped_mm(x, gate_up_proj, group_end, gather_rows=sorted_slots, top_k=top_k)   # sorted
    h       = act(gate) * up                                                                  # sorted
    out     = grouped_mm(h, down_proj, group_end, scatter_rows=sorted_slots)                  # slot order
    y       = (out.view(T, top_k, H) * routing_weights[..., None]).sum(1)

``fastft.kernels.down_combine`` runs those last two lines as one autograd node that saves ``h`` but not
``out`` (the routing weights' gradient is taken from ``h`` and the unweighted ``dh``), and skips both when
activation checkpointing re-runs a layer whose output it discards.

LoRA on the experts (``A [E, r, K]``, ``B [E, N, r]``; a ``B`` stored ``[E, r, N]`` goes in as
``B.transpose(1, 2)``), never forming ``W + s B A``: the low-rank term first, then the base GEMM adds it in
its epilogue (``add``, in output order)::

    xa      = grouped_mm(x, A_gu, group_end, gather_rows=sorted_slots, top_k=top_k)          # [M, r]
    gate_up = grouped_mm(x, gate_up_proj, group_end, gather_rows=sorted_slots, top_k=top_k,
                         add=grouped_mm(xa * s, B_gu, group_end))
    ha      = grouped_mm(h, A_d, group_end)                                                   # [M, r]
    out     = grouped_mm(h, down_proj, group_end, scatter_rows=sorted_slots,
                         add=grouped_mm(ha * s, B_d, group_end, scatter_rows=sorted_slots))

The kernels. Forward and dA share ``_grouped_mm_kernel``: a 1-D grid sized from host-known bounds
(``sum_e ceil(M_e / BLOCK_M) < ceil(M / BLOCK_M) + E`` row tiles, times the column tiles); each program
loads ``group_end`` (E <= a few hundred: one vector), forms the per-expert tile counts and their cumsum in
registers, and finds its expert and row range there -- no host sync, no extra launch, no schedule tensor.
Programs past the real tile count exit at once. Tiles are ordered in groups of ``GROUP_M`` row tiles, column
tiles inside a group (the Triton matmul tutorial's L2 swizzle), so the row tiles of one expert that share a
weight tile run together. bf16 / fp16 operands, fp32 accumulation (``tl.dot``), rounded once to the output
dtype (nearest even, also under the interpreter); fp32 operands use IEEE fp32 products (no TF32), so fp32
results match the reference to ~1e-6.

Precision against the reference: the reference computes each product in the input dtype with fp32
accumulation (``torch.mm``), as here; the top-k sum of ``da`` rounds each slot's ``da_s`` once and the sum
once, where autograd through ``index_select`` accumulates in the input dtype.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from . import use_triton
from .autotune import autotuned
from .rounding import round_to

_INT_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Interpreted (CPU tests): small tiles, so the numpy steps stay few on awkward shapes of tens of rows.
_INTERPRETED_BLOCK = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=4)
_INTERPRETED_DW_BLOCK = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
# fp32 operands on a GPU (IEEE products on the FMA units: a correctness path, not a speed path) take one
# fixed tile instead of compiling and timing every autotune config for each new shape.
_FP32_BLOCK = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
_FP32_DW_BLOCK = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


# --------------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------------


def grouped_mm_reference(
    a: torch.Tensor,
    weight: torch.Tensor,
    group_end: torch.Tensor,
    *,
    gather_rows: torch.Tensor | None = None,
    scatter_rows: torch.Tensor | None = None,
    top_k: int = 1,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch: a per-expert loop, differentiable through autograd. Shapes as in the module doc.

    ``a``: ``[R, K]``; ``weight``: ``[E, N, K]``; ``group_end``: int ``[E]``; ``gather_rows``: int
    ``[M]`` (else ``M = R * top_k``); ``scatter_rows``: int ``[M]``, a permutation; ``add``: ``[M, N]``.
    Returns ``[M, N]`` in ``a``'s dtype, each product accumulated in fp32 by the matmul and rounded once
    (the weight is cast to ``a``'s dtype first).
    """
    _check_top_k(top_k)
    if gather_rows is not None:
        src = gather_rows.long() // top_k if top_k > 1 else gather_rows.long()
        rows = a.index_select(0, src)
    else:
        rows = a.repeat_interleave(top_k, dim=0) if top_k > 1 else a
    w = weight.to(a.dtype)
    ends = group_end.long().tolist()  # reference path: a host sync is fine here
    if ends and ends[-1] != rows.shape[0]:
        raise ValueError(f"group_end[-1] = {ends[-1]} must equal the number of routed rows {rows.shape[0]}")
    starts = [0] + ends[:-1]
    if add is not None:  # the sum before the one rounding, as the kernel does
        rows, w = rows.float(), w.float()
    pieces = [rows[s:e] @ w[i].t() for i, (s, e) in enumerate(zip(starts, ends, strict=True))]
    y = torch.cat(pieces, dim=0) if pieces else rows.new_zeros(0, weight.shape[1])
    if scatter_rows is not None:
        y = torch.empty_like(y).index_copy(0, scatter_rows.long(), y)
    if add is not None:
        y = (y + add.float()).to(a.dtype)
    return y


# --------------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------------


@triton.jit
def _expert_tiles(group_end_ptr, n_experts, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Per-expert ``(start, end, row tiles, inclusive cumsum of row tiles)`` as ``[E_POW2]`` vectors
    (zeros past ``n_experts``), from ``group_end`` alone."""
    e = tl.arange(0, E_POW2)
    valid = e < n_experts
    ends = tl.load(group_end_ptr + e, mask=valid, other=0).to(tl.int32)
    starts = tl.load(group_end_ptr + e - 1, mask=valid & (e > 0), other=0).to(tl.int32)
    tiles = tl.where(valid, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    return starts, ends, tiles, tl.cumsum(tiles, 0)


@triton.jit
def _pick(vector, index_vector, index):
    """``vector[index]`` as a scalar (a masked sum: Triton has no dynamic register indexing)."""
    return tl.sum(tl.where(index_vector == index, vector, 0), 0)


@triton.jit
def _row_ids(index_ptr, rows, row_mask, HAS_INDEX: tl.constexpr):
    """``index[rows]`` if an index is given, else ``rows``, as int64 (``src`` / ``dst`` in the module doc)."""
    if HAS_INDEX:  # noqa: SIM108 (a constexpr branch: the load compiles away without an index)
        ids = tl.load(index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        ids = rows.to(tl.int64)
    return ids


@triton.jit
def _grouped_mm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    add_ptr,
    group_end_ptr,
    gather_ptr,
    scatter_ptr,
    N,
    K,
    n_experts,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_addm,
    stride_addn,
    TOP_K: tl.constexpr,
    HAS_GATHER: tl.constexpr,
    HAS_SCATTER: tl.constexpr,
    HAS_ADD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``C[dst(m), n] = ADD[dst(m), n] + sum_k A[src(m), k] B[e(m), n, k]`` for the rows of one
    ``BLOCK_M x BLOCK_N`` tile of one expert (module docstring for ``src``, ``dst``, the tile schedule)."""
    pid = tl.program_id(0)
    e_idx = tl.arange(0, E_POW2)
    starts, ends, tiles, tile_end = _expert_tiles(group_end_ptr, n_experts, BLOCK_M, E_POW2)
    total_m = tl.sum(tiles, 0)
    num_n = tl.cdiv(N, BLOCK_N)
    if pid < total_m * num_n:
        # grouped order: GROUP_M consecutive row tiles (mostly of one expert) share each column tile
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_size = tl.minimum(total_m - first_m, GROUP_M)
        local = pid % per_group
        tile_m = first_m + local % group_size
        tile_n = local // group_size

        expert = tl.sum((tile_end <= tile_m).to(tl.int32), 0)
        first_tile = _pick(tile_end - tiles, e_idx, expert)
        row_start = _pick(starts, e_idx, expert) + (tile_m - first_tile) * BLOCK_M
        row_end = _pick(ends, e_idx, expert)

        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        src = _row_ids(gather_ptr, rows, row_mask, HAS_GATHER)
        if TOP_K > 1:
            src = src // TOP_K
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + src[:, None] * stride_am + ks[None, :] * stride_ak
        b_ptrs = (
            b_ptr
            + expert.to(tl.int64) * stride_be
            + cols[None, :].to(tl.int64) * stride_bn
            + ks[:, None] * stride_bk
        )
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = ks < K - k0
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if INTERPRETED:  # its dot of 16-bit operands is wrong; fp32 products of them are exact
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk

        dst = _row_ids(scatter_ptr, rows, row_mask, HAS_SCATTER)
        mask = row_mask[:, None] & col_mask[None, :]
        if HAS_ADD:
            add_ptrs = add_ptr + dst[:, None] * stride_addm + cols[None, :] * stride_addn
            acc += tl.load(add_ptrs, mask=mask, other=0.0).to(tl.float32)
        c_ptrs = c_ptr + dst[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, round_to(acc, c_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _grouped_mm_dw_kernel(
    dy_ptr,
    a_ptr,
    dw_ptr,
    group_end_ptr,
    gather_ptr,
    scatter_ptr,
    N,
    K,
    stride_dym,
    stride_dyn,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    TOP_K: tl.constexpr,
    HAS_GATHER: tl.constexpr,
    HAS_SCATTER: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``DW[e, n, k] = sum over rows m of expert e of DY[dst(m), n] A[src(m), k]``: one program per
    (expert, N tile, K tile), rows in ascending order (deterministic); zero for an expert with no rows."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    expert = pid // (num_n * num_k)
    local = pid % (num_n * num_k)
    tile_n = local // num_k
    tile_k = local % num_k
    row_start = tl.load(group_end_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int32)
    row_end = tl.load(group_end_ptr + expert).to(tl.int32)

    cols_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = cols_n < N
    k_mask = cols_k < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        src = _row_ids(gather_ptr, rows, row_mask, HAS_GATHER)
        if TOP_K > 1:
            src = src // TOP_K
        dst = _row_ids(scatter_ptr, rows, row_mask, HAS_SCATTER)
        dy = tl.load(
            dy_ptr + dst[:, None] * stride_dym + cols_n[None, :] * stride_dyn,
            mask=row_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        a = tl.load(
            a_ptr + src[:, None] * stride_am + cols_k[None, :] * stride_ak,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if INTERPRETED:  # its dot of 16-bit operands is wrong; fp32 products of them are exact
            dy = dy.to(tl.float32)
            a = a.to(tl.float32)
        acc = tl.dot(tl.trans(dy), a, acc, input_precision=DOT_PRECISION)

    dw_ptrs = (
        dw_ptr
        + expert.to(tl.int64) * stride_we
        + cols_n[:, None].to(tl.int64) * stride_wn
        + cols_k[None, :] * stride_wk
    )
    tl.store(
        dw_ptrs, round_to(acc, dw_ptr.dtype.element_ty, INTERPRETED), mask=n_mask[:, None] & k_mask[None, :]
    )


# --------------------------------------------------------------------------------------------------
# Autotuning (GPU only; keyed on N, K and the variant, never on M, which changes every step)
# --------------------------------------------------------------------------------------------------


_FWD_KEY = ["N", "K", "TOP_K", "HAS_GATHER", "HAS_SCATTER", "HAS_ADD"]
_DW_KEY = ["N", "K", "TOP_K", "HAS_GATHER", "HAS_SCATTER"]


def _tuned_kernel(name: str):
    """The autotuned wrapper of a kernel (``"fwd"``: forward and dA; ``"dw"``), built on first GPU use
    (never under the interpreter). The tile tables, their pruning, timing and disk cache: `autotune`."""
    if name == "fwd":
        return autotuned(_grouped_mm_kernel, "fwd", _FWD_KEY)
    return autotuned(_grouped_mm_dw_kernel, "dw", _DW_KEY)


# --------------------------------------------------------------------------------------------------
# Host launchers
# --------------------------------------------------------------------------------------------------


def _interpreted(x: torch.Tensor) -> bool:
    return not x.is_cuda and os.environ.get("TRITON_INTERPRET") == "1"


def _device_guard(x: torch.Tensor):
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands


def _check_top_k(top_k: int) -> None:
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")


def _check_inputs(a, weight, group_end, gather_rows, scatter_rows, top_k, add) -> int:
    """Validate shapes, dtypes and devices; return the number of routed rows ``M``."""
    _check_top_k(top_k)
    if a.dim() != 2 or weight.dim() != 3:
        raise ValueError(
            f"grouped_mm takes a [R, K] and weight [E, N, K], got {tuple(a.shape)} and {tuple(weight.shape)}"
        )
    if weight.shape[2] != a.shape[1]:
        raise ValueError(
            f"weight [E, N, K] = {tuple(weight.shape)} does not match a's K = {a.shape[1]}; "
            "pass weight.transpose(1, 2) for weights stored [E, K, N]"
        )
    if a.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"grouped_mm takes fp32/bf16/fp16 operands, got {a.dtype} and {weight.dtype}")
    if group_end.dim() != 1 or group_end.shape[0] != weight.shape[0] or group_end.dtype not in _INT_DTYPES:
        raise ValueError(
            f"group_end must be int32/int64 of shape [E] = [{weight.shape[0]}], "
            f"got {group_end.dtype} {tuple(group_end.shape)}"
        )
    m = a.shape[0] * top_k if gather_rows is None else gather_rows.shape[0]
    for name, idx in (("gather_rows", gather_rows), ("scatter_rows", scatter_rows)):
        if idx is not None and (idx.dim() != 1 or idx.shape[0] != m or idx.dtype not in _INT_DTYPES):
            raise ValueError(f"{name} must be int32/int64 of shape [{m}], got {idx.dtype} {tuple(idx.shape)}")
    if add is not None and tuple(add.shape) != (m, weight.shape[1]):
        raise ValueError(f"add must have the output's shape [{m}, {weight.shape[1]}], got {tuple(add.shape)}")
    for name, t in (("weight", weight), ("group_end", group_end), ("gather_rows", gather_rows),
                    ("scatter_rows", scatter_rows), ("add", add)):  # fmt: skip
        if t is not None and t.device != a.device:
            raise ValueError(f"{name} is on {t.device}, a on {a.device}: move them to one device")
    return m


def _routing_args(a, group_end, gather_rows, scatter_rows, top_k) -> tuple[tuple, dict]:
    """Both kernels' ``(gather_ptr, scatter_ptr)`` (``group_end`` stands in for an absent one: the HAS_* flags
    compile it away) and their routing / precision flags."""
    index_ptrs = (
        gather_rows if gather_rows is not None else group_end,
        scatter_rows if scatter_rows is not None else group_end,
    )
    flags = dict(
        TOP_K=top_k,
        HAS_GATHER=gather_rows is not None,
        HAS_SCATTER=scatter_rows is not None,
        DOT_PRECISION=_dot_precision(a.dtype),
        INTERPRETED=_interpreted(a),
    )
    return index_ptrs, flags


def grouped_mm_launch(
    a: torch.Tensor,
    weight: torch.Tensor,
    group_end: torch.Tensor,
    out: torch.Tensor,
    *,
    gather_rows: torch.Tensor | None = None,
    scatter_rows: torch.Tensor | None = None,
    top_k: int = 1,
    add: torch.Tensor | None = None,
    n_rows: int | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch the grouped GEMM kernel into ``out`` (any strides; rows ``dst(m)`` written) and return it.

    ``weight`` is ``[E, N, K]`` with any strides and ``a``'s dtype; ``n_rows`` is ``M`` (default: from
    ``gather_rows`` or ``a``); ``config`` fixes the tile sizes (``BLOCK_M/N/K``, ``GROUP_M``, ``num_warps``,
    ``num_stages``) instead of autotuning. No autograd, no host sync.
    """
    m = (
        n_rows
        if n_rows is not None
        else (a.shape[0] * top_k if gather_rows is None else gather_rows.shape[0])
    )
    n_experts, n, k = weight.shape
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if add is None else out.copy_(add)
    index_ptrs, flags = _routing_args(a, group_end, gather_rows, scatter_rows, top_k)
    flags.update(HAS_ADD=add is not None, E_POW2=triton.next_power_of_2(n_experts))
    add_strides = (add.stride(0), add.stride(1)) if add is not None else (0, 0)
    args = (
        a, weight, out, add if add is not None else out, group_end, *index_ptrs, n, k, n_experts,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
        out.stride(0), out.stride(1), *add_strides,
    )  # fmt: skip

    def grid(meta):
        row_tiles = min(triton.cdiv(m, meta["BLOCK_M"]) + n_experts, m)
        return (row_tiles * triton.cdiv(n, meta["BLOCK_N"]),)

    _run_kernel(a, "fwd", _grouped_mm_kernel, grid, args, flags, config, _INTERPRETED_BLOCK, _FP32_BLOCK)
    return out


def grouped_mm_dw_launch(
    dy: torch.Tensor,
    a: torch.Tensor,
    group_end: torch.Tensor,
    dw: torch.Tensor,
    *,
    gather_rows: torch.Tensor | None = None,
    scatter_rows: torch.Tensor | None = None,
    top_k: int = 1,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch the weight-gradient kernel: ``dw[e] = sum over rows m of e of dy[dst(m)]^T a[src(m)]`` into
    ``dw [E, N, K]`` (any strides, any float dtype: the fp32 sum is rounded once to it). No host sync."""
    n_experts, n, k = dw.shape
    if dw.numel() == 0:
        return dw
    index_ptrs, flags = _routing_args(a, group_end, gather_rows, scatter_rows, top_k)
    args = (
        dy, a, dw, group_end, *index_ptrs, n, k,
        dy.stride(0), dy.stride(1), a.stride(0), a.stride(1), dw.stride(0), dw.stride(1), dw.stride(2),
    )  # fmt: skip

    def grid(meta):
        return (n_experts * triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(k, meta["BLOCK_K"]),)

    _run_kernel(
        a, "dw", _grouped_mm_dw_kernel, grid, args, flags, config, _INTERPRETED_DW_BLOCK, _FP32_DW_BLOCK
    )
    return dw


def _run_kernel(a, name, kernel, grid, args, flags, config, interpreted_block, fp32_block) -> None:
    """Launch `kernel` with a fixed tile (the caller's `config`; else the interpreter's, or fp32's on a GPU)
    or, for 16-bit on a GPU, through its autotuner `_tuned_kernel(name)`."""
    with _device_guard(a):
        if config is None and not a.is_cuda:
            config = interpreted_block
        elif config is None and a.dtype == torch.float32:
            config = fp32_block
        if config is None:
            _tuned_kernel(name)[grid](*args, **flags)
            return
        config = dict(config)
        launch = {key: config.pop(key) for key in ("num_warps", "num_stages") if key in config}
        kernel[grid(config)](*args, **flags, **config, **launch)


# --------------------------------------------------------------------------------------------------
# Autograd function and the public entry point
# --------------------------------------------------------------------------------------------------


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class GroupedMMFunction(torch.autograd.Function):
    """``GroupedMMFunction.apply(a, weight, group_end, gather_rows, scatter_rows, top_k, add)``: the grouped
    GEMM through the Triton kernels (module docstring for the math). Saves ``a``, the weight (cast to the
    compute dtype) and the index tensors; differentiable in ``a``, ``weight`` and ``add``."""

    @staticmethod
    def forward(ctx, a, weight, group_end, gather_rows, scatter_rows, top_k, add):
        m = _check_inputs(a, weight, group_end, gather_rows, scatter_rows, top_k, add)
        dtype = _compute_dtype(a)
        a_c = a.to(dtype)
        w_c = weight.to(dtype)
        out = torch.empty((m, weight.shape[1]), dtype=dtype, device=a.device)
        grouped_mm_launch(
            a_c, w_c, group_end, out, gather_rows=gather_rows, scatter_rows=scatter_rows, top_k=top_k, add=add
        )
        ctx.top_k, ctx.a_dtype, ctx.weight_dtype = top_k, a.dtype, weight.dtype
        ctx.add_dtype = None if add is None else add.dtype
        ctx.save_for_backward(a_c, w_c, group_end, gather_rows, scatter_rows)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        a, w, group_end, gather_rows, scatter_rows = ctx.saved_tensors
        need_a, need_w, need_add = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[6]
        top_k = ctx.top_k
        dy = dy.to(a.dtype)
        m = dy.shape[0]
        da = dw = None
        if need_a:
            # dA = dy_s @ W[e]: the same kernel on weight^T, gathering dy at dst(m) (the forward's scatter)
            w_t = w.transpose(1, 2)
            r, k = a.shape
            if top_k > 1:
                slots = r * top_k
                buffer = (torch.empty if m == slots else torch.zeros)(
                    (slots, k), dtype=a.dtype, device=a.device
                )
                grouped_mm_launch(
                    dy, w_t, group_end, buffer, gather_rows=scatter_rows, scatter_rows=gather_rows
                )
                da = buffer.view(r, top_k, k).sum(1)
            elif gather_rows is None:
                da = torch.empty((m, k), dtype=a.dtype, device=a.device)
                grouped_mm_launch(dy, w_t, group_end, da, gather_rows=scatter_rows)
            else:
                da_sorted = torch.empty((m, k), dtype=a.dtype, device=a.device)
                grouped_mm_launch(dy, w_t, group_end, da_sorted, gather_rows=scatter_rows)
                da = torch.zeros_like(a).index_put_((gather_rows.long(),), da_sorted, accumulate=True)
            da = da.to(ctx.a_dtype)
        if need_w:
            dw = torch.empty(w.shape, dtype=ctx.weight_dtype, device=w.device)
            grouped_mm_dw_launch(
                dy, a, group_end, dw, gather_rows=gather_rows, scatter_rows=scatter_rows, top_k=top_k
            )
        dadd = dy.to(ctx.add_dtype) if need_add else None
        return da, dw, None, None, None, None, dadd


def grouped_mm(
    a: torch.Tensor,
    weight: torch.Tensor,
    group_end: torch.Tensor,
    *,
    gather_rows: torch.Tensor | None = None,
    scatter_rows: torch.Tensor | None = None,
    top_k: int = 1,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped GEMM with optional fused gather / scatter (see the module doc); differentiable in ``a``,
    ``weight`` and ``add``. No host sync on the fast path.

    ``a [R, K]``, ``weight [E, N, K]`` (any strides; cast to ``a``'s dtype, its gradient returned in its own),
    ``group_end`` int ``[E]`` inclusive cumulative row counts with ``group_end[-1] == M``. ``gather_rows``
    ``[M]``: rows read are ``a[gather_rows // top_k]`` (MoE gate/up: the sorted slot ids with ``top_k``;
    with ``top_k > 1`` each slot at most once). ``scatter_rows`` ``[M]``: a permutation, row ``m`` of the
    product is written to ``out[scatter_rows[m]]``. ``add [M, N]`` (output order) is added before the single
    rounding. Returns ``[M, N]`` in ``a``'s dtype (the autocast dtype under autocast).

    CUDA tensors (and CPU ones under ``TRITON_INTERPRET=1``) take the Triton kernels, others the reference.
    """
    if use_triton(a):
        return GroupedMMFunction.apply(a, weight, group_end, gather_rows, scatter_rows, top_k, add)
    return grouped_mm_reference(
        a, weight, group_end, gather_rows=gather_rows, scatter_rows=scatter_rows, top_k=top_k, add=add
    )


__all__ = [
    "GroupedMMFunction",
    "grouped_mm",
    "grouped_mm_dw_launch",
    "grouped_mm_launch",
    "grouped_mm_reference",
]

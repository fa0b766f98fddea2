"""Grouped GEMM for mixture-of-experts layers: one launch multiplies every expert's rows by its weight.

Rows arrive sorted by expert (see ``fastft.engine.routing.RoutingPlan``): the ``M = tokens * top_k``
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

``down_combine`` runs those last two lines as one autograd node that saves ``h`` but not ``out`` (the
routing weights' gradient is taken from ``h`` and the unweighted ``dh``), and skips both when activation
checkpointing re-runs a layer whose output it discards.

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
import inspect
import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from . import use_triton
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
        if HAS_GATHER:
            src = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
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

        if HAS_SCATTER:
            dst = tl.load(scatter_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            dst = rows.to(tl.int64)
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
        if HAS_GATHER:
            src = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            src = rows.to(tl.int64)
        if TOP_K > 1:
            src = src // TOP_K
        if HAS_SCATTER:
            dst = tl.load(scatter_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            dst = rows.to(tl.int64)
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


def _config(m, n, k, warps, stages, group_m=None):
    kw = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k)
    if group_m is not None:
        kw["GROUP_M"] = group_m
    return triton.Config(kw, num_warps=warps, num_stages=stages)


# Three regimes, picked by shape: the expert GEMMs themselves ("wide"), and the LoRA low-rank GEMMs, where
# N = r ("skinny_n": x A^T, dy B) or K = r ("small_k": xa B^T, dxa A) and the work is memory-bound --
# there, deep reduction tiles or wide output tiles amortise each program's fixed cost (the tile schedule,
# the index loads).
_FWD_CONFIGS = {
    "wide": [
        _config(128, 128, 64, 8, 3, 8),
        _config(128, 128, 64, 4, 4, 8),
        _config(64, 128, 64, 4, 4, 8),
        _config(128, 256, 64, 8, 3, 8),
        _config(128, 256, 64, 8, 4, 8),
        _config(64, 256, 64, 8, 3, 8),
    ],
    "skinny_n": [
        _config(32, 32, 128, 4, 4, 8),
        _config(64, 32, 128, 4, 4, 8),
        _config(64, 32, 256, 4, 3, 8),
        _config(128, 32, 128, 8, 3, 8),
    ],
    "small_k": [
        _config(64, 128, 32, 4, 2, 8),
        _config(128, 128, 32, 4, 2, 8),
        _config(64, 256, 32, 4, 2, 8),
        _config(128, 256, 32, 8, 2, 8),
    ],
}
_DW_CONFIGS = {
    "wide": [
        _config(64, 128, 128, 8, 3),
        _config(128, 128, 128, 8, 3),
        _config(64, 256, 128, 8, 3),
        _config(32, 128, 128, 8, 4),
        _config(64, 128, 64, 4, 4),
        _config(64, 64, 128, 4, 4),
    ],
    "skinny_n": [
        _config(64, 32, 128, 4, 4),
        _config(64, 32, 256, 8, 3),
        _config(128, 32, 128, 8, 3),
        _config(32, 32, 256, 4, 4),
    ],
    "small_k": [
        _config(64, 128, 32, 4, 4),
        _config(64, 256, 32, 8, 3),
        _config(128, 128, 32, 8, 3),
    ],
}


def _regime(n: int, k: int) -> str:
    if n <= 32 < k:
        return "skinny_n"
    if k <= 32 < n:
        return "small_k"
    return "wide"


def _pruner(table):
    def prune(configs, named_args, **kwargs):
        """The shape's regime's configs, column / reduction tiles shrunk to the problem, never below 16
        (``tl.dot``'s minimum); duplicates dropped."""
        n, k = named_args["N"], named_args["K"]
        fitted, seen = [], set()
        for config in table[_regime(n, k)]:
            kw = dict(config.kwargs)
            kw["BLOCK_N"] = min(kw["BLOCK_N"], max(16, triton.next_power_of_2(n)))
            kw["BLOCK_K"] = min(kw["BLOCK_K"], max(16, triton.next_power_of_2(k)))
            key = (tuple(sorted(kw.items())), config.num_warps, config.num_stages)
            if key not in seen:
                seen.add(key)
                fitted.append(triton.Config(kw, num_warps=config.num_warps, num_stages=config.num_stages))
        return fitted

    return prune


_FWD_KEY = ["N", "K", "TOP_K", "HAS_GATHER", "HAS_SCATTER", "HAS_ADD"]
_DW_KEY = ["N", "K", "TOP_K", "HAS_GATHER", "HAS_SCATTER"]
_tuned: dict[str, object] = {}
# Triton >= 3.4 keeps autotuning results in its cache folder, keyed by the kernel's source, the GPU and the key
# values: a new process (a restarted notebook, each `fastft bench step` worker) reuses them instead of
# re-timing every config for tens of seconds. Older Tritons (some Colab images) lack the option.
_DISK_CACHE = (
    {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
)


def _time_config(kernel_call, quantiles) -> list[float]:
    """How the autotuner times one config: CUDA events around ~25 ms of calls, median and the asked
    quantiles. Triton's own ``do_bench`` allocates a 256 MiB buffer for every config it times, to flush
    the L2 between calls; timed inside a training step's first backward, that buffer was the MoE step's
    peak memory (+256 MiB over the steady state). Without it nothing is allocated; the operands of these
    GEMMs (tens of MiB and more) outgrow the L2 anyway."""
    kernel_call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        kernel_call()
    end.record()
    torch.cuda.synchronize()
    reps = max(5, min(100, int(25.0 / max(start.elapsed_time(end) / 3, 1e-3))))
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for first, last in events:
        first.record()
        kernel_call()
        last.record()
    torch.cuda.synchronize()
    times = sorted(first.elapsed_time(last) for first, last in events)
    return [times[min(reps - 1, int(q * reps))] for q in quantiles]


_OWN_TIMING = (
    {"do_bench": _time_config} if "do_bench" in inspect.signature(triton.autotune).parameters else {}
)


def _tuned_kernel(name: str):
    """The autotuned wrapper of a kernel, built on first GPU use (never under the interpreter)."""
    if name not in _tuned:
        kernel, table, key = (
            (_grouped_mm_kernel, _FWD_CONFIGS, _FWD_KEY)
            if name == "fwd"
            else (_grouped_mm_dw_kernel, _DW_CONFIGS, _DW_KEY)
        )
        configs = [config for regime in table.values() for config in regime]
        _tuned[name] = triton.autotune(
            configs=configs,
            key=key,
            prune_configs_by={"early_config_prune": _pruner(table)},
            **_DISK_CACHE,
            **_OWN_TIMING,
        )(kernel)
    return _tuned[name]


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
    dummy = group_end  # stands in for absent pointers; compiled away by the HAS_* flags
    args = (
        a,
        weight,
        out,
        add if add is not None else out,
        group_end,
        gather_rows if gather_rows is not None else dummy,
        scatter_rows if scatter_rows is not None else dummy,
        n,
        k,
        n_experts,
        a.stride(0),
        a.stride(1),
        weight.stride(0),
        weight.stride(1),
        weight.stride(2),
        out.stride(0),
        out.stride(1),
        add.stride(0) if add is not None else 0,
        add.stride(1) if add is not None else 0,
    )
    flags = dict(
        TOP_K=top_k,
        HAS_GATHER=gather_rows is not None,
        HAS_SCATTER=scatter_rows is not None,
        HAS_ADD=add is not None,
        DOT_PRECISION=_dot_precision(a.dtype),
        INTERPRETED=_interpreted(a),
        E_POW2=triton.next_power_of_2(n_experts),
    )

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
    dummy = group_end
    args = (
        dy,
        a,
        dw,
        group_end,
        gather_rows if gather_rows is not None else dummy,
        scatter_rows if scatter_rows is not None else dummy,
        n,
        k,
        dy.stride(0),
        dy.stride(1),
        a.stride(0),
        a.stride(1),
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
    )
    flags = dict(
        TOP_K=top_k,
        HAS_GATHER=gather_rows is not None,
        HAS_SCATTER=scatter_rows is not None,
        DOT_PRECISION=_dot_precision(a.dtype),
        INTERPRETED=_interpreted(a),
    )

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


# --------------------------------------------------------------------------------------------------
# The down projection and the top-k combine as one autograd node
# --------------------------------------------------------------------------------------------------


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
    # the module's `grouped_mm` (looked up at call time): the reference off the GPU
    return down_combine_reference(
        h,
        weight,
        group_end,
        sorted_slots,
        route_weights,
        bias,
        lora,
        sorted_experts=sorted_experts,
        mm=grouped_mm,
    )


__all__ = [
    "DownCombineFunction",
    "GroupedMMFunction",
    "down_combine",
    "down_combine_reference",
    "grouped_mm",
    "grouped_mm_dw_launch",
    "grouped_mm_launch",
    "grouped_mm_reference",
]

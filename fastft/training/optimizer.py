"""The optimizer (with its state in device memory before the first step) and its learning-rate schedule.

PyTorch's Adam and AdamW make their moment estimates lazily, in the first `step()`. By then the first
forward and backward have filled the caching allocator's segments with activations and freed them, so
each state tensor above the small-block size (1 MiB; a LoRA B of 14,336 × 32 in fp32 is 1.75 MiB) is
carved out of a large freed segment. Those segments can no longer be released, and their remainders are
a little too small for the next step's largest activations: near a memory cap, step 1 trains and step 2 runs
out with the cap reserved but not allocated (docs/journal.md, "Long context as BENCHMARKS.md recorded it").
Made at setup, the state lies beside the weights and the activation segments stay whole.

`adamw` builds the optimizer and makes its state at once, exactly as the first `step()` would have made it
(the same keys, dtypes and devices), so every step after is bitwise the same.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable

import torch


def adamw(
    parameters: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """`torch.optim.AdamW` over `parameters` with its state made now (`make_state`). `fused`: None picks
    the fused kernel where every parameter is on a CUDA device."""
    parameters = list(parameters)
    if fused is None:
        fused = bool(parameters) and all(p.device.type == "cuda" for p in parameters)
    optimizer = torch.optim.AdamW(
        parameters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused
    )
    make_state(optimizer)
    return optimizer


def make_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make an Adam or AdamW optimizer's per-parameter state now instead of in its first `step()`; a no-op
    for any other optimizer and for parameters that already have state (idempotent). Returns `optimizer`."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return optimizer
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in optimizer.param_groups:
        on_device = group["capturable"] or group["fused"]
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            # torch.optim.adam.Adam._init_group's lazy initialisation: `step` lives on the parameter's
            # device when capturable or fused (float32 for fused), else on the host
            if on_device:
                dtype = torch.float32 if group["fused"] else scalar
                state["step"] = torch.zeros((), dtype=dtype, device=p.device)
            else:
                state["step"] = torch.tensor(0.0, dtype=scalar, device="cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return optimizer


def cosine_with_warmup(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warmup from 0 to 1, then cosine decay from 1 to `min_ratio`."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def advance_schedule(scheduler, steps: int) -> None:
    """Move a fresh LR schedule to `steps` optimizer steps without stepping the optimizer."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*", category=UserWarning)
        for _ in range(steps):
            scheduler.step()

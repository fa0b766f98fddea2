"""fp16 loss scaling that never makes the host wait for the device.

fp16 has 5 exponent bits: small gradients underflow to zero unless the loss is multiplied by a large
scale before backward. The scale is dynamic: halved when a step's gradients hold inf/NaN (that step's
update is skipped), doubled after `growth_interval` clean steps in a row. `torch.amp.GradScaler` does the
same, but its non-fused path reads the inf flag on the host (``found_inf.item()``) every step, and the
trainer never captured its fp16 steps as CUDA graphs.

`LossScaler` keeps every number on the device, and each piece is a device op:

- ``scale``: a 0-d float32 tensor, changed only in place, so a CUDA graph that captured ``loss * scale``
  reads the current scale at every replay;
- unscaling and the inf/NaN check: one ``torch._amp_foreach_non_finite_check_and_unscale_`` per dtype,
  which multiplies the gradients by ``1 / scale`` and sets ``found_inf``;
- the skipped update: the fused AdamW takes ``found_inf`` (``optimizer.found_inf``, as GradScaler hands it
  over) and leaves parameters, both moments and the step count untouched when it is set, on CUDA and CPU;
- the new scale: ``torch._amp_update_scale_`` on ``scale``, ``growth_tracker`` and ``found_inf``.

The decisions and the parameters equal GradScaler's with a fused optimizer bit for bit (the same ops in
the same order; `tests/training/test_loss_scale.py`). Gradient clipping sits between `unscale_` and
`step`, on the unscaled gradients. The state (scale and growth tracker) is read back to the host only in
`state_dict`, for a checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class LossScaler:
    """Dynamic loss scaling on the device (module docstring). Per step: backward on ``scaled(loss)``, then
    ``unscale_(parameters)``, clipping, ``step(optimizer)``, ``update()``."""

    def __init__(
        self,
        device: torch.device | str,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ):
        self.device = torch.device(device)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.scale = torch.full((), float(init_scale), dtype=torch.float32, device=self.device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=self.device)
        # 1.0 when the last unscaled gradients held an inf or NaN: that step is skipped
        self.found_inf = torch.zeros((), dtype=torch.float32, device=self.device)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``: backward on this."""
        return loss * self.scale

    @torch.no_grad()
    def unscale_(self, parameters: Sequence[torch.Tensor], all_reduce=None) -> torch.Tensor:
        """Divide the parameters' gradients by the scale in place and set ``found_inf`` (returned). A
        sharded run passes `all_reduce` (called on ``found_inf``: the max over ranks, so every rank skips)."""
        self.found_inf.zero_()
        inv_scale = self.scale.double().reciprocal().float()  # as GradScaler computes it
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for parameter in parameters:
            grad = parameter.grad
            if grad is None:
                continue
            grad = grad.to_local() if hasattr(grad, "to_local") else grad  # an FSDP2 shard
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inv_scale)
        if all_reduce is not None:
            all_reduce(self.found_inf)
        return self.found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step on the unscaled gradients, a no-op on the device where ``found_inf`` is set.
        Needs an optimizer that takes ``found_inf`` itself (the fused Adam / AdamW)."""
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ValueError(
                f"fp16 loss scaling skips an overflowing step on the device, which needs a fused optimizer "
                f"(torch.optim.AdamW(..., fused=True)); got {type(optimizer).__name__} without fused=True."
            )
        optimizer.grad_scale, optimizer.found_inf = None, self.found_inf  # gradients are unscaled already
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf

    def update(self) -> None:
        """Halve the scale after a skipped step; double it after `growth_interval` clean steps in a row."""
        torch._amp_update_scale_(
            self.scale,
            self.growth_tracker,
            self.found_inf,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
        )

    def state_dict(self) -> dict:
        """Plain numbers for a checkpoint (reads the device: call it at save time, never in a step)."""
        return {
            "scale": float(self.scale),
            "growth_tracker": int(self.growth_tracker),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s numbers in place (a captured graph keeps reading the same tensors)."""
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))


__all__ = ["LossScaler"]

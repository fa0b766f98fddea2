"""A step's numbers on their way to the host, without a host–device sync inside the step.

An objective's step ends by handing its device scalars (loss, gradient norm, its metric sums) and host facts to
`Trainer.queue_readout` as a `PendingReadout`; the trainer turns it into a `StepEvent` once its copy has
completed (one step later on CUDA). `StepTimer` times the step with CUDA events (never stalling), and
`device_scalar` puts a host count on the device the same way (a pinned, non-blocking copy).
"""

from __future__ import annotations

import resource
import time

import torch


class PendingReadout:
    """A step's device scalars on their way to the host, read once their copy has completed."""

    def __init__(self, values: torch.Tensor, info: dict):
        self.info = info
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host, self.done = values, None

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def read(self) -> list[float]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class StepTimer:
    """Step wall time: CUDA events on a GPU (read later, never stalling), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.begin, self.finish = time.perf_counter(), None

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.finish = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            return self.start.elapsed_time(self.end) / 1000.0
        return self.finish - self.begin


def device_scalar(value: float, device: torch.device) -> torch.Tensor:
    """`value` as a 0-d float32 tensor on `device`, copied from pinned memory without a host sync."""
    scalar = torch.tensor(float(value), dtype=torch.float32)
    return scalar.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else scalar


def peak_memory(device: torch.device) -> int:
    """Peak bytes so far: the CUDA allocator's on a GPU, the process's resident set on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

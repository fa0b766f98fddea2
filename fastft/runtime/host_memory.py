"""Host memory for offloaded layer inputs: pinned slabs cut into slots, and how much may be pinned.

Pinned-memory budget: before the first layer of each forward the whole forward's need (what the slabs
for every layer's input pin, `pinned_bytes`: PyTorch rounds each pinned allocation up to a power of two) is
compared with what may be pinned (`pinnable_bytes`): pinned memory already held plus 75 % of the host's
available memory (``psutil.virtual_memory().available``, else ``MemAvailable`` in /proc/meminfo; no limit
when neither exists), or ``host_budget_bytes``. If it does not fit, the offloader (`fastft.runtime.offload`)
offloads the first layers' inputs that do (`layers_that_fit`) and the others recompute from the device; if
pinning fails (WSL caps pinned memory), it warns once (`OffloadBudgetWarning`) and every layer uses plain
recompute from then on.
"""

from __future__ import annotations

import torch

from fastft.runtime.host_budget import HOST_BUDGET_FRACTION, host_memory_available, pinnable_bytes, slab_plan


class HostSlabs:
    """Host buffers for layer inputs, cut from a few large (pinned) slabs.

    PyTorch's pinned allocator rounds each allocation up to a power of two (one 320 MiB layer input would
    pin 512 MiB), so slabs are allocated at power-of-two sizes, up to 2 GiB and as many slots as the
    forward still needs, and cut into equal slots. When a larger slot is needed, slabs with no slot in
    use are released. A slot handed back may be reused at once: every access to it is a copy on the copy
    stream, so stream order keeps a new write behind the last read.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.bytes = 0
        self._slabs: dict[int, torch.Tensor] = {}
        self._busy: dict[int, int] = {}
        self._free: list[tuple[int, torch.Tensor]] = []
        self._ids = 0

    def take(self, nbytes: int, count: int) -> tuple[int, torch.Tensor]:
        fitting = [slot for slot in self._free if slot[1].numel() >= nbytes]
        if not fitting:
            self._release_idle()
            fitting = [self._allocate(nbytes, count)]
        slot = min(fitting, key=lambda s: s[1].numel())
        self._free.remove(slot)
        self._busy[slot[0]] += 1
        return slot

    def give(self, slot: tuple[int, torch.Tensor]) -> None:
        self._busy[slot[0]] -= 1
        self._free.append(slot)

    def _allocate(self, nbytes: int, count: int) -> tuple[int, torch.Tensor]:
        slot_bytes, size = slab_plan(nbytes, count)
        slab = _allocate_host(size, self.pin)
        self._ids += 1
        self._slabs[self._ids], self._busy[self._ids] = slab, 0
        self.bytes += size
        slots = [(self._ids, slab[i * slot_bytes : (i + 1) * slot_bytes]) for i in range(size // slot_bytes)]
        self._free += slots
        return slots[0]

    def _release_idle(self) -> None:
        idle = {key for key, busy in self._busy.items() if busy == 0}
        self._free = [slot for slot in self._free if slot[0] not in idle]
        for key in idle:
            self.bytes -= self._slabs.pop(key).numel()
            del self._busy[key]


def _allocate_host(size: int, pin: bool) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=pin)


__all__ = ["HOST_BUDGET_FRACTION", "HostSlabs", "host_memory_available", "pinnable_bytes"]

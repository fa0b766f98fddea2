"""How much host memory offloading may pin: 75 % of what the host has available, or a budget given.

Plain Python, no torch: the VRAM estimator asks it too (`estimate_vram(host_memory="auto")`), and
``fastft estimate`` runs without torch. The pinned slabs themselves are `fastft.runtime.host_memory`'s.
"""

from __future__ import annotations

HOST_BUDGET_FRACTION = 0.75  # of available host memory
HOST_GRANULE = 2 * 2**20  # host slots are rounded up to 2 MiB so nearby sizes reuse them
SMALL_SLAB_BYTES = 2 * 2**30  # slots that fit this many at once share one slab of the next power of two


def _power_of_two(size: int) -> int:
    return 1 << (max(1, size) - 1).bit_length()


def slab_plan(nbytes: int, count: int) -> tuple[int, int]:
    """``(slot_bytes, slab_bytes)``: how `count` host slots of `nbytes` each are pinned (`HostSlabs`).

    PyTorch's pinned allocator rounds every allocation up to a power of two, so a slab is one, cut into
    slots of `nbytes` rounded up to `HOST_GRANULE`. Up to `SMALL_SLAB_BYTES` of slots share one slab of the
    next power of two. Larger needs take the power-of-two slab size that pins the fewest bytes for all
    `count` slots: one slot per slab wastes up to half of each at long context (Llama-3.1-8B's layer input
    at 163,840 tokens is 1.25 GiB: a 2 GiB slab each, 64 GiB for 40 GiB of inputs, where 4 GiB slabs of
    three pin 44 GiB)."""
    slot = -(-max(1, nbytes) // HOST_GRANULE) * HOST_GRANULE
    count = max(1, count)
    if count * slot <= SMALL_SLAB_BYTES:
        return slot, _power_of_two(count * slot)
    candidates = []
    size = _power_of_two(slot)
    while True:
        per_slab = size // slot
        # the fewest bytes; among equals, slabs as close to SMALL_SLAB_BYTES as possible (fewer pinnings)
        candidates.append((-(-count // per_slab) * size, abs(size - SMALL_SLAB_BYTES), size))
        if per_slab >= count:
            break
        size *= 2
    return slot, min(candidates)[2]


def layers_that_fit(nbytes: int, layers: int, budget: int) -> int:
    """How many of `layers` inputs of `nbytes` each the offloader may pin within `budget` bytes (the first
    ones of each forward; the others recompute from the device)."""
    return max((k for k in range(layers + 1) if pinned_bytes(nbytes, k) <= budget), default=0)


def pinned_bytes(nbytes: int, count: int) -> int:
    """Bytes pinned for `count` slots of `nbytes` taken together (`slab_plan`): what offloading `count`
    layer inputs of `nbytes` each really holds in host memory."""
    if count <= 0:
        return 0
    slot, slab = slab_plan(nbytes, count)
    return -(-count // (slab // slot)) * slab


def host_memory_available() -> int | None:
    """Bytes of host memory available now (psutil, else /proc/meminfo ``MemAvailable``); None if unknown."""
    return _host_memory("available", "MemAvailable:")


def host_memory_total() -> int | None:
    """Bytes of host memory this machine has in all (psutil, else /proc/meminfo ``MemTotal``); None if unknown.
    Unlike `host_memory_available`, it does not move while the machine works: what a plan states."""
    return _host_memory("total", "MemTotal:")


def _host_memory(field: str, meminfo_key: str) -> int | None:
    """psutil's ``virtual_memory().<field>``, else the ``meminfo_key`` line of /proc/meminfo, in bytes;
    None when neither says."""
    try:
        import psutil

        return int(getattr(psutil.virtual_memory(), field))
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(meminfo_key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def pinnable_bytes(held: int, host_budget_bytes: int | None) -> int | None:
    """How many bytes of host memory offloading may hold: `host_budget_bytes` when given, else the `held`
    bytes plus `HOST_BUDGET_FRACTION` of what is available; None when the host does not say."""
    if host_budget_bytes is not None:
        return host_budget_bytes
    available = host_memory_available()
    return None if available is None else held + int(HOST_BUDGET_FRACTION * available)


__all__ = [
    "HOST_BUDGET_FRACTION",
    "host_memory_available",
    "host_memory_total",
    "layers_that_fit",
    "pinnable_bytes",
    "pinned_bytes",
    "slab_plan",
]

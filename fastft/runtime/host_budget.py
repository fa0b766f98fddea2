"""How much host memory offloading may pin: 75 % of what the host has available, or a budget given.

Plain Python, no torch: the VRAM estimator asks it too (`estimate_vram(host_memory="auto")`), and
``fastft estimate`` runs without torch. The pinned slabs themselves are `fastft.runtime.host_memory`'s.
"""

from __future__ import annotations

HOST_BUDGET_FRACTION = 0.75  # of available host memory


def host_memory_available() -> int | None:
    """Bytes of host memory available now (psutil, else /proc/meminfo ``MemAvailable``); None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
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


__all__ = ["HOST_BUDGET_FRACTION", "host_memory_available", "pinnable_bytes"]

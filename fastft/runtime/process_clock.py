"""When this process started, so that a command's reported time covers its imports too (no torch here)."""

from __future__ import annotations

import os
import time


def process_started_at() -> float | None:
    """The `time.time()` this process started (Linux ``/proc``), None where that cannot be read."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None

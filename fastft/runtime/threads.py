"""How many CPU threads torch uses, chosen by measurement.

torch starts with one intra-op thread per core. On a quiet machine that is right; on a busy one (another
process on the other core) the threads wait for each other at every small op, and a tiny model's training
step can take 2.5x longer than with one thread. Neither count wins everywhere, so `choose_cpu_threads` times
the real work (a few repeats of a caller's workload, such as one training micro-batch) at one thread and at
torch's default, keeps the faster, and says what it measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# torch's own count when fastft was imported (one per core, or OMP_NUM_THREADS): the count to try against
# one thread, even after an earlier choice in this process set a different one
TORCH_DEFAULT_THREADS = torch.get_num_threads()


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count kept and the median seconds of the workload at each count tried."""

    threads: int
    seconds: dict[int, float]

    def describe(self, unit: str = "call") -> str:
        """One line for a summary: what was kept and why (`unit` names one call of the timed workload)."""
        if len(self.seconds) < 2:
            return f"{self.threads} (the only count to try on this machine)"
        timings = ", ".join(f"{n}: {s * 1000:.0f} ms" for n, s in sorted(self.seconds.items()))
        return f"{self.threads} (fastest of a timed probe: {timings} per {unit})"


def _median_seconds(workload: Callable[[], object], repeats: int) -> float:
    workload()  # warm-up: first calls allocate and pick kernels
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        workload()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def choose_cpu_threads(workload: Callable[[], object], repeats: int = 3) -> ThreadChoice:
    """Time `workload` at 1 thread and at torch's default count, set the faster one and return the choice.

    Ties (within 5 %) go to one thread: it leaves the other cores to the rest of the machine. The workload
    runs ``1 + repeats`` times per count (the first is a warm-up), so it must leave no trace (zero the
    gradients it makes).
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: time the workload at least once (repeats >= 1)")
    current = torch.get_num_threads()
    counts = sorted({1, TORCH_DEFAULT_THREADS})
    seconds = {}
    try:
        for count in counts:
            torch.set_num_threads(count)
            seconds[count] = _median_seconds(workload, repeats)
    finally:
        torch.set_num_threads(current)
    best = min(counts, key=lambda n: (seconds[n] / (1.05 if n == 1 else 1.0), n))
    torch.set_num_threads(best)
    return ThreadChoice(best, seconds)

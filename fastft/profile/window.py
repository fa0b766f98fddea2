"""On demand: a few training steps under `torch.profiler`, summarised and saved as a trace file.

`profile_window(trainer, steps=3, path="trace.json")` runs `warmup` steps unrecorded (first-step
allocations and backend choice stay out), then `steps` steps recorded, and returns a
`KernelProfile`: the top kernels by total GPU time (on a CPU: the top operators by self time),
how much of the host↔device copy time ran while a kernel was running (copy/compute overlap), and
the Chrome/Perfetto trace (open it in https://ui.perfetto.dev or chrome://tracing). The window's
steps are real training steps: the run advances by ``warmup + steps``. While it records, the step
profiler's phases are also torch.profiler ranges, so the trace shows them by name.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fastft.training.timing import ORDER, TOP_LEVEL, Table

KERNEL = "kernel"
COPY = "gpu_memcpy"


@dataclass(frozen=True)
class KernelRow:
    """One kernel (or CPU operator) name: how often it ran and its total time over the window."""

    name: str
    calls: int
    total_ms: float
    share: float  # of all kernel time in the window


@dataclass
class KernelProfile:
    """What `profile_window` measured over `steps` steps; `overlap` is None when nothing was copied."""

    steps: int
    device: str
    kernels: list[KernelRow] = field(default_factory=list)
    kernel_ms: float = 0.0
    copy_ms: float = 0.0
    overlapped_copy_ms: float = 0.0
    path: Path | None = None

    @property
    def overlap(self) -> float | None:
        """Fraction of memcpy time during which some kernel ran (1.0: copies fully hidden)."""
        return self.overlapped_copy_ms / self.copy_ms if self.copy_ms > 0 else None

    def table(self) -> Table:
        return Table(
            ["kernel", "calls", "total ms", "ms per step", "share"],
            [[k.name, k.calls, k.total_ms, k.total_ms / max(1, self.steps), k.share] for k in self.kernels],
            formats={"share": "{:.1%}"},
        )

    def __str__(self) -> str:
        what = "kernels" if self.device == "cuda" else "CPU operators (self time)"
        head = f"top {what} over {self.steps} steps: {self.kernel_ms:,.1f} ms in all"
        if self.overlap is not None:
            head += f"; {self.copy_ms:,.1f} ms of copies, {self.overlap:.0%} overlapped by kernels"
        if self.path:
            head += f"\ntrace: {self.path}"
        return f"{head}\n{self.table()}"


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def copy_compute_overlap(events: Iterable[Mapping]) -> tuple[float, float]:
    """(copy time, copy time overlapped by kernels) of Chrome-trace events, in the trace's unit (µs).

    Kernels are events of category ``kernel``, copies ``gpu_memcpy``; a copy counts as overlapped
    where any kernel (on any stream) runs at the same time.
    """
    kernels, copies = [], []
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        interval = (float(event["ts"]), float(event["ts"]) + float(event["dur"]))
        if event.get("cat") == KERNEL:
            kernels.append(interval)
        elif event.get("cat") == COPY:
            copies.append(interval)
    busy = _union(kernels)
    total = overlapped = 0.0
    for start, end in copies:
        total += end - start
        for k_start, k_end in busy:  # few thousand intervals per window: a plain scan is fast enough
            if k_start >= end:
                break
            overlapped += max(0.0, min(end, k_end) - max(start, k_start))
    return total, overlapped


def _top_kernels(events: Iterable[Mapping], top: int) -> tuple[list[KernelRow], float]:
    calls: dict[str, int] = collections.Counter()
    times: dict[str, float] = collections.defaultdict(float)
    for event in events:
        if event.get("cat") == KERNEL and event.get("ph") == "X":
            calls[event["name"]] += 1
            times[event["name"]] += float(event.get("dur", 0.0)) / 1000.0
    total = sum(times.values())
    names = sorted(times, key=times.get, reverse=True)[:top]
    return [KernelRow(n, calls[n], times[n], times[n] / total if total else 0.0) for n in names], total


def _top_operators(
    profiler: torch.profiler.profile, skip: set[str], top: int
) -> tuple[list[KernelRow], float]:
    rows = [
        (e.key, e.count, e.self_cpu_time_total / 1000.0)
        for e in profiler.key_averages()
        if e.key not in skip and not e.key.startswith("ProfilerStep")
    ]
    total = sum(ms for _, _, ms in rows)
    rows.sort(key=lambda r: r[2], reverse=True)
    return [KernelRow(n, c, ms, ms / total if total else 0.0) for n, c, ms in rows[:top]], total


def profile_window(
    trainer,
    steps: int = 3,
    path: str | os.PathLike[str] | None = None,
    *,
    warmup: int = 1,
    top: int = 20,
) -> KernelProfile:
    """Run `warmup` + `steps` steps of `trainer`, the last `steps` under torch.profiler (see the module docstring).

    `path` is where the Chrome trace JSON goes (parent folders are created; None: not kept).
    Raises ValueError when the run has fewer than ``warmup + steps`` steps left.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}.")
    left = trainer.max_steps - trainer.step
    if left < warmup + steps:
        raise ValueError(
            f"profile_window needs {warmup + steps} steps (warmup={warmup}, steps={steps}) but the run has "
            f"{left} left of max_steps={trainer.max_steps}: raise max_steps or ask for fewer steps."
        )
    if warmup:
        trainer.train(steps=warmup)
    cuda = trainer.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    step_profile = getattr(trainer, "profile", None)
    labels = {*_phase_names(step_profile)}
    profiler = torch.profiler.profile(activities=activities)
    with _without_kineto_notices():
        profiler.start()
    try:
        if step_profile is not None:
            step_profile._annotate(True)
        try:
            trainer.train(steps=steps)
            if cuda:
                torch.cuda.synchronize(trainer.device)
        finally:
            if step_profile is not None:
                step_profile._annotate(False)
    finally:
        with _without_kineto_notices():
            profiler.stop()
    target = Path(path) if path is not None else None
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        trace_file = target
    else:
        handle, name = tempfile.mkstemp(suffix=".json")
        os.close(handle)
        trace_file = Path(name)
    try:
        profiler.export_chrome_trace(str(trace_file))
        events = json.loads(trace_file.read_text(encoding="utf-8")).get("traceEvents", [])
    finally:
        if target is None:
            trace_file.unlink(missing_ok=True)
    result = KernelProfile(steps=steps, device="cuda" if cuda else "cpu", path=target)
    if cuda:
        result.kernels, result.kernel_ms = _top_kernels(events, top)
        copy_us, overlapped_us = copy_compute_overlap(events)
        result.copy_ms, result.overlapped_copy_ms = copy_us / 1000.0, overlapped_us / 1000.0
    else:
        result.kernels, result.kernel_ms = _top_operators(profiler, labels, top)
    return result


# Kineto (torch.profiler's C++ side) writes "USDT:… profiler_start" / "profiler_stop" (and "STAGE:… Completed
# Stage") lines straight to file descriptor 2 at every start and stop, whatever KINETO_LOG_LEVEL says: in a
# notebook they show as red stderr. Only those lines are dropped, and only around start and stop.
_KINETO_NOTICE = re.compile(
    r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \S+\.cpp:\d+\] (profiler_st(art|op)|Completed Stage: .*)$"
)


@contextlib.contextmanager
def _without_kineto_notices():
    """Run the block with fd 2 sent to a temporary file, then write back every line but Kineto's notices."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 here: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [
                line
                for line in caught.read().decode("utf-8", "replace").splitlines(keepends=True)
                if not _KINETO_NOTICE.match(line.rstrip("\n"))
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _phase_names(step_profile) -> list[str]:
    """Every range name the step profiler may emit (left out of the operator table)."""

    names = [*TOP_LEVEL, *ORDER, "loss_backward"]
    if step_profile is not None:
        names += step_profile.instrumented
        names += [
            n.rsplit(".", 1)[0] + ".recompute" for n in step_profile.instrumented if n.startswith("layers.")
        ]
    return names

"""Shared benchmark plumbing: step timing, sync counting, the environment and tables (random-weight models:
`fastft.models.random_model`)."""

from __future__ import annotations

import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib.metadata import version

import torch

from fastft.kernels import tiling

# No transformers, peft or TRL at import: the benches' Unsloth workers import this module before Unsloth.


@dataclass
class StepTimes:
    """Per-step device times in milliseconds (CUDA events; perf_counter on the CPU)."""

    forward: list[float] = field(default_factory=list)
    backward: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)

    def median(self) -> dict[str, float]:
        return {name: statistics.median(getattr(self, name)) for name in ("forward", "backward", "total")}


class _Clock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start, end) -> float:
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1000.0


def time_calls(fn: Callable[[], object], device: torch.device, reps: int) -> list[float]:
    """Milliseconds of each of `reps` calls of ``fn()``: CUDA events read after the last call (the calls are
    not separated by syncs), perf_counter on the CPU."""
    clock = _Clock(device)
    marks = []
    for _ in range(reps):
        start = clock.mark()
        fn()
        marks.append((start, clock.mark()))
    if clock.cuda:
        torch.cuda.synchronize()
    return [clock.elapsed_ms(start, end) for start, end in marks]


def time_steps(
    forward: Callable[[int], torch.Tensor],
    after_backward: Callable[[], None],
    device: torch.device,
    warmup: int,
    steps: int,
) -> StepTimes:
    """Run `warmup` + `steps` steps of ``forward(i).backward(); after_backward()``; time the last `steps`."""
    clock, times = _Clock(device), StepTimes()
    for i in range(warmup + steps):
        start = clock.mark()
        loss = forward(i)
        middle = clock.mark()
        loss.backward()
        after_backward()
        end = clock.mark()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.forward.append(clock.elapsed_ms(start, middle))
            times.backward.append(clock.elapsed_ms(middle, end))
            times.total.append(clock.elapsed_ms(start, end))
    return times


def count_syncs(function: Callable[[], object]) -> int | None:
    """Host–device synchronisations PyTorch sees during ``function()`` (None on the CPU)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            function()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def set_memory_trades(adapter_copies: str | None = None, dh_slice_mib: int | None = None) -> dict:
    """Set this process's two speed-for-memory switches of the fused kernels before a model is built (for
    A/B runs of the benches): `adapter_copies` "on"/"off" sets `fastft.kernels.tiling.ADAPTER_COMPUTE_COPIES`
    (read when a model is patched), `dh_slice_mib` sets `DH_SLICE_BYTES` (0: the untiled MLP's backward makes
    its ``dh`` whole). None keeps fastft's default. Returns both settings as they now stand."""

    if adapter_copies is not None:
        if adapter_copies not in ("on", "off"):
            raise ValueError(f"adapter_copies={adapter_copies!r}: give 'on' or 'off'")
        tiling.ADAPTER_COMPUTE_COPIES = adapter_copies == "on"
    if dh_slice_mib is not None:
        if dh_slice_mib < 0:
            raise ValueError(f"dh_slice_mib={dh_slice_mib}: give 0 (no slices) or a size in MiB")
        tiling.DH_SLICE_BYTES = dh_slice_mib << 20 if dh_slice_mib else 1 << 62
    return {"adapter_copies": tiling.ADAPTER_COMPUTE_COPIES, "dh_slice_bytes": tiling.DH_SLICE_BYTES}


def add_memory_trade_options(parser) -> None:
    """The benches' `--adapter-copies` and `--dh-slice-mib` (what `set_memory_trades` sets in a fastft worker)."""
    parser.add_argument(
        "--adapter-copies",
        choices=("on", "off"),
        default=None,
        help="fastft's 16-bit adapter compute copies (fastft.kernels.tiling.ADAPTER_COMPUTE_COPIES; default: "
        "fastft's own, off): 2 bytes per adapter parameter held against per-use casts",
    )
    parser.add_argument(
        "--dh-slice-mib",
        type=int,
        default=None,
        help="fastft's untiled MLP backward makes dh in row slices of at most this many MiB "
        "(fastft.kernels.tiling.DH_SLICE_BYTES; 0: whole; default: fastft's own)",
    )


def memory_trade_argv(args) -> list[str]:
    """The options of `add_memory_trade_options` that `args` sets, for a worker's command line."""
    argv = ["--adapter-copies", args.adapter_copies] if args.adapter_copies else []
    return argv + (["--dh-slice-mib", str(args.dh_slice_mib)] if args.dh_slice_mib is not None else [])


def environment() -> dict:
    """The date, the device and the versions a record was measured with (read from the installed packages'
    metadata: importing transformers or peft here would load them before Unsloth in its workers)."""
    info = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "peft": version("peft"),
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name()
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
    }
    return info


def environment_line(env: dict, *libraries: str) -> str:
    """A record's `environment` in one line: the device, the versions of those of `libraries` it names, the
    date."""
    versions = [f"{name} {env[name]}" for name in libraries if env.get(name)]
    return ", ".join([env["device"], *versions, env["date"]])


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """Rows as a markdown table; `columns` are (key, header) pairs."""
    header = "| " + " | ".join(h for _, h in columns) + " |"
    rule = "| " + " | ".join("---" for _ in columns) + " |"
    lines = [header, rule]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(key)) for key, _ in columns) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)

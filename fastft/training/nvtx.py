"""Named ranges around the profiled phases, for external tools: NVTX (Nsight Systems) and torch.profiler.

NVTX lives only in CUDA builds of torch: on a CPU build ``torch.cuda.nvtx.range_push`` raises, so
`nvtx_available` probes once and the profiler never calls it there. Ranges opened by a forward
pre-hook and closed by its post-hook nest and use push/pop; a layer's backward (opened by one
gradient hook, closed by another, overlapping its neighbour by one hook call) uses start/end,
which need no nesting and may cross threads (CUDA runs backward on the autograd device thread).
"""

from __future__ import annotations

import functools
import os

import torch


def nvtx_tool_attached() -> bool:
    """Whether an NVTX tool (Nsight Systems, Nsight Compute...) is listening to this process.

    NVTX finds its tool through ``NVTX_INJECTION64_PATH`` (``nsys profile`` sets it); without one every
    range is a no-op in C, yet each Python call to open or close one still costs about a microsecond,
    and a profiled step opens hundreds.
    """
    return bool(os.environ.get("NVTX_INJECTION64_PATH") or os.environ.get("NVTX_INJECTION32_PATH"))


@functools.cache
def nvtx_available() -> bool:
    """True when NVTX ranges can be emitted (a CUDA build of torch with a visible GPU)."""
    if not torch.cuda.is_available():
        return False
    try:
        torch.cuda.nvtx.range_push("fastft.probe")
        torch.cuda.nvtx.range_pop()
    except (RuntimeError, AttributeError):
        return False
    return True


class NvtxRanges:
    """NVTX ranges: nested push/pop for module spans, start/end ids for overlapping spans."""

    def push(self, name: str) -> None:
        torch.cuda.nvtx.range_push(name)

    def pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    def start(self, name: str) -> int:
        return torch.cuda.nvtx.range_start(name)

    def end(self, handle: int) -> None:
        torch.cuda.nvtx.range_end(handle)


class RecordFunctionRanges:
    """torch.profiler user annotations, so a profiling window's trace shows the phases by name.

    Only the nested ranges: a layer's backward span may end on another thread than it began (CUDA),
    which a record_function range must not do; the trace has those layers' kernels anyway.
    """

    def __init__(self) -> None:
        self._stack: list[torch.autograd.profiler.record_function] = []

    def push(self, name: str) -> None:
        scope = torch.autograd.profiler.record_function(name)
        scope.__enter__()
        self._stack.append(scope)

    def pop(self) -> None:
        if self._stack:
            self._stack.pop().__exit__(None, None, None)

    def start(self, name: str) -> None:
        return None

    def end(self, handle: None) -> None:
        pass

    def close(self) -> None:
        while self._stack:
            self.pop()

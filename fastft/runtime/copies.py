"""Copy engines of offloaded checkpointing: the CUDA copy stream, its ordering events and their timings.

The offloader (`fastft.runtime.offload.ActivationOffloader`) moves layer inputs between the device and
host memory only through a copy engine, which it takes as ``copies=`` (by default a `CudaCopies` on the
first CUDA device it sees). An engine provides:

- ``device`` (the device whose layer inputs it copies: the offloader offloads inputs on it only),
  ``pin_host`` (whether host buffers are pinned), ``timing`` and ``ms`` (copy and wait times in
  milliseconds by kind, when timing);
- ``to_host(host, source)``: copy `source` to the host buffer after everything queued on the compute
  stream (the source is fully written), and keep its memory from reuse until the copy has read it;
- ``to_device(target, host, free) -> ready``: copy a host buffer into a device buffer once `free` (a mark
  of the compute stream, or None) has passed, and return an event marking the copy done;
- ``wait(ready)``: the compute stream waits for a `to_device`'s event before reading the buffer;
- ``mark() -> free``: an ordering mark of the compute stream now (after the reads queued so far);
- ``protect(buffer)``: a device buffer the copy stream writes is not reused before it has;
- ``drain(block)``: fold finished timings into ``ms`` (all of them, waiting, when `block`).

The tests run the same protocol on CPU tensors through stand-ins that copy at once or only when waited
for (tests/copy_stand_ins.py), which catches a missing wait as wrong gradients.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import torch


class Mark(NamedTuple):
    """An ordering event on the compute stream, and whether it was recorded during a graph capture."""

    event: torch.cuda.Event
    captured: bool


class CudaCopies:
    """A dedicated copy stream on one CUDA device, its events and (optionally) their timings.

    Safe inside a CUDA graph capture (`fastft.training.graph`): no timing events are recorded and none is
    polled while the stream captures, and an ordering event recorded on the other side of a capture's
    boundary (eagerly before it, or inside a graph that has since been replayed) is never waited on: the copy
    stream waits for the whole compute stream instead, which a capture allows and which orders at least as
    strongly. `mark` returns a `Mark`: the event and whether it was recorded while capturing.
    """

    pin_host = True

    def __init__(self, device: torch.device, timing: bool):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.timing = timing
        self._pending: dict[str, collections.deque] = {k: collections.deque() for k in ("d2h", "h2d", "wait")}
        self.ms = dict.fromkeys(self._pending, 0.0)

    @staticmethod
    def _capturing() -> bool:
        return torch.cuda.is_current_stream_capturing()

    def _timed(self):
        return torch.cuda.Event(enable_timing=True) if self.timing and not self._capturing() else None

    def _after(self, mark: Mark | None) -> None:
        """The copy stream waits for `mark`'s event, or for the whole compute stream when the event was
        recorded on the other side of a capture boundary."""
        if mark is None:
            return
        if mark.captured == self._capturing():
            self.stream.wait_event(mark.event)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _copy(self, kind: str, start, end, target: torch.Tensor, source: torch.Tensor) -> None:
        """``target.copy_(source)`` on the current stream (the copy stream), between the timing events
        `start` and `end` when timing (then kept for `drain` as a `kind` span)."""
        if start is not None:
            start.record()
        target.copy_(source, non_blocking=True)
        if end is not None:
            end.record()
            self._pending[kind].append((start, end))

    def to_host(self, host: torch.Tensor, source: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the source is fully written
        start, end = self._timed(), self._timed()
        with torch.cuda.stream(self.stream):
            self._copy("d2h", start, end, host, source)
        source.record_stream(self.stream)  # its memory is not reused by S before C has read it

    def to_device(self, target: torch.Tensor, host: torch.Tensor, free) -> torch.cuda.Event:
        self._after(free)  # S has finished reading the previous contents of `target`
        start, end = self._timed(), self._timed()
        ready = torch.cuda.Event()  # recorded and waited for within one backward pass
        with torch.cuda.stream(self.stream):
            self._copy("h2d", start, end, target, host)
            ready.record()
        return ready

    def wait(self, ready) -> None:
        compute = torch.cuda.current_stream(self.device)
        before, after = self._timed(), self._timed()
        if before is not None:
            before.record(compute)
        compute.wait_event(ready)
        if after is not None:
            after.record(compute)  # completes when the wait is over: after - before = time S stood still
            self._pending["wait"].append((before, after))

    def mark(self) -> Mark:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return Mark(event, self._capturing())

    def protect(self, buffer: torch.Tensor) -> None:
        buffer.record_stream(self.stream)  # the allocator waits for C before reusing a dropped buffer

    def drain(self, block: bool) -> None:
        """Fold finished timings into `ms` (all of them, synchronising, when `block`); nothing while a
        graph is being captured (an event may not be queried then)."""
        if self._capturing():
            return
        if block:
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()
        for name, pending in self._pending.items():
            while pending and (block or pending[0][1].query()):
                start, end = pending.popleft()
                self.ms[name] += start.elapsed_time(end)


__all__ = ["CudaCopies", "Mark"]

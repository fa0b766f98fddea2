"""CPU stand-ins for the offloader's copy engine (`fastft.runtime.copies`), so that tests run the offload
protocol on CPU tensors: ``enable_offload(model, copies=SyncCopies())`` or ``copies=DeferredCopies()``.

`SyncCopies` copies at once, so a prefetch into the buffer a layer is reading would corrupt its gradients;
`DeferredCopies` copies only when an event recorded after it is waited for, so a missing wait reads stale
data, which the tests see in gradients.
"""

from __future__ import annotations

import collections
import functools

import torch


class SyncCopies:
    """CPU stand-in for the copy stream: every copy happens at once, every event is already complete."""

    pin_host = False
    timing = False

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.ms = {}

    def to_host(self, host, source):
        host.copy_(source)

    def to_device(self, target, host, free):
        target.copy_(host)
        return None

    def wait(self, ready):
        pass

    def mark(self):
        return None

    def protect(self, buffer):
        pass

    def drain(self, block):
        pass


class DeferredCopies(SyncCopies):
    """CPU stand-in for an asynchronous copy stream: a copy runs only when an event recorded after it is
    waited for, in issue order. A missing wait then reads stale data, which the tests see in gradients."""

    def __init__(self, device: str | torch.device = "cpu"):
        super().__init__(device)
        self._queue: collections.deque = collections.deque()
        self._issued = 0
        self._ran = 0

    def to_host(self, host, source):
        self._queue.append(functools.partial(host.copy_, source.detach()))  # the memory, not the graph
        self._issued += 1

    def to_device(self, target, host, free):
        self._queue.append(functools.partial(target.copy_, host))
        self._issued += 1
        return self._issued

    def wait(self, ready):
        while ready is not None and self._ran < ready:
            self._queue.popleft()()
            self._ran += 1


STAND_INS = {"sync": SyncCopies, "deferred": DeferredCopies}  # the tests' `force` names


def copies(force: str | None):
    """A fresh stand-in for the tests' ``force`` names ("sync", "deferred"), or None (the CUDA default)."""
    return None if force is None else STAND_INS[force]()

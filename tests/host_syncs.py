"""A dispatch mode that catches host–device syncs (shared by the routing and MoE tests)."""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def fastft_frames() -> tuple[str, ...]:
    """The fastft frames of the current Python stack, outermost first, as ``path:line function``."""
    return tuple(
        f"{frame.filename.rsplit('/fastft/', 1)[1]}:{frame.lineno} {frame.name}"
        for frame in traceback.extract_stack()
        if "/fastft/" in frame.filename and "/tests/" not in frame.filename
    )


class SyncTrap(TorchDispatchMode):
    """Records every ATen call that makes the host wait for the device: reading a scalar (``.item()``,
    ``bool(t)``), nonzero / boolean-mask indexing, data-dependent output sizes, ``bincount`` (sizes its
    output from the input's maximum on CUDA), and ``Tensor.tolist()`` (which reads the data without an ATen
    call: patched while a ``SyncTrap(tolist=True)`` is on; host tensors' lists are no sync, so opt in). Backward passes are seen too (dispatch modes reach them). ``where``
    holds, for each sync, the fastft frames it was made under (empty: outside fastft's code)."""

    SYNCING = {
        "aten._local_scalar_dense",
        "aten.nonzero",
        "aten.masked_select",
        "aten.bincount",
        "aten._unique",
        "aten._unique2",
        "aten.unique_dim",
        "aten.unique_consecutive",
    }

    def __init__(self, tolist: bool = False):
        super().__init__()
        self.tolist = tolist
        self.syncs: list[str] = []
        self.where: list[tuple[str, ...]] = []

    def _record(self, name: str) -> None:
        self.syncs.append(name)
        self.where.append(fastft_frames())

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        tolist, record = self._tolist, self._record

        def recording_tolist(tensor):
            record("Tensor.tolist")
            return tolist(tensor)

        if self.tolist:
            torch.Tensor.tolist = recording_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        kwargs = kwargs or {}
        if name in self.SYNCING:
            self._record(name)
        elif name == "aten.index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        ):
            self._record("boolean-mask indexing")
        elif name == "aten.repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            self._record(name)
        return func(*args, **kwargs)

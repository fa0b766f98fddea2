"""A dispatch mode that catches host–device syncs (shared by the routing and MoE tests)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SyncTrap(TorchDispatchMode):
    """Records every ATen call that makes the host wait for the device: reading a scalar (``.item()``,
    ``bool(t)``), nonzero / boolean-mask indexing, data-dependent output sizes, ``bincount`` (sizes its
    output from the input's maximum on CUDA). Backward passes are seen too (dispatch modes reach them)."""

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

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        kwargs = kwargs or {}
        if name in self.SYNCING:
            self.syncs.append(name)
        elif name == "aten.index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())
        ):
            self.syncs.append("boolean-mask indexing")
        elif name == "aten.repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            self.syncs.append(name)
        return func(*args, **kwargs)

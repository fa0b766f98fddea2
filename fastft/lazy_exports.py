"""Names a package exports but imports only on first use (``import fastft`` and ``import fastft.studio`` stay
light): the package's module-level ``__getattr__`` calls `lazy_export`."""

from __future__ import annotations

import importlib

__all__ = ["lazy_export"]


def lazy_export(namespace: dict, exports: dict[str, str], name: str):
    """`name` imported from its module in `exports` (name → module) and kept in the package's `namespace`
    (its ``globals()``), so the next look-up finds it there; an AttributeError for a name not exported."""
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module '{namespace['__name__']}' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    namespace[name] = value
    return value

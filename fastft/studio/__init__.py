"""The studio: notebook widget panels for each step of a run, sharing one `StudioState`.

``fastft.studio()`` shows the Model, Data, VRAM, Run and Export panels as tabs and returns the
`Studio`; each panel also works alone (``fastft.studio.ModelPanel()``, ``fastft.studio.DataPanel()``,
…), and every panel's ``.code()`` gives the plain-Python calls its clicks stand for.

This module is itself callable (``fastft.studio()``), and imports ipywidgets and torch only when a
panel or the studio is first used.
"""

from __future__ import annotations

import sys
import types

from fastft.lazy_exports import lazy_export as _lazy_export

# Function-local imports: `fastft.studio` stays light until it is called (tests/faces/test_studio.py).

_EXPORTS = {
    "Studio": "fastft.studio.app",
    "StudioState": "fastft.studio.state",
    "LoadSettings": "fastft.studio.state",
    "LoraSettings": "fastft.studio.state",
    "PackSettings": "fastft.studio.state",
    "ModelPanel": "fastft.studio.model",
    "DataPanel": "fastft.studio.data",
    "VramPanel": "fastft.studio.vram",
    "RunPanel": "fastft.studio.run",
    "Run": "fastft.studio.run",
    "ExportPanel": "fastft.studio.export",
}

__all__ = [*_EXPORTS, "studio"]


def studio(*args, **kwargs):
    """`fastft.studio.app.studio`: show the five panels as tabs and return the `Studio`."""
    from fastft.studio.app import studio as _studio

    return _studio(*args, **kwargs)


def __getattr__(name: str):
    return _lazy_export(globals(), _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted(__all__)


class _CallableModule(types.ModuleType):
    """``fastft.studio`` is a module (``fastft.studio.ModelPanel``) that can also be called."""

    def __call__(self, *args, **kwargs):
        return studio(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

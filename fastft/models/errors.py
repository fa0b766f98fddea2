"""The errors of loading a model, in a module of their own so that code which only reports them (the CLI,
the VRAM estimator) needs neither torch nor transformers."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model could not be loaded; the message names the input and the fix."""


class UnknownModelError(ModelLoadError):
    pass


class UnsupportedArchitectureError(ModelLoadError):
    pass


class QuantizationError(ModelLoadError):
    pass


class RemoteCodeError(UnsupportedArchitectureError):
    """The model needs its own Python code (``auto_map``) and the user did not pass ``trust_remote_code=True``
    (`fastft.models.remote_code`)."""


__all__ = [
    "ModelLoadError",
    "QuantizationError",
    "RemoteCodeError",
    "UnknownModelError",
    "UnsupportedArchitectureError",
]

"""The gated activations the fused kernel computes, and transformers' ``hidden_act`` names for them.

Plain data, no Triton (and no torch): `fastft.kernels.swiglu` runs these kinds, and the fusion plan
(`fastft.models.fusion`) reads the table to decide whether a model's MLPs get the kernel, on machines
without Triton too.
"""

from __future__ import annotations

KINDS = ("swiglu", "geglu", "geglu_tanh")

# transformers' ``hidden_act`` names whose ``ACT2FN`` entry computes one of the three activations.
HIDDEN_ACT_TO_KIND = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu": "geglu",
    "gelu_python": "geglu",
    "gelu_pytorch_tanh": "geglu_tanh",
    "gelu_python_tanh": "geglu_tanh",
    "gelu_new": "geglu_tanh",
}

__all__ = ["HIDDEN_ACT_TO_KIND", "KINDS"]

"""fastft.kernels: fused Triton kernels with manual backward, each beside a plain-PyTorch reference.

Never a top-level ``kernels`` module: that name belongs to Hugging Face's kernel hub, which
transformers imports. This layer knows torch
and triton only. One module per op, each with its plain-PyTorch reference beside it:
``rms_norm`` (Llama/Qwen and Gemma's (1 + w)), ``rope`` (Q and K in one launch, per-token
positions), ``qk_norm_rope`` (Qwen3's q/k norm fused with it), ``swiglu`` (SwiGLU / GeGLU, backward
recomputes the activation), ``grouped_gemm`` (MoE experts) and ``down_combine`` (the experts' down
projection and top-k combine on it), ``fused_linear_ce`` (chunked linear cross-entropy), ``nf4`` (NF4
dequantisation as bitsandbytes does it) and ``lora`` (LoRA-fused projections and MLP); ``autotune`` is the
GEMM kernels' autotuning harness, ``capability`` the table of which GPUs, dtypes and configs each kernel
runs on (and the fallback elsewhere), and ``activations`` the gated activations the kernels support (free of
Triton, so the fusion plan reads it anywhere). Submodules import triton, except ``activations`` and
``capability``; this package itself does not.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from fastft.kernels import capability
from fastft.kernels.capability import triton_importable

if TYPE_CHECKING:  # torch is imported where used: the fusion plan reads `activations` without it
    import torch

# Function-local imports: the CLI and the fusion plan read this module without torch or triton
# (tests/models/test_fusion.py).


def triton_available() -> bool:
    """Whether Triton can run here: on a CUDA GPU, or on the CPU under ``TRITON_INTERPRET=1``."""
    import torch

    if not triton_importable():
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Dispatch rule: CUDA tensors take the Triton kernel where `fastft.kernels.capability` says it runs
    (Triton installed, sm75 or newer, the dtype computed there, ``FASTFT_NO_TRITON`` unset; else the op's
    PyTorch reference, said once); CPU tensors take it only when interpreted."""
    if tensor.is_cuda:
        reason = capability.fallback_reason(tensor.device, tensor.dtype, triton_importable())
        if reason is None:
            return True
        capability.say_fallback(reason)
        return False
    if os.environ.get("TRITON_INTERPRET") != "1" or not triton_available():
        return False
    if capability.forced_off():
        capability.say_fallback(f"{capability.NO_TRITON_VARIABLE}=1 is set")
        return False
    return True


__all__ = ["triton_available", "triton_importable", "use_triton"]

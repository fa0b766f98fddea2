"""fastft.kernels: fused Triton kernels with manual backward, each beside a plain-PyTorch reference.

Never a top-level ``kernels`` module: that name belongs to Hugging Face's kernel hub, which
transformers imports. This layer knows torch
and triton only. One module per op, each with its plain-PyTorch reference beside it:
``rms_norm`` (Llama/Qwen and Gemma's (1 + w)), ``rope`` (Q and K in one launch, per-token
positions), ``qk_norm_rope`` (Qwen3's q/k norm fused with it), ``swiglu`` (SwiGLU / GeGLU, backward
recomputes the activation), ``grouped_gemm`` (MoE experts) and ``down_combine`` (the experts' down
projection and top-k combine on it), ``fused_linear_ce`` (chunked linear cross-entropy), ``nf4`` (NF4
dequantisation as bitsandbytes does it) and ``lora`` (LoRA-fused projections and MLP); ``autotune`` is the
GEMM kernels' autotuning harness and ``activations`` the gated activations the kernels support (free of
Triton, so the fusion plan reads it anywhere). Submodules import triton, except ``activations``; this
package itself does not.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where used: the fusion plan reads `activations` without it
    import torch


def triton_available() -> bool:
    """Whether Triton can run here: on a CUDA GPU, or on the CPU under ``TRITON_INTERPRET=1``."""
    import torch

    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Dispatch rule: CUDA tensors take the Triton kernel; CPU tensors take it only when interpreted."""
    if tensor.is_cuda:
        return triton_available()
    return os.environ.get("TRITON_INTERPRET") == "1" and triton_available()


__all__ = ["triton_available", "use_triton"]

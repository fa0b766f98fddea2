"""fastft.kernels.qk_norm_rope: Qwen3's q / k RMSNorm + RoPE in one pass, against transformers'
``Qwen3RMSNorm`` followed by ``apply_rotary_pos_emb``, in the outputs and every gradient (q, k, both norm
weights, and through them the projections).

Without a GPU the kernels run on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set below
before anything imports triton, as conftest does); ``grad_fn`` proves the Triton path ran. The tolerances
and the helpers shared with test_kernel_rope are in rope_cases.py.
"""

from __future__ import annotations

import os
import shutil

if shutil.which("nvidia-smi") is None:  # no GPU: interpret Triton on the CPU (must precede `import triton`)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from rope_cases import (  # noqa: E402
    DEVICE,
    _close,
    _cos_sin,
    _gpu_inputs,
    _grads,
    _position_ids,
    _projected_qk,
    triton_path,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

from fastft.kernels.qk_norm_rope import apply_qk_norm_rope, qk_norm_rope_reference  # noqa: E402

# --------------------------------------------------------------------------------- Qwen3 QK-norm fusion


@pytest.mark.parametrize(
    ("head_dim", "dtype"), [(32, torch.float32), (96, torch.float32), (96, torch.bfloat16)]
)
@triton_path
def test_qwen3_qk_norm_rope_matches_transformers(head_dim, dtype):
    position_ids = _position_ids("packed")
    cos, sin = _cos_sin("qwen3", head_dim, position_ids, dtype)
    hidden, w_q, w_k, q, k = _projected_qk(1, position_ids.shape[1], head_dim, 4, 2, dtype)
    g = torch.Generator().manual_seed(5)
    q_norm, k_norm = Qwen3RMSNorm(head_dim, eps=1e-6), Qwen3RMSNorm(head_dim, eps=1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(1 + torch.randn(head_dim, generator=g) / 4)
        k_norm.weight.copy_(1 + torch.randn(head_dim, generator=g) / 4)
    q_norm.to(DEVICE, dtype)
    k_norm.to(DEVICE, dtype)

    q_rot, k_rot = apply_qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, eps=1e-6)
    assert type(q_rot.grad_fn).__name__ == "QKNormRoPEFunctionBackward"
    # Qwen3Attention: q_norm on [b, s, h, d] before the transpose; the norm is per head vector, so the same.
    q_hf, k_hf = apply_rotary_pos_emb(
        q_norm(q.transpose(1, 2)).transpose(1, 2), k_norm(k.transpose(1, 2)).transpose(1, 2), cos, sin
    )
    assert q_rot.dtype == q_hf.dtype
    _close(q_rot, q_hf, dtype, "q")
    _close(k_rot, k_hf, dtype, "k")
    inputs = (q, k, q_norm.weight, k_norm.weight, hidden, w_q, w_k)
    names = ["dq", "dk", "dq_norm.weight", "dk_norm.weight", "dhidden", "dw_q", "dw_k"]
    for name, a, e in zip(names, _grads(q_rot, k_rot, inputs), _grads(q_hf, k_hf, inputs), strict=True):
        _close(a, e, dtype, name)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_16k_tokens_gqa_bf16_against_fp32_reference():
    q, k, cos, sin = _gpu_inputs()
    q32 = q.detach().float().requires_grad_()
    k32 = k.detach().float().requires_grad_()
    # Qwen3 fusion at scale
    w_q = (1 + torch.randn(128, device="cuda") / 4).to(torch.bfloat16)
    w_k = (1 + torch.randn(128, device="cuda") / 4).to(torch.bfloat16)
    qn, kn = apply_qk_norm_rope(q, k, w_q, w_k, cos, sin, 1e-6)
    qn_ref, kn_ref = qk_norm_rope_reference(
        q32, k32, w_q.float(), w_k.float(), cos.float(), sin.float(), 1e-6
    )
    _close(qn, qn_ref, torch.bfloat16, "qk-norm q")
    _close(kn, kn_ref, torch.bfloat16, "qk-norm k")

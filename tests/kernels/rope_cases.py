"""Shared by the RoPE and the fused QK-norm + RoPE kernel tests: tolerances, transformers' rotary
embeddings, q / k made the way attention makes them.

Tolerances (``rel`` = ||actual - expected|| / ||expected||, per tensor):

| dtype    | rel    | per element              | against                                          |
| -------- | ------ | ------------------------ | ------------------------------------------------ |
| float32  | 1e-5   | rtol 1e-5, atol 1e-6     | rope_reference and transformers, same inputs     |
| bfloat16 | 2e-2   | -                        | transformers in bf16 and the fp32 reference      |
| float16  | 2e-2   | -                        | transformers in fp16 and the fp32 reference      |

Gradients behind a reduction (``REDUCED``: dhidden sums over heads x head_dim, the projection and Qwen3 norm
weight gradients over tokens and heads) keep rel 1e-5, but their fp32 per-element atol is 1e-6 x max|expected|:
an absolute 1e-6 is below the rounding of a sum of ~10^2 terms with cancellation.

The kernel computes in fp32 and rounds once; transformers rounds after each bf16 / fp16 op, hence the gap.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from fastft.kernels import use_triton

TOL = {
    torch.float32: {"rel": 1e-5, "rtol": 1e-5, "atol": 1e-6},
    torch.bfloat16: {"rel": 2e-2},
    torch.float16: {"rel": 2e-2},
}
REDUCED = {"dhidden", "dw_q", "dw_k", "dq_norm.weight", "dk_norm.weight"}
PACKED = [7, 31, 3]  # three documents in one row; positions restart at 0 for each
# CPU tensors under the interpreter; CUDA tensors on a GPU machine (where the interpreter is off).
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"
triton_path = pytest.mark.skipif(
    not use_triton(torch.empty(0, device=DEVICE)), reason="neither CUDA nor TRITON_INTERPRET=1"
)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = "") -> None:
    tol = dict(TOL[dtype])
    if what in REDUCED:
        tol["atol"] = tol.get("atol", 0.0) * max(1.0, expected.detach().abs().max().item())
    assert actual.shape == expected.shape, what
    a, e = actual.detach().double(), expected.detach().double()
    rel = ((a - e).norm() / e.norm().clamp_min(1e-30)).item()
    assert rel <= tol["rel"], f"{what}: relative error {rel:.2e} > {tol['rel']:.0e}"
    if "rtol" in tol:
        torch.testing.assert_close(a, e, rtol=tol["rtol"], atol=tol["atol"], msg=lambda m: f"{what}: {m}")


def _position_ids(layout: str) -> torch.Tensor:
    if layout == "packed":  # batch 1 x T tokens, per-document positions
        return torch.cat([torch.arange(n) for n in PACKED])[None].to(DEVICE)
    rows = [torch.arange(13), torch.cat([torch.arange(5), torch.arange(8)])]  # batch 2, seq 13
    return torch.stack(rows).to(DEVICE)


def _rotary(kind: str, head_dim: int, n_heads: int = 4, n_kv: int = 2):
    common = dict(
        hidden_size=64,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        vocab_size=32,
        num_hidden_layers=1,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    if kind == "llama":
        return LlamaRotaryEmbedding(LlamaConfig(**common))
    config = Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    return Qwen3RotaryEmbedding(config)


def _cos_sin(kind: str, head_dim: int, position_ids: torch.Tensor, dtype: torch.dtype):
    with torch.no_grad():
        x = torch.zeros(1, dtype=dtype, device=DEVICE)
        return _rotary(kind, head_dim).to(DEVICE)(x, position_ids.to(DEVICE))


def _projected_qk(
    batch: int, seq: int, head_dim: int, n_q: int, n_kv: int, dtype: torch.dtype, seed: int = 0
):
    """q / k the way attention makes them: ``proj(h).view(b, s, heads, d).transpose(1, 2)`` (strided views)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, 48, generator=g).to(DEVICE, dtype).requires_grad_()
    w_q = (torch.randn(n_q * head_dim, 48, generator=g) / 7).to(DEVICE, dtype).requires_grad_()
    w_k = (torch.randn(n_kv * head_dim, 48, generator=g) / 7).to(DEVICE, dtype).requires_grad_()
    q = (hidden @ w_q.T).view(batch, seq, n_q, head_dim).transpose(1, 2)
    k = (hidden @ w_k.T).view(batch, seq, n_kv, head_dim).transpose(1, 2)
    return hidden, w_q, w_k, q, k


def _grads(q_rot, k_rot, inputs, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    gq = torch.randn(q_rot.shape, generator=g).to(DEVICE, q_rot.dtype)
    gk = torch.randn(k_rot.shape, generator=g).to(DEVICE, k_rot.dtype)
    return torch.autograd.grad((q_rot * gq).sum() + (k_rot * gk).sum(), inputs, retain_graph=True)


def _gpu_inputs(dtype=torch.bfloat16, tokens=16384, n_q=32, n_kv=8, head_dim=128):
    torch.manual_seed(0)
    lengths = [3000, 5000, 1, 4096, tokens - 12097]  # packed documents, positions restart at 0
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    rotary = _rotary("llama", head_dim, n_q, n_kv).cuda()
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1, dtype=dtype, device="cuda"), position_ids)
    # q / k as attention makes them: [b, s, h, d] memory seen as [b, h, s, d]
    q = torch.randn(1, tokens, n_q, head_dim, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    k = torch.randn(1, tokens, n_kv, head_dim, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    return q, k, cos, sin

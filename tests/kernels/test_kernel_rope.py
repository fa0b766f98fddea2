"""fastft.kernels.rope: the Triton RoPE kernels against transformers' ``apply_rotary_pos_emb``.

Without a GPU the kernels run on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, set below
before anything imports triton, as conftest does); ``grad_fn`` proves the Triton path ran. The tolerances
and the helpers shared with test_kernel_qk_norm_rope are in rope_cases.py.
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
    PACKED,
    _close,
    _cos_sin,
    _gpu_inputs,
    _grads,
    _position_ids,
    _projected_qk,
    triton_path,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from fastft.kernels import rope  # noqa: E402
from fastft.kernels.rope import (  # noqa: E402
    apply_rope,
    rope_backward,
    rope_forward,
    rope_inplace_,
    rope_reference,
)

RoPE = "RoPEFunctionBackward"


# ------------------------------------------------------------------------------- against transformers


@triton_path
@pytest.mark.parametrize("layout", ["packed", "batch2"])
@pytest.mark.parametrize("head_dim", [32, 96])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_transformers_forward_and_gradients(kind, head_dim, layout, dtype):
    position_ids = _position_ids(layout)
    batch, seq = position_ids.shape
    cos, sin = _cos_sin(kind, head_dim, position_ids, dtype)
    hidden, w_q, w_k, q, k = _projected_qk(batch, seq, head_dim, 4, 2, dtype)
    q_before, k_before = q.detach().clone(), k.detach().clone()

    q_rot, k_rot = apply_rope(q, k, cos, sin)
    assert type(q_rot.grad_fn).__name__ == RoPE and type(k_rot.grad_fn).__name__ == RoPE
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # inputs untouched
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    assert q_rot.dtype == q_hf.dtype and k_rot.dtype == k_hf.dtype
    _close(q_rot, q_hf, dtype, "q")
    _close(k_rot, k_hf, dtype, "k")

    inputs = (q, k, hidden, w_q, w_k)
    ours = _grads(q_rot, k_rot, inputs)
    theirs = _grads(q_hf, k_hf, inputs)
    for name, a, e in zip(["dq", "dk", "dhidden", "dw_q", "dw_k"], ours, theirs, strict=True):
        assert a.dtype == e.dtype, name
        _close(a, e, dtype, name)

    if dtype != torch.float32:  # also against the fp32 truth on the same (rounded) inputs
        q32, k32 = q.detach().float().requires_grad_(), k.detach().float().requires_grad_()
        q_ref, k_ref = rope_reference(q32, k32, cos.float(), sin.float())
        _close(q_rot, q_ref, dtype, "q vs fp32")
        _close(k_rot, k_ref, dtype, "k vs fp32")
        for name, a, e in zip(["dq", "dk"], ours[:2], _grads(q_ref, k_ref, (q32, k32)), strict=True):
            _close(a, e, dtype, f"{name} vs fp32")


@triton_path
def test_fp16_matches_transformers():
    position_ids = _position_ids("packed")
    cos, sin = _cos_sin("llama", 96, position_ids, torch.float16)
    _, _, _, q, k = _projected_qk(1, position_ids.shape[1], 96, 4, 2, torch.float16)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    assert type(q_rot.grad_fn).__name__ == RoPE
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    _close(q_rot, q_hf, torch.float16, "q")
    _close(k_rot, k_hf, torch.float16, "k")
    for name, a, e in zip(
        ["dq", "dk"], _grads(q_rot, k_rot, (q, k)), _grads(q_hf, k_hf, (q, k)), strict=True
    ):
        _close(a, e, torch.float16, name)


def test_reference_is_transformers_bit_for_bit():
    position_ids = _position_ids("batch2")
    cos, sin = _cos_sin("llama", 32, position_ids, torch.float32)
    q, k = torch.randn(2, 4, 13, 32, device=DEVICE), torch.randn(2, 2, 13, 32, device=DEVICE)
    for a, e in zip(rope_reference(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        assert torch.equal(a, e)


# ----------------------------------------------------------------------- shapes, layouts, head dims


@triton_path
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_head_dims_odd_head_counts_and_contiguous_inputs(head_dim):
    position_ids = torch.stack([torch.arange(5), torch.tensor([0, 1, 2, 0, 1])])
    cos, sin = _cos_sin("llama", head_dim, position_ids, torch.float32)
    q = torch.randn(2, 3, 5, head_dim, requires_grad=True, device=DEVICE)  # 3 / 1 heads: masked head rows
    k = torch.randn(2, 1, 5, head_dim, requires_grad=True, device=DEVICE)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    assert type(q_rot.grad_fn).__name__ == RoPE
    q_ref, k_ref = rope_reference(q, k, cos, sin)
    _close(q_rot, q_ref, torch.float32, "q")
    _close(k_rot, k_ref, torch.float32, "k")
    for a, e in zip(_grads(q_rot, k_rot, (q, k)), _grads(q_ref, k_ref, (q, k)), strict=True):
        _close(a, e, torch.float32, "grad")


@triton_path
def test_cos_sin_of_batch_one_broadcast_over_the_batch_and_unsqueeze_dim_2():
    # transformers builds position_ids = cache_position.unsqueeze(0): cos / sin [1, seq, d] for a batch of 2.
    cos, sin = _cos_sin("qwen3", 32, torch.arange(6)[None], torch.float32)
    q = torch.randn(2, 4, 6, 32, requires_grad=True, device=DEVICE)
    k = torch.randn(2, 2, 6, 32, requires_grad=True, device=DEVICE)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    assert type(q_rot.grad_fn).__name__ == RoPE
    for a, e in zip((q_rot, k_rot), apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        _close(a, e, torch.float32, "broadcast cos")
    # [batch, seq, heads, head_dim] inputs, as apply_rotary_pos_emb(..., unsqueeze_dim=2) takes them.
    q_bshd, k_bshd = q.transpose(1, 2), k.transpose(1, 2)
    out = apply_rope(q_bshd, k_bshd, cos, sin, unsqueeze_dim=2)
    for a, e in zip(out, apply_rotary_pos_emb(q_bshd, k_bshd, cos, sin, unsqueeze_dim=2), strict=True):
        _close(a, e, torch.float32, "unsqueeze_dim=2")


# ------------------------------------------------------------------------------------- backward


@triton_path
def test_backward_is_the_inverse_rotation():
    cos, sin = _cos_sin("llama", 96, _position_ids("packed"), torch.float32)
    q, k = (
        torch.randn(1, 4, sum(PACKED), 96, device=DEVICE),
        torch.randn(1, 2, sum(PACKED), 96, device=DEVICE),
    )
    q_rot, k_rot = rope_forward(q, k, cos, sin)
    q_back, k_back = rope_backward(q_rot, k_rot, cos, sin)
    _close(q_back, q, torch.float32, "q round trip")
    _close(k_back, k, torch.float32, "k round trip")
    # ... and the backward is the forward with sin -> -sin (rotation by -theta).
    for a, e in zip(rope_backward(q, k, cos, sin), rope_forward(q, k, cos, -sin), strict=True):
        _close(a, e, torch.float32, "-theta")


@triton_path
def test_backward_is_the_exact_adjoint_for_arbitrary_cos_sin():
    # Halves that differ (not cat(freqs, freqs)): the kernel's backward is still autograd's transpose.
    cos, sin = torch.randn(2, 9, 32, device=DEVICE), torch.randn(2, 9, 32, device=DEVICE)
    q = torch.randn(2, 3, 9, 32, requires_grad=True, device=DEVICE)
    k = torch.randn(2, 2, 9, 32, requires_grad=True, device=DEVICE)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    q_ref, k_ref = rope_reference(q, k, cos, sin)
    _close(q_rot, q_ref, torch.float32, "q")
    for a, e in zip(_grads(q_rot, k_rot, (q, k)), _grads(q_ref, k_ref, (q, k)), strict=True):
        _close(a, e, torch.float32, "adjoint")


@triton_path
def test_shared_and_expanded_incoming_gradients_are_not_corrupted():
    # Autograd hands one tensor to several consumers: (q_rot + k_rot) gives dq_rot is dk_rot, and
    # (q_rot + x) shares dq_rot with x's gradient; .sum() gives a stride-0 gradient. None may be overwritten.
    cos, sin = _cos_sin("llama", 32, _position_ids("batch2"), torch.float32)
    _, _, _, q, k = _projected_qk(2, 13, 32, 2, 2, torch.float32)
    x = torch.randn(2, 2, 13, 32, requires_grad=True, device=DEVICE)

    def losses(fn):
        q_rot, k_rot = fn(q, k, cos, sin)
        shared = (q_rot + k_rot + x).square().sum()
        return torch.autograd.grad(shared + q_rot.sum(), (q, k, x))

    ours, theirs = losses(apply_rope), losses(apply_rotary_pos_emb)
    for name, a, e in zip(["dq", "dk", "dx"], ours, theirs, strict=True):
        _close(a, e, torch.float32, name)


@triton_path
def test_only_one_output_used():
    cos, sin = _cos_sin("llama", 32, _position_ids("batch2"), torch.float32)
    q = torch.randn(2, 4, 13, 32, requires_grad=True, device=DEVICE)
    k = torch.randn(2, 2, 13, 32, requires_grad=True, device=DEVICE)
    q_rot, _ = apply_rope(q, k, cos, sin)
    (q_rot * 2).sum().backward()
    q2 = q.detach().clone().requires_grad_()
    q_ref, _ = rope_reference(q2, k.detach(), cos, sin)
    (q_ref * 2).sum().backward()
    _close(q.grad, q2.grad, torch.float32, "dq")
    assert k.grad is None or not k.grad.any()


# --------------------------------------------------------------------------------- in place, dispatch


@triton_path
def test_rope_inplace_rotates_in_place_and_refuses_autograd_tensors():
    cos, sin = _cos_sin("llama", 96, _position_ids("packed"), torch.float32)
    q, k = (
        torch.randn(1, 4, sum(PACKED), 96, device=DEVICE),
        torch.randn(1, 2, sum(PACKED), 96, device=DEVICE),
    )
    q_ref, k_ref = rope_reference(q, k, cos, sin)
    q_ptr = q.data_ptr()
    q_out, k_out = rope_inplace_(q, k, cos, sin)
    assert q_out is q and k_out is k and q.data_ptr() == q_ptr
    _close(q, q_ref, torch.float32, "q in place")
    _close(k, k_ref, torch.float32, "k in place")
    with pytest.raises(RuntimeError):
        rope_inplace_(q.clone().requires_grad_(), k, cos, sin)


def test_falls_back_to_the_reference_without_triton(monkeypatch):
    monkeypatch.setattr(rope, "use_triton", lambda tensor: False)
    cos, sin = _cos_sin("llama", 32, _position_ids("batch2"), torch.float32)
    q = torch.randn(2, 4, 13, 32, requires_grad=True, device=DEVICE)
    k = torch.randn(2, 2, 13, 32, requires_grad=True, device=DEVICE)
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    assert type(q_rot.grad_fn).__name__ != RoPE
    for a, e in zip((q_rot, k_rot), apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        assert torch.equal(a, e)


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_16k_tokens_gqa_bf16_against_fp32_reference():
    q, k, cos, sin = _gpu_inputs()
    q_rot, k_rot = apply_rope(q, k, cos, sin)
    assert type(q_rot.grad_fn).__name__ == RoPE
    q32 = q.detach().float().requires_grad_()
    k32 = k.detach().float().requires_grad_()
    q_ref, k_ref = rope_reference(q32, k32, cos.float(), sin.float())
    _close(q_rot, q_ref, torch.bfloat16, "q")
    _close(k_rot, k_ref, torch.bfloat16, "k")
    gq, gk = torch.randn_like(q_rot), torch.randn_like(k_rot)
    dq, dk = torch.autograd.grad((q_rot * gq).sum() + (k_rot * gk).sum(), (q, k))
    dq_ref, dk_ref = torch.autograd.grad((q_ref * gq.float()).sum() + (k_ref * gk.float()).sum(), (q32, k32))
    _close(dq, dq_ref, torch.bfloat16, "dq")
    _close(dk, dk_ref, torch.bfloat16, "dk")
    # fp32 on the GPU: the tight tolerance
    q32_rot, k32_rot = apply_rope(q32, k32, cos.float(), sin.float())
    _close(q32_rot, q_ref, torch.float32, "q fp32")
    _close(k32_rot, k_ref, torch.float32, "k fp32")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bandwidth_report():
    import triton.testing

    q, k, cos, sin = _gpu_inputs()
    q, k = q.detach(), k.detach()
    moved = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size()
    results = {
        "triton fwd": triton.testing.do_bench(lambda: rope_forward(q, k, cos, sin)),
        "triton bwd": triton.testing.do_bench(lambda: rope_backward(q, k, cos, sin)),
        "triton in-place": triton.testing.do_bench(lambda: rope_inplace_(q, k, cos, sin)),
        "torch fwd": triton.testing.do_bench(lambda: apply_rotary_pos_emb(q, k, cos, sin)),
    }
    for name, ms in results.items():
        print(f"rope {name:16s} {ms * 1e3:8.1f} us  {moved / ms / 1e6:7.0f} GB/s (kernel bytes)")
    assert all(ms > 0 for ms in results.values())

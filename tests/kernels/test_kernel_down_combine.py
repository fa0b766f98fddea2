"""fastft.kernels.down_combine: the MoE down projection + top-k combine node against its plain-PyTorch
composition, in the output and every gradient (``h``, the down weight, the bias, both LoRA factors and the
routing weights), and its ``skip`` for activation-checkpointing re-runs. On the CPU the kernels run through
the Triton interpreter; the `gpu` test adds Qwen3-30B-A3B shapes. Tolerances as in test_kernel_grouped_gemm:
rel 1e-5 for fp32 inputs, 2e-2 for bf16, against the reference on fp32 copies.
"""

from __future__ import annotations

import os
import shutil

# The interpreter must be on before any @triton.jit function is defined (conftest does the same).
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from grouped_gemm_cases import DEVICE, QWEN3_MOE, TOLERANCE, _rel, _routing  # noqa: E402

from fastft.kernels.down_combine import DownCombineFunction, down_combine, down_combine_reference  # noqa: E402


def _down_operands(dtype, tokens=29, top_k=3, experts=6, hidden=40, inter=24, rank=4, bias=True, seed=21):
    """``h`` in expert order, the down weight, routing weights, and optionally biases and a LoRA pair;
    experts 1 and 4 get no token. Also each sorted row's expert, as the routing plan carries it."""
    generator = torch.Generator().manual_seed(seed)
    slots, group_end = _routing(tokens, top_k, experts, generator, empty=(1, 4))
    m = tokens * top_k
    h = torch.randn(m, inter, generator=generator)
    weight = torch.randn(experts, hidden, inter, generator=generator) / inter**0.5
    route = torch.softmax(torch.randn(tokens, top_k, generator=generator), -1)
    b = torch.randn(experts, hidden, generator=generator) * 0.1 if bias else None
    lora = None
    if rank:
        lora = (
            torch.randn(experts, rank, inter, generator=generator) / inter**0.5,
            torch.randn(experts, hidden, rank, generator=generator) * 0.1,
            0.7,
        )
    counts = torch.diff(group_end.long().cpu(), prepend=torch.zeros(1, dtype=torch.long))
    sorted_experts = torch.repeat_interleave(torch.arange(experts), counts).to(DEVICE)
    return slots, group_end, sorted_experts, h, weight, route, b, lora


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias, rank", [(False, 0), (True, 0), (False, 4), (True, 3)])
def test_down_combine_matches_the_reference_in_every_gradient(dtype, bias, rank):
    """Output and the gradients of ``h``, the weight, the bias, both LoRA factors and the routing weights,
    the last computed from ``h`` and the unweighted ``dh`` (no ``y`` saved), against autograd through the
    reference on fp32 copies."""
    slots, group_end, sorted_experts, h, weight, route, b, lora = _down_operands(dtype, bias=bias, rank=rank)
    tensors = [h, weight, route] + ([b] if bias else []) + (list(lora[:2]) if rank else [])

    def run(leaves, fn):
        h_, w_, r_ = leaves[:3]
        b_ = leaves[3] if bias else None
        lora_ = (leaves[-2], leaves[-1], lora[2]) if rank else None
        return fn(h_, w_, group_end, slots, r_, b_, lora_, sorted_experts=sorted_experts)

    leaves = [t.to(DEVICE, dtype).requires_grad_() for t in tensors]
    out = run(leaves, down_combine)
    assert out.grad_fn.name() == DownCombineFunction.__name__ + "Backward" and out.dtype == dtype
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    grads = torch.autograd.grad(out, leaves, upstream.to(dtype))
    leaves32 = [t.to(DEVICE).float().requires_grad_() for t in tensors]
    want = run(leaves32, down_combine_reference)
    expected = torch.autograd.grad(want, leaves32, upstream)
    tol = TOLERANCE[dtype]
    assert _rel(out, want) <= tol
    names = ["dh", "dweight", "droute"] + (["dbias"] if bias else []) + (["dA", "dB"] if rank else [])
    for name, got, ref, leaf in zip(names, grads, expected, leaves, strict=True):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape, name
        assert _rel(got, ref) <= tol, f"{name} rel {_rel(got, ref):.2e}"


def test_down_combine_skips_its_gemms_only_when_told_its_output_is_discarded(monkeypatch):
    """``skip`` (an activation-checkpointing re-run whose output nobody reads) launches only the LoRA
    down-projection's first GEMM, whose result the backward needs; the gradients are the same as a full
    forward's, bit for bit."""
    from fastft.kernels import down_combine as down_combine_module

    slots, group_end, sorted_experts, h, weight, route, b, lora = _down_operands(torch.float32, rank=4)
    h, weight, route = h.to(DEVICE), weight.to(DEVICE), route.to(DEVICE)
    b = b.to(DEVICE)
    lora = (lora[0].to(DEVICE).requires_grad_(), lora[1].to(DEVICE).requires_grad_(), lora[2])
    launches = []
    original = down_combine_module.grouped_mm_launch
    monkeypatch.setattr(
        down_combine_module, "grouped_mm_launch", lambda *a, **k: launches.append(1) or original(*a, **k)
    )
    grads = {}
    for skip in (False, True):
        launches.clear()
        h_, r_ = h.clone().requires_grad_(), route.clone().requires_grad_()
        out = down_combine(
            h_, weight, group_end, slots, r_, b, lora, sorted_experts=sorted_experts, skip=skip
        )
        assert len(launches) == (1 if skip else 3)  # h A^T; then h W^T and low B^T unless skipped
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(DEVICE)
        grads[skip] = torch.autograd.grad(out, [h_, r_, lora[0], lora[1]], upstream)
    for full, skipped in zip(grads[False], grads[True], strict=True):
        assert torch.equal(full, skipped)


def test_bad_inputs_name_the_fix():
    a = torch.randn(6, 24, device=DEVICE)
    slots, ends = torch.arange(6, device=DEVICE), torch.tensor([2, 6], device=DEVICE)
    with pytest.raises(ValueError, match="sorted_experts"):
        down_combine(a, torch.randn(2, 8, 24, device=DEVICE), ends, slots, torch.ones(6, 1, device=DEVICE),
                     bias=torch.zeros(2, 8, device=DEVICE))  # fmt: skip


# ------------------------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
def test_gpu_down_combine_at_qwen3_moe_shapes():
    """The down projection + combine node at Qwen3-30B-A3B's shapes, LoRA r = 16, bf16 against fp32."""
    cfg = QWEN3_MOE
    generator = torch.Generator().manual_seed(9)
    slots, group_end = _routing(cfg["tokens"], cfg["top_k"], cfg["experts"], generator)
    m = cfg["tokens"] * cfg["top_k"]
    tensors = [
        torch.randn(m, cfg["intermediate"], generator=generator),
        torch.randn(cfg["experts"], cfg["hidden"], cfg["intermediate"], generator=generator) / 28,
        torch.softmax(torch.randn(cfg["tokens"], cfg["top_k"], generator=generator), -1),
        torch.randn(cfg["experts"], 16, cfg["intermediate"], generator=generator) / 28,
        torch.randn(cfg["experts"], cfg["hidden"], 16, generator=generator) * 0.05,
    ]
    upstream = torch.randn(cfg["tokens"], cfg["hidden"], generator=generator).to(DEVICE)
    results = []
    for dtype, fn in ((torch.bfloat16, down_combine), (torch.float32, down_combine_reference)):
        leaves = [t.to(DEVICE, dtype).requires_grad_() for t in tensors]
        h, w, route, a, b = leaves
        out = fn(h, w, group_end, slots, route, None, (a, b, 2.0))
        results.append((out, torch.autograd.grad(out, [h, route, a, b], upstream.to(dtype))))
    (out, grads), (want, expected) = results
    assert _rel(out, want) <= 2e-2
    for name, got, ref in zip(("dh", "droute", "dA", "dB"), grads, expected, strict=True):
        assert _rel(got, ref) <= 2e-2, name

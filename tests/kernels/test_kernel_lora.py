"""fastft.kernels.lora: LoRA-fused projections (QKV-style shared input, and the whole gated MLP) against PEFT's
formula in plain PyTorch, forward and every gradient, with 16-bit and NF4 bases.

Tolerances (``rel`` = ``||a - b|| / ||b||`` over a whole tensor):

    | inputs                         | compared with                         | rel   |
    | ------------------------------ | ------------------------------------- | ----- |
    | fp32                           | reference, fp32                       | 1e-5  |
    | bf16 / fp16 (adapters fp32)    | reference on fp32 copies              | 2e-2  |
    | NF4 base, bf16                 | reference with the dequantised weight | 2e-2  |

On the CPU the gated activation inside the MLP runs through the Triton interpreter (conftest sets it).
"""

from __future__ import annotations

import pytest
import torch

from fastft.kernels.lora import (
    FrozenLinear,
    LoraMLPFunction,
    LoraTiledMLPFunction,
    lora_linear_reference,
    lora_linears,
    lora_mlp,
    lora_mlp_reference,
)
from fastft.kernels.nf4 import dequantize_quant_state, quantize_nf4_reference
from fastft.kernels.tiling import TILE_BYTES, mlp_tile_bytes, mlp_tile_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _projection(out_f, in_f, rank, dtype, generator, bias=False, adapter_dtype=None, device=DEVICE):
    weight = (torch.randn(out_f, in_f, generator=generator) / in_f**0.5).to(device, dtype)
    b = (torch.randn(out_f, generator=generator) * 0.1).to(device, dtype) if bias else None
    if rank == 0:
        return FrozenLinear(weight, b), None, None
    adapter_dtype = adapter_dtype or dtype
    a = (torch.randn(rank, in_f, generator=generator) / in_f**0.5).to(device, adapter_dtype).requires_grad_()
    bb = (torch.randn(out_f, rank, generator=generator) * 0.2).to(device, adapter_dtype).requires_grad_()
    return FrozenLinear(weight, b), a, bb


def _fp32(projection):
    base, a, b = projection
    base32 = FrozenLinear(base.dense(torch.float32), None if base.bias is None else base.bias.float())
    if a is None:
        return base32, None, None
    return base32, a.detach().float().requires_grad_(), b.detach().float().requires_grad_()


def _leaves(x, projections):
    return [x] + [t for _, a, b in projections for t in (a, b) if t is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_shared_input_projections_match_peft_formula(dtype, tokens):
    generator = torch.Generator().manual_seed(tokens)
    hidden = 40
    adapter_dtype = torch.float32  # PEFT keeps adapters in fp32 beside 16-bit bases
    projections = [
        _projection(48, hidden, 4, dtype, generator, bias=True, adapter_dtype=adapter_dtype),  # q
        _projection(16, hidden, 0, dtype, generator),  # k without LoRA
        _projection(16, hidden, 8, dtype, generator, adapter_dtype=adapter_dtype),  # v, another rank
    ]
    scales = (2.0, 1.0, 0.5)
    x = torch.randn(2, tokens, hidden, generator=generator).to(DEVICE, dtype).requires_grad_()
    outputs = lora_linears(x, [p[0] for p in projections], scales, [(p[1], p[2]) for p in projections])
    weights = [torch.randn(o.shape, generator=generator).to(DEVICE) for o in outputs]
    loss = sum((o.float() * w).sum() for o, w in zip(outputs, weights, strict=True))
    grads = torch.autograd.grad(loss, _leaves(x, projections))

    reference = [_fp32(p) for p in projections]
    x32 = x.detach().float().requires_grad_()
    expected_out = [lora_linear_reference(x32, *p, scale=s) for p, s in zip(reference, scales, strict=True)]
    expected_loss = sum((o * w).sum() for o, w in zip(expected_out, weights, strict=True))
    expected = torch.autograd.grad(expected_loss, _leaves(x32, reference))

    for got, want in zip(outputs, expected_out, strict=True):
        assert got.dtype == dtype
        assert _rel(got, want) <= TOLERANCE[dtype]
    for got, want, leaf in zip(grads, expected, _leaves(x, projections), strict=True):
        assert got.dtype == leaf.dtype
        assert _rel(got, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["swiglu", "geglu", "geglu_tanh"])
@pytest.mark.parametrize("ranks", [(4, 4, 4), (0, 8, 4), (4, 0, 0)])
def test_fused_mlp_matches_peft_formula(dtype, kind, ranks):
    generator = torch.Generator().manual_seed(sum(ranks))
    hidden, intermediate = 24, 70
    projections = [
        _projection(intermediate, hidden, ranks[0], dtype, generator, adapter_dtype=torch.float32),
        _projection(intermediate, hidden, ranks[1], dtype, generator, adapter_dtype=torch.float32),
        _projection(hidden, intermediate, ranks[2], dtype, generator, adapter_dtype=torch.float32),
    ]
    scales = (2.0, 0.5, 1.5)
    x = torch.randn(1, 9, hidden, generator=generator).to(DEVICE, dtype).requires_grad_()
    y = lora_mlp(x, *[p[0] for p in projections], scales, kind, [(p[1], p[2]) for p in projections])
    weight = torch.randn(y.shape, generator=generator).to(DEVICE)
    grads = torch.autograd.grad((y.float() * weight).sum(), _leaves(x, projections))

    reference = [_fp32(p) for p in projections]
    x32 = x.detach().float().requires_grad_()
    flat = [t for p in reference for t in p[1:]]
    expected_y = lora_mlp_reference(x32, *[p[0] for p in reference], scales, kind, *flat)
    expected = torch.autograd.grad((expected_y * weight).sum(), _leaves(x32, reference))

    assert y.dtype == dtype
    assert _rel(y, expected_y) <= TOLERANCE[dtype]
    for got, want in zip(grads, expected, strict=True):
        assert _rel(got, want) <= TOLERANCE[dtype]


def test_fused_mlp_saves_two_intermediate_tensors_not_four():
    """Saved for backward: x, gate, up and the [N, r] LoRA intermediates -- never act(gate) or h."""
    generator = torch.Generator().manual_seed(0)
    hidden, intermediate, tokens = 16, 64, 11
    projections = [
        _projection(intermediate, hidden, 2, torch.float32, generator),
        _projection(intermediate, hidden, 2, torch.float32, generator),
        _projection(hidden, intermediate, 2, torch.float32, generator),
    ]
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE).requires_grad_()
    y = lora_mlp(
        x, *[p[0] for p in projections], (1.0, 1.0, 1.0), "swiglu", [(p[1], p[2]) for p in projections]
    )
    assert y.grad_fn.__class__.__name__ == LoraMLPFunction.__name__ + "Backward"
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    big = [t for t in saved if t.numel() >= tokens * intermediate]
    assert len(big) == 2  # gate and up


@pytest.mark.parametrize("nested", [True, False])
def test_nf4_base_is_dequantised_on_use(nested):
    generator = torch.Generator().manual_seed(1)
    hidden, out_f = 64, 96
    dense = torch.randn(out_f, hidden, generator=generator).to(DEVICE, torch.bfloat16) / 8
    packed, state = quantize_nf4_reference(dense, blocksize=64, compress_statistics=nested)
    base = FrozenLinear(packed, None, state)
    assert base.out_features == out_f
    dequantised = dequantize_quant_state(packed, state, dtype=torch.bfloat16)
    a = (torch.randn(4, hidden, generator=generator) / 8).to(DEVICE).requires_grad_()
    b = torch.randn(out_f, 4, generator=generator).to(DEVICE).requires_grad_()
    x = torch.randn(5, hidden, generator=generator).to(DEVICE, torch.bfloat16).requires_grad_()
    (y,) = lora_linears(x, [base], [2.0], [(a, b)])
    grads = torch.autograd.grad(y.float().sum(), [x, a, b])
    x32 = x.detach().float().requires_grad_()
    a32, b32 = a.detach().requires_grad_(), b.detach().requires_grad_()
    want = lora_linear_reference(x32, FrozenLinear(dequantised.float()), a32, b32, 2.0)
    expected = torch.autograd.grad(want.sum(), [x32, a32, b32])
    assert _rel(y, want) <= 2e-2
    for got, ref in zip(grads, expected, strict=True):
        assert _rel(got, ref) <= 2e-2


def test_autocast_dtype_is_the_compute_dtype():
    generator = torch.Generator().manual_seed(2)
    projection = _projection(32, 16, 4, torch.float32, generator)
    x = torch.randn(3, 16, generator=generator).to(DEVICE).requires_grad_()
    device_type = "cuda" if DEVICE == "cuda" else "cpu"
    with torch.autocast(device_type, dtype=torch.bfloat16):
        (y,) = lora_linears(x, [projection[0]], [1.0], [(projection[1], projection[2])])
    assert y.dtype == torch.bfloat16
    (dx,) = torch.autograd.grad(y.float().sum(), [x])
    assert dx.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("hidden,intermediate", [(4096, 14336), (1000, 2752)])
def test_gpu_fused_mlp_bf16_large(hidden, intermediate):
    generator = torch.Generator().manual_seed(3)
    projections = [
        _projection(intermediate, hidden, 16, torch.bfloat16, generator, adapter_dtype=torch.float32),
        _projection(intermediate, hidden, 16, torch.bfloat16, generator, adapter_dtype=torch.float32),
        _projection(hidden, intermediate, 16, torch.bfloat16, generator, adapter_dtype=torch.float32),
    ]
    x = torch.randn(1, 1024, hidden, generator=generator).to("cuda", torch.bfloat16).requires_grad_()
    y = lora_mlp(
        x, *[p[0] for p in projections], (2.0, 2.0, 2.0), "swiglu", [(p[1], p[2]) for p in projections]
    )
    weight = torch.randn(y.shape, generator=generator).cuda()
    grads = torch.autograd.grad((y.float() * weight).sum(), _leaves(x, projections))
    reference = [_fp32(p) for p in projections]
    x32 = x.detach().float().requires_grad_()
    flat = [t for p in reference for t in p[1:]]
    want = lora_mlp_reference(x32, *[p[0] for p in reference], (2.0, 2.0, 2.0), "swiglu", *flat)
    expected = torch.autograd.grad((want * weight).sum(), _leaves(x32, reference))
    assert _rel(y, want) <= 2e-2
    for got, ref in zip(grads, expected, strict=True):
        assert _rel(got, ref) <= 2e-2


@pytest.mark.parametrize("discarded", [True, False])
def test_checkpointed_mlp_skips_the_down_projection_only_when_its_output_is_discarded(monkeypatch, discarded):
    """Under activation checkpointing an MLP whose output only enters a residual add computes gate and up
    only when re-run; one whose output a later op saves (Qwen2-MoE's gated shared expert: ``sigmoid(g) *
    mlp(x)``) computes its down projection again, or that product's backward would read uninitialised
    memory. Gradients equal the un-checkpointed ones exactly either way."""
    import torch.utils.checkpoint as checkpoint

    from fastft.kernels import lora

    generator = torch.Generator().manual_seed(4)
    projections = [
        _projection(48, 16, 4, torch.float32, generator),
        _projection(48, 16, 4, torch.float32, generator),
        _projection(16, 48, 4, torch.float32, generator),
    ]
    adapters = [(p[1], p[2]) for p in projections]
    down = projections[2][0]
    calls = []
    original = lora._project
    monkeypatch.setattr(
        lora, "_project", lambda x2, base, *rest: calls.append(base is down) or original(x2, base, *rest)
    )

    outputs = []
    discard = lora._discarded_output
    monkeypatch.setattr(lora, "_discarded_output", lambda *a: outputs.append(discard(*a)) or outputs[-1])

    def mlp(x):
        y = lora_mlp(x, *[p[0] for p in projections], (1.0, 2.0, 0.5), "swiglu", adapters, discarded)
        return y + x if discarded else y * torch.sigmoid(x[:, :1]) + x

    x = torch.randn(7, 16, generator=generator).to(DEVICE).requires_grad_()
    leaves = _leaves(x, projections)
    plain = torch.autograd.grad(mlp(x).square().sum(), leaves)
    calls.clear()
    out = checkpoint.checkpoint(mlp, x, use_reentrant=False)
    assert calls == [False, False, True]  # forward: gate, up, down
    checkpointed = torch.autograd.grad(out.square().sum(), leaves)
    # recompute: gate and up only, or all three
    assert calls == [False, False, True, False, False] + ([] if discarded else [True])
    for a, b in zip(checkpointed, plain, strict=True):
        assert torch.equal(a, b)
    # a discarded recompute output has the output's shape and holds one element, not [rows, out]
    assert len(outputs) == int(discarded)
    for recomputed in outputs:
        assert recomputed.shape == (7, 16) and recomputed.untyped_storage().nbytes() == 4


# ------------------------------------------------------------------------------- the MLP in sequence tiles


def _mlp_case(dtype, ranks, seed, hidden=24, intermediate=70, tokens=37):
    generator = torch.Generator().manual_seed(seed)
    projections = [
        _projection(intermediate, hidden, ranks[0], dtype, generator, adapter_dtype=torch.float32),
        _projection(intermediate, hidden, ranks[1], dtype, generator, adapter_dtype=torch.float32),
        _projection(hidden, intermediate, ranks[2], dtype, generator, adapter_dtype=torch.float32),
    ]
    x = torch.randn(1, tokens, hidden, generator=generator).to(DEVICE, dtype).requires_grad_()
    weight = torch.randn(1, tokens, hidden, generator=generator).to(DEVICE)
    return projections, x, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["swiglu", "geglu_tanh"])
@pytest.mark.parametrize("ranks", [(4, 4, 4), (0, 8, 4), (4, 0, 0), (0, 0, 6), (0, 0, 0)])
def test_tiled_mlp_matches_the_untiled_mlp_and_the_reference(dtype, kind, ranks):
    """37 rows in tiles of 8 (the last one 5 rows): output and every gradient equal the untiled function's
    and PEFT's formula (fp32 1e-5, 16-bit 2e-2 against the fp32 reference)."""
    projections, x, weight = _mlp_case(dtype, ranks, seed=11 + sum(ranks))
    bases, adapters, scales = (
        [p[0] for p in projections],
        [(p[1], p[2]) for p in projections],
        (2.0, 0.5, 1.5),
    )
    leaves = _leaves(x, projections)
    tiled = lora_mlp(x, *bases, scales, kind, adapters, tile_rows=8)
    assert tiled.grad_fn.__class__.__name__ == LoraTiledMLPFunction.__name__ + "Backward"
    tiled_grads = torch.autograd.grad((tiled.float() * weight).sum(), leaves)
    untiled = lora_mlp(x, *bases, scales, kind, adapters)
    assert untiled.grad_fn.__class__.__name__ == LoraMLPFunction.__name__ + "Backward"
    untiled_grads = torch.autograd.grad((untiled.float() * weight).sum(), leaves)

    reference = [_fp32(p) for p in projections]
    x32 = x.detach().float().requires_grad_()
    flat = [t for p in reference for t in p[1:]]
    want = lora_mlp_reference(x32, *[p[0] for p in reference], scales, kind, *flat)
    expected = torch.autograd.grad((want * weight).sum(), _leaves(x32, reference))

    assert tiled.dtype == dtype and tiled.shape == untiled.shape
    assert _rel(tiled, want) <= TOLERANCE[dtype]
    assert _rel(tiled, untiled) <= TOLERANCE[dtype]
    for got, same, ref in zip(tiled_grads, untiled_grads, expected, strict=True):
        assert got.dtype == same.dtype
        assert _rel(got, ref) <= TOLERANCE[dtype]
        assert _rel(got, same) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks", [(4, 4, 4), (0, 0, 6), (4, 0, 0)])
def test_untiled_backward_makes_dh_in_row_slices_with_the_same_gradients(dtype, ranks, monkeypatch):
    """The untiled function's backward builds ``dh`` 64 rows at a time when a slice is capped (301 rows: five
    slices, the last 45 rows): every gradient equals one whole ``dh``'s and PEFT's formula, and no
    ``[N, I]`` tensor beyond the saved gate and up outputs is made."""
    from fastft.kernels import tiling

    generator = torch.Generator().manual_seed(7 + sum(ranks))
    hidden, intermediate, tokens = 67, 173, 301
    projections = [
        _projection(intermediate, hidden, ranks[0], dtype, generator, adapter_dtype=torch.float32),
        _projection(intermediate, hidden, ranks[1], dtype, generator, adapter_dtype=torch.float32),
        _projection(hidden, intermediate, ranks[2], dtype, generator, adapter_dtype=torch.float32),
    ]
    bases, adapters, scales = (
        [p[0] for p in projections],
        [(p[1], p[2]) for p in projections],
        (2.0, 0.5, 1.5),
    )
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE, dtype).requires_grad_()
    weight = torch.randn(tokens, hidden, generator=generator).to(DEVICE)
    leaves = _leaves(x, projections)

    import fastft.kernels.lora as lora_module

    slices = []
    activate_backward = lora_module._activate_backward

    def counting(dh, g, u, kind):
        slices.append(dh.shape)
        return activate_backward(dh, g, u, kind)

    monkeypatch.setattr(lora_module, "_activate_backward", counting)

    def gradients(slice_bytes):
        monkeypatch.setattr(tiling, "DH_SLICE_BYTES", slice_bytes)
        slices.clear()
        y = lora_mlp(x, *bases, scales, "swiglu", adapters)
        assert y.grad_fn.__class__.__name__ == LoraMLPFunction.__name__ + "Backward"
        return torch.autograd.grad((y.float() * weight).sum(), leaves)

    assert tiling.dh_slice_rows(tokens, intermediate, x.element_size()) == tokens
    whole = gradients(tiling.DH_SLICE_BYTES)
    assert slices == [(tokens, intermediate)]
    sliced = gradients(1)
    assert slices == [(64, intermediate)] * 4 + [(45, intermediate)]

    reference = [_fp32(p) for p in projections]
    x32 = x.detach().float().requires_grad_()
    flat = [t for p in reference for t in p[1:]]
    want = lora_mlp_reference(x32, *[p[0] for p in reference], scales, "swiglu", *flat)
    expected = torch.autograd.grad((want * weight).sum(), _leaves(x32, reference))
    for got, same, ref in zip(sliced, whole, expected, strict=True):
        assert got.dtype == same.dtype
        assert _rel(got, ref) <= TOLERANCE[dtype]
        assert _rel(got, same) <= (1e-6 if dtype == torch.float32 else TOLERANCE[dtype])


def test_dh_slices_are_balanced_multiples_of_64_rows():
    from fastft.kernels.tiling import DH_SLICE_BYTES, dh_slice_rows

    assert DH_SLICE_BYTES == 32 << 20
    assert dh_slice_rows(4096, 14336, 2) == 1024  # Llama-3.1-8B: four slices of 28 MiB
    assert dh_slice_rows(1000, 14336, 2) == 1000  # one slice holds them
    for rows in (1171, 4097, 9362):
        step = dh_slice_rows(rows, 14336, 2)
        assert step % 64 == 0 and step * 14336 * 2 <= DH_SLICE_BYTES + 64 * 14336 * 2
        assert -(-rows // step) == -(-rows // (DH_SLICE_BYTES // (14336 * 2)))


def test_tiled_mlp_saves_only_its_input():
    """No [N, I] tensor is saved (the untiled function saves gate and up): only the input and adapters."""
    projections, x, _ = _mlp_case(torch.float32, (2, 2, 2), seed=5, hidden=16, intermediate=64, tokens=33)
    y = lora_mlp(
        x,
        *[p[0] for p in projections],
        (1.0,) * 3,
        "swiglu",
        [(p[1], p[2]) for p in projections],
        tile_rows=16,
    )
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert max(t.numel() for t in saved) == x.numel()
    assert sum(t.numel() >= x.numel() for t in saved) == 1


def test_checkpointed_tiled_mlp_computes_nothing_when_re_run(monkeypatch):
    """Under activation checkpointing (output discarded) the re-run forward returns at once: gate and up
    run once per tile in the backward, as the untiled recompute runs them once. Gradients equal the plain
    tiled ones exactly."""
    import torch.utils.checkpoint as checkpoint

    from fastft.kernels import lora

    projections, x, weight = _mlp_case(
        torch.float32, (4, 4, 4), seed=6, hidden=16, intermediate=48, tokens=21
    )
    bases, adapters = [p[0] for p in projections], [(p[1], p[2]) for p in projections]
    calls = []
    original = lora._project
    monkeypatch.setattr(
        lora,
        "_project",
        lambda x2, base, *rest, **kw: calls.append(bases.index(base)) or original(x2, base, *rest, **kw),
    )

    outputs = []
    discard = lora._discarded_output
    monkeypatch.setattr(lora, "_discarded_output", lambda *a: outputs.append(discard(*a)) or outputs[-1])

    def mlp(x):
        return lora_mlp(x, *bases, (1.0, 2.0, 0.5), "swiglu", adapters, True, tile_rows=8) + x

    leaves = _leaves(x, projections)
    plain = torch.autograd.grad((mlp(x) * weight).sum(), leaves)
    calls.clear()
    out = checkpoint.checkpoint(mlp, x, use_reentrant=False)
    assert calls == [0, 1, 2] * 3  # forward: three tiles of gate, up, down
    calls.clear()
    checkpointed = torch.autograd.grad((out * weight).sum(), leaves)
    assert calls == [0, 1] * 3  # the re-run computes nothing; backward: gate and up per tile
    for a, b in zip(checkpointed, plain, strict=True):
        assert torch.equal(a, b)
    (recomputed,) = outputs  # the re-run's output: its shape over one fp32 element
    assert recomputed.shape == (21, 16) and recomputed.untyped_storage().nbytes() == 4


def test_tiled_mlp_on_an_nf4_base():
    generator = torch.Generator().manual_seed(7)
    hidden, intermediate, tokens = 64, 128, 45
    bases, dense = [], []
    for out_f, in_f in ((intermediate, hidden), (intermediate, hidden), (hidden, intermediate)):
        w = (torch.randn(out_f, in_f, generator=generator) / in_f**0.5).to(DEVICE, torch.bfloat16)
        packed, state = quantize_nf4_reference(w, blocksize=64, compress_statistics=True)
        bases.append(FrozenLinear(packed, None, state))
        dense.append(FrozenLinear(dequantize_quant_state(packed, state, dtype=torch.bfloat16).float()))
    adapters = []
    for base in bases:
        in_f = base.quant_state.shape[1]
        a = (torch.randn(4, in_f, generator=generator) / in_f**0.5).to(DEVICE).requires_grad_()
        b = (torch.randn(base.out_features, 4, generator=generator) * 0.2).to(DEVICE).requires_grad_()
        adapters.append((a, b))
    x = torch.randn(tokens, hidden, generator=generator).to(DEVICE, torch.bfloat16).requires_grad_()
    leaves = [x] + [t for pair in adapters for t in pair]
    y = lora_mlp(x, *bases, (2.0, 2.0, 2.0), "swiglu", adapters, tile_rows=16)
    grads = torch.autograd.grad(y.float().sum(), leaves)
    x32 = x.detach().float().requires_grad_()
    flat = [t.detach().requires_grad_() for pair in adapters for t in pair]
    want = lora_mlp_reference(x32, *dense, (2.0, 2.0, 2.0), "swiglu", *flat)
    expected = torch.autograd.grad(want.sum(), [x32, *flat])
    assert _rel(y, want) <= 2e-2
    for got, ref in zip(grads, expected, strict=True):
        assert _rel(got, ref) <= 2e-2


def test_tile_rule_leaves_short_sequences_untiled():
    """Llama-3.1-8B's MLP (I = 14,336, bf16): 2 x 2,048, 4,096 and 8,192 tokens run untiled (the code path of
    the recorded short-sequence and packed-chat benchmarks); from 9,363 tokens on (256 MiB per [rows, I]
    tensor) they tile in balanced tiles of at most 256 MiB per tensor."""
    assert mlp_tile_rows(4096, 14336, 2) is None
    assert mlp_tile_rows(8192, 14336, 2) is None
    assert mlp_tile_rows(9362, 14336, 2) is None and mlp_tile_rows(9363, 14336, 2) is not None
    assert mlp_tile_bytes(8192, 14336, 2) == 0
    assert mlp_tile_rows(16384, 14336, 2) == 8192  # two tiles
    for rows in (9_363, 16_384, 37_450, 88_064, 163_840, 524_288):
        tile = mlp_tile_rows(rows, 14336, 2)
        assert tile % 64 == 0 and tile * 14336 * 2 <= TILE_BYTES + 64 * 14336 * 2
        tiles = -(-rows // tile)
        assert rows - (tiles - 1) * tile > 0  # no empty tile
        assert mlp_tile_bytes(rows, 14336, 2) == 3 * tile * 14336 * 2


@pytest.mark.gpu
def test_gpu_tiled_mlp_bf16_long_rows_peak_memory():
    """40,960 rows of Llama-3.1-8B's MLP in bf16: the tiled function (chosen by the rule) matches the untiled
    one to 2e-2, and its backward allocates less than the untiled one by the two [N, I] tensors that one
    saves, less its own three [tile, I]."""
    generator = torch.Generator().manual_seed(8)
    hidden, intermediate, tokens = 4096, 14336, 40960
    projections = [
        _projection(intermediate, hidden, 16, torch.bfloat16, generator, adapter_dtype=torch.float32),
        _projection(intermediate, hidden, 16, torch.bfloat16, generator, adapter_dtype=torch.float32),
        _projection(hidden, intermediate, 16, torch.bfloat16, generator, adapter_dtype=torch.float32),
    ]
    bases, adapters = [p[0] for p in projections], [(p[1], p[2]) for p in projections]
    x = (torch.randn(tokens, hidden, device="cuda") * 0.5).to(torch.bfloat16).requires_grad_()
    leaves = _leaves(x, projections)
    peaks, results = [], []
    for tile in (None, tokens):  # the rule's choice (tiled), then one tile (untiled)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        y = lora_mlp(x, *bases, (2.0,) * 3, "swiglu", adapters, tile_rows=tile)
        grads = torch.autograd.grad(y.float().sum(), leaves)
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        results.append((y.detach(), grads))
        del y, grads
    (y_tiled, g_tiled), (y_plain, g_plain) = results
    assert _rel(y_tiled, y_plain) <= 2e-2
    for a, b in zip(g_tiled, g_plain, strict=True):
        assert _rel(a, b) <= 2e-2
    # the untiled backward holds g and u ([N, I] each) and a 32 MiB slice of dh; the tiled one three
    # [tile, I] tensors at most (H100, 2026-12-06: 1.95 GB tiled against 3.87 GB untiled)
    rows = mlp_tile_rows(tokens, intermediate, 2)
    saved = 2 * tokens * intermediate * 2 - 3 * rows * intermediate * 2
    assert peaks[0] <= peaks[1] - saved

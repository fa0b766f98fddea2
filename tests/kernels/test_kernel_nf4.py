"""fastft.kernels.nf4: Triton NF4 dequantisation against the PyTorch reference and bitsandbytes, bit for bit.

Without a GPU the kernel runs on the CPU through the Triton interpreter (``TRITON_INTERPRET=1``); every CPU
test that expects the kernel asserts it was launched.

Tolerances:

    | compared                                            | tolerance                                   |
    | --------------------------------------------------- | ------------------------------------------- |
    | Triton vs ``dequantize_nf4_reference``, any dtype    | bit for bit                                 |
    | Triton vs bitsandbytes ``dequantize_4bit`` (CPU, GPU) | bit for bit                                 |
    | reference quantiser vs bnb ``quantize_4bit``: packed codes, fp32 absmax, offset, nested scale | bit for bit |
    | ... nested uint8 absmax codes vs bnb's **CPU** kernel | <= 1 + 2% of blocks differ, ours always the nearer code (bnb's CPU C kernel does not always pick the nearest; its CUDA and plain-PyTorch backends and ours do) |
    | quantise -> dequantise (fp32) vs the input          | ``|w - y| <= 0.139 * absmax`` per value (half NF4's widest gap), plus the nested absmax's own error |
"""

from __future__ import annotations

import math
import os
import types
from fractions import Fraction

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fastft.kernels import nf4  # noqa: E402
from fastft.kernels.nf4 import (  # noqa: E402
    NF4_CODE,
    NF4QuantState,
    dequantize_nf4,
    dequantize_nf4_reference,
    dequantize_quant_state,
    dequantize_weight,
    quantize_nf4_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (64, 3): odd last dim; (1000, 24): 24000 values, a partial last tile; (7, 9): 63 values, an odd count and a
# short last block; (256, 64): 16384 values, whole tiles (the unmasked path); (4097,): 1-D, a 1-value block.
SHAPES = [(64, 3), (1000, 24), (7, 9), (256, 64), (4097,)]
# Half the widest gap between neighbouring NF4 values (0.7229568 -> 1.0): the most rounding can move a value.
NF4_HALF_GAP = max(b - a for a, b in zip(NF4_CODE, NF4_CODE[1:], strict=False)) / 2


@pytest.fixture(autouse=True)
def _interpret_on_cpu(monkeypatch):
    """Keep CPU tensors on the Triton path even if another test changed the environment."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture
def launches(monkeypatch):
    """Counts Triton kernel launches, so a test can assert the kernel (not the reference) ran."""
    calls = []
    real = nf4._launch

    def spy(inputs, packed, dest):
        calls.append(inputs)
        real(inputs, packed, dest)

    monkeypatch.setattr(nf4, "_launch", spy)
    return calls


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype}{tuple(actual.shape)} vs {expected.dtype}{tuple(expected.shape)}"
    )
    differ = (_bits(actual.cpu()) != _bits(expected.cpu())).sum().item()
    assert differ == 0, f"{what}: {differ} of {actual.numel()} values differ in their bits"


def _weight(shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 0.02).to(DEVICE, dtype)


def _nested_kwargs(state: NF4QuantState) -> dict:
    if state.state2 is None:
        return {}
    return {
        "nested_absmax_code": state.state2.code,
        "nested_absmax_scale": state.state2.absmax,
        "nested_blocksize": state.state2.blocksize,
        "offset": state.offset,
    }


# ------------------------------------------------------------------------------------------------------------
# Triton against the reference
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_equals_reference_bit_for_bit(shape, blocksize, nested, dtype, launches):
    packed, state = quantize_nf4_reference(_weight(shape, seed=1), blocksize, compress_statistics=nested)
    assert state.nested == nested and state.absmax.dtype == (torch.uint8 if nested else torch.float32)
    kwargs = {"shape": shape, "blocksize": blocksize, "dtype": dtype, **_nested_kwargs(state)}
    y = dequantize_nf4(packed, state.absmax, **kwargs)
    assert len(launches) == 1, "the Triton kernel did not run"
    _assert_same_bits(y, dequantize_nf4_reference(packed, state.absmax, **kwargs), f"{shape} bs={blocksize}")


@pytest.mark.parametrize(
    ("blocksize", "bytes_per_program"),
    [(32, 2048), (4096, 2048), (64, 64), (64, 32)],  # one block per program; several programs on tiny input
)
def test_tilings_equal_reference(blocksize, bytes_per_program, launches, monkeypatch):
    monkeypatch.setattr(nf4, "_BYTES_PER_PROGRAM", bytes_per_program)
    for shape in [(3, 4096 + 64), (5, 640)]:  # ragged last tile; whole tiles
        packed, state = quantize_nf4_reference(_weight(shape, seed=2), blocksize)
        kwargs = {"shape": shape, "blocksize": blocksize, "dtype": torch.bfloat16, **_nested_kwargs(state)}
        y = dequantize_nf4(packed, state.absmax, **kwargs)
        expected = dequantize_nf4_reference(packed, state.absmax, **kwargs)
        _assert_same_bits(y, expected, f"{shape} bs={blocksize} bytes/program={bytes_per_program}")
    assert len(launches) == 2


def test_format_nibble_order_and_code_table(launches):
    """Value 2k is byte k's high nibble; nibble i means NF4_CODE[i] * absmax."""
    packed = torch.tensor([0x0F, 0x8C, 0x70], dtype=torch.uint8, device=DEVICE)  # 5 values, odd
    absmax = torch.tensor([2.0], device=DEVICE)
    y = dequantize_nf4(packed, absmax, shape=(5,), dtype=torch.float32)
    expected = torch.tensor([-1.0, 1.0, NF4_CODE[8], NF4_CODE[12], 0.0]) * 2.0
    _assert_same_bits(y, expected.to(DEVICE), "hand-packed bytes")
    assert len(launches) == 1


def test_nested_absmax_rounds_twice():
    """``code2[q] * scale + offset`` is rounded after the product and after the sum (bnb runs them as two
    kernels); a fused multiply-add rounds once and differs in the last bit for these values."""
    gen = torch.Generator().manual_seed(3)
    dynamic = quantize_nf4_reference(torch.ones(64), compress_statistics=True)[1].state2.code
    q = torch.randint(0, 256, (512,), generator=gen, dtype=torch.uint8)
    scale = torch.rand(2, generator=gen) * 0.2 + 0.01
    offset = torch.tensor(0.0731)
    two_roundings = dynamic[q.long()] * scale.repeat_interleave(256) + offset  # eager torch: never fused
    fused = torch.tensor(
        [
            float(
                Fraction(dynamic[int(qi)].item()) * Fraction(scale[i // 256].item()) + Fraction(offset.item())
            )
            for i, qi in enumerate(q)
        ]
    ).float()
    assert (fused != two_roundings).sum().item() >= 5, "pick values where fusing would show"

    packed = torch.full((512 * 32,), 0xFF, dtype=torch.uint8)  # every nibble 15: y = 1.0 * absmax
    y = dequantize_nf4(
        packed.to(DEVICE),
        q.to(DEVICE),
        shape=(512, 64),
        dtype=torch.float32,
        nested_absmax_code=dynamic.to(DEVICE),
        nested_absmax_scale=scale.to(DEVICE),
        offset=offset.to(DEVICE),
    )
    _assert_same_bits(y[:, 0].contiguous(), two_roundings.to(DEVICE), "resolved nested absmax")


def test_offset_as_float_or_tensor(launches):
    packed, state = quantize_nf4_reference(_weight((40, 64), seed=4))
    kwargs = {
        "shape": (40, 64),
        "nested_absmax_code": state.state2.code,
        "nested_absmax_scale": state.state2.absmax,
    }
    y_tensor = dequantize_nf4(packed, state.absmax, offset=state.offset, **kwargs)
    y_float = dequantize_nf4(packed, state.absmax, offset=state.offset.item(), **kwargs)
    _assert_same_bits(y_float, y_tensor, "offset given as a float")
    assert len(launches) == 2


def test_non_uint8_storage_is_read_as_bytes():
    """bnb's ``quant_storage`` (e.g. bf16 for FSDP) stores the same bytes viewed as another dtype."""
    packed, state = quantize_nf4_reference(_weight((64, 32), seed=5))
    as_bf16 = packed.view(-1).view(torch.bfloat16).unsqueeze(1)
    _assert_same_bits(
        dequantize_quant_state(as_bf16, state), dequantize_quant_state(packed, state), "bf16 storage"
    )


# ------------------------------------------------------------------------------------------------------------
# The reference quantiser
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_round_trip_within_nf4_error(blocksize, nested):
    shape = (1000, 24)
    w = _weight(shape, seed=6)
    packed, state = quantize_nf4_reference(w, blocksize, compress_statistics=nested)
    assert packed.shape == (math.prod(shape) // 2, 1) and packed.dtype == torch.uint8
    assert state.shape == shape and state.dtype == torch.float32 and state.blocksize == blocksize
    y = dequantize_quant_state(packed, state)
    assert y.shape == shape and y.dtype == torch.float32

    n_blocks = -(-w.numel() // blocksize)
    blocks = torch.nn.functional.pad(w.reshape(-1), (0, n_blocks * blocksize - w.numel())).view(n_blocks, -1)
    absmax = blocks.abs().amax(1)
    resolved = dequantize_nf4(torch.full((n_blocks * blocksize // 2,), 0xFF, dtype=torch.uint8, device=DEVICE),
                              state.absmax, shape=(n_blocks, blocksize), blocksize=blocksize,
                              dtype=torch.float32, **_nested_kwargs(state))[:, 0]  # fmt: skip
    if nested:  # the 8-bit dynamic code keeps the absmax within ~1% of its block's nested scale
        scale = state.state2.absmax.repeat_interleave(256)[:n_blocks]
        assert ((resolved - absmax).abs() <= 0.02 * scale).all()
    else:
        _assert_same_bits(resolved, absmax, "stored absmax")
    bound = NF4_HALF_GAP * absmax + (resolved - absmax).abs() + 1e-7
    err = (y.reshape(-1) - w.reshape(-1)).abs()
    err = torch.nn.functional.pad(err, (0, n_blocks * blocksize - w.numel())).view(n_blocks, -1)
    assert (err <= bound[:, None]).all(), f"max excess {(err - bound[:, None]).max().item():.3e}"
    rel = ((y - w).norm() / w.norm()).item()
    assert rel < 0.12, f"relative round-trip error {rel:.3f} (NF4 on Gaussian weights is ~0.1)"


def test_values_on_the_grid_survive_exactly():
    """Weights that are exactly ``code * absmax`` (each block holding a +absmax) come back bit for bit."""
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (12, 64), generator=gen)
    codes[:, 5] = 15  # value 1.0: makes the block's absmax exactly its scale
    scale = torch.rand(12, 1, generator=gen) + 0.5
    w = (torch.tensor(NF4_CODE)[codes] * scale).reshape(6, 128).to(DEVICE)
    packed, state = quantize_nf4_reference(w, 64, compress_statistics=False)
    expected = (codes.reshape(-1, 2)[:, 0] << 4 | codes.reshape(-1, 2)[:, 1]).to(torch.uint8)
    assert torch.equal(packed.view(-1).cpu(), expected), "packed nibbles"
    _assert_same_bits(dequantize_quant_state(packed, state), w, "round trip of grid values")


# ------------------------------------------------------------------------------------------------------------
# out= buffers, quant states, dispatch, errors
# ------------------------------------------------------------------------------------------------------------


def test_out_buffer_is_reused(launches):
    """One workspace serves several weights: results are views of it, equal to fresh allocations."""
    weights = [((96, 64), 8), ((40, 100), 9), ((7, 9), 10)]
    workspace = torch.full((96 * 64 + 5,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    for shape, seed in weights:
        packed, state = quantize_nf4_reference(_weight(shape, seed=seed), 64)
        fresh = dequantize_quant_state(packed, state, dtype=torch.bfloat16)
        y = dequantize_quant_state(packed, state, out=workspace, dtype=torch.bfloat16)
        assert y.data_ptr() == workspace.data_ptr() and y.shape == shape
        _assert_same_bits(y, fresh, f"{shape} into the workspace")
        assert torch.equal(_bits(workspace[: y.numel()]), _bits(fresh.reshape(-1)))
    assert len(launches) == 2 * len(weights)

    packed, state = quantize_nf4_reference(_weight((8, 64), seed=11), 64)
    exact = torch.empty(8, 64, dtype=torch.float32, device=DEVICE)
    assert dequantize_quant_state(packed, state, out=exact).data_ptr() == exact.data_ptr()
    with pytest.raises(ValueError, match="out is torch.bfloat16"):
        dequantize_quant_state(packed, state, out=workspace)  # state.dtype is fp32
    with pytest.raises(ValueError, match="fewer than 512"):
        dequantize_quant_state(packed, state, out=torch.empty(100, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        dequantize_quant_state(packed, state, out=torch.empty(64, 16, device=DEVICE).t())


def test_quant_state_and_params4bit_duck_types(launches):
    w = _weight((64, 96), seed=12, dtype=torch.bfloat16)
    packed, state = quantize_nf4_reference(w, 64, compress_statistics=True)
    assert state.dtype == torch.bfloat16 and state.quant_type == "nf4"
    expected = dequantize_nf4_reference(packed, state.absmax, shape=(64, 96), **_nested_kwargs(state))
    _assert_same_bits(dequantize_quant_state(packed, state), expected, "dequantize_quant_state")
    param = types.SimpleNamespace(data=packed, quant_state=state)  # what Params4bit offers
    _assert_same_bits(dequantize_weight(param), expected, "dequantize_weight")
    as_fp16 = dequantize_weight(param, dtype=torch.float16)
    ref_fp16 = dequantize_nf4_reference(
        packed, state.absmax, shape=(64, 96), dtype=torch.float16, **_nested_kwargs(state)
    )
    _assert_same_bits(as_fp16, ref_fp16, "dtype override")
    assert len(launches) == 3


def test_cached_launch_inputs_do_not_keep_the_weight_alive():
    """A Params4bit holds its quant state; the state's cached launch inputs must not hold the weight (a view's
    ``_base`` cycle that the garbage collector cannot break leaked every NF4 model's weights)."""
    import gc
    import weakref

    packed, state = quantize_nf4_reference(_weight((64, 96), seed=14, dtype=torch.bfloat16), 64)
    weight = torch.nn.Parameter(packed, requires_grad=False)
    weight.quant_state = state  # what bitsandbytes' Params4bit does
    first = dequantize_quant_state(weight, state)
    _assert_same_bits(dequantize_quant_state(weight, state), first, "cached inputs")
    assert getattr(state, "_fastft_nf4_inputs", None) is not None  # the second call took the cache
    alive = weakref.ref(weight)
    del weight, state, packed
    gc.collect()
    assert alive() is None


def test_cpu_without_interpreter_runs_the_reference(monkeypatch, launches):
    if DEVICE != "cpu":
        pytest.skip("CPU dispatch only")
    monkeypatch.delenv("TRITON_INTERPRET")
    packed, state = quantize_nf4_reference(_weight((64, 3), seed=13))
    y = dequantize_quant_state(packed, state, dtype=torch.bfloat16)
    assert launches == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _assert_same_bits(y, dequantize_quant_state(packed, state, dtype=torch.bfloat16), "reference vs Triton")
    assert len(launches) == 1


def test_empty_weight():
    packed, state = quantize_nf4_reference(torch.empty(0, 64, device=DEVICE))
    y = dequantize_quant_state(packed, state)
    assert y.shape == (0, 64) and y.dtype == torch.float32


def test_errors_name_the_input():
    packed, state = quantize_nf4_reference(_weight((64, 8), seed=14))
    kwargs = _nested_kwargs(state)
    with pytest.raises(ValueError, match="absmax has 8 entries, expected ceil"):
        dequantize_nf4(packed, state.absmax, shape=(64, 8), blocksize=128, **kwargs)
    with pytest.raises(ValueError, match="double-quantised"):
        dequantize_nf4(packed, state.absmax, shape=(64, 8))
    with pytest.raises(ValueError, match="packed bytes for shape"):
        dequantize_nf4(packed[:-1], state.absmax, shape=(64, 8), **kwargs)
    with pytest.raises(ValueError, match="power of two"):
        dequantize_nf4(packed, state.absmax, shape=(64, 8), blocksize=48, **kwargs)
    with pytest.raises(ValueError, match="dtype must be"):
        dequantize_nf4(packed, state.absmax, shape=(64, 8), dtype=torch.int8, **kwargs)
    with pytest.raises(ValueError, match="only NF4"):
        dequantize_quant_state(packed, types.SimpleNamespace(**{**vars(state), "quant_type": "fp4"}))
    with pytest.raises(ValueError, match="Params4bit with a quant_state"):
        dequantize_weight(torch.nn.Parameter(torch.empty(4, 4)))
    with pytest.raises(ValueError, match="blocksize must be one of"):
        quantize_nf4_reference(torch.ones(64), blocksize=48)


# ------------------------------------------------------------------------------------------------------------
# Against bitsandbytes on the CPU (skipped without bitsandbytes; 0.50 quantises and dequantises 4-bit on CPU)
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def bnb_functional():
    functional = pytest.importorskip("bitsandbytes.functional")
    # bnb's plain-PyTorch path (odd last dims) is wrapped in torch.compile: eager is the same math and faster
    # to run once than to compile.
    with torch.compiler.set_stance("force_eager"):
        yield functional


def test_tables_match_bitsandbytes(bnb_functional):
    assert torch.equal(torch.tensor(NF4_CODE), bnb_functional.get_4bit_type("nf4", device="cpu"))
    _, state = quantize_nf4_reference(torch.ones(64))
    assert torch.equal(state.state2.code, bnb_functional.create_dynamic_map())


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("shape", [(64, 3), (1000, 24), (33, 130), (40, 256), (4097,)])
def test_matches_bitsandbytes_cpu(shape, blocksize, nested, bnb_functional, launches):
    """bnb quantises on the CPU; its ``dequantize_4bit`` and ours agree bit for bit in every dtype, and our
    reference quantiser writes the same format.

    Not among the shapes: a last dim that is a multiple of 16 but not of ``blocksize`` (e.g. 96 with
    blocksize 64). bnb 0.50's CPU C kernel reads the wrong absmax there (its row-wise fast path assumes whole
    blocks per row); its CUDA kernel and its plain-PyTorch backend index blocks over the flat weight, as we do.
    """
    F = bnb_functional
    for dtype in DTYPES:
        w = _weight(shape, seed=15, dtype=dtype).cpu()
        packed, state = F.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
        expected = F.dequantize_4bit(packed, state, quant_type="nf4")
        state.absmax, state.code = state.absmax.to(DEVICE), state.code.to(DEVICE)
        if nested:
            state.offset = state.offset.to(DEVICE)
            state.state2.absmax, state.state2.code = (
                state.state2.absmax.to(DEVICE),
                state.state2.code.to(DEVICE),
            )
        y = dequantize_quant_state(packed.to(DEVICE), state)
        _assert_same_bits(y, expected, f"bnb {shape} bs={blocksize} nested={nested} {dtype}")

        ours_packed, ours = quantize_nf4_reference(w, blocksize, compress_statistics=nested)
        assert torch.equal(ours_packed, packed) and ours.shape == state.shape and ours.dtype == state.dtype
        if not nested:
            _assert_same_bits(ours.absmax, state.absmax.cpu(), "fp32 absmax")
            continue
        _assert_same_bits(ours.offset, state.offset.cpu(), "offset")
        _assert_same_bits(ours.state2.absmax, state.state2.absmax.cpu(), "nested scale")
        assert ours.state2.blocksize == state.state2.blocksize == 256
        # Where the nested codes differ, ours is the nearer code to the value being quantised.
        code = ours.state2.code
        absmax = quantize_nf4_reference(w, blocksize, compress_statistics=False)[1].absmax
        scaled = (absmax - ours.offset) * (1.0 / ours.state2.absmax).repeat_interleave(256)[: absmax.numel()]
        ours_err = (code[ours.absmax.long()] - scaled).abs()
        bnb_err = (code[state.absmax.cpu().long()] - scaled).abs()
        assert (ours_err <= bnb_err).all(), "a nested absmax code farther than bnb's"
        differ = (ours.absmax != state.absmax.cpu()).sum().item()
        assert differ <= 1 + 0.02 * absmax.numel(), f"{differ} of {absmax.numel()} nested absmax codes differ"
    assert len(launches) == len(DTYPES)


def test_linear4bit_weight_on_cpu(bnb_functional):
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(16)
    layer = bnb.nn.Linear4bit(128, 40, bias=False, quant_type="nf4", compress_statistics=True)
    weight = layer.weight
    weight._quantize("cpu")  # what `.to(device)` does on first move
    expected = bnb_functional.dequantize_4bit(weight.data, weight.quant_state, quant_type="nf4")
    _assert_same_bits(dequantize_weight(weight).cpu(), expected, "Params4bit")
    assert expected.shape == (40, 128)


# ------------------------------------------------------------------------------------------------------------
# GPU (H200): bitsandbytes' CUDA kernels, full-size weights, no host sync, bandwidth for information
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("shape", [(4096, 1000), (4096, 14336)])
def test_gpu_matches_bitsandbytes(shape, nested, dtype):
    F = pytest.importorskip("bitsandbytes.functional")
    gen = torch.Generator("cuda").manual_seed(17)
    w = (torch.randn(shape, generator=gen, device="cuda") * 0.02).to(dtype)
    packed, state = F.quantize_4bit(w, compress_statistics=nested, quant_type="nf4")
    expected = F.dequantize_4bit(packed, state, quant_type="nf4")
    dequantize_quant_state(packed, state)  # compile, and make the per-device NF4 table, before watching
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync in our dequantisation raises
    try:
        y = dequantize_quant_state(packed, state)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _assert_same_bits(y, expected, f"bnb CUDA {shape} nested={nested} {dtype}")
    workspace = torch.empty(4096 * 14336, dtype=dtype, device="cuda")
    _assert_same_bits(dequantize_quant_state(packed, state, out=workspace), expected, "into a workspace")


@pytest.mark.gpu
@pytest.mark.parametrize("compress_statistics", [True, False])
def test_gpu_linear4bit_dequantize_weight(compress_statistics):
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(18)
    layer = bnb.nn.Linear4bit(
        1000,
        4096,
        bias=False,
        compute_dtype=torch.bfloat16,
        quant_type="nf4",
        compress_statistics=compress_statistics,
    )
    layer.weight.data = layer.weight.data.to(torch.bfloat16)
    layer = layer.cuda()
    weight = layer.weight
    expected = bnb.functional.dequantize_4bit(weight.data, weight.quant_state, quant_type="nf4")
    y = dequantize_weight(weight)
    assert y.shape == (4096, 1000) and y.dtype == torch.bfloat16
    _assert_same_bits(y, expected, f"Linear4bit compress_statistics={compress_statistics}")


@pytest.mark.gpu
def test_gpu_reference_quantiser_matches_bitsandbytes():
    """Our quantiser against bnb's CUDA kernel: the same format and scales; where a 4-bit or nested 8-bit code
    differs (a near-tie, rounded another way), ours is at least as near the value being quantised."""
    F = pytest.importorskip("bitsandbytes.functional")
    gen = torch.Generator("cuda").manual_seed(19)
    w = (torch.randn(4096, 1000, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    packed, state = F.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
    ours_packed, ours = quantize_nf4_reference(w, 64, compress_statistics=True)
    _, plain = quantize_nf4_reference(w, 64, compress_statistics=False)
    _assert_same_bits(plain.absmax, F.quantize_4bit(w, quant_type="nf4")[1].absmax, "fp32 absmax")
    _assert_same_bits(ours.offset, state.offset, "offset")
    _assert_same_bits(ours.state2.absmax, state.state2.absmax, "nested scale")
    assert ours_packed.shape == packed.shape and ours.absmax.shape == state.absmax.shape

    def nibbles(p):
        p = p.view(-1)
        return torch.stack((p >> 4, p & 0xF), dim=1).view(-1).long()

    code = torch.tensor(NF4_CODE, device="cuda")
    scaled = (w.float().view(-1, 64) * (1.0 / plain.absmax).view(-1, 1)).view(-1)
    ours_err = (code[nibbles(ours_packed)] - scaled).abs()
    bnb_err = (code[nibbles(packed)] - scaled).abs()
    assert (ours_err <= bnb_err).all() and (ours_packed != packed).float().mean().item() < 1e-3

    dynamic = ours.state2.code
    centred = (plain.absmax - ours.offset) * (1.0 / ours.state2.absmax).repeat_interleave(256)[
        : plain.absmax.numel()
    ]
    ours_err = (dynamic[ours.absmax.long()] - centred).abs()
    bnb_err = (dynamic[state.absmax.long()] - centred).abs()
    assert (ours_err <= bnb_err).all() and (ours.absmax != state.absmax).float().mean().item() < 1e-2


@pytest.mark.gpu
def test_gpu_bandwidth_report(monkeypatch):
    """For information: 4096 x 14336 bf16, nested, against bnb's CUDA kernel, per launch setting."""
    F = pytest.importorskip("bitsandbytes.functional")
    import triton

    shape = (4096, 14336)
    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    packed, state = F.quantize_4bit(w, compress_statistics=True, quant_type="nf4")
    n = w.numel()
    moved = n // 2 + n // 64 + 2 * n  # packed bytes + uint8 absmax codes read, bf16 written
    workspace = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    bnb_ms = triton.testing.do_bench(lambda: F.dequantize_4bit(packed, state, quant_type="nf4"))
    lines = [f"bitsandbytes {bnb_ms * 1e3:.0f} us ({moved / bnb_ms / 1e6:.0f} GB/s)"]
    for bytes_per_program in (1024, 2048, 4096, 8192):
        for num_warps in (4, 8):
            monkeypatch.setattr(nf4, "_BYTES_PER_PROGRAM", bytes_per_program)
            monkeypatch.setattr(nf4, "_NUM_WARPS", num_warps)
            ms = triton.testing.do_bench(lambda: dequantize_quant_state(packed, state, out=workspace))
            lines.append(
                f"fastft {bytes_per_program} B/program {num_warps} warps: {ms * 1e3:.0f} us "
                f"({moved / ms / 1e6:.0f} GB/s)"
            )
    print("\nnf4 dequantise 4096x14336 -> bf16, nested:\n  " + "\n  ".join(lines))

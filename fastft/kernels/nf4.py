"""NF4 dequantisation: one Triton kernel, bit-exact with bitsandbytes, beside a plain-PyTorch reference.

The format (bitsandbytes 0.50 ``quantize_4bit(..., quant_type="nf4")``, read from its source):

* ``packed``: uint8, ``ceil(n / 2)`` bytes for ``n = prod(shape)`` values in row-major order (bnb keeps it as
  ``[ceil(n / 2), 1]``; other ``quant_storage`` dtypes are the same bytes viewed as another type). Value
  ``2k`` is the **high** nibble of byte ``k``, value ``2k + 1`` the low nibble; an odd ``n`` leaves the last
  low nibble as padding (code 7, the value 0).
* ``code``: the 16 NF4 values (``NF4_CODE``), QLoRA's normal-quantile table, in nibble order.
* ``absmax``: one scale per ``blocksize`` consecutive values of the flattened weight (64 by default; the
  last block may be short, and blocks run across rows), fp32. With ``compress_statistics=True`` (bnb's ``nested``) it is stored as uint8 codes instead, quantised
  blockwise (``nested_blocksize`` 256) with the signed 8-bit dynamic map ``state2.code``, one fp32 scale per
  256 blocks ``state2.absmax``, after subtracting ``offset = absmax.mean()``.

Math (what bnb's CUDA kernels compute; every product and sum rounds in fp32, none fused)::

    absmax[b] = fl(fl(nested_code[qabsmax[b]] * nested_scale[b // nested_blocksize]) + offset)   # nested
    y[i]      = round_to_dtype(fl(code[nibble(i)] * absmax[i // blocksize]))

The nested line is ``dequantize_blockwise`` (``code[q] * absmax`` in fp32) followed by ``absmax += offset``:
two fp32 roundings, so the Triton launch turns off FMA contraction (``enable_fp_fusion=False``) or the GPU
would round once and differ in the last bit. The second line is ``kDequantizeBlockwise``'s
``vals[j*2] = dDequantizeNF4(q >> 4) * local_abs_max`` (fp32 product, then one round-to-nearest-even cast to
the output type). bnb's CUDA kernel ignores ``quant_state.code`` and uses its built-in NF4 table, whose
literals are the same fp32 numbers as ``NF4_CODE``; so ``dequantize_quant_state`` uses ``NF4_CODE`` too.

The kernel resolves the nested absmax inline (uint8 code -> dynamic-map value -> times the nested scale ->
plus the offset, read from device memory so no host sync happens) and writes both nibbles of each byte: no
intermediate fp32 absmax tensor, one launch.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fastft.kernels import use_triton
from fastft.kernels.rounding import round_to

# NF4 values in nibble order (bitsandbytes ``get_4bit_type("nf4")``, QLoRA's ``create_normal_map``).
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# Blocksizes bitsandbytes accepts for 4-bit weights.
BNB_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
# bitsandbytes quantises the absmax of a nested (compress_statistics=True) state in blocks of 256.
NESTED_BLOCKSIZE = 256
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Packed bytes per program and warps per program. 2048 bytes = 4096 outputs = 8 KiB of bf16 out; with
# 4 warps each thread reads 16 contiguous bytes (one 128-bit load) and writes 32 values (four 128-bit
# bf16 stores). Chosen by counting, not yet measured: 4096 x 14336 gives 14336 programs (~109 per H200
# SM, so the tail wave is small), ~16 resident programs per SM keep ~32 KiB of loads in flight, and the
# absmax / code-table gathers hit L1. `test_gpu_bandwidth_report` sweeps the alternatives.
_BYTES_PER_PROGRAM = 2048
_NUM_WARPS = 4


@dataclass
class NF4QuantState:
    """The fields of a bitsandbytes ``QuantState`` that NF4 dequantisation reads (a duck-typed stand-in).

    ``absmax``: fp32 ``[n_blocks]``, or uint8 ``[n_blocks]`` when ``state2`` is set. ``shape``: the weight's
    shape. ``code``: fp32 ``[16]`` (NF4) or, in ``state2``, fp32 ``[256]`` (the dynamic map). ``dtype``: the
    weight's dtype before quantisation. ``offset``: fp32 0-d tensor (nested only). ``state2``: the nested
    absmax's own state (``absmax`` fp32 ``[ceil(n_blocks / 256)]``, ``code``, ``blocksize=256``).
    """

    absmax: torch.Tensor
    shape: torch.Size | None
    code: torch.Tensor
    blocksize: int
    dtype: torch.dtype
    quant_type: str | None = "nf4"
    offset: torch.Tensor | None = None
    state2: NF4QuantState | None = None

    @property
    def nested(self) -> bool:
        return self.state2 is not None


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------


@functools.cache
def _nf4_code(device: torch.device) -> torch.Tensor:
    """``NF4_CODE`` as fp32 on ``device``, made once per device (later calls copy nothing)."""
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


@dataclass(frozen=True)
class _Inputs:
    """Validated, flattened inputs shared by the kernel launcher and the reference: everything but the
    packed bytes, which the caller passes beside them (`_flat_bytes`), so these can be kept on a quant state
    without holding its weight."""

    absmax: torch.Tensor  # fp32 or (nested) uint8 [n_blocks]
    code: torch.Tensor  # fp32 [16]
    nested_code: torch.Tensor | None  # fp32 [256]
    nested_scale: torch.Tensor | None  # fp32 [ceil(n_blocks / nested_blocksize)]
    nested_blocksize: int
    offset: torch.Tensor | float | None  # fp32 0-d tensor on the device, or a float
    shape: torch.Size
    numel: int
    blocksize: int
    dtype: torch.dtype


def _flat_bytes(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype != torch.uint8:  # bnb's quant_storage other than uint8: the same bytes, another type
        packed = packed.contiguous().view(torch.uint8)
    return packed.reshape(-1)


def _prepare(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    shape,
    blocksize: int,
    dtype: torch.dtype,
    code: torch.Tensor | None,
    nested_absmax_code: torch.Tensor | None,
    nested_absmax_scale: torch.Tensor | None,
    nested_blocksize: int,
    offset: torch.Tensor | float | None,
) -> _Inputs:
    shape = torch.Size(shape)
    n = math.prod(shape)
    device = packed.device
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dequantize_nf4: dtype must be bfloat16, float16 or float32, got {dtype}")
    if blocksize < 2 or blocksize & (blocksize - 1):
        raise ValueError(
            f"dequantize_nf4: blocksize must be a power of two >= 2 (bnb: 32..4096), got {blocksize}"
        )

    packed = _flat_bytes(packed)
    n_bytes = (n + 1) // 2
    if packed.numel() < n_bytes or (packed.element_size() == 1 and packed.numel() != n_bytes and n > 0):
        raise ValueError(
            f"dequantize_nf4: {packed.numel()} packed bytes for shape {tuple(shape)}; expected {n_bytes} "
            "(two 4-bit values per byte). Pass the Params4bit's data and its quant_state's shape."
        )

    n_blocks = -(-n // blocksize)
    absmax = absmax.reshape(-1)
    if absmax.numel() != n_blocks:
        raise ValueError(
            f"dequantize_nf4: absmax has {absmax.numel()} entries, expected ceil({n} / {blocksize}) = {n_blocks}; "
            "is blocksize the one the weight was quantised with?"
        )
    nested = absmax.dtype == torch.uint8
    if nested:
        if nested_absmax_code is None or nested_absmax_scale is None or offset is None:
            raise ValueError(
                "dequantize_nf4: a uint8 absmax is double-quantised; pass nested_absmax_code (state2.code), "
                "nested_absmax_scale (state2.absmax) and offset (quant_state.offset)"
            )
        if nested_blocksize < 1:
            raise ValueError(f"dequantize_nf4: nested_blocksize must be positive, got {nested_blocksize}")
        nested_absmax_code = nested_absmax_code.reshape(-1).float()
        nested_absmax_scale = nested_absmax_scale.reshape(-1).float()
        if nested_absmax_code.numel() != 256:
            raise ValueError(
                f"dequantize_nf4: nested_absmax_code needs 256 entries, got {nested_absmax_code.numel()}"
            )
        n_scales = -(-n_blocks // nested_blocksize)
        if nested_absmax_scale.numel() != n_scales:
            raise ValueError(
                f"dequantize_nf4: nested_absmax_scale has {nested_absmax_scale.numel()} entries, expected "
                f"ceil({n_blocks} / {nested_blocksize}) = {n_scales}"
            )
        if isinstance(offset, torch.Tensor):
            if offset.numel() != 1:
                raise ValueError(f"dequantize_nf4: offset must be a scalar, got shape {tuple(offset.shape)}")
            offset = offset.reshape(()).float()
        else:
            offset = float(offset)
    else:
        if not absmax.is_floating_point():
            raise ValueError(
                f"dequantize_nf4: absmax must be float32 (or uint8 when nested), got {absmax.dtype}"
            )
        absmax = absmax.float()
        nested_absmax_code = nested_absmax_scale = offset = None

    if code is None:
        code = _nf4_code(device)
    else:
        code = code.reshape(-1).float()
        if code.numel() != 16:
            raise ValueError(f"dequantize_nf4: code needs 16 entries, got {code.numel()}")

    for name, t in (
        ("absmax", absmax),
        ("code", code),
        ("nested_absmax_code", nested_absmax_code),
        ("nested_absmax_scale", nested_absmax_scale),
        ("offset", offset),
    ):
        if isinstance(t, torch.Tensor) and t.device != device:
            raise ValueError(
                f"dequantize_nf4: {name} is on {t.device} but packed is on {device}; move it first"
            )

    return _Inputs(
        absmax=absmax.contiguous(),
        code=code.contiguous(),
        nested_code=nested_absmax_code.contiguous() if nested else None,
        nested_scale=nested_absmax_scale.contiguous() if nested else None,
        nested_blocksize=nested_blocksize,
        offset=offset,
        shape=shape,
        numel=n,
        blocksize=blocksize,
        dtype=dtype,
    )


def _output(inputs: _Inputs, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A contiguous flat ``[numel]`` buffer of ``dtype``: ``out``'s first ``numel`` elements, or a new one."""
    if out is None:
        return torch.empty(inputs.numel, dtype=inputs.dtype, device=device)
    if out.dtype != inputs.dtype:
        raise ValueError(
            f"dequantize_nf4: out is {out.dtype} but dtype is {inputs.dtype}; pass a matching buffer"
        )
    if out.device != device:
        raise ValueError(f"dequantize_nf4: out is on {out.device} but packed is on {device}")
    if not out.is_contiguous():
        raise ValueError("dequantize_nf4: out must be contiguous (a workspace buffer or a slice of one)")
    if out.numel() < inputs.numel:
        raise ValueError(
            f"dequantize_nf4: out holds {out.numel()} elements, fewer than {inputs.numel} for shape "
            f"{tuple(inputs.shape)}"
        )
    return out.view(-1)[: inputs.numel]


# ----------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------


def _absmax_reference(inputs: _Inputs) -> torch.Tensor:
    """fp32 ``[n_blocks]``: the stored absmax, or the nested one resolved as bnb's ``dequantize_blockwise``
    followed by ``absmax += offset`` (two separate fp32 roundings)."""
    if inputs.nested_code is None:
        return inputs.absmax
    n_blocks = inputs.absmax.numel()
    scale = inputs.nested_scale.repeat_interleave(inputs.nested_blocksize)[:n_blocks]
    absmax = inputs.nested_code[inputs.absmax.long()] * scale
    offset = inputs.offset
    if not isinstance(offset, torch.Tensor):
        offset = torch.tensor(offset, dtype=torch.float32, device=absmax.device)
    return absmax + offset


def dequantize_nf4_reference(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    *,
    shape,
    blocksize: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    code: torch.Tensor | None = None,
    nested_absmax_code: torch.Tensor | None = None,
    nested_absmax_scale: torch.Tensor | None = None,
    nested_blocksize: int = NESTED_BLOCKSIZE,
    offset: torch.Tensor | float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch NF4 dequantisation, ``y[i] = (code[nibble(i)] * absmax[i // blocksize]).to(dtype)``.

    Same arguments and result as ``dequantize_nf4``; the oracle for the Triton kernel (and the CPU path).
    """
    inputs = _prepare(
        packed,
        absmax,
        shape,
        blocksize,
        dtype,
        code,
        nested_absmax_code,
        nested_absmax_scale,
        nested_blocksize,
        offset,
    )
    return _run(inputs, out, packed, kernel=False)


def _dequantize_reference(inputs: _Inputs, packed: torch.Tensor, dest: torch.Tensor) -> None:
    n = inputs.numel
    b = packed[: (n + 1) // 2]
    nibbles = torch.stack((b >> 4, b & 0xF), dim=1).reshape(-1)[:n].long()
    scale = _absmax_reference(inputs).repeat_interleave(inputs.blocksize)[:n]
    dest.copy_((inputs.code[nibbles] * scale).to(inputs.dtype))


def _dynamic_map() -> torch.Tensor:
    """bitsandbytes' ``create_dynamic_map()`` (signed, 7 exponent bits, 8 bits): the nested absmax code.

    Built with the same torch ops in the same order, so the 256 fp32 values are the same bits.
    """
    data: list[float] = []
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0, 1.0]
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def _quantize_blocks(
    x: torch.Tensor, code: torch.Tensor, blocksize: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes uint8 [n], absmax fp32 [ceil(n / blocksize)])`` of a flat fp32 ``x``: nearest entry of the
    sorted ``code`` to ``x * (1 / absmax)`` (bnb: a reciprocal, not a division; midpoint ties go down)."""
    n = x.numel()
    n_blocks = -(-n // blocksize)
    blocks = torch.nn.functional.pad(x, (0, n_blocks * blocksize - n)).view(n_blocks, blocksize)
    absmax = blocks.abs().amax(dim=1)
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1), -1, 1).reshape(-1)[:n]
    midpoints = (code[:-1] + code[1:]) / 2
    return torch.bucketize(scaled, midpoints).to(torch.uint8), absmax


def quantize_nf4_reference(
    weight: torch.Tensor, blocksize: int = 64, compress_statistics: bool = True
) -> tuple[torch.Tensor, NF4QuantState]:
    """Plain-PyTorch NF4 quantisation in bitsandbytes' format: ``(packed uint8 [ceil(n / 2), 1], state)``.

    Mirrors ``bitsandbytes.functional.quantize_4bit(weight, blocksize, compress_statistics, quant_type="nf4")``
    (its plain-PyTorch backend; its CUDA kernel takes the same steps): per block, ``absmax = max |w|`` and
    the code nearest ``w * (1 / absmax)``; with ``compress_statistics`` the absmax is centred on its mean
    (``offset``) and quantised in blocks of 256 with the 8-bit dynamic map. For making test data without
    bitsandbytes; on a GPU prefer bnb's kernel.
    """
    if weight.dtype not in _OUT_DTYPES:
        raise ValueError(f"quantize_nf4_reference: weight must be bf16, fp16 or fp32, got {weight.dtype}")
    if blocksize not in BNB_BLOCKSIZES:
        raise ValueError(
            f"quantize_nf4_reference: blocksize must be one of {BNB_BLOCKSIZES}, got {blocksize}"
        )
    device = weight.device
    code = _nf4_code(device)
    codes, absmax = _quantize_blocks(weight.reshape(-1).float(), code, blocksize)
    if codes.numel() % 2:
        codes = torch.cat((codes, torch.full((1,), 7, dtype=torch.uint8, device=device)))  # 7 is NF4's 0.0
    packed = ((codes[0::2] << 4) | codes[1::2]).unsqueeze(1)

    if not compress_statistics:
        return packed, NF4QuantState(absmax, weight.shape, code, blocksize, weight.dtype)
    offset = absmax.mean()
    dynamic = _dynamic_map().to(device)
    qabsmax, nested_scale = _quantize_blocks(absmax - offset, dynamic, NESTED_BLOCKSIZE)
    state2 = NF4QuantState(nested_scale, None, dynamic, NESTED_BLOCKSIZE, torch.float32, quant_type=None)
    return packed, NF4QuantState(
        qabsmax, weight.shape, code, blocksize, weight.dtype, offset=offset, state2=state2
    )


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _nf4_dequantize_kernel(
    Out_ptr,
    Packed_ptr,
    Absmax_ptr,
    Code_ptr,
    NestedCode_ptr,
    NestedScale_ptr,
    Offset_ptr,
    offset_value,
    n_elements,
    n_bytes,
    n_blocks,
    BLOCKSIZE: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    NESTED: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    OFFSET_IN_MEMORY: tl.constexpr,
    EVEN: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
):
    """One program decodes ``BLOCKS_PER_PROGRAM`` quantisation blocks, a ``[blocks, BLOCKSIZE // 2]`` tile
    of packed bytes: ``y = code[nibble] * absmax[block]`` in fp32, rounded once to ``Out``'s dtype.

    ``NESTED``: ``absmax = NestedCode[absmax_u8] * NestedScale[block // NESTED_BLOCKSIZE] + offset`` (fp32,
    two roundings; the launch disables FMA contraction). ``OFFSET_IN_MEMORY``: the offset is read from
    ``Offset_ptr`` (a device scalar: no host sync), else it is ``offset_value``. ``EVEN``: every tile is
    full, so no masks (and unmasked 128-bit accesses).
    """
    HALF: tl.constexpr = BLOCKSIZE // 2
    pid = tl.program_id(0).to(tl.int64)
    blocks = pid * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    byte_idx = blocks[:, None] * HALF + tl.arange(0, HALF)[None, :]
    out_idx = blocks[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]

    if EVEN:
        packed = tl.load(Packed_ptr + byte_idx)
        absmax = tl.load(Absmax_ptr + blocks)
    else:
        block_mask = blocks < n_blocks
        packed = tl.load(Packed_ptr + byte_idx, mask=byte_idx < n_bytes, other=0)
        absmax = tl.load(Absmax_ptr + blocks, mask=block_mask, other=0)

    if NESTED:
        nested_code = tl.load(NestedCode_ptr + absmax.to(tl.int32))
        if EVEN:
            nested_scale = tl.load(NestedScale_ptr + blocks // NESTED_BLOCKSIZE)
        else:
            nested_scale = tl.load(NestedScale_ptr + blocks // NESTED_BLOCKSIZE, mask=block_mask, other=0.0)
        offset = offset_value
        if OFFSET_IN_MEMORY:
            offset = tl.load(Offset_ptr)
        absmax = nested_code * nested_scale + offset
    absmax = absmax.to(tl.float32)[:, None]

    high = tl.load(Code_ptr + (packed >> 4).to(tl.int32)) * absmax
    low = tl.load(Code_ptr + (packed & 0xF).to(tl.int32)) * absmax
    values = round_to(tl.interleave(high, low), Out_ptr.dtype.element_ty, EMULATE_RNE)
    if EVEN:
        tl.store(Out_ptr + out_idx, values)
    else:
        tl.store(Out_ptr + out_idx, values, mask=out_idx < n_elements)


def _launch(inputs: _Inputs, packed: torch.Tensor, dest: torch.Tensor) -> None:
    n = inputs.numel
    half = inputs.blocksize // 2
    blocks_per_program = max(1, _BYTES_PER_PROGRAM // half)
    n_blocks = inputs.absmax.numel()
    nested = inputs.nested_code is not None
    offset_in_memory = isinstance(inputs.offset, torch.Tensor)
    grid = (triton.cdiv(n_blocks, blocks_per_program),)
    _nf4_dequantize_kernel[grid](
        dest,
        packed,
        inputs.absmax,
        inputs.code,
        inputs.nested_code if nested else inputs.code,  # unused placeholders when not nested
        inputs.nested_scale if nested else inputs.code,
        inputs.offset if offset_in_memory else inputs.code,
        inputs.offset if nested and not offset_in_memory else 0.0,
        n,
        (n + 1) // 2,
        n_blocks,
        BLOCKSIZE=inputs.blocksize,
        BLOCKS_PER_PROGRAM=blocks_per_program,
        NESTED=nested,
        NESTED_BLOCKSIZE=inputs.nested_blocksize,
        OFFSET_IN_MEMORY=offset_in_memory,
        EVEN=n % (blocks_per_program * inputs.blocksize) == 0,
        EMULATE_RNE=not dest.is_cuda,
        num_warps=_NUM_WARPS,
        enable_fp_fusion=False,  # code * scale + offset must round twice, as bnb's two kernels do
    )


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def dequantize_nf4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    *,
    shape,
    blocksize: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    code: torch.Tensor | None = None,
    nested_absmax_code: torch.Tensor | None = None,
    nested_absmax_scale: torch.Tensor | None = None,
    nested_blocksize: int = NESTED_BLOCKSIZE,
    offset: torch.Tensor | float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantise an NF4 weight to ``dtype``, bit-exact with ``bitsandbytes.functional.dequantize_4bit``.

    ``packed``: ``ceil(n / 2)`` bytes (any shape; non-uint8 storage is viewed as bytes), high nibble first.
    ``absmax``: fp32 ``[ceil(n / blocksize)]``, or uint8 codes when double-quantised, in which case
    ``nested_absmax_code`` (fp32 ``[256]``, bnb ``state2.code``), ``nested_absmax_scale`` (fp32
    ``[ceil(n_blocks / nested_blocksize)]``, ``state2.absmax``) and ``offset`` (a 0-d fp32 device tensor,
    read in the kernel without a host sync, or a float) are required. ``code``: the 16-entry table (default
    ``NF4_CODE``). ``out``: a contiguous ``dtype`` buffer of at least ``n`` elements on the same device (a
    shared workspace); the result is then a view of its first ``n`` elements.

    Returns a ``dtype`` tensor of ``shape``. CUDA tensors (and CPU ones under ``TRITON_INTERPRET=1``) run
    the Triton kernel; other CPU tensors run ``dequantize_nf4_reference``.
    """
    inputs = _prepare(
        packed,
        absmax,
        shape,
        blocksize,
        dtype,
        code,
        nested_absmax_code,
        nested_absmax_scale,
        nested_blocksize,
        offset,
    )
    return _run(inputs, out, packed)


def _run(
    inputs: _Inputs, out: torch.Tensor | None, packed: torch.Tensor, kernel: bool = True
) -> torch.Tensor:
    """Dequantise into ``out`` (or a fresh tensor) through the Triton kernel when ``kernel`` and
    ``use_triton(packed)``, else the reference; returns it viewed as ``inputs.shape``."""
    dest = _output(inputs, out, packed.device)
    flat = _flat_bytes(packed)
    if kernel and inputs.numel > 0 and use_triton(packed):
        _launch(inputs, flat, dest)
    else:
        _dequantize_reference(inputs, flat, dest)
    return dest.view(inputs.shape)


def _state_arguments(quant_state) -> dict:
    """``dequantize_nf4`` keyword arguments read from a bnb ``QuantState`` (or any object with its fields)."""
    quant_type = getattr(quant_state, "quant_type", "nf4")
    if quant_type != "nf4":
        raise ValueError(f"dequantize_quant_state: only NF4 is supported, this state is {quant_type!r}")
    if getattr(quant_state, "packing_format_for_cpu", False):
        raise ValueError(
            "dequantize_quant_state: this weight is repacked in bitsandbytes' CPU inference layout; move it to "
            "the GPU (`.cuda()`) to restore the standard layout first"
        )
    state2 = getattr(quant_state, "state2", None)
    args = {"shape": quant_state.shape, "blocksize": quant_state.blocksize}
    if state2 is not None:
        args.update(
            nested_absmax_code=state2.code,
            nested_absmax_scale=state2.absmax,
            nested_blocksize=state2.blocksize,
            offset=quant_state.offset,
        )
    return args


def dequantize_quant_state(
    packed: torch.Tensor, quant_state, out: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Dequantise ``packed`` with a bitsandbytes ``QuantState`` (duck-typed: ``absmax``, ``shape``,
    ``blocksize``, ``dtype``, ``quant_type``, ``offset``, ``state2``; ``NF4QuantState`` fits).

    ``dtype`` defaults to ``quant_state.dtype`` (the weight's dtype before quantisation). The state's ``code``
    is not read: bnb's CUDA kernel uses its built-in NF4 table, and so does this. See ``dequantize_nf4``.
    """
    if quant_state is None:
        raise ValueError("dequantize_quant_state: quant_state is None; the weight has not been quantised yet")
    dtype = quant_state.dtype if dtype is None else dtype
    # Validating and flattening the state costs ~15 small torch calls (~100 us of host time): a LoRA step
    # dequantises each weight three times (forward, recompute, backward), so the prepared inputs are kept on
    # the state, keyed by where its tensors live (a move or a re-quantisation makes a new key).
    # The kept inputs never hold the packed weight (`_Inputs` has no field for it): a view of it references
    # the Params4bit through ``_base``, which references this state, a cycle the garbage collector cannot see
    # through tensors: it would leak every NF4 model's weights.
    key = (packed.data_ptr(), packed.device, dtype, quant_state.absmax.data_ptr())
    cached = getattr(quant_state, "_fastft_nf4_inputs", None)
    if cached is not None and cached[0] == key:
        return _run(cached[1], out, packed)
    args = _state_arguments(quant_state)
    inputs = _prepare(
        packed,
        quant_state.absmax,
        args.pop("shape"),
        args.pop("blocksize"),
        dtype,
        None,
        args.get("nested_absmax_code"),
        args.get("nested_absmax_scale"),
        args.get("nested_blocksize", NESTED_BLOCKSIZE),
        args.get("offset"),
    )
    with contextlib.suppress(AttributeError):  # a state that takes no new attributes: prepare every time
        quant_state._fastft_nf4_inputs = (key, inputs)
    return _run(inputs, out, packed)


def dequantize_weight(
    param: torch.Tensor, out: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Dequantise a bitsandbytes ``Params4bit`` (``module.weight`` of a ``Linear4bit``) to its ``[out, in]``
    shape, in ``dtype`` (default: the dtype it was quantised from). See ``dequantize_quant_state``."""
    quant_state = getattr(param, "quant_state", None)
    if quant_state is None:
        raise ValueError(
            "dequantize_weight: expected a bitsandbytes Params4bit with a quant_state (pass `module.weight`; "
            "bnb quantises the weight when it is moved to the GPU)"
        )
    return dequantize_quant_state(param.data, quant_state, out=out, dtype=dtype)


__all__ = [
    "BNB_BLOCKSIZES",
    "NESTED_BLOCKSIZE",
    "NF4_CODE",
    "NF4QuantState",
    "dequantize_nf4",
    "dequantize_nf4_reference",
    "dequantize_quant_state",
    "dequantize_weight",
    "quantize_nf4_reference",
]

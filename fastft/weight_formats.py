"""The base-weight formats fastft knows: one `WeightFormat` record each, in one registry.

A record says everything the rest of the package asks about a format: the names a user gives it
(`load_model`'s ``load_in_4bit``, the estimator's ``precision="nf4"``, the studio's "4-bit"), how it loads,
how a loaded parameter or model shows it, its bytes per weight for the VRAM estimator, the dense view the
LoRA kernels read of a frozen base (`fastft.kernels.lora.FrozenLinear`), how a merge or a GGUF export treats
it, and what it needs. Loading, detection, the estimator, the fused kernels, export, the studio and the CLI
look a format up here (`get`, `of_parameter`, `of_model`, `quantized`) instead of naming it, so a new format
(FP8 next) is one `register` call beside its kernels, plus its loader.

This module imports no torch (the CLI's parser reads the names) and sits with the kernels in the lowest layer:
a record holds plain data and functions; what needs transformers or bitsandbytes (building the
quantisation config, the merge's exact dequantisation) lives in `fastft.models`, keyed by `WeightFormat.loader`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

# a `WeightFormat.loader_options` value the loader replaces with the run's compute dtype
COMPUTE_DTYPE = "<compute dtype>"


def _no_bytes(*_: int) -> int:
    return 0


@dataclass(frozen=True)
class WeightFormat:
    """How one base-weight format loads, shows itself, counts and exports.

    Bytes: a quantised format stores each linear projection's weight in `bits_per_weight` bits plus
    `constant_bytes(n, rows)` bytes of scales for an ``n``-weight matrix of ``rows`` outputs; the embeddings, head, norms and experts
    stay in the compute dtype. The dense format (`bits_per_weight` None) stores everything in the compute
    dtype. `dense_bytes(n, width)`: the transient bytes of one ``n``-weight matrix's dense view in a
    ``width``-byte compute dtype (0 for the dense format)."""

    name: str  # the estimator's precision and ModelInfo.quantization (None for the dense format)
    label: str  # what the studio and the CLI show of a loaded model ("4-bit NF4")
    choice: str  # the studio's precision choice that picks it ("4-bit")
    aliases: tuple[str, ...]  # other names the estimator and the faces accept
    quantized: bool
    load_flag: str | None  # the `load_model` keyword that picks it (the dense format: none)
    loader: str  # how it loads: "dtype" (in the compute dtype), "bitsandbytes" (`loader_options`)
    loader_options: tuple[tuple[str, Any], ...]  # the loader's settings (BitsAndBytesConfig keywords;
    # `COMPUTE_DTYPE` stands for the compute dtype)
    bits_per_weight: float | None  # a projection weight's storage; None: the compute dtype's width
    constant_bytes: Callable[[int, int], int]  # scales of a matrix of (n weights, output rows)
    constants_note: str  # the estimator's note on those constants
    dense_bytes: Callable[[int, int], int]  # transient bytes of one dense view (n weights, compute width)
    parameter_types: tuple[str, ...]  # class names of its loaded parameters (detection)
    storage_dtypes: tuple[str, ...]  # torch dtype names its weights are stored in (detection)
    model_flag: str | None  # the attribute a model loaded in it carries, True (detection)
    state_attribute: str | None  # the parameter attribute holding its quantisation state
    state_match: tuple[tuple[str, Any], ...]  # (attribute, value) its state must carry for `dense_view`
    dense_view: (
        Callable[[Any, Any, Any], Any] | None
    )  # (weight, state, dtype) → dense [out, in]; None: not fused
    merge: str  # "as-is", "dequantize" (a lossy merge, only when asked) or "refuse"
    export_note: str  # how a merge and a GGUF export treat it, in words
    compute_dtypes: tuple[str, ...]  # the compute dtypes it trains in
    needs: str  # packages and cards, in words
    quantizes_experts: bool = False  # fused MoE experts' stacked weights stored in it too (FP8), else 16-bit

    @property
    def fused(self) -> bool:
        """Whether fastft's fused LoRA kernels run over a base in this format (else its own forward runs)."""
        return not self.quantized or self.dense_view is not None

    def accepts(self, state) -> bool:
        """Whether `dense_view` reads this quantisation state (bitsandbytes' 4-bit layers also hold FP4)."""
        return self.dense_view is not None and all(
            getattr(state, attribute, None) == value for attribute, value in self.state_match
        )

    def logical_shape(self, parameter) -> tuple[int, ...]:
        """The unquantised weight's shape (a packed 4-bit tensor holds two weights per byte)."""
        state = getattr(parameter, self.state_attribute, None) if self.state_attribute else None
        shape = getattr(state, "shape", None)
        return tuple(shape if shape is not None else parameter.shape)

    def logical_numel(self, parameter) -> int:
        """Elements of the unquantised weight."""
        return math.prod(self.logical_shape(parameter))


# -- the records ----------------------------------------------------------------------------------------------


def _nf4_dense(weight, state, dtype):
    # imported on use: this module stays torch-free for the CLI's parser
    from fastft.kernels.nf4 import dequantize_quant_state

    return dequantize_quant_state(weight, state, dtype=dtype)


# NF4 (bitsandbytes): 4-bit codes, one absmax per block of 64 weights; with double quantisation the absmax
# are themselves 8-bit, with one fp32 absmax per 256 of them, plus a 16-entry fp32 codebook per weight
# and a 256-entry fp32 map for the nested state.
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256


def _nf4_constants(numel: int, rows: int) -> int:
    blocks = math.ceil(numel / NF4_BLOCK)
    # 8-bit absmax per block, fp32 absmax per 256 blocks, fp32 offset, NF4 codebook (16) and nested map (256)
    return blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK) + 4 + 4 * 16 + 4 * 256


def _nf4_dense_bytes(numel: int, width: int) -> int:
    # the dequantised weight in the compute dtype (bf16 on the kernels' path) and the fp32 absmax it first
    # expands from the nested state
    return numel * 2 + 4 * math.ceil(numel / NF4_BLOCK)


DENSE = WeightFormat(
    name="16bit",
    label="16-bit",
    choice="16-bit",
    aliases=("16-bit", "bf16", "fp16", "fp32", "bfloat16", "float16", "float32"),
    quantized=False,
    load_flag=None,
    loader="dtype",
    loader_options=(),
    bits_per_weight=None,
    constant_bytes=_no_bytes,
    constants_note="none (16/32-bit weights)",
    dense_bytes=_no_bytes,
    parameter_types=(),
    storage_dtypes=(),
    model_flag=None,
    state_attribute=None,
    state_match=(),
    dense_view=None,
    merge="as-is",
    export_note="merged in fp32 and saved in the chosen dtype; GGUF from the merged tensors",
    compute_dtypes=("bfloat16", "float16", "float32"),
    needs="nothing beyond torch; bf16 on sm80 and newer, fp16 on older GPUs, fp32 on the CPU",
)

NF4 = WeightFormat(
    name="nf4",
    label="4-bit NF4",
    choice="4-bit",
    aliases=("4bit", "4-bit", "qlora"),
    quantized=True,
    load_flag="load_in_4bit",
    loader="bitsandbytes",
    loader_options=(
        ("load_in_4bit", True),
        ("bnb_4bit_quant_type", "nf4"),
        ("bnb_4bit_use_double_quant", True),
        ("bnb_4bit_compute_dtype", COMPUTE_DTYPE),
    ),
    bits_per_weight=4,
    constant_bytes=_nf4_constants,
    constants_note=f"absmax per {NF4_BLOCK} weights, double-quantised (8-bit + fp32 per {NF4_NESTED_BLOCK})",
    dense_bytes=_nf4_dense_bytes,
    parameter_types=("Params4bit",),
    storage_dtypes=(),
    model_flag="is_loaded_in_4bit",
    state_attribute="quant_state",
    state_match=(("quant_type", "nf4"),),
    dense_view=_nf4_dense,
    merge="dequantize",
    export_note=(
        "merging is refused unless dequantize=True: then each weight is dequantised exactly (bitsandbytes) and "
        "its delta added (the original 16-bit weights are not recovered); GGUF from those merged tensors"
    ),
    compute_dtypes=("bfloat16", "float16"),
    needs="bitsandbytes; a CUDA GPU (or bitsandbytes' slow CPU backend)",
)

INT8 = WeightFormat(
    name="int8",
    label="8-bit",
    choice="8-bit",
    aliases=("8bit", "8-bit"),
    quantized=True,
    load_flag="load_in_8bit",
    loader="bitsandbytes",
    loader_options=(("load_in_8bit", True),),
    bits_per_weight=8,
    constant_bytes=lambda numel, rows: 4 * rows,
    constants_note="one fp32 scale per output row",
    # bitsandbytes' 8-bit layers keep their own forward: CB cast to the input's dtype for the input gradient
    dense_bytes=lambda numel, width: numel * width,
    parameter_types=("Int8Params",),
    storage_dtypes=("int8",),
    model_flag="is_loaded_in_8bit",
    state_attribute=None,
    state_match=(),
    dense_view=None,  # not on fastft's fused kernels: bitsandbytes' LLM.int8() matmul runs
    merge="refuse",
    export_note=(
        "merging and GGUF export are refused: load the base in 16-bit, attach the saved adapter, then export"
    ),
    compute_dtypes=("bfloat16", "float16"),
    needs="bitsandbytes; a CUDA GPU (or bitsandbytes' slow CPU backend)",
)


def _fp8_dense(weight, scale, dtype):
    # imported on use: this module stays torch-free for the CLI's parser
    from fastft.kernels.fp8 import dequantize_weight

    return dequantize_weight(weight, scale, dtype)


# FP8 (fastft.models.fp8): e4m3 weights with one fp32 scale per output channel, made at load from a 16-bit
# checkpoint; the forward and input-gradient GEMMs run on FP8 tensor cores (sm89 and newer)
FP8 = WeightFormat(
    name="fp8",
    label="FP8 (e4m3)",
    choice="FP8",
    aliases=("float8", "e4m3"),
    quantized=True,
    load_flag="load_in_fp8",
    loader="fp8",
    loader_options=(),
    bits_per_weight=8,
    constant_bytes=lambda numel, rows: 4 * rows,
    constants_note="one fp32 scale per output row",
    # the input gradient's transposed e4m3 weight (fastft.kernels.fp8), one byte a weight
    dense_bytes=lambda numel, width: numel,
    parameter_types=(),
    storage_dtypes=("float8_e4m3fn",),
    model_flag="is_loaded_in_fp8",
    state_attribute=None,  # the scales are the layer's `weight_scale` buffer (fastft.models.fp8.FP8Linear)
    state_match=(),
    dense_view=_fp8_dense,
    merge="as-is",  # e4m3 times its scale is exact in fp32: the merge needs no dequantize=True
    export_note="merged exactly (e4m3 values times their channel scales, in fp32) and saved in 16-bit; GGUF "
    "from those merged tensors",
    compute_dtypes=("bfloat16",),
    needs="an sm89+ GPU (L4, RTX 40xx, H100, Blackwell) for the FP8 GEMMs; the CPU runs a dequantised reference",
    quantizes_experts=True,  # one fp32 scale per expert and output row (fastft.models.fp8.FP8Experts)
)

_REGISTRY: dict[str, WeightFormat] = {}


class UnknownWeightFormatError(ValueError):
    """A weight-format name that no record answers to."""


def register(record: WeightFormat) -> WeightFormat:
    """Add `record` to the registry (a new format: FP8 next); its name and aliases must be new. Returns it."""
    for field in fields(record):
        if getattr(record, field.name, None) is None and field.name not in _OPTIONAL:
            raise ValueError(f"WeightFormat {record.name!r}: {field.name} is required")
    taken = {name for existing in _REGISTRY.values() for name in (existing.name, *existing.aliases)}
    clash = sorted({record.name, *record.aliases} & taken)
    if clash:
        raise ValueError(f"WeightFormat {record.name!r}: the name(s) {clash} are already registered")
    _REGISTRY[record.name] = record
    return record


def unregister(name: str) -> None:
    """Remove a registered format (tests register fakes)."""
    _REGISTRY.pop(name, None)


# fields that are None by meaning for some formats (the dense one, or one fastft does not fuse)
_OPTIONAL = {"load_flag", "bits_per_weight", "model_flag", "state_attribute", "dense_view"}

for _record in (DENSE, NF4, INT8, FP8):
    register(_record)


def formats() -> tuple[WeightFormat, ...]:
    """Every registered format, the dense one first."""
    return tuple(_REGISTRY.values())


def quantized() -> tuple[WeightFormat, ...]:
    """The quantised formats, in registration order."""
    return tuple(record for record in _REGISTRY.values() if record.quantized)


def choices() -> tuple[WeightFormat, ...]:
    """Every format in the order the studio offers them: the widest storage first (16-bit, 8-bit, 4-bit)."""
    return tuple(sorted(_REGISTRY.values(), key=lambda record: -(record.bits_per_weight or 16)))


def from_choice(choice: str) -> WeightFormat:
    """The format the studio's precision `choice` ("4-bit") picks."""
    for record in _REGISTRY.values():
        if record.choice == choice:
            return record
    known = ", ".join(repr(record.choice) for record in choices())
    raise UnknownWeightFormatError(f"precision {choice!r}: choose one of {known}.")


def quantized_names() -> tuple[str, ...]:
    """The quantised formats' names: the estimator's precisions beside "bf16", "fp16" and "fp32"."""
    return tuple(record.name for record in quantized())


def get(name: str | None) -> WeightFormat:
    """The format `name` or one of its aliases names (None: the dense format)."""
    if name is None:
        return DENSE
    for record in _REGISTRY.values():
        if name == record.name or name in record.aliases:
            return record
    known = ", ".join(repr(record.name) for record in _REGISTRY.values())
    raise UnknownWeightFormatError(f"weight format {name!r} is not one fastft knows: use one of {known}.")


def from_flags(**flags: bool) -> WeightFormat:
    """The format `load_model`'s flags pick (``load_in_4bit=True`` → NF4; none set: the dense format).
    Two flags at once are refused, naming both."""
    chosen = [record for record in quantized() if record.load_flag and flags.get(record.load_flag)]
    if len(chosen) > 1:
        names = " or ".join(f"{record.load_flag}=True" for record in chosen)
        raise UnknownWeightFormatError(f"Choose one of {names}, not both.")
    return chosen[0] if chosen else DENSE


def of_parameter(parameter) -> WeightFormat:
    """The format a loaded parameter is stored in (its class, then its storage dtype), else the dense one."""
    kind = type(parameter).__name__
    dtype = str(getattr(parameter, "dtype", "")).removeprefix("torch.")
    for record in quantized():
        if kind in record.parameter_types:
            return record
    for record in quantized():
        if dtype in record.storage_dtypes:
            return record
    return DENSE


def of_model(model) -> WeightFormat:
    """The format of a loaded model's base (under a PEFT model, its transformers model): the flag its
    loader set, else the dense format."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    for record in quantized():
        if record.model_flag and bool(getattr(base, record.model_flag, False)):
            return record
    return DENSE


def frozen_state(parameter) -> tuple[WeightFormat, Any]:
    """``(format, its quantisation state)`` of a weight (the state None for the dense format)."""
    record = of_parameter(parameter)
    state = getattr(parameter, record.state_attribute, None) if record.state_attribute else None
    return record, state

"""FP8 base weights: a model's frozen projections stored as e4m3 with per-output-channel scales.

What the weight-format registry points to, one function per question:

- `check_fp8_device(device)`: refuse, with the card's name and the alternatives, where there are no FP8
  tensor cores (CUDA below compute capability 8.9: T4, V100, A100, RTX 30xx); the CPU runs the reference.
- `convert_to_fp8(model, device)`: make the FP8 model from a 16-bit one held on the host, one projection
  at a time: each is moved to `device`, quantised there and its 16-bit copy dropped, so the 16-bit model
  is never on the device whole. Then the rest (norms, embeddings, head) goes to `device` in 16-bit.
- `is_fp8(model)`: whether a model's projections are FP8 (detection).
- `BYTES_PER_PARAM` and `scale_bytes(out_features)`: the estimator's bytes (1 byte a weight, one fp32 scale
  per output channel).
- `dequantized_weight(weight, scale)` and `fp8_scales(model)`: the weights dequantised for export (merge into 16-bit, and
  GGUF from that, `fastft.models.hf_save.merged_tensors`).

Which projections: the linear layers LoRA can target (`fastft.models.lora.linear_layer_names`: attention
q/k/v/o, MLP gate/up/down and their kin, shared experts), never the output head, MoE routers, norms or
embeddings. The stacked expert weights of fused MoE blocks (``gate_up_proj`` and ``down_proj``, 3-D) are
made FP8 too, per expert and output channel (`fastft.kernels.fp8.quantize_experts`; the scales as buffers
``gate_up_proj_scale`` and ``down_proj_scale`` beside them, `FP8Experts`); fastft's fused MoE forward
dequantises them to the compute dtype for its grouped GEMMs, a layer at a time (`fastft.models.moe`): the
weights take half the memory at rest, the GEMMs are the bf16 ones (no FP8 grouped GEMM yet).
"""

from __future__ import annotations

import functools

import torch

from fastft.kernels import fp8 as kernels
from fastft.models.errors import QuantizationError

BYTES_PER_PARAM = 1  # e4m3
SCALE_BYTES = 4  # one fp32 scale per output channel


class FP8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose frozen ``weight`` is ``float8_e4m3fn [out, in]`` with ``weight_scale`` (fp32
    ``[out]``, a buffer): ``W ~ weight_scale[:, None] * weight``. Its forward is `fastft.kernels.fp8.fp8_linear`
    (FP8 tensor cores where the card has them, else the dequantised reference). PEFT wraps it as any linear;
    fastft's fused projections read it as an FP8 `FrozenLinear`."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        torch.nn.Module.__init__(self)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.fp8_linear(x, self.weight, self.weight_scale, self.bias)

    def _apply(self, fn, recurse=True):
        # `model.to(dtype)` / `.half()` cast every floating tensor, fp8 included: the weight and its scales keep
        # their dtypes (a move to another device still applies)
        weight, scale = self.weight.data, self.weight_scale
        super()._apply(fn, recurse)
        if self.weight.dtype != weight.dtype:
            self.weight.data = weight.to(self.weight.device)
        if self.weight_scale.dtype != torch.float32:
            self.weight_scale = scale.to(self.weight_scale.device)
        return self

    def dense_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The weight dequantised to `dtype`."""
        return kernels.dequantize_weight(self.weight, self.weight_scale, dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8=e4m3, per-channel scales"


EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


class FP8Experts:
    """Mixed into an experts module's class when its stacked weights are made FP8 (`convert_to_fp8`): keeps
    the e4m3 weights and their fp32 ``<name>_scale`` buffers through ``model.to(dtype)``, and refuses
    transformers' own forward (which would read e4m3 values as weights) with what to do instead. fastft's
    fused MoE forward dequantises them per call (`fastft.models.moe.expert_weights`, which cannot import this
    module: this one imports it); `dense_experts` gives the same 16-bit stacks to export and the tests."""

    def _apply(self, fn, recurse=True):
        kept = {
            name: (getattr(self, name).data, getattr(self, f"{name}_scale")) for name in EXPERT_PARAMETERS
        }
        super()._apply(fn, recurse)
        for name, (weight, scale) in kept.items():
            parameter = getattr(self, name)
            if parameter.dtype != weight.dtype:
                parameter.data = weight.to(parameter.device)
            if getattr(self, f"{name}_scale").dtype != torch.float32:
                setattr(self, f"{name}_scale", scale.to(parameter.device))
        return self

    def forward(self, *args, **kwargs):
        raise QuantizationError(
            f"{type(self).__name__}: FP8 expert weights run on fastft's fused MoE forward only (fastft.patch, "
            "one active LoRA adapter, not merged; no router jitter while training). This call took "
            "transformers' own forward: load the model in 16-bit for it."
        )


@functools.cache
def _fp8_experts_class(cls: type) -> type:
    return type(f"FP8{cls.__name__}", (FP8Experts, cls), {"__module__": cls.__module__})


def is_fp8_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is an experts module whose stacked weights `convert_to_fp8` made FP8."""
    return isinstance(module, FP8Experts)


def dense_experts(experts: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 experts module's ``(gate_up_proj, down_proj)`` dequantised to `dtype`, in their stored layout."""
    return tuple(
        kernels.dequantize_experts(getattr(experts, name), getattr(experts, f"{name}_scale"), dtype)
        for name in EXPERT_PARAMETERS
    )


def _convert_experts(experts: torch.nn.Module, device: torch.device, transposed: bool) -> None:
    """Make one experts module's stacked weights FP8 on `device` (`FP8Experts`)."""
    for name in EXPERT_PARAMETERS:
        parameter = getattr(experts, name)
        with torch.no_grad():
            weight, scale = kernels.quantize_experts(parameter.detach().to(device), transposed)
        parameter.data = torch.empty(0)  # the 16-bit copy goes now
        setattr(experts, name, torch.nn.Parameter(weight, requires_grad=False))
        experts.register_buffer(f"{name}_scale", scale)
    experts.__class__ = _fp8_experts_class(type(experts))


def check_fp8_device(device: torch.device) -> None:
    """Raise `QuantizationError` where FP8 weights cannot run fast: a CUDA card without FP8 tensor cores.
    The CPU passes (the dequantised reference runs there: tests and tiny presets)."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= kernels.MIN_CAPABILITY:
        return
    name = torch.cuda.get_device_name(device)
    raise QuantizationError(
        f"FP8 weights need FP8 tensor cores (compute capability 8.9 or newer: L4, RTX 40xx, H100, H200, "
        f"Blackwell); {name} is sm{major}{minor}. Load it in 16-bit (the default) or 4-bit "
        "(load_in_4bit=True, NF4) instead."
    )


def fp8_targets(model: torch.nn.Module) -> list[str]:
    """Short names of the linear layers made FP8: those LoRA can target (`linear_layer_names`: no head, no
    routers), without the stacked experts, which are not linear layers."""
    from fastft.models.lora import expert_module_names, linear_layer_names

    experts = set(expert_module_names(model))
    return [name for name in linear_layer_names(model) if name not in experts]


def convert_to_fp8(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Replace every `fp8_targets` linear of `model` (16-bit, on the host) by an `FP8Linear` on `device`, and
    make every fused experts module's stacked weights FP8 (`FP8Experts`), one at a time, then move the rest of
    the model to `device`. Returns `model` (changed in place)."""
    check_fp8_device(device)
    names = set(fp8_targets(model))
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    replaced = 0
    for full_name, module in list(model.named_modules()):
        if (
            type(module) is not torch.nn.Linear
            or module is output
            or full_name.rsplit(".", 1)[-1] not in names
        ):
            continue
        with torch.no_grad():
            weight, scale = kernels.quantize_weight(module.weight.to(device))
            bias = None if module.bias is None else module.bias.detach().to(device)
        parent_name, _, child = full_name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP8Linear(weight, scale, bias))
        module.weight = None  # the 16-bit copy goes now, not at the end
        replaced += 1
    from fastft.models.moe import is_expert_module

    transposed = getattr(getattr(model, "config", None), "model_type", None) == "gpt_oss"
    for module in list(model.modules()):
        if is_expert_module(module) and not is_fp8_experts(module):
            _convert_experts(module, device, bool(getattr(module, "is_transposed", transposed)))
            replaced += 1
    if replaced == 0:
        raise QuantizationError(
            f"FP8 weights: {type(model).__name__} has no linear projections to quantise ({sorted(names)} "
            "named none); load it in 16-bit."
        )
    model.to(device)
    return model


def is_fp8(model: torch.nn.Module) -> bool:
    """Whether `model` (or the transformers model under a PEFT model) holds FP8 projections."""
    return any(isinstance(module, (FP8Linear, FP8Experts)) for module in model.modules())


def scale_bytes(out_features: int) -> int:
    """Bytes of one FP8 projection's scales."""
    return SCALE_BYTES * out_features


def dequantized_weight(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """An FP8 weight times its channel scales, in `dtype` (fp32 for a merge: the LoRA delta is added in fp32);
    a 3-D one is stacked experts (`fastft.kernels.fp8.quantize_experts`)."""
    if weight.dim() == 3:
        return kernels.dequantize_experts(weight, scale, dtype)
    return kernels.dequantize_weight(weight, scale, dtype)


def fp8_scales(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{state-dict key of an FP8 weight: its scales}`` for every `FP8Linear` and `FP8Experts` of `model` (the
    keys as ``model.state_dict()`` names them)."""
    scales = {}
    for name, module in model.named_modules():
        if isinstance(module, FP8Linear):
            scales[f"{name}.weight"] = module.weight_scale
        elif isinstance(module, FP8Experts):
            for parameter in EXPERT_PARAMETERS:
                scales[f"{name}.{parameter}"] = getattr(module, f"{parameter}_scale")
    return scales


__all__ = [
    "BYTES_PER_PARAM",
    "SCALE_BYTES",
    "EXPERT_PARAMETERS",
    "FP8Experts",
    "FP8Linear",
    "check_fp8_device",
    "convert_to_fp8",
    "dense_experts",
    "dequantized_weight",
    "fp8_scales",
    "fp8_targets",
    "is_fp8",
    "is_fp8_experts",
    "scale_bytes",
]

"""Step 1 of `estimate_vram`: its arguments checked against the model, defaults and "auto" resolved.

A `ResolvedRun` is what one estimate describes (the model's inventory, precision, checkpointing kind,
tokens, LoRA rank and targets, kernels, GPU); every later step of `fastft.vram.estimate` reads it. Each
bad input raises `VramEstimateError` naming the input and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import fastft.weight_formats as weight_formats
from fastft.runtime.activation_checkpointing import (
    BY_MEMORY,
    KEEP_FROM_LENGTH,
    KEEP_QUANTISED_FROM_LENGTH,
    Checkpointing,
    CheckpointingError,
)
from fastft.vram import activation_bytes as act
from fastft.vram.activation_bytes import Profile
from fastft.vram.gpus import GpuSpec, detect_gpu, get_gpu
from fastft.vram.inventory import ModelInventory, inventory_of
from fastft.vram.result import VramEstimateError

DTYPE_PRECISIONS = ("bf16", "fp16", "fp32")  # the dense format's compute dtypes
# the precisions an estimate answers for: the dtypes, then every quantised `fastft.weight_formats` record
# (this tuple is the built-in ones; `precisions()` also names a format registered later)
PRECISIONS = DTYPE_PRECISIONS + weight_formats.quantized_names()
CHECKPOINTING = BY_MEMORY  # the kinds an estimate answers for (its "auto" is "offload": the GPU's)
OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")
LOSSES = ("auto", "eager", "fused")


@dataclass(frozen=True)
class ResolvedRun:
    """What one estimate describes: `estimate_vram`'s arguments checked, defaults and "auto" resolved."""

    inventory: ModelInventory
    precision: str
    mode: str  # checkpointing: "none", "recompute" or "offload"
    optimizer: str
    loss: str  # "eager" or "fused"
    seq_len: int
    tokens: int  # per micro-batch
    trained: int  # of those, the ones carrying a label
    r: int
    targets: tuple[str, ...]
    fused: bool
    gpu: GpuSpec | None
    profile: Profile
    keep_attention: bool
    loaded_lora: bool  # a loaded model's own adapters are estimated (neither lora_r nor targets was given)
    # what an offloaded layer keeps (`fastft.runtime.offload.default_keep`): o_proj's output with the
    # attention output, the shortest sequence whose attention output is kept, and whether the run keeps
    # only where that still fits the GPU (a quantised base's default: `estimate_vram` then answers for the
    # run that does not keep when keeping would not fit)
    keep_output: bool = True
    keep_from: int = KEEP_FROM_LENGTH
    keep_if_fits: bool = (
        False  # a loaded model's own adapters are estimated (neither lora_r nor targets was given)
    )

    @property
    def layer_input(self) -> int:
        """A decoder layer's input (the residual stream), bytes per token."""
        return self.inventory.hidden_size * self.profile.residual


def resolve_run(
    model,
    *,
    seq_len: int,
    batch_tokens: int | None,
    precision: str | None,
    lora_r: int | None,
    targets: str | Sequence[str] | None,
    checkpointing: Checkpointing | str | bool,
    optimizer: str,
    gpu: str | GpuSpec | None,
    fused: bool,
    loss: str,
    trained_fraction: float,
    keep_attention: bool | None,
) -> ResolvedRun:
    """`estimate_vram`'s arguments (see there) checked and resolved; `VramEstimateError` for a bad one."""
    inventory = inventory_of(model)
    loaded = inventory.loaded
    precision = _resolve_precision(precision, loaded)
    mode = resolve_checkpointing(checkpointing)
    if (
        loaded is not None
        and loaded.checkpointing is not None
        and Checkpointing.parse(checkpointing).kind == "auto"
    ):
        mode = loaded.checkpointing  # "auto" is what this model's training runs: add_lora's mode
    if optimizer not in OPTIMIZERS:
        raise VramEstimateError(f"optimizer={optimizer!r}: use one of {OPTIMIZERS}.")
    if loss not in LOSSES:
        raise VramEstimateError(f"loss={loss!r}: use 'auto', 'eager' or 'fused'.")
    seq_len = int(seq_len)
    if seq_len < 1:
        raise VramEstimateError(f"seq_len must be a positive number of tokens, got {seq_len}.")
    tokens = seq_len if batch_tokens is None else int(batch_tokens)
    if tokens < seq_len:
        raise VramEstimateError(
            f"batch_tokens={tokens} is smaller than seq_len={seq_len}: a micro-batch holds at least one "
            "whole sequence. Raise batch_tokens or leave it out (it defaults to seq_len)."
        )
    if not 0.0 < trained_fraction <= 1.0:
        raise VramEstimateError(f"trained_fraction must be in (0, 1], got {trained_fraction}.")
    r = int(lora_r if lora_r is not None else (loaded.lora_r if loaded and loaded.lora_r else 16))
    if r < 1:
        raise VramEstimateError(f"lora_r must be a positive integer, got {r}.")
    target_names = _resolve_targets(inventory, targets)
    if loaded is not None and loaded.fused is not None:
        fused = loaded.fused  # the model is already wrapped: its kernels are what they are
    gpu_spec = resolve_gpu(gpu)
    # fp16 compute keeps a quantised model's other weights 16-bit as bf16 does (`add_lora`); a loaded model's
    # are what they are (fp32 when loaded so, or upcast by peft's k-bit preparation outside fastft)
    upcast = loaded is not None and loaded.residual_bytes == 4
    profile = act.Profile.of(
        precision,
        fused=fused,
        model_type=inventory.model_type,
        hidden_act=inventory.hidden_act,
        residual=loaded.residual_bytes if loaded else None,
        upcast=upcast,
    )
    if loss == "auto":
        loss = "fused" if profile.fused_loss else "eager"
    # a 4/8-bit base is the memory-first choice (`fastft.runtime.offload.default_keep`); FP8 is the speed one
    keep_if_fits = keep_attention is None and profile.quantized in ("nf4", "int8")
    if keep_attention is None:  # `fastft.runtime.offload.default_keep`
        keep_attention = True
    return ResolvedRun(
        inventory=inventory,
        precision=precision,
        mode=mode,
        optimizer=optimizer,
        loss=loss,
        seq_len=seq_len,
        tokens=tokens,
        trained=max(1, round(tokens * trained_fraction)),
        r=r,
        targets=tuple(target_names),
        fused=fused,
        gpu=gpu_spec,
        profile=profile,
        keep_attention=keep_attention,
        loaded_lora=bool(loaded and loaded.lora_params and lora_r is None and targets is None),
        keep_output=not keep_if_fits,
        keep_from=KEEP_QUANTISED_FROM_LENGTH if keep_if_fits else KEEP_FROM_LENGTH,
        keep_if_fits=keep_if_fits,
    )


def _resolve_precision(precision: str | None, loaded) -> str:
    if loaded is not None:
        actual = loaded.quantization or {2: "bf16", 4: "fp32"}.get(_dtype_size(loaded.compute_dtype), "bf16")
        if loaded.quantization is None and str(loaded.compute_dtype) == "torch.float16":
            actual = "fp16"
        if precision is not None and precision != actual and {precision, actual} != {"bf16", "fp16"}:
            raise VramEstimateError(
                f"This model is loaded in {actual}; precision={precision!r} does not describe it. Leave "
                f"precision out, or estimate the name instead: estimate_vram('<hub id>', precision={precision!r})."
            )
        return actual
    precision = precision or "bf16"
    if precision == "bfloat16":
        return "bf16"
    if precision in DTYPE_PRECISIONS:
        return precision
    record = next((f for f in weight_formats.quantized() if precision in (f.name, *f.aliases)), None)
    if record is None:
        raise VramEstimateError(f"precision={precision!r}: use one of {precisions()}.")
    return record.name


def precisions() -> tuple[str, ...]:
    """Every precision an estimate answers for: "bf16", "fp16", "fp32" and the quantised formats' names."""
    return DTYPE_PRECISIONS + weight_formats.quantized_names()


def _dtype_size(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def resolve_checkpointing(mode: Checkpointing | str | bool) -> str:
    """The kind an estimate answers for: the estimate is for a GPU, so "auto" is "offload"."""
    try:
        return Checkpointing.parse(mode).resolved(cuda=True).kind
    except CheckpointingError as error:
        raise VramEstimateError(str(error)) from None


def _resolve_targets(inventory: ModelInventory, targets) -> list[str]:
    available = inventory.lora_target_names()
    if targets is None:
        loaded = inventory.loaded
        if loaded is not None and loaded.lora_targets:
            return [t for t in loaded.lora_targets if t in available] or available
        return available
    if targets == "all-linear":  # what check_targets answers, without importing peft for the default
        return list(available)
    from fastft.models.lora import LoraTargetError, check_targets

    try:
        return check_targets(targets, available, inventory.name)
    except LoraTargetError as error:  # the same check and message as add_lora's, as the estimator's error
        raise VramEstimateError(str(error)) from None


def resolve_gpu(gpu) -> GpuSpec | None:
    """A `GpuSpec` for a preset name or a spec, the visible GPU for "auto", None for None."""
    if gpu is None:
        return None
    if gpu == "auto":
        return detect_gpu()
    return get_gpu(gpu)

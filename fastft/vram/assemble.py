"""The estimate from its parts: which of the step's peaks is the largest (the loss, the backward, a DPO reference
pass or GRPO's rollout), the caching allocator's slack, and the `VramComponent` list a `VramEstimate` shows
(a part of a phase that is not the peak is listed with its own size but adds nothing to the total)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import fastft.weight_formats as weight_formats
from fastft.vram import activation_bytes as act
from fastft.vram.gpus import DEFAULT_CONTEXT_BYTES, GiB, MiB
from fastft.vram.part_bytes import Adapters, Backward, Stored
from fastft.vram.result import VramComponent, VramEstimate, VramSettings, count_label
from fastft.vram.settings import ResolvedRun

# Caching-allocator slack at the peak (reserved − allocated): a fraction of what is allocated and freed
# during the step, plus a floor. To be calibrated from `fastft bench vram` (its "reserved" column).
SLACK_FRACTION = 0.05
SLACK_FLOOR_BYTES = 64 * MiB
# ... and at least the step's largest transient block under PyTorch's default caching allocator, which in
# step 1 of a fresh process can hold that much free only as smaller fragments (with expandable segments,
# which map blocks into one address range, it need not; docs/journal.md, "Design history", "The allocator").
# `allocator_fragments` says which allocator the process runs.

OPTIMIZER_NOTES = {"adamw": "AdamW m and v in fp32", "adamw_8bit": "8-bit AdamW m and v", "sgd": "none"}


@dataclass(frozen=True)
class StepParts:
    """Each part's bytes (`fastft.vram.part_bytes`, `fastft.vram.methods`), before the peaks decide what counts."""

    weights: tuple[int, int, str]  # the weights' bytes, their quantisation constants', the note
    adapters: Adapters
    stored: Stored
    loss: tuple[int, str]  # the logits' and loss buffers' bytes, the note
    workspace: int  # RoPE's cos/sin and the cuBLAS workspaces
    backward: Backward
    reference: int | None = None  # DPO's reference pass (or GRPO's KL / old-policy pass)
    rollout: int | None = None  # GRPO's sampling

    @property
    def loss_phase(self) -> int:
        return self.stored.bytes + self.loss[0]

    @property
    def backward_phase(self) -> int:
        backward = self.backward
        return (
            self.stored.bytes
            + backward.recompute
            + backward.workspace
            + backward.dequant
            + backward.gradients
        )


def allocator_fragments() -> bool:
    """Whether this process's CUDA caching allocator is PyTorch's default one, whose free memory can be
    split into blocks too small for a large request (False under ``expandable_segments:True`` in
    ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``)."""
    settings = ",".join(
        os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )
    return "expandable_segments:true" not in settings.replace(" ", "").lower()


def largest_transient_block(run: ResolvedRun, stored: Stored) -> int:
    """The largest single tensor a step allocates and frees: a dense MLP's ``[rows, I]`` block (a tile's
    rows when it tiles), a layer's input or, offloaded, one device buffer of an offloaded input and what
    it keeps."""
    layers, tokens = run.inventory.layers, run.tokens
    mlp = max((act.mlp_block_bytes(layer, run.profile, tokens) for layer in layers), default=0)
    buffer = stored.bytes // 2 if run.mode == "offload" else 0
    return max(mlp, buffer, run.layer_input * tokens)


def assemble(run: ResolvedRun, parts: StepParts, notes: list[str]) -> VramEstimate:
    """The `VramEstimate` of `parts`: its components at the peak, `notes` (appended to) under them."""
    inventory, gpu_spec = run.inventory, run.gpu
    peak = _peak_phase(parts)
    slack = _slack(run, parts, notes)
    workspace = parts.workspace
    components = (
        *_held_components(run, parts),
        *_phase_components(parts, peak),
        VramComponent(
            "workspace",
            "attention and cuBLAS workspace",
            workspace,
            workspace,
            "persistent",
            "RoPE cos/sin, cuBLAS workspace",
        ),
        VramComponent(
            "slack", "allocator slack", slack, slack, "outside", "caching allocator: reserved − allocated"
        ),
    )
    if inventory.model_type == "gpt_oss":
        notes.append(
            "gpt-oss: attention sinks and clamped SwiGLU are approximated by the Llama-style formulas"
        )
    if gpu_spec is not None and not gpu_spec.bf16 and run.precision not in ("fp16", "fp32"):
        notes.append(f"{gpu_spec.label} has no bf16: training runs in fp16 (the same bytes)")
    return VramEstimate(
        model=inventory.name,
        parameters=inventory.total_params,
        lora_parameters=parts.adapters.params,
        settings=_settings(run),
        components=components,
        peak_phase=peak,
        gpu=gpu_spec,
        notes=tuple(notes),
    )


def _peak_phase(parts: StepParts) -> str:
    """The phase whose moment holds the most: "loss", "backward", "reference" or "rollout"."""
    loss_phase, backward_phase, reference = parts.loss_phase, parts.backward_phase, parts.reference
    peak = "loss" if loss_phase > backward_phase else "backward"
    if reference is not None and reference > max(loss_phase, backward_phase):
        peak = "reference"  # nothing stored yet: the reference pass runs before the policy's forward
    if parts.rollout is not None and parts.rollout > max(loss_phase, backward_phase, reference or 0):
        peak = "rollout"  # GRPO's sampling, before anything of the update exists
    return peak


def _slack(run: ResolvedRun, parts: StepParts, notes: list[str]) -> int:
    """The caching allocator's slack at the peak: a share of the step's transient bytes and a floor, or the
    step's largest block where the default allocator may hold it free only in fragments (said in `notes`)."""
    weights, constants, _ = parts.weights
    adapters = parts.adapters
    persistent = weights + constants + adapters.bytes + adapters.optimizer_bytes + parts.workspace
    phases = (parts.loss_phase, parts.backward_phase, parts.reference or 0, parts.rollout or 0)
    allocated = persistent + max(phases)
    transient = allocated - weights - constants
    slack = int(SLACK_FRACTION * transient) + SLACK_FLOOR_BYTES
    largest = largest_transient_block(run, parts.stored)
    if allocator_fragments() and largest > slack:
        slack = largest
        notes.append(
            f"allocator slack: one {largest / GiB:.2f} GiB block, the step's largest, which PyTorch's default "
            "caching allocator may hold free only as smaller fragments; "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts) avoids that"
        )
    return slack


def _held_components(run: ResolvedRun, parts: StepParts) -> tuple[VramComponent, ...]:
    """What is held through the whole step: the CUDA context, the weights, their quantisation constants,
    the adapters and the optimizer states."""
    weights, constants, weights_note = parts.weights
    adapters = parts.adapters
    context = run.gpu.context_bytes if run.gpu else DEFAULT_CONTEXT_BYTES
    lora_note = f"{count_label(adapters.params)} params in fp32" + (
        " + 16-bit compute copies" if adapters.compute_copies else ""
    )
    return (
        VramComponent(
            "context", "CUDA context", context, context, "outside", "driver, kernels, library handles"
        ),
        VramComponent("weights", "model weights", weights, weights, "persistent", weights_note),
        VramComponent(
            "quant_constants",
            "quantisation constants",
            constants,
            constants,
            "persistent",
            weight_formats.get(run.profile.quantized).constants_note,
        ),
        VramComponent("lora", "LoRA adapters", adapters.bytes, adapters.bytes, "persistent", lora_note),
        VramComponent(
            "optimizer",
            "optimizer states",
            adapters.optimizer_bytes,
            adapters.optimizer_bytes,
            "persistent",
            OPTIMIZER_NOTES[run.optimizer],
        ),
    )


def _phase_components(parts: StepParts, peak: str) -> tuple[VramComponent, ...]:
    """The step's own parts, each counted only in the phase that is the `peak`: the stored activations, the
    loss's buffers, a reference pass, a rollout, and the backward's moment."""
    stored, backward, reference, rollout = parts.stored, parts.backward, parts.reference, parts.rollout
    logits, logits_note = parts.loss

    def counted(key: str, label: str, value: int, phase: str, note: str) -> VramComponent:
        return VramComponent(key, label, value if phase == peak else 0, value, phase, note)

    optional = []
    if reference is not None:
        optional.append(
            counted(
                "reference",
                "reference pass",
                reference,
                "reference",
                "the reference forward, adapters off, no autograd: one layer or one log-prob chunk",
            )
        )
    if rollout is not None:
        optional.append(
            counted(
                "rollout",
                "rollout (KV cache, sampling)",
                rollout,
                "rollout",
                "GRPO's sampling: the static KV cache of every row, then prefill or one decode step",
            )
        )
    recompute_note = (
        "one layer's activations, rebuilt in backward" if backward.recompute else "nothing recomputed"
    )
    return (
        VramComponent("activations", "saved activations", stored.bytes, stored.bytes, "stored", stored.note),
        counted("logits", "logits and loss", logits, "loss", logits_note),
        *optional,
        counted("gradients", "LoRA gradients", backward.gradients, "backward", backward.gradients_note),
        counted("recompute", "recomputed layer", backward.recompute, "backward", recompute_note),
        counted(
            "backward_workspace", "backward buffers", backward.workspace, "backward", backward.workspace_note
        ),
        counted("dequant", "dequantised weight", backward.dequant, "backward", backward.dequant_note),
    )


def _settings(run: ResolvedRun) -> VramSettings:
    """The run the estimate describes (`estimate_vram` adds the method's and the keeping's)."""
    all_linear = set(run.targets) == set(run.inventory.lora_target_names())
    return VramSettings(
        seq_len=run.seq_len,
        batch_tokens=run.tokens,
        precision=run.precision,
        lora_r=run.r,
        targets=("all-linear",) if all_linear else tuple(run.targets),
        checkpointing=run.mode,
        optimizer=run.optimizer,
        loss=run.loss,
        trained_tokens=run.trained,
        fused=run.fused,
        kernels=run.profile.path,
    )

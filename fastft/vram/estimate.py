"""`estimate_vram`: will this LoRA/QLoRA run fit on that GPU, and what takes the memory?

The estimate is a sum of named components, each an explicit formula over the architecture (see
`fastft.vram.activations` for the activations). A training step has two memory peaks, and the larger wins:

- **loss**: every stored activation plus the logits and the loss's buffers (and the final norm's saved
  input, which the loss's backward frees before any layer's), just before backward starts;
- **backward**: the layer whose backward holds the most (the last one, unless stored activations are
  freed more slowly than LoRA gradients appear): every stored activation; for checkpointed layers, one
  layer recomputed; the larger of two moments inside that layer -- its backward (gradient buffers and a
  dequantised 4/8-bit weight) or, on 8-bit bases, its forward re-run reaching an 8-bit projection (outlier
  columns' weights dequantised in fp32) -- and the LoRA gradients made by then beyond the activations
  already freed.

Components of the phase that is not the peak are listed with their own size but add nothing to the total.
``allocated_bytes`` is what ``torch.cuda.max_memory_allocated`` reports; ``total_bytes`` adds the CUDA
context and the caching allocator's slack, and is what must fit the GPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from fastft.runtime.attention import KEEP_FROM_LENGTH
from fastft.runtime.checkpointing import BY_MEMORY, Checkpointing, CheckpointingError
from fastft.vram import activations as act
from fastft.vram.activations import Profile
from fastft.vram.gpus import DEFAULT_CONTEXT_BYTES, GiB, GpuSpec, MiB, detect_gpu, get_gpu
from fastft.vram.inventory import ModelInventory, inventory_of

PRECISIONS = ("bf16", "fp16", "fp32", "nf4", "int8")
CHECKPOINTING = BY_MEMORY  # the kinds an estimate answers for (its "auto" is "offload": the GPU's)
OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")
LOSSES = ("auto", "eager", "fused")

# NF4 (bitsandbytes): 4-bit codes, one absmax per block of 64 weights; with double quantisation the absmax
# are themselves 8-bit, with one fp32 absmax per 256 of them, plus a 16-entry fp32 codebook per weight
# and a 256-entry fp32 map for the nested state.
NF4_BLOCK = 64
NF4_NESTED_BLOCK = 256
# The fused linear cross-entropy (kernels/fused_linear_ce.py) keeps one chunk of logits of at most this
# many bytes (its LOGITS_CHUNK_BYTES for a frozen head, as LoRA leaves it), in the hidden states' dtype.
FUSED_CE_CHUNK_BYTES = 2**28
# cuBLAS workspaces PyTorch allocates through its caching allocator and keeps for the process: 32 MiB on
# Hopper and newer, one per (cuBLAS handle, stream), and handles are per thread -- the forward runs on the
# Python thread, backward on autograd's device thread: two. `fastft bench vram` saw 0.0645 GiB stay
# allocated once the first configuration was freed, in every later one.
CUBLAS_WORKSPACE_BYTES = 2 * 32 * MiB
# Caching-allocator slack at the peak (reserved − allocated): a fraction of what is allocated and freed
# during the step, plus a floor. To be calibrated from `fastft bench vram` (its "reserved" column).
SLACK_FRACTION = 0.05
SLACK_FLOOR_BYTES = 64 * MiB


class VramEstimateError(ValueError):
    """The estimate's inputs do not make sense together; the message names the input and the fix."""


@dataclass(frozen=True)
class VramComponent:
    """One block of the memory bar.

    ``bytes`` counts at the step's peak (components sum to the total); ``own_bytes`` is the component's own
    size, which differs only for the phase that is not the peak (then ``bytes`` is 0).
    """

    key: str
    label: str
    bytes: int
    own_bytes: int
    phase: str  # "outside" (not torch's allocator), "persistent", "stored", "loss" or "backward"
    note: str = ""


@dataclass(frozen=True)
class VramSettings:
    """The run the estimate describes."""

    seq_len: int
    batch_tokens: int
    precision: str
    lora_r: int
    targets: tuple[str, ...]
    checkpointing: str
    optimizer: str
    loss: str
    trained_tokens: int
    fused: bool  # fastft's fused kernels asked for (add_lora(fused=...))
    kernels: str  # which code path the estimate assumes (fastft fused kernels, or transformers + peft)


@dataclass(frozen=True)
class VramEstimate:
    """A breakdown of the GPU memory a LoRA training step needs. Sizes are in bytes."""

    model: str
    parameters: int
    lora_parameters: int
    settings: VramSettings
    components: tuple[VramComponent, ...]
    peak_phase: str  # "loss" or "backward"
    gpu: GpuSpec | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def total_bytes(self) -> int:
        """Everything on the device at the peak: CUDA context, allocations, allocator slack."""
        return sum(component.bytes for component in self.components)

    @property
    def allocated_bytes(self) -> int:
        """The peak of ``torch.cuda.max_memory_allocated`` (no context, no slack)."""
        return sum(c.bytes for c in self.components if c.phase != "outside")

    @property
    def capacity_bytes(self) -> int | None:
        return self.gpu.capacity_bytes if self.gpu else None

    @property
    def headroom_bytes(self) -> int | None:
        """Capacity left at the peak (negative: short by that much); None without a GPU."""
        return None if self.gpu is None else self.gpu.capacity_bytes - self.total_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.gpu is None else self.total_bytes <= self.gpu.capacity_bytes

    def phase_bytes(self, phase: str) -> int:
        """Allocated bytes at the peak of one phase ("loss" or "backward"): what lives throughout the step
        plus that phase's own components."""
        return sum(c.own_bytes for c in self.components if c.phase in ("persistent", "stored", phase))

    def component(self, key: str) -> VramComponent:
        for component in self.components:
            if component.key == key:
                return component
        raise KeyError(f"no component {key!r}; components: {[c.key for c in self.components]}")

    def __getitem__(self, key: str) -> int:
        """Bytes of one component at the peak, e.g. ``estimate["activations"]``."""
        return self.component(key).bytes

    def with_gpu(self, gpu: str | GpuSpec) -> VramEstimate:
        """The same estimate judged against another GPU (its CUDA context differs too)."""
        gpu = get_gpu(gpu)
        components = tuple(
            replace(c, bytes=gpu.context_bytes, own_bytes=gpu.context_bytes) if c.key == "context" else c
            for c in self.components
        )
        return replace(self, gpu=gpu, components=components)

    def to_dict(self) -> dict:
        """Plain data for JSON and plots: settings, components (bytes and GiB) and the verdict."""
        return {
            "model": self.model,
            "parameters": self.parameters,
            "lora_parameters": self.lora_parameters,
            "settings": {**asdict(self.settings), "targets": list(self.settings.targets)},
            "components": [
                {**asdict(c), "gib": c.bytes / GiB, "own_gib": c.own_bytes / GiB} for c in self.components
            ],
            "peak_phase": self.peak_phase,
            "allocated_bytes": self.allocated_bytes,
            "total_bytes": self.total_bytes,
            "total_gib": self.total_bytes / GiB,
            "gpu": None if self.gpu is None else {**asdict(self.gpu), "capacity_gib": self.gpu.capacity_gib},
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """The breakdown as aligned text, one component per line, then the total and the verdict."""
        s = self.settings
        targets = "all-linear" if s.targets == ("all-linear",) else ",".join(s.targets)
        head = [
            f"VRAM estimate: {self.model} ({_count(self.parameters)} parameters), {s.precision}, "
            f"LoRA r={s.lora_r} on {targets} ({_count(self.lora_parameters)} trainable)",
            f"seq_len {s.seq_len:,}, {s.batch_tokens:,} tokens per micro-batch ({s.trained_tokens:,} trained), "
            f"checkpointing={s.checkpointing}, optimizer={s.optimizer}, loss={s.loss}; {s.kernels}; "
            f"peak during {self.peak_phase}",
            "",
        ]
        unit, scale = ("GiB", GiB) if self.total_bytes >= GiB else ("MiB", MiB)
        width = max(len(c.label) for c in self.components)
        lines = [f"{'component':<{width}}  {unit:>8}  note", f"{'-' * width}  {'-' * 8}  ----"]
        for c in self.components:
            if c.bytes == c.own_bytes:
                value, note = f"{c.bytes / scale:8.2f}", c.note
            else:
                value = f"{'–':>8}"
                note = f"{c.own_bytes / scale:.2f} {unit} during {c.phase}, freed before the {self.peak_phase} peak"
            lines.append(f"{c.label:<{width}}  {value}  {note}".rstrip())
        lines.append(f"{'-' * width}  {'-' * 8}")
        lines.append(f"{'total':<{width}}  {self.total_bytes / scale:8.2f}  {self.verdict()}")
        tail = [f"note: {note}" for note in self.notes]
        return "\n".join(head + lines + tail)

    def verdict(self) -> str:
        if self.gpu is None:
            return "(no GPU given: pass gpu='rtx4090' or another preset to judge the fit)"
        headroom = self.headroom_bytes / GiB
        if self.fits:
            return f"fits {self.gpu} with {headroom:.2f} GiB to spare"
        return f"does NOT fit {self.gpu}: short by {-headroom:.2f} GiB"

    def __str__(self) -> str:
        return self.table()


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


# -- the estimate -------------------------------------------------------------------------------------


def estimate_vram(
    model,
    seq_len: int = 2048,
    batch_tokens: int | None = None,
    precision: str | None = None,
    lora_r: int | None = None,
    targets: str | Sequence[str] | None = None,
    checkpointing: Checkpointing | str | bool = "recompute",
    optimizer: str = "adamw",
    gpu: str | GpuSpec | None = "auto",
    *,
    fused: bool = True,
    loss: str = "auto",
    trained_fraction: float = 1.0,
    keep_attention: bool | None = None,
) -> VramEstimate:
    """Estimate the GPU memory of LoRA/QLoRA training with fastft's trainer, component by component.

    `model`: an embedded preset ("tiny-llama"), a catalog hub id (offline), a local folder or any hub id
    (only its config.json is read), a `transformers` config, or a loaded model (its real dtypes, 4/8-bit
    quantisation and attached LoRA are read). `seq_len`: the longest sequence (a packed bin);
    `batch_tokens`: tokens per micro-batch (default `seq_len`: one bin). `precision`: "bf16", "fp16",
    "fp32", "nf4" (QLoRA, double quantisation) or "int8"; default bf16, or what a loaded model uses.
    `lora_r` (default 16) and `targets` ("all-linear" or short names such as ``["q_proj", "v_proj"]``).
    `checkpointing`: a `Checkpointing` or what it parses, as in `add_lora`: "none", "recompute" (each
    layer's input kept, the layer recomputed in backward) or "offload" (layer inputs in host memory, two
    buffers on the device); "auto" is "offload", what `add_lora` picks on a GPU. `optimizer`: "adamw" (fp32 m and v), "adamw_8bit" or "sgd". `gpu`: a preset name
    (`GPUS`), a `GpuSpec`, "auto" (the visible GPU, if any) or None. `fused`: fastft's fused kernels, as
    ``add_lora(fused=True)`` (the default) swaps them in for Llama/Mistral/Qwen2/Qwen3(-MoE)/Mixtral; False
    for transformers + peft modules. `loss`: "auto" (fused linear cross-entropy with the fused kernels, else
    eager), "eager" (logits of trained positions, fp32 log-softmax) or "fused". `trained_fraction`: share
    of tokens that carry a label (1.0, every token, is the worst case). `keep_attention`: with "offload",
    each layer's attention output (and the fused o_proj's) travels with its input so the recompute skips
    the attention forward, for sequences of ``KEEP_FROM_LENGTH`` tokens and more, and each MoE layer's
    routing order (4 bytes per routed slot) with it; False for an offloader that recomputes them; None (the
    default) as `fastft.runtime.offload.enable_offload` decides: keep on 16-bit bases, not on quantised ones.
    """
    inventory = inventory_of(model)
    loaded = inventory.loaded
    precision = _resolve_precision(precision, loaded)
    mode = _resolve_checkpointing(checkpointing)
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
    gpu_spec = _resolve_gpu(gpu)
    # fp16 compute (asked for, or a GPU without bf16): peft upcasts a quantised model's other weights to fp32
    fp16 = precision == "fp16" or (gpu_spec is not None and not gpu_spec.bf16)
    upcast = loaded.residual_bytes == 4 if loaded is not None else fp16
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
    trained = max(1, round(tokens * trained_fraction))

    notes: list[str] = []
    weights, constants, weights_note = _weights(inventory, profile)
    lora_modules = [
        linear for linear in inventory.linears if linear.lora_targetable and linear.short in target_names
    ]
    lora_params = sum(r * (linear.in_features + linear.out_features) for linear in lora_modules)
    if "experts" in target_names:
        lora_params += inventory.expert_lora_params(r)
    if loaded and loaded.lora_params and lora_r is None and targets is None:
        lora_params = loaded.lora_params
    # peft keeps adapters in fp32 (4 B), and under 16-bit compute a 16-bit copy (2 B) lives through the step:
    # autocast's cast cache of every adapter on the transformers path; on the fused path
    # fastft.kernels.lora.AdapterComputeCopies of the fused projections' adapters (experts cast on use)
    copied = lora_params
    if profile.fused_projections:
        fused_names = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        fused_lora = sum(r * (m.in_features + m.out_features) for m in lora_modules if m.short in fused_names)
        copied = min(lora_params, fused_lora)
    autocast_copies = bool(profile.lora_copy) and copied > 0
    lora_bytes = 4 * lora_params + (2 * copied if autocast_copies else 0)
    gradient_bytes = 4 * lora_params
    optimizer_bytes = {"adamw": 8, "adamw_8bit": 2, "sgd": 0}[optimizer] * lora_params

    # -- activations kept from forward to backward ------------------------------------------------------
    targets_set = set(target_names)
    layers = inventory.layers
    per_layer = [act.layer_bytes(layer, inventory, profile, targets_set, r) for layer in layers]
    # bitsandbytes' 8-bit matmuls keep their inputs (and outlier columns) as ctx attributes: outside the
    # checkpoint's saved-tensor hooks, and alive until the whole graph is freed after backward
    kept = [act.int8_kept_bytes(layer, inventory, profile) for layer in layers]
    h = inventory.hidden_size
    final_norm = act.norm_bytes(h, profile)
    layer_input = h * profile.residual
    # what an offloaded layer keeps beside its input (`fastft.runtime.offload.KeptTensors`): its attention
    # output (16-bit) and fp32 log-sum-exp from `KEEP_FROM_LENGTH` tokens on, where it pays, with the fused
    # o_proj's output (`fastft.models.patch`), and an MoE layer's routing order (int32 sorted slots) at any
    # length
    if keep_attention is None:  # `fastft.runtime.offload.keeps_by_default`
        keep_attention = profile.quantized is None
    keeping = mode == "offload" and keep_attention
    attention_kept = keeping and seq_len >= KEEP_FROM_LENGTH
    kept_attention = inventory.num_heads * (inventory.head_dim * 2 + 4) if attention_kept else 0
    kept_output = layer_input if attention_kept and profile.fused_projections else 0
    moe_layers = sum(1 for layer in layers if layer.moe)
    kept_routing = 4 * inventory.experts_per_token if keeping and moe_layers else 0
    if mode == "none":
        # the first layer's input norm saves nothing: the embeddings need no gradient
        stored_per_token = sum(per_layer) - (act.norm_bytes(h, profile) if per_layer else 0)
        released = [b - k for b, k in zip(per_layer, kept, strict=True)]
        stored_note = f"all {len(per_layer)} layers' saved tensors (no checkpointing)"
    elif mode == "recompute":
        stored_per_token = len(per_layer) * layer_input + sum(kept)
        released = [layer_input] * len(per_layer)
        stored_note = f"one input per layer ({len(per_layer)} × hidden × {profile.residual} B per token)"
    else:
        stored_per_token = 2 * (layer_input + kept_attention + kept_output + kept_routing)
        released = [0] * len(per_layer)
        what = "layer inputs" + (" and attention outputs" if kept_attention else "")
        what += " and routing orders" if kept_routing else ""
        stored_note = f"{what} in host memory; two buffers for them on the device"
        host = len(per_layer) * (layer_input + kept_attention + kept_output) + moe_layers * kept_routing
        host = host * tokens / GiB
        notes.append(f"offload keeps {host:.2f} GiB of {what} in pinned host memory")
    if mode != "offload" and sum(kept):
        outliers = sum(act.int8_outlier_bytes(layer, inventory, profile) for layer in layers) * tokens
        stored_note += "; bitsandbytes' 8-bit inputs and outlier columns"
        notes.append(
            "8-bit: bitsandbytes keeps every projection's input and its outlier columns (|x| >= 6) for "
            "backward even when checkpointed; counted as all of down_proj's input columns, the worst case "
            f"(random weights reach it): {outliers / GiB:.2f} GiB here. Trained weights keep fewer"
        )
    stored = stored_per_token * tokens

    # -- the loss phase -----------------------------------------------------------------------------------
    vocab = inventory.vocab_size
    # peft upcast a quantised fp16 model's head to fp32; the eager matmul runs under autocast on a copy
    head_fp32 = profile.quantized is not None and profile.param == 4
    head_copy = (
        (inventory.head_params or inventory.embedding_params) * 2 if head_fp32 and loss == "eager" else 0
    )
    # the final norm's saved input (the last layer's output) and rstd live until the loss's backward
    # reaches it, before any layer's: a loss-phase tensor
    if loss == "eager":
        # bf16 logits (2) → fp32 copy (4) → log-softmax output (4, saved); in backward the saved output,
        # its incoming gradient and the gradient it produces (4 + 4 + 4) are alive at once
        logits = trained * vocab * 12 + head_copy + final_norm * tokens
        logits_note = (
            f"{trained:,} trained positions × vocab {vocab:,} × 12 B (fp32 log-softmax and its grads)"
        )
    else:
        # the decoder's output (the final norm's, all tokens), the trained positions' copy of it
        # (index_select) and its gradient (computed in the forward), the fp32 row losses, and one reused
        # [rows, vocab] logits buffer in the hidden states' dtype
        rows = fused_ce_rows(trained, vocab, profile.residual)
        logits = (
            (final_norm + layer_input) * tokens
            + rows * vocab * profile.residual
            + 2 * trained * h * profile.residual
            + 4 * trained
        )
        logits_note = (
            f"one chunk of {rows:,} rows × vocab {vocab:,} (fused linear cross-entropy), the final norm's "
            "input and output, the trained hidden states and their gradient"
        )
    if head_copy:
        logits_note += "; bf16 copy of the fp32 head"
    attention_ws = 2 * inventory.head_dim * profile.residual * tokens + CUBLAS_WORKSPACE_BYTES

    # -- the backward phase -------------------------------------------------------------------------------
    # The recomputed layer's first norm saves the layer input, which the stored activations already hold.
    # An offloaded layer is re-run whole (its output is the root of the gradients taken through it);
    # checkpointing stops the re-run at the last tensor backward needs, before the output exists.
    reuse = layer_input if act.first_norm_reads_stored_input(profile) else 0
    # ... but not a kept attention output and log-sum-exp: the recompute reads them from the buffer
    rerun_output = layer_input - kept_attention if mode == "offload" else 0
    recompute = (
        0
        if mode == "none"
        else max(
            (b - (reuse if layer.norms else 0) for b, layer in zip(per_layer, layers, strict=True)), default=0
        )
        * tokens
        + rerun_output * tokens
    )
    backward_ws = (
        max(
            (act.backward_workspace_bytes(layer, inventory, profile, targets_set, r) for layer in layers),
            default=0,
        )
        * tokens
    )
    dequant = _dequant_bytes(inventory, profile)
    workspace_note = "gradients flowing through the layer in backward"
    dequant_note = "largest quantised linear, unpacked for its matmul" if dequant else "no quantised weights"
    # An 8-bit projection's forward (re-run in backward under checkpointing) can outweigh the layer's
    # backward buffers: its outlier columns' weights are dequantised in fp32. The moment is then that
    # forward beside the gradient arriving at the layer.
    int8_forward = max(
        (act.int8_forward_transient_bytes(layer, inventory, profile, tokens) for layer in layers), default=0
    )
    if int8_forward and layer_input * tokens + int8_forward > backward_ws + dequant:
        backward_ws, dequant = layer_input * tokens, int8_forward
        workspace_note = "the gradient arriving at the layer whose 8-bit forward is the peak"
        dequant_note = (
            "an 8-bit projection's forward: its int8 input, down_proj's outlier columns' weights in fp32 "
            "(worst case: all) or the int32 GEMM output"
        )
    # LoRA gradients appear layer by layer while backward frees each layer's stored activations: at the
    # backward peak only those beyond the activations already freed count
    layer_grads = [4 * act.layer_lora_params(layer, inventory, targets_set, r) for layer in layers]
    gradients = min(gradient_bytes, _gradients_at_peak(layer_grads, released, tokens, gradient_bytes))
    gradients_note = f"fp32, {gradient_bytes / GiB:.2f} GiB in all" + (
        "; made layer by layer as backward frees stored activations, so few exist at the peak"
        if gradients < gradient_bytes
        else ""
    )

    loss_phase = stored + logits
    backward_phase = stored + recompute + backward_ws + dequant + gradients
    peak = "loss" if loss_phase > backward_phase else "backward"
    persistent = weights + constants + lora_bytes + optimizer_bytes + attention_ws
    allocated = persistent + max(loss_phase, backward_phase)
    transient = allocated - weights - constants
    slack = int(SLACK_FRACTION * transient) + SLACK_FLOOR_BYTES
    context = gpu_spec.context_bytes if gpu_spec else DEFAULT_CONTEXT_BYTES

    def at_peak(value: int, phase: str) -> int:
        return value if phase == peak else 0

    components = (
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
            _constants_note(profile),
        ),
        VramComponent(
            "lora",
            "LoRA adapters",
            lora_bytes,
            lora_bytes,
            "persistent",
            f"{_count(lora_params)} params in fp32" + (" + 16-bit compute copies" if autocast_copies else ""),
        ),
        VramComponent(
            "optimizer",
            "optimizer states",
            optimizer_bytes,
            optimizer_bytes,
            "persistent",
            {"adamw": "AdamW m and v in fp32", "adamw_8bit": "8-bit AdamW m and v", "sgd": "none"}[optimizer],
        ),
        VramComponent("activations", "saved activations", stored, stored, "stored", stored_note),
        VramComponent("logits", "logits and loss", at_peak(logits, "loss"), logits, "loss", logits_note),
        VramComponent(
            "gradients",
            "LoRA gradients",
            at_peak(gradients, "backward"),
            gradients,
            "backward",
            gradients_note,
        ),
        VramComponent(
            "recompute",
            "recomputed layer",
            at_peak(recompute, "backward"),
            recompute,
            "backward",
            "one layer's activations, rebuilt in backward" if recompute else "nothing recomputed",
        ),
        VramComponent(
            "backward_workspace",
            "backward buffers",
            at_peak(backward_ws, "backward"),
            backward_ws,
            "backward",
            workspace_note,
        ),
        VramComponent(
            "dequant",
            "dequantised weight",
            at_peak(dequant, "backward"),
            dequant,
            "backward",
            dequant_note,
        ),
        VramComponent(
            "workspace",
            "attention and cuBLAS workspace",
            attention_ws,
            attention_ws,
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
    if gpu_spec is not None and not gpu_spec.bf16 and precision == "bf16":
        notes.append(f"{gpu_spec.label} has no bf16: training runs in fp16 (the same bytes)")
    settings = VramSettings(
        seq_len=seq_len,
        batch_tokens=tokens,
        precision=precision,
        lora_r=r,
        targets=("all-linear",)
        if set(target_names) == set(inventory.lora_target_names())
        else tuple(target_names),
        checkpointing=mode,
        optimizer=optimizer,
        loss=loss,
        trained_tokens=trained,
        fused=fused,
        kernels=profile.path,
    )
    return VramEstimate(
        model=inventory.name,
        parameters=inventory.total_params,
        lora_parameters=lora_params,
        settings=settings,
        components=components,
        peak_phase=peak,
        gpu=gpu_spec,
        notes=tuple(notes),
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
    aliases = {
        "4bit": "nf4",
        "4-bit": "nf4",
        "qlora": "nf4",
        "8bit": "int8",
        "8-bit": "int8",
        "bfloat16": "bf16",
    }
    precision = aliases.get(precision, precision)
    if precision not in PRECISIONS:
        raise VramEstimateError(f"precision={precision!r}: use one of {PRECISIONS}.")
    return precision


def _dtype_size(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _resolve_checkpointing(mode: Checkpointing | str | bool) -> str:
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
    from fastft.models.lora import LoraTargetError, check_targets

    try:
        return check_targets(targets, available, inventory.name)
    except LoraTargetError as error:  # the same check and message as add_lora's, as the estimator's error
        raise VramEstimateError(str(error)) from None


def _resolve_gpu(gpu) -> GpuSpec | None:
    if gpu is None:
        return None
    if gpu == "auto":
        return detect_gpu()
    return get_gpu(gpu)


def _nf4_constants(numel: int) -> int:
    blocks = math.ceil(numel / NF4_BLOCK)
    # 8-bit absmax per block, fp32 absmax per 256 blocks, fp32 offset, NF4 codebook (16) and nested map (256)
    return blocks + 4 * math.ceil(blocks / NF4_NESTED_BLOCK) + 4 + 4 * 16 + 4 * 256


def _weights(inventory: ModelInventory, profile: Profile) -> tuple[int, int, str]:
    loaded = inventory.loaded
    if loaded is not None:
        upcast = loaded.upcast_pending_params * 2  # 16-bit → fp32 adds 2 B each when add_lora runs
        note = f"as loaded ({loaded.quantization or str(loaded.compute_dtype).removeprefix('torch.')})"
        if upcast:
            note += ", + fp32 upcast of non-quantised weights by add_lora"
        return loaded.weight_bytes + upcast, loaded.quant_constant_bytes, note
    biases = sum(linear.out_features for linear in inventory.linears if linear.bias)
    rest = (
        inventory.head_params + inventory.embedding_params + inventory.expert_params + inventory.other_params
    )
    if profile.quantized is None:
        total = (inventory.linear_params + biases + rest) * profile.param
        return total, 0, f"{_count(inventory.total_params)} × {profile.param} B"
    per_weight = 0.5 if profile.quantized == "nf4" else 1
    quantized = int(inventory.linear_params * per_weight)
    if profile.quantized == "nf4":
        constants = sum(_nf4_constants(linear.weight_params) for linear in inventory.linears)
    else:  # int8: one fp32 scale per output row
        constants = sum(4 * linear.out_features for linear in inventory.linears)
    kept = (biases + rest) * profile.param
    others = "embeddings, head, norms" + (", experts" if inventory.expert_params else "")
    if profile.param == 4:
        kept_note = f"in fp32 ({others}: peft's k-bit preparation upcasts them for fp16 compute)"
    else:
        kept_note = f"in bf16 ({others})"
    note = f"{_count(inventory.linear_params)} linear weights in {profile.quantized}, {_count(biases + rest)} {kept_note}"
    return quantized + kept, constants, note


def _constants_note(profile: Profile) -> str:
    if profile.quantized == "nf4":
        return f"absmax per {NF4_BLOCK} weights, double-quantised (8-bit + fp32 per {NF4_NESTED_BLOCK})"
    if profile.quantized == "int8":
        return "one fp32 scale per output row"
    return "none (16/32-bit weights)"


def _dequant_bytes(inventory: ModelInventory, profile: Profile) -> int:
    if profile.quantized is None or not inventory.linears:
        return 0
    largest = max(linear.weight_params for linear in inventory.linears)
    if profile.quantized == "nf4":
        # dequantize_4bit → bf16 weight, and the fp32 absmax it first expands from the nested state
        return largest * 2 + 4 * math.ceil(largest / NF4_BLOCK)
    return largest * profile.act  # int8: CB cast to the input's dtype for the input gradient


def fused_ce_rows(trained: int, vocab: int, element_size: int) -> int:
    """Rows of the fused linear cross-entropy's logits buffer, as `fastft.kernels.fused_linear_ce`'s
    ``default_chunk_size`` picks them: as many as keep a chunk within ``FUSED_CE_CHUNK_BYTES``, balanced
    over the chunks that takes (at 8,192 rows and Qwen3's 151,936 words: 10 chunks of 820 rows, 0.23 GiB,
    not 883 rows and 0.25 GiB)."""
    max_rows = max(1, FUSED_CE_CHUNK_BYTES // (vocab * element_size))
    chunks = -(-max(trained, 1) // max_rows)
    return max(1, -(-trained // chunks))


def _gradients_at_peak(layer_grads: list[int], released: list[int], tokens: int, total: int) -> int:
    """LoRA gradient bytes at the backward peak, beyond the stored activations freed by then.

    Backward runs the layers last to first; when layer i runs, the gradients of layers i..L-1 exist and
    the activations layers i+1..L-1 stored (``released`` per token each) are freed. The largest surplus of
    the first over the second is what the gradients add to a peak that counts every stored activation:
    one layer's under recompute (a layer input per token outweighs a layer's adapters), all of them under
    offload (nothing stored on the device is freed). Adapters outside the layers count from the start.
    """
    outside = max(0, total - sum(layer_grads))
    best = grads = freed = 0
    for grad, free in zip(reversed(layer_grads), reversed(released), strict=True):
        grads += grad
        best = max(best, grads - freed)
        freed += free * tokens
    return best + outside


# -- the longest context, and what to change when it does not fit --------------------------------------


def max_context(
    model,
    gpu: str | GpuSpec | None = "auto",
    *,
    multiple_of: int = 128,
    limit: int = 1 << 22,
    **settings,
) -> int:
    """The longest `seq_len` (a multiple of `multiple_of`) whose estimate fits `gpu`; 0 if none does.

    `settings` are `estimate_vram`'s (precision, lora_r, checkpointing, …). A micro-batch holds one
    sequence unless `batch_tokens` is given (it then grows with `seq_len` when shorter).
    """
    gpu_spec = _require_gpu(gpu)
    inventory = inventory_of(model)
    settings.pop("seq_len", None)
    fixed_tokens = settings.pop("batch_tokens", None)

    def fits_at(length: int) -> bool:
        tokens = None if fixed_tokens is None else max(fixed_tokens, length)
        return bool(estimate_vram(inventory, length, tokens, gpu=gpu_spec, **settings).fits)

    if not fits_at(multiple_of):
        return 0
    low, high = multiple_of, multiple_of * 2
    while high <= limit and fits_at(high):
        low, high = high, high * 2
    if high > limit:
        return low if not fits_at(limit) else limit
    while high - low > multiple_of:  # invariant: fits(low), not fits(high)
        middle = (low + high) // 2 // multiple_of * multiple_of
        if middle in (low, high):
            break
        if fits_at(middle):
            low = middle
        else:
            high = middle
    return low


@dataclass(frozen=True)
class Fix:
    """One change that makes the run fit, with the estimate it leads to."""

    description: str
    changes: dict
    total_bytes: int


@dataclass(frozen=True)
class FitVerdict:
    """Whether a run fits a GPU and, when it does not, the changes that make it fit (best first)."""

    fits: bool
    estimate: VramEstimate
    fixes: tuple[Fix, ...] = ()

    def __bool__(self) -> bool:
        return self.fits

    @property
    def message(self) -> str:
        e = self.estimate
        need = f"{e.total_bytes / GiB:.2f} GiB"
        if self.fits:
            return f"Fits: needs {need} of {e.gpu} ({e.headroom_bytes / GiB:.2f} GiB to spare)."
        if not self.fixes:
            return (
                f"Does not fit: needs {need} of {e.gpu}, and no single change tried here (checkpointing, "
                "seq_len, 4-bit, rank, fused loss) is enough. Use a smaller model or a larger GPU."
            )
        fixes = "; ".join(f"{fix.description} (→ {fix.total_bytes / GiB:.2f} GiB)" for fix in self.fixes)
        return f"Does not fit: needs {need} of {e.gpu}. Fixes: {fixes}."

    def __str__(self) -> str:
        return self.message


def fits(
    model,
    seq_len: int = 2048,
    gpu: str | GpuSpec | None = "auto",
    **settings,
) -> FitVerdict:
    """Whether `model` trains at `seq_len` on `gpu`, and if not, which changes make it fit.

    Each fix is computed, not guessed: stronger checkpointing, the fused loss, a shorter `seq_len` (the
    longest that fits), 4-bit weights, a lower LoRA rank, or 4-bit with offloaded checkpointing; only
    changes whose estimate fits are returned, least intrusive first.
    """
    gpu_spec = _require_gpu(gpu)
    inventory = inventory_of(model)
    settings.pop("gpu", None)
    estimate = estimate_vram(inventory, seq_len, gpu=gpu_spec, **settings)
    if estimate.fits:
        return FitVerdict(True, estimate)
    s = estimate.settings
    base = {
        "batch_tokens": None if s.batch_tokens == s.seq_len else s.batch_tokens,
        "precision": s.precision if inventory.loaded is None else None,
        "lora_r": s.lora_r,
        "targets": list(s.targets) if s.targets != ("all-linear",) else "all-linear",
        "checkpointing": s.checkpointing,
        "optimizer": s.optimizer,
        "loss": s.loss,
        "fused": s.fused,
        "trained_fraction": s.trained_tokens / s.batch_tokens,
    }

    def fix(description: str, changes: dict) -> Fix | None:
        trial = estimate_vram(
            inventory,
            changes.get("seq_len", seq_len),
            gpu=gpu_spec,
            **{**base, **{k: v for k, v in changes.items() if k != "seq_len"}},
        )
        return Fix(description, changes, trial.total_bytes) if trial.fits else None

    # least intrusive first: memory traded for time, then a shorter context, then quality-affecting changes
    found: list[Fix | None] = [
        fix(f"use checkpointing='{mode}'", {"checkpointing": mode})
        for mode in CHECKPOINTING[CHECKPOINTING.index(s.checkpointing) + 1 :]
    ]
    if (
        s.loss == "eager"
        and not s.fused
        and act.fusion_plan(inventory.model_type, inventory.hidden_act).fuses_decoder
    ):
        found.append(
            fix(
                "use fastft's fused kernels (add_lora(fused=True)): fused loss, fewer saved activations",
                {"fused": True, "loss": "auto"},
            )
        )
    longest = max_context(inventory, gpu_spec, **{k: v for k, v in base.items() if k != "batch_tokens"})
    if 0 < longest < seq_len:
        found.append(fix(f"lower seq_len to {longest:,}", {"seq_len": longest, "batch_tokens": None}))
    rank = s.lora_r // 2
    while rank >= 1:  # the largest rank that fits
        lower = fix(f"lower lora_r to {rank}", {"lora_r": rank})
        if lower is not None:
            found.append(lower)
            break
        rank //= 2
    if inventory.loaded is None and s.precision in ("bf16", "fp16", "fp32"):
        nf4 = fix("use 4-bit weights (precision='nf4', QLoRA)", {"precision": "nf4"})
        found.append(nf4)
        if nf4 is None and s.checkpointing != "offload":
            found.append(
                fix(
                    "use 4-bit weights and checkpointing='offload'",
                    {"precision": "nf4", "checkpointing": "offload"},
                )
            )
    return FitVerdict(False, estimate, tuple(f for f in found if f is not None))


def _require_gpu(gpu) -> GpuSpec:
    spec = _resolve_gpu(gpu)
    if spec is None:
        from fastft.vram.gpus import GPUS

        raise VramEstimateError(
            "No GPU to judge the fit against"
            + (" (none is visible here)" if gpu == "auto" else "")
            + f": pass gpu='rtx4090' or another preset ({', '.join(GPUS)}), or a GpuSpec."
        )
    return spec

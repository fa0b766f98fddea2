"""The bytes of each part of a training step, one formula a part over the architecture: the weights and their
quantisation constants, the LoRA adapters with their gradients and optimizer states, the activations stored
from forward to backward (by checkpointing mode), the loss phase's logits and buffers, the workspace that lives
through the step, and the backward phase's moment (`fastft.vram.estimate` adds them up; per layer and tensor,
the activations are `fastft.vram.activation_bytes`'s)."""

from __future__ import annotations

from dataclasses import dataclass

import fastft.weight_formats as weight_formats
from fastft.kernels import tiling
from fastft.vram import activation_bytes as act
from fastft.vram.activation_bytes import Profile
from fastft.vram.gpus import GiB, MiB
from fastft.vram.inventory import ModelInventory
from fastft.vram.result import count_label
from fastft.vram.settings import ResolvedRun

# The fused linear cross-entropy (fastft/kernels/fused_linear_ce.py) keeps one chunk of logits of at most this
# many bytes (its LOGITS_CHUNK_BYTES for a frozen head, as LoRA leaves it), in the hidden states' dtype.
FUSED_CE_CHUNK_BYTES = 2**28
# cuBLAS workspaces PyTorch allocates through its caching allocator and keeps for the process: 32 MiB on
# Hopper and newer, one per (cuBLAS handle, stream), and handles are per thread -- the forward runs on the
# Python thread, backward on autograd's device thread: two (`fastft bench vram` sees them stay allocated
# once the first configuration is freed).
CUBLAS_WORKSPACE_BYTES = 2 * 32 * MiB


# -- step 2: the weights and their quantisation constants ----------------------------------------------------


def weight_bytes(inventory: ModelInventory, profile: Profile) -> tuple[int, int, str]:
    """The weights' bytes, their quantisation constants' and the note: as loaded, or by the precision's format."""
    loaded = inventory.loaded
    if loaded is not None:
        note = f"as loaded ({loaded.quantization or str(loaded.compute_dtype).removeprefix('torch.')})"
        return loaded.weight_bytes, loaded.quant_constant_bytes, note
    biases = sum(linear.out_features for linear in inventory.linears if linear.bias)
    rest = (
        inventory.head_params + inventory.embedding_params + inventory.expert_params + inventory.other_params
    )
    if profile.quantized is None:
        total = (inventory.linear_params + biases + rest) * profile.param
        return total, 0, f"{count_label(inventory.total_params)} × {profile.param} B"
    weight_format = weight_formats.get(profile.quantized)
    # FP8 stores the experts' stacked gate/up [E, 2I, H] and down [E, H, I] weights too, a scale per output row
    moe_layers = sum(1 for layer in inventory.layers if layer.moe) if weight_format.quantizes_experts else 0
    stacks = moe_layers * inventory.experts * 3 * inventory.moe_intermediate * inventory.hidden_size
    stack_rows = moe_layers * inventory.experts * (2 * inventory.moe_intermediate + inventory.hidden_size)
    quantized = int((inventory.linear_params + stacks) * weight_format.bits_per_weight / 8)
    constants = sum(
        weight_format.constant_bytes(linear.weight_params, linear.out_features)
        for linear in inventory.linears
    ) + (weight_format.constant_bytes(stacks, stack_rows) if stacks else 0)
    kept = (biases + rest - stacks) * profile.param
    others = "embeddings, head, norms" + (", experts" if inventory.expert_params and not stacks else "")
    quantized_label = "linear weights" + (" and expert stacks" if stacks else "")
    note = f"{count_label(inventory.linear_params + stacks)} {quantized_label} in {profile.quantized}, {count_label(biases + rest - stacks)} in 16-bit ({others})"
    return quantized + kept, constants, note


# -- step 3: LoRA adapters, their gradients and the optimizer ------------------------------------------------


@dataclass(frozen=True)
class Adapters:
    """The LoRA adapters' bytes, their gradients' and their optimizer states'."""

    params: int
    bytes: int  # the fp32 adapters and their 16-bit compute copies
    compute_copies: bool
    gradient_bytes: int  # all of them (`backward_phase` counts those alive at the peak)
    optimizer_bytes: int


def adapter_bytes(run: ResolvedRun) -> Adapters:
    """The adapters of `run`'s targets at rank r (or those a loaded model has), in fp32 with any 16-bit copies."""
    inventory, profile, r = run.inventory, run.profile, run.r
    lora_modules = [
        linear for linear in inventory.linears if linear.lora_targetable and linear.short in run.targets
    ]
    lora_params = sum(r * (linear.in_features + linear.out_features) for linear in lora_modules)
    if "experts" in run.targets:
        lora_params += inventory.expert_lora_params(r)
    if run.loaded_lora:
        lora_params = inventory.loaded.lora_params
    # peft keeps adapters in fp32 (4 B), and under 16-bit compute a 16-bit copy (2 B) lives through the step:
    # autocast's cast cache of every adapter on the transformers path; on the fused path
    # fastft.kernels.lora.AdapterComputeCopies of the fused projections' adapters (experts cast on use)
    copied = lora_params
    if profile.fused_projections:  # copies only where fastft keeps them (off by default: cast where used)
        fused_names = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
        fused_lora = sum(r * (m.in_features + m.out_features) for m in lora_modules if m.short in fused_names)
        copied = min(lora_params, fused_lora) if tiling.ADAPTER_COMPUTE_COPIES else 0
    autocast_copies = bool(profile.lora_copy) and copied > 0
    return Adapters(
        params=lora_params,
        bytes=4 * lora_params + (2 * copied if autocast_copies else 0),
        compute_copies=autocast_copies,
        gradient_bytes=4 * lora_params,
        optimizer_bytes={"adamw": 8, "adamw_8bit": 2, "sgd": 0}[run.optimizer] * lora_params,
    )


# -- step 4: activations kept from forward to backward, by checkpointing mode --------------------------------


@dataclass(frozen=True)
class Stored:
    """The activations stored from forward to backward, and what offloading keeps in host memory."""

    bytes: int
    note: str
    per_layer: list[int]  # what each layer saves, per token, when it is not checkpointed
    released: list[int]  # what each layer's backward frees of the stored activations, per token
    kept_attention: int  # an offloaded layer's kept attention output and log-sum-exp, per token
    keeping: bool = False  # offloaded layers keep something beside their inputs
    host_bytes: int = 0  # what offloading pins in host memory: every layer's input, and what it keeps
    host_input_bytes: int = 0  # of those, the layer inputs alone (without them the offloader recomputes)


def stored_activations(run: ResolvedRun, notes: list[str]) -> Stored:
    """What the forward stores for backward under `run`'s checkpointing mode; `notes` gets what the table says."""
    inventory, profile, mode, tokens = run.inventory, run.profile, run.mode, run.tokens
    layers = inventory.layers
    per_layer = [
        act.layer_bytes(layer, inventory, profile, set(run.targets), run.r, tokens) for layer in layers
    ]
    # bitsandbytes' 8-bit matmuls keep their inputs (and outlier columns) as ctx attributes: outside the
    # checkpoint's saved-tensor hooks, and alive until the whole graph is freed after backward
    kept = [act.int8_kept_bytes(layer, inventory, profile) for layer in layers]
    h = inventory.hidden_size
    layer_input = run.layer_input
    # what an offloaded layer keeps beside its input (`fastft.runtime.context.KeptTensors`): its attention
    # output (16-bit) and fp32 log-sum-exp from `run.keep_from` tokens on, where it pays, with the fused
    # o_proj's output (`fastft.models.patch`) on 16-bit bases, and an MoE layer's routing order (int32
    # sorted slots); a quantised base keeps only from `run.keep_from` tokens a micro-batch
    keeping = mode == "offload" and run.keep_attention and (not run.keep_if_fits or tokens >= run.keep_from)
    attention_kept = keeping and run.seq_len >= run.keep_from
    kept_attention = inventory.num_heads * (inventory.head_dim * 2 + 4) if attention_kept else 0
    kept_output = layer_input if attention_kept and run.keep_output and profile.fused_projections else 0
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
        host_per_token = len(per_layer) * (layer_input + kept_attention + kept_output)
        host_per_token += moe_layers * kept_routing
        notes.append(f"offload keeps {host_per_token * tokens / GiB:.2f} GiB of {what} in pinned host memory")
    if mode != "offload" and sum(kept):
        outliers = sum(act.int8_outlier_bytes(layer, inventory, profile) for layer in layers) * tokens
        stored_note += "; bitsandbytes' 8-bit inputs and outlier columns"
        notes.append(
            "8-bit: bitsandbytes keeps every projection's input and its outlier columns (|x| >= 6) for "
            "backward even when checkpointed; counted as all of down_proj's input columns, the worst case "
            f"(random weights reach it): {outliers / GiB:.2f} GiB here. Trained weights keep fewer"
        )
    keeping = bool(kept_attention or kept_routing)
    host = (host_per_token * tokens, len(per_layer) * layer_input * tokens) if mode == "offload" else (0, 0)
    return Stored(stored_per_token * tokens, stored_note, per_layer, released, kept_attention, keeping, *host)


# -- step 5: the loss phase: logits and the loss's buffers ---------------------------------------------------


def logits_and_loss(run: ResolvedRun) -> tuple[int, str]:
    """The loss phase's bytes beyond the stored activations (eager or fused linear cross-entropy), and the note."""
    inventory, profile, trained, tokens = run.inventory, run.profile, run.trained, run.tokens
    vocab, h = inventory.vocab_size, inventory.hidden_size
    final_norm = act.norm_bytes(h, profile)
    # a quantised model loaded in fp32 (or upcast by peft's k-bit preparation outside fastft, or by
    # add_lora for modules trained whole in fp16) has an fp32 head; the eager matmul runs on an autocast copy
    head_fp32 = profile.quantized is not None and profile.param == 4
    head_copy = (
        (inventory.head_params or inventory.embedding_params) * 2 if head_fp32 and run.loss == "eager" else 0
    )
    # the final norm's saved input (the last layer's output) and rstd live until the loss's backward
    # reaches it, before any layer's: a loss-phase tensor
    if run.loss == "eager":
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
            (final_norm + run.layer_input) * tokens
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
    return logits, logits_note


def fused_ce_rows(trained: int, vocab: int, element_size: int) -> int:
    """Rows of the fused linear cross-entropy's logits buffer, as `fastft.kernels.fused_linear_ce`'s
    ``default_chunk_size`` picks them: as many as keep a chunk within ``FUSED_CE_CHUNK_BYTES``, balanced
    over the chunks that takes (at 8,192 rows and Qwen3's 151,936 words: 10 chunks of 820 rows, 0.23 GiB,
    not 883 rows and 0.25 GiB)."""
    max_rows = max(1, FUSED_CE_CHUNK_BYTES // (vocab * element_size))
    chunks = -(-max(trained, 1) // max_rows)
    return max(1, -(-trained // chunks))


# -- step 6: workspace that lives through the step -----------------------------------------------------------


def workspace_bytes(run: ResolvedRun) -> int:
    """RoPE's cos/sin and the cuBLAS workspaces."""
    return 2 * run.inventory.head_dim * run.profile.residual * run.tokens + CUBLAS_WORKSPACE_BYTES


# -- step 7: the backward phase ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backward:
    """The backward phase's moment, beside the stored activations: its parts' bytes and notes."""

    recompute: int
    workspace: int
    workspace_note: str
    dequant: int
    dequant_note: str
    gradients: int  # the LoRA gradients alive at the backward peak
    gradients_note: str


def backward_phase(run: ResolvedRun, stored: Stored, adapters: Adapters) -> Backward:
    """The layer whose backward holds the most: its recompute, gradient buffers, a dequantised weight (or an
    8-bit forward), and the LoRA gradients made by then beyond the activations already freed."""
    inventory, profile, mode, tokens, r = run.inventory, run.profile, run.mode, run.tokens, run.r
    layers, per_layer, targets_set = inventory.layers, stored.per_layer, set(run.targets)
    layer_input = run.layer_input
    # The recomputed layer's first norm saves the layer input, which the stored activations already hold.
    # An offloaded layer is re-run whole (its output is the root of the gradients taken through it);
    # checkpointing stops the re-run at the last tensor backward needs, before the output exists.
    reuse = layer_input if act.first_norm_reads_stored_input(profile) else 0
    # ... but not a kept attention output and log-sum-exp: the recompute reads them from the buffer
    rerun_output = layer_input - stored.kept_attention if mode == "offload" else 0
    recompute = (
        0
        if mode == "none"
        else max(
            (b - (reuse if layer.norms else 0) for b, layer in zip(per_layer, layers, strict=True)), default=0
        )
        * tokens
        + rerun_output * tokens
    )
    backward_ws = max(
        (act.backward_workspace(layer, inventory, profile, targets_set, r, tokens) for layer in layers),
        default=0,
    )
    dequant = _dequant_bytes(inventory, profile)
    workspace_note = "gradients flowing through the layer in backward"
    dequant_note = "largest quantised linear, unpacked for its matmul" if dequant else "no quantised weights"
    if profile.quantized == "fp8":
        dequant_note = "largest FP8 linear, transposed for its input gradient"
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
    gradient_bytes = adapters.gradient_bytes
    layer_grads = [4 * act.layer_lora_params(layer, inventory, targets_set, r) for layer in layers]
    gradients = min(gradient_bytes, _gradients_at_peak(layer_grads, stored.released, tokens, gradient_bytes))
    gradients_note = f"fp32, {gradient_bytes / GiB:.2f} GiB in all" + (
        "; made layer by layer as backward frees stored activations, so few exist at the peak"
        if gradients < gradient_bytes
        else ""
    )
    return Backward(recompute, backward_ws, workspace_note, dequant, dequant_note, gradients, gradients_note)


def _dequant_bytes(inventory: ModelInventory, profile: Profile) -> int:
    if profile.quantized is None or not inventory.linears:
        return 0
    largest = max(linear.weight_params for linear in inventory.linears)
    return weight_formats.get(profile.quantized).dense_bytes(largest, profile.act)


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

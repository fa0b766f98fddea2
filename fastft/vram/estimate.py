"""`estimate_vram`: will this LoRA/QLoRA run fit on that GPU, and what takes the memory?

The estimate is a sum of named components, each an explicit formula over the architecture (see
`fastft.vram.activation_bytes` for the activations). A training step has two memory peaks, and the larger wins:

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

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import fastft.weight_formats as weight_formats
from fastft.kernels import tiling
from fastft.runtime.activation_checkpointing import Checkpointing
from fastft.runtime.host_budget import layers_that_fit, pinnable_bytes, pinned_bytes
from fastft.vram import activation_bytes as act
from fastft.vram.activation_bytes import Profile
from fastft.vram.gpus import DEFAULT_CONTEXT_BYTES, GiB, GpuSpec, MiB
from fastft.vram.inventory import ModelInventory
from fastft.vram.result import VramComponent, VramEstimate, VramEstimateError, VramSettings, _count
from fastft.vram.settings import ResolvedRun, resolve_run

# The fused linear cross-entropy (fastft/kernels/fused_linear_ce.py) keeps one chunk of logits of at most this
# many bytes (its LOGITS_CHUNK_BYTES for a frozen head, as LoRA leaves it), in the hidden states' dtype.
FUSED_CE_CHUNK_BYTES = 2**28
# cuBLAS workspaces PyTorch allocates through its caching allocator and keeps for the process: 32 MiB on
# Hopper and newer, one per (cuBLAS handle, stream), and handles are per thread -- the forward runs on the
# Python thread, backward on autograd's device thread: two (`fastft bench vram` sees them stay allocated
# once the first configuration is freed).
CUBLAS_WORKSPACE_BYTES = 2 * 32 * MiB
# Caching-allocator slack at the peak (reserved − allocated): a fraction of what is allocated and freed
# during the step, plus a floor. To be calibrated from `fastft bench vram` (its "reserved" column).
SLACK_FRACTION = 0.05
SLACK_FLOOR_BYTES = 64 * MiB
# ... and at least the step's largest transient block under PyTorch's default caching allocator, which in
# step 1 of a fresh process can hold that much free only as smaller fragments (with expandable segments,
# which map blocks into one address range, it need not; docs/journal.md, "Design history", "The allocator").
# `allocator_fragments` says which allocator the process runs.


# -- the estimate --------------------------------------------------------------------------------------------


def estimate_vram(
    model,
    seq_len: int = 2048,
    batch_tokens: int | None = None,
    precision: str | None = None,
    lora_r: int | None = None,
    targets: str | Sequence[str] | None = None,
    checkpointing: Checkpointing | str | bool = "auto",
    optimizer: str = "adamw",
    gpu: str | GpuSpec | None = "auto",
    *,
    fused: bool = True,
    loss: str = "auto",
    trained_fraction: float = 1.0,
    keep_attention: bool | None = None,
    world_size: int = 1,
    sharding: str = "ddp",
    method: str = "sft",
    precompute_reference: bool = False,
    generations: int = 8,
    prompts_per_step: int = 4,
    completion_tokens: int = 64,
    generation_batch_size: int | None = None,
    kl_coef: float = 0.0,
    num_iterations: int = 1,
    host_memory: int | str | None = "auto",
) -> VramEstimate:
    """Estimate the GPU memory of LoRA/QLoRA training with fastft's trainer, component by component.

    `model`: an embedded preset ("tiny-llama"), a catalog hub id (offline), a local folder or any hub id
    (only its config.json is read), a `transformers` config, or a loaded model (its real dtypes, 4/8-bit
    quantisation and attached LoRA are read). `seq_len`: the longest sequence (a packed bin);
    `batch_tokens`: tokens per micro-batch (default `seq_len`: one bin). `precision`: "bf16", "fp16",
    "fp32", "nf4" (QLoRA, double quantisation), "int8" or "fp8" (e4m3 projections, one fp32 scale per output
    row); default bf16, or what a loaded model uses.
    `lora_r` (default 16) and `targets` ("all-linear" or short names such as ``["q_proj", "v_proj"]``).
    `checkpointing`: a `Checkpointing` or what it parses, as in `add_lora`: "none", "recompute" (each
    layer's input kept, the layer recomputed in backward) or "offload" (layer inputs in host memory, two
    buffers on the device); "auto" (the default, `add_lora`'s too) is "offload", what `add_lora("auto")`
    runs on a GPU, so an estimate with no arguments describes the run training does (for a model that
    has its adapters already, the checkpointing its `add_lora` call chose). `optimizer`: "adamw" (fp32 m and v), "adamw_8bit" or "sgd". `gpu`: a preset name
    (`GPUS`), a `GpuSpec`, "auto" (the visible GPU, if any) or None. `fused`: fastft's fused kernels, as
    ``add_lora(fused=True)`` (the default) swaps them in where the model's fusion plan
    (`fastft.models.fusion`) fuses the whole decoder: Llama/Mistral/Qwen2/Qwen3(-MoE)/Mixtral; False
    for transformers + peft modules. `loss`: "auto" (fused linear cross-entropy with the fused kernels, else
    eager), "eager" (logits of trained positions, fp32 log-softmax) or "fused". `trained_fraction`: share
    of tokens that carry a label (1.0, every token, is the worst case). `keep_attention`: with "offload",
    each layer's attention output (and the fused o_proj's) travels with its input so the recompute skips
    the attention forward, for sequences of ``KEEP_FROM_LENGTH`` tokens and more, and each MoE layer's
    routing order (4 bytes per routed slot) with it; False for an offloader that recomputes them; None (the
    default) as `fastft.runtime.offload.default_keep` decides: keep on 16-bit bases; on quantised ones keep
    the attention output (not o_proj's) from ``KEEP_QUANTISED_FROM_LENGTH`` tokens on where that still fits
    `gpu`, and otherwise answer for the run that recomputes it (``settings.keep_attention`` says which).
       `world_size` / `sharding`: a run on several GPUs under torchrun, answered per GPU
    (`fastft.vram.parallel`): "ddp" holds the whole model on each GPU, "fsdp" (FSDP2) splits the 16-bit
    base, the adapters, their gradients and the optimizer states; `batch_tokens` is per rank.

    `method`: "sft", or a preference method ("dpo", "orpo", "simpo"; `TrainConfig.method`). A preference
    micro-batch holds whole pairs, so `seq_len` is one side (prompt and answer) and `batch_tokens` defaults to
    a pair's two sides, ``2 × seq_len``; the summed log-probs add fp32 per-token log-probs and sequence ids
    to the loss phase; DPO adds its reference pass (the adapters off, no autograd: one layer's forward at a
    time and one log-prob chunk, before the policy's forward), which `precompute_reference` removes from
    the step.

    ``method="grpo"``: `seq_len` is a prompt and its completion, `completion_tokens` the completion (as
    `GRPOConfig.max_new_tokens`); `generations` (G), `prompts_per_step`, `generation_batch_size`, `kl_coef`
    and `num_iterations` are `GRPOConfig`'s. The step has a phase of its own before the update, the rollout:
    the static decoder's KV cache for every sampled row (``prompts × G`` rows of `seq_len` slots, all layers,
    16-bit), at the largest of its prefill (each prompt once: one layer's forward, the 4D mask, the last
    position's logits), the repeat of the prompts' cache for their groups, and a decode step (the rows'
    logits and top-p's sort), and on 4/8-bit bases one dequantised weight; the cache is freed before
    training. The update trains the completions packed
    (`batch_tokens` defaults to all of the step's rows at full length, as ``micro_batch_tokens=None`` packs
    them), only completion tokens carrying a target, with the per-target log-probs; a KL to the reference or
    more than one update per rollout adds one no-autograd pass (as DPO's reference pass).

    `host_memory`: bytes of host memory offloading may pin, as the offloader decides
    (`fastft.runtime.host_budget.pinnable_bytes`): "auto" (the default) is this machine's (75 % of what is
    available now), an int another machine's, None unchecked. Offloaded layer inputs that do not fit it make
    the offloader recompute instead (`OffloadBudgetWarning`), so the estimate then answers for
    ``checkpointing="recompute"`` and says why in its notes; kept attention outputs that do not fit are kept
    by some layers only, so it answers for the larger of keeping and not keeping.
    """
    arguments = dict(locals())
    if method == "grpo":
        rollout = _Rollout.of(
            seq_len,
            generations,
            prompts_per_step,
            completion_tokens,
            generation_batch_size,
            kl_coef,
            num_iterations,
        )
        batch_tokens = rollout.step_rows * seq_len if batch_tokens is None else batch_tokens
        trained_fraction = min(trained_fraction, completion_tokens / seq_len)
    else:
        rollout = None
    sides = _sides_per_unit(method, precompute_reference)
    if batch_tokens is not None and batch_tokens < sides * seq_len:
        raise VramEstimateError(
            f"batch_tokens={batch_tokens} cannot hold one pair of two {seq_len}-token sides for "
            f"method={method!r}: raise batch_tokens to at least {sides * seq_len} or leave it out."
        )
    # step 1 (`fastft.vram.settings`): the arguments checked against the model, defaults resolved
    run = resolve_run(
        model,
        seq_len=seq_len,
        batch_tokens=sides * seq_len if batch_tokens is None else batch_tokens,
        precision=precision,
        lora_r=lora_r,
        targets=targets,
        checkpointing=checkpointing,
        optimizer=optimizer,
        gpu=gpu,
        fused=fused,
        loss=loss,
        trained_fraction=trained_fraction,
        keep_attention=keep_attention,
    )
    notes: list[str] = []  # what the table prints under the components, in the order the steps find it
    weights = _weights(run.inventory, run.profile)
    adapters = _adapters(run)
    stored = _stored_activations(run, notes)
    loss_phase = _logits_and_loss(run)
    if method in PREFERENCE_METHODS:
        loss_phase = _with_log_prob_sums(run, loss_phase)
        notes.append(f"{method}: micro-batches of whole pairs, {run.tokens:,} tokens (both sides)")
    reference = _reference_pass(run, stored) if method == "dpo" and not precompute_reference else None
    rollout_bytes = None
    if rollout is not None:
        loss_phase = _with_log_prob_sums(run, loss_phase)
        if rollout.reference_pass:
            reference = _reference_pass(run, stored)
        rollout_bytes = _rollout_bytes(run, stored, rollout)
        notes.append(
            f"grpo: rollouts of {rollout.rows} rows ({rollout.prompts} prompts × G={rollout.generations}) of "
            f"{seq_len:,} tokens ({completion_tokens:,} sampled); the update trains {run.tokens:,} tokens a "
            "micro-batch"
        )
    workspace = _workspace(run)
    backward = _backward_phase(run, stored, adapters)
    estimate = _assemble(
        run, weights, adapters, stored, loss_phase, workspace, backward, notes, reference, rollout_bytes
    )
    if run.keep_if_fits and stored.keeping and estimate.fits is False:
        # a quantised base keeps only where it fits (`fastft.runtime.offload.KeepPolicy`): answer for the
        # run that recomputes instead
        return estimate_vram(**{**arguments, "keep_attention": False})
    estimate = replace(
        estimate,
        settings=replace(
            estimate.settings,
            keep_attention=stored.keeping,
            method=method,
            precompute_reference=precompute_reference,
            rollout=()
            if rollout is None
            else (
                ("generations", generations),
                ("prompts_per_step", prompts_per_step),
                ("completion_tokens", completion_tokens),
                ("generation_batch_size", generation_batch_size),
                ("kl_coef", kl_coef),
                ("num_iterations", num_iterations),
            ),
        ),
    )
    if world_size != 1 or sharding != "ddp":
        from fastft.vram.parallel import per_gpu

        estimate = per_gpu(estimate, run.inventory, world_size, sharding)
    budget = _host_budget(host_memory)
    if budget is not None and world_size > 1:
        budget //= world_size  # the ranks of one host pin from the same memory
    if run.mode == "offload" and budget is not None and _pinned(stored) > budget:
        return _within_host_memory(arguments, estimate, stored, budget)
    return estimate


def _host_budget(host_memory: int | str | None) -> int | None:
    """The bytes of host memory offloading may pin (`estimate_vram`'s `host_memory`), None if unchecked."""
    if host_memory is None:
        return None
    if host_memory == "auto":
        return pinnable_bytes(0, None)
    if isinstance(host_memory, bool) or not isinstance(host_memory, int) or host_memory < 0:
        raise VramEstimateError(
            f'host_memory={host_memory!r}: give the bytes of host memory offloading may pin, "auto" (this '
            "machine's) or None (unchecked)."
        )
    return host_memory


def _pinned(stored: _Stored) -> int:
    """Host bytes offloading pins: the layer inputs' slabs as `fastft.runtime.host_budget.pinned_bytes` counts
    them (PyTorch pins powers of two), and what layers keep beside them."""
    layers = len(stored.per_layer)
    inputs = stored.host_input_bytes
    return pinned_bytes(inputs // max(1, layers), layers) + stored.host_bytes - inputs


def _within_host_memory(
    arguments: dict, estimate: VramEstimate, stored: _Stored, budget: int
) -> VramEstimate:
    """The estimate of the run the offloader really makes when what it would pin is over `budget`
    (`fastft.runtime.offload.ActivationOffloader`): when the layer inputs alone do not fit, the first layers'
    inputs fill the budget and keep nothing beside them, and the later layers keep theirs on the device
    (plain recompute; all of them when not one input fits); else the larger of keeping and not keeping
    (layers whose kept outputs do not fit recompute them)."""
    layers = len(stored.per_layer)
    per_input = stored.host_input_bytes // max(1, layers)
    if pinned_bytes(per_input, layers) > budget:
        held = layers_that_fit(per_input, layers, budget)
        need = pinned_bytes(per_input, layers)
        if held:
            chosen = estimate_vram(**{**arguments, "keep_attention": False, "host_memory": None})
            on_device = (layers - held) * per_input
            components = tuple(
                replace(c, bytes=c.bytes + on_device, own_bytes=c.own_bytes + on_device)
                if c.key == "activations"
                else c
                for c in chosen.components
            )
            chosen = replace(chosen, components=components)
            what = (
                f"the inputs of the first {held} of {layers} layers fit there; the other {layers - held} stay "
                f"on the GPU ({on_device / GiB:.2f} GiB, plain recompute)"
            )
        else:
            chosen = estimate_vram(**{**arguments, "checkpointing": "recompute", "host_memory": None})
            what = "not one layer's input fits, so every layer keeps its input on the GPU: plain recompute"
    else:
        need = _pinned(stored)
        what = "only some layers' kept attention outputs fit: the larger of keeping and recomputing them"
        chosen = estimate_vram(**{**arguments, "keep_attention": False, "host_memory": None})
        if estimate.total_bytes > chosen.total_bytes:
            chosen = estimate
    note = (
        f"host memory: offloading would pin {need / GiB:.2f} GiB but this host may pin {budget / GiB:.2f} GiB "
        f"(host_memory): {what}. Free host memory, or shorten the sequences, to offload"
    )
    return replace(chosen, notes=(*chosen.notes, note))


# -- preference runs -------------------------------------------------------------------------------------------

PREFERENCE_METHODS = ("dpo", "orpo", "simpo")


def _sides_per_unit(method: str, precompute_reference: bool) -> int:
    """Sequences one `seq_len` unit of a micro-batch holds: 1 for SFT and GRPO, a pair's 2 for a preference
    method."""
    if method not in ("sft", "grpo", *PREFERENCE_METHODS):
        raise VramEstimateError(
            f"method={method!r} is not one of sft, {', '.join(PREFERENCE_METHODS)}, grpo."
        )
    if precompute_reference and method != "dpo":
        raise VramEstimateError(
            f"precompute_reference=True applies to method='dpo' only ({method!r} has no reference pass)."
        )
    return 2 if method in PREFERENCE_METHODS else 1


@dataclass(frozen=True)
class _Rollout:
    """A GRPO step's sampling: `rows` sequences decoded at once, `step_rows` trained per step."""

    generations: int
    prompts: int  # per generate call
    step_rows: int
    completion_tokens: int
    reference_pass: bool  # a KL reference or an old-policy pass before the update

    @property
    def rows(self) -> int:
        return self.prompts * self.generations

    @classmethod
    def of(
        cls, seq_len, generations, prompts_per_step, completion_tokens, generation_batch_size, kl, iterations
    ):
        for name, value, low in (
            ("generations", generations, 1),
            ("prompts_per_step", prompts_per_step, 1),
            ("completion_tokens", completion_tokens, 1),
            ("num_iterations", iterations, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise VramEstimateError(f"{name}={value!r}: give a whole number of at least {low}.")
        if completion_tokens >= seq_len:
            raise VramEstimateError(
                f"completion_tokens={completion_tokens} must be below seq_len={seq_len} (a prompt and its "
                "completion): pass seq_len=prompt tokens + completion_tokens."
            )
        prompts = min(generation_batch_size or prompts_per_step, prompts_per_step)
        return cls(
            generations, prompts, prompts_per_step * generations, completion_tokens, kl > 0 or iterations > 1
        )


# top-p sampling of one decode step, bytes per row and vocabulary entry: the 16-bit logits, their fp32
# scores, the ascending sort's values (fp32) and indices (int64), the cumulative probabilities (fp32), the
# drop mask scattered back (2 bools), the probabilities and the exponential noise (fp32 each)
_SAMPLING_BYTES_PER_LOGIT = 2 + 4 + 4 + 8 + 4 + 2 + 4 + 4


def _rollout_bytes(run: ResolvedRun, stored: _Stored, rollout: _Rollout) -> int:
    """The rollout's peak above what lives through the step (`fastft.training.objectives.decode.StaticDecoder`): the
    largest of the prefill (each prompt once: its KV cache, one layer's forward, the 4D mask, the last
    position's logits), the KV cache repeated for the group (both copies at once), and a decode step (every
    row's cache and the sampling buffers); on 4/8-bit bases one dequantised weight on top."""
    inventory, rows, prompts, length = run.inventory, rollout.rows, rollout.prompts, run.seq_len
    width = length - rollout.completion_tokens  # the prompts' slots
    residual = run.profile.residual
    per_slot = inventory.num_layers * 2 * inventory.num_kv_heads * inventory.head_dim * residual
    kv_prompts, kv_rows = prompts * length * per_slot, rows * length * per_slot
    prefill = (
        kv_prompts
        + (max(stored.per_layer, default=0) + 2 * run.layer_input) * prompts * width  # one layer's forward
        + prompts * width * length * residual  # the prompts' 4D additive mask
        + prompts * inventory.vocab_size * (residual + 4)  # the last position's logits
    )
    expand = kv_prompts + kv_rows
    decode = (
        kv_rows + rows * inventory.vocab_size * _SAMPLING_BYTES_PER_LOGIT + rows * length * (residual + 1)
    )
    dequantised = 0
    if run.profile.quantized:
        dequantised = (
            max((lin.in_features * lin.out_features for lin in inventory.linears), default=0) * residual
        )
    return max(prefill, expand, decode) + dequantised


def _with_log_prob_sums(run: ResolvedRun, loss_entry: tuple[int, str]) -> tuple[int, str]:
    """Per-sequence summed log-probs (`fastft.training.objectives.preference.sequence_log_probs`): the per-target fp32
    log-probs, their trained mask and the int64 sequence of each target, beside the loss's own buffers."""
    logits, note = loss_entry
    return logits + 16 * run.trained, note + "; per-target log-probs summed per sequence (16 B a target)"


def _reference_pass(run: ResolvedRun, stored: _Stored) -> int:
    """DPO's reference forward (adapters off, no autograd), before the policy's: nothing is saved, so the
    moment is one layer's forward (its input, output and activations) or the final norm's output with one
    log-prob chunk of the fused head and the per-target log-probs."""
    tokens, trained, vocab = run.tokens, run.trained, run.inventory.vocab_size
    layer = (max(stored.per_layer, default=0) + 2 * run.layer_input) * tokens
    if run.loss == "eager":  # the trained positions' logits, their fp32 copy and log-softmax (no grads kept)
        chunk = trained * vocab * 10
    else:
        chunk = fused_ce_rows(trained, vocab, run.profile.residual) * vocab * run.profile.residual
    head = run.layer_input * tokens + chunk
    return max(layer, head + 16 * trained)


# -- step 2: the weights and their quantisation constants ----------------------------------------------------


def _weights(inventory: ModelInventory, profile: Profile) -> tuple[int, int, str]:
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
        return total, 0, f"{_count(inventory.total_params)} × {profile.param} B"
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
    note = f"{_count(inventory.linear_params)} linear weights in {profile.quantized}, {_count(biases + rest)} in 16-bit ({others})"
    return quantized + kept, constants, note


# -- step 3: LoRA adapters, their gradients and the optimizer ------------------------------------------------


@dataclass(frozen=True)
class _Adapters:
    params: int
    bytes: int  # the fp32 adapters and their 16-bit compute copies
    compute_copies: bool
    gradient_bytes: int  # all of them (`_backward_phase` counts those alive at the peak)
    optimizer_bytes: int


def _adapters(run: ResolvedRun) -> _Adapters:
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
    return _Adapters(
        params=lora_params,
        bytes=4 * lora_params + (2 * copied if autocast_copies else 0),
        compute_copies=autocast_copies,
        gradient_bytes=4 * lora_params,
        optimizer_bytes={"adamw": 8, "adamw_8bit": 2, "sgd": 0}[run.optimizer] * lora_params,
    )


# -- step 4: activations kept from forward to backward, by checkpointing mode --------------------------------


@dataclass(frozen=True)
class _Stored:
    bytes: int
    note: str
    per_layer: list[int]  # what each layer saves, per token, when it is not checkpointed
    released: list[int]  # what each layer's backward frees of the stored activations, per token
    kept_attention: int  # an offloaded layer's kept attention output and log-sum-exp, per token
    keeping: bool = False  # offloaded layers keep something beside their inputs
    host_bytes: int = 0  # what offloading pins in host memory: every layer's input, and what it keeps
    host_input_bytes: int = 0  # of those, the layer inputs alone (without them the offloader recomputes)


def _stored_activations(run: ResolvedRun, notes: list[str]) -> _Stored:
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
    return _Stored(
        stored_per_token * tokens, stored_note, per_layer, released, kept_attention, keeping, *host
    )


# -- step 5: the loss phase: logits and the loss's buffers ---------------------------------------------------


def _logits_and_loss(run: ResolvedRun) -> tuple[int, str]:
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


def _workspace(run: ResolvedRun) -> int:
    """RoPE's cos/sin and the cuBLAS workspaces."""
    return 2 * run.inventory.head_dim * run.profile.residual * run.tokens + CUBLAS_WORKSPACE_BYTES


# -- step 7: the backward phase ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Backward:
    recompute: int
    workspace: int
    workspace_note: str
    dequant: int
    dequant_note: str
    gradients: int  # the LoRA gradients alive at the backward peak
    gradients_note: str


def _backward_phase(run: ResolvedRun, stored: _Stored, adapters: _Adapters) -> _Backward:
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
    return _Backward(recompute, backward_ws, workspace_note, dequant, dequant_note, gradients, gradients_note)


def allocator_fragments() -> bool:
    """Whether this process's CUDA caching allocator is PyTorch's default one, whose free memory can be
    split into blocks too small for a large request (False under ``expandable_segments:True`` in
    ``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``)."""
    settings = ",".join(
        os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    )
    return "expandable_segments:true" not in settings.replace(" ", "").lower()


def _largest_transient_block(run: ResolvedRun, stored: _Stored) -> int:
    """The largest single tensor a step allocates and frees: a dense MLP's ``[rows, I]`` block (a tile's
    rows when it tiles), a layer's input or, offloaded, one device buffer of an offloaded input and what
    it keeps."""
    layers, tokens = run.inventory.layers, run.tokens
    mlp = max((act.mlp_block_bytes(layer, run.profile, tokens) for layer in layers), default=0)
    buffer = stored.bytes // 2 if run.mode == "offload" else 0
    return max(mlp, buffer, run.layer_input * tokens)


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


# -- step 8: the two peaks, the components and the estimate --------------------------------------------------


def _assemble(
    run: ResolvedRun,
    weights_entry: tuple[int, int, str],
    adapters: _Adapters,
    stored: _Stored,
    loss_entry: tuple[int, str],
    attention_ws: int,
    backward: _Backward,
    notes: list[str],
    reference: int | None = None,
    rollout: int | None = None,
) -> VramEstimate:
    inventory, profile, gpu_spec = run.inventory, run.profile, run.gpu
    weights, constants, weights_note = weights_entry
    logits, logits_note = loss_entry
    loss_phase = stored.bytes + logits
    backward_phase = (
        stored.bytes + backward.recompute + backward.workspace + backward.dequant + backward.gradients
    )
    peak = "loss" if loss_phase > backward_phase else "backward"
    if reference is not None and reference > max(loss_phase, backward_phase):
        peak = "reference"  # nothing stored yet: the reference pass runs before the policy's forward
    if rollout is not None and rollout > max(loss_phase, backward_phase, reference or 0):
        peak = "rollout"  # GRPO's sampling, before anything of the update exists
    persistent = weights + constants + adapters.bytes + adapters.optimizer_bytes + attention_ws
    allocated = persistent + max(loss_phase, backward_phase, reference or 0, rollout or 0)
    transient = allocated - weights - constants
    slack = int(SLACK_FRACTION * transient) + SLACK_FLOOR_BYTES
    largest = _largest_transient_block(run, stored)
    if allocator_fragments() and largest > slack:
        slack = largest
        notes.append(
            f"allocator slack: one {largest / GiB:.2f} GiB block, the step's largest, which PyTorch's default "
            "caching allocator may hold free only as smaller fragments; "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before CUDA starts) avoids that"
        )
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
            weight_formats.get(profile.quantized).constants_note,
        ),
        VramComponent(
            "lora",
            "LoRA adapters",
            adapters.bytes,
            adapters.bytes,
            "persistent",
            f"{_count(adapters.params)} params in fp32"
            + (" + 16-bit compute copies" if adapters.compute_copies else ""),
        ),
        VramComponent(
            "optimizer",
            "optimizer states",
            adapters.optimizer_bytes,
            adapters.optimizer_bytes,
            "persistent",
            {"adamw": "AdamW m and v in fp32", "adamw_8bit": "8-bit AdamW m and v", "sgd": "none"}[
                run.optimizer
            ],
        ),
        VramComponent("activations", "saved activations", stored.bytes, stored.bytes, "stored", stored.note),
        VramComponent("logits", "logits and loss", at_peak(logits, "loss"), logits, "loss", logits_note),
        *(
            ()
            if reference is None
            else (
                VramComponent(
                    "reference",
                    "reference pass",
                    at_peak(reference, "reference"),
                    reference,
                    "reference",
                    "the reference forward, adapters off, no autograd: one layer or one log-prob chunk",
                ),
            )
        ),
        *(
            ()
            if rollout is None
            else (
                VramComponent(
                    "rollout",
                    "rollout (KV cache, sampling)",
                    at_peak(rollout, "rollout"),
                    rollout,
                    "rollout",
                    "GRPO's sampling: the static KV cache of every row, then prefill or one decode step",
                ),
            )
        ),
        VramComponent(
            "gradients",
            "LoRA gradients",
            at_peak(backward.gradients, "backward"),
            backward.gradients,
            "backward",
            backward.gradients_note,
        ),
        VramComponent(
            "recompute",
            "recomputed layer",
            at_peak(backward.recompute, "backward"),
            backward.recompute,
            "backward",
            "one layer's activations, rebuilt in backward" if backward.recompute else "nothing recomputed",
        ),
        VramComponent(
            "backward_workspace",
            "backward buffers",
            at_peak(backward.workspace, "backward"),
            backward.workspace,
            "backward",
            backward.workspace_note,
        ),
        VramComponent(
            "dequant",
            "dequantised weight",
            at_peak(backward.dequant, "backward"),
            backward.dequant,
            "backward",
            backward.dequant_note,
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
    if gpu_spec is not None and not gpu_spec.bf16 and run.precision not in ("fp16", "fp32"):
        notes.append(f"{gpu_spec.label} has no bf16: training runs in fp16 (the same bytes)")
    settings = VramSettings(
        seq_len=run.seq_len,
        batch_tokens=run.tokens,
        precision=run.precision,
        lora_r=run.r,
        targets=("all-linear",)
        if set(run.targets) == set(inventory.lora_target_names())
        else tuple(run.targets),
        checkpointing=run.mode,
        optimizer=run.optimizer,
        loss=run.loss,
        trained_tokens=run.trained,
        fused=run.fused,
        kernels=profile.path,
    )
    return VramEstimate(
        model=inventory.name,
        parameters=inventory.total_params,
        lora_parameters=adapters.params,
        settings=settings,
        components=components,
        peak_phase=peak,
        gpu=gpu_spec,
        notes=tuple(notes),
    )

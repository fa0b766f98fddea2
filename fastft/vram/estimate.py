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

from collections.abc import Sequence
from dataclasses import replace

from fastft.runtime.activation_checkpointing import Checkpointing
from fastft.runtime.host_budget import layers_that_fit, pinnable_bytes, pinned_bytes
from fastft.vram.assemble import StepParts, assemble
from fastft.vram.gpus import GiB, GpuSpec
from fastft.vram.methods import (
    PREFERENCE_METHODS,
    ROLLOUT_ARGUMENTS,
    Rollout,
    reference_pass,
    rollout_bytes,
    sides_per_unit,
    with_log_prob_sums,
)
from fastft.vram.parallel import per_gpu
from fastft.vram.part_bytes import (
    Stored,
    adapter_bytes,
    backward_phase,
    logits_and_loss,
    stored_activations,
    weight_bytes,
    workspace_bytes,
)
from fastft.vram.result import VramEstimate, VramEstimateError
from fastft.vram.settings import ResolvedRun, resolve_run

# The parts' formulas are `fastft.vram.part_bytes` (a preference or GRPO step's own, `fastft.vram.methods`), the
# peaks and components they make `fastft.vram.assemble`.


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
    run, rollout = _resolve(arguments)
    notes: list[str] = []  # what the table prints under the components, in the order the steps find it
    parts = _step_parts(run, arguments, rollout, notes)
    estimate = assemble(run, parts, notes)
    stored = parts.stored
    if run.keep_if_fits and stored.keeping and estimate.fits is False:
        # a quantised base keeps only where it fits (`fastft.runtime.offload.KeepPolicy`): answer for the
        # run that recomputes instead
        return estimate_vram(**{**arguments, "keep_attention": False})
    rollout_settings = () if rollout is None else tuple((name, arguments[name]) for name in ROLLOUT_ARGUMENTS)
    settings = replace(
        estimate.settings,
        keep_attention=stored.keeping,
        method=method,
        precompute_reference=precompute_reference,
        rollout=rollout_settings,
    )
    estimate = replace(estimate, settings=settings)
    if world_size != 1 or sharding != "ddp":
        estimate = per_gpu(estimate, run.inventory, world_size, sharding)
    budget = _host_budget(host_memory)
    if budget is not None and world_size > 1:
        budget //= world_size  # the ranks of one host pin from the same memory
    if run.mode == "offload" and budget is not None and _pinned(stored) > budget:
        return _within_host_memory(arguments, estimate, stored, budget)
    return estimate


def _resolve(arguments: dict) -> tuple[ResolvedRun, Rollout | None]:
    """Step 1 (`fastft.vram.settings`): `estimate_vram`'s arguments checked against the model, defaults
    resolved; for GRPO its rollout too, whose rows and completions set the update's micro-batch and the share
    of tokens that carry a target."""
    seq_len, method = arguments["seq_len"], arguments["method"]
    batch_tokens, trained_fraction = arguments["batch_tokens"], arguments["trained_fraction"]
    rollout = None
    if method == "grpo":
        rollout = Rollout.of(seq_len, *(arguments[name] for name in ROLLOUT_ARGUMENTS))
        batch_tokens = rollout.step_rows * seq_len if batch_tokens is None else batch_tokens
        trained_fraction = min(trained_fraction, rollout.completion_tokens / seq_len)
    sides = sides_per_unit(method, arguments["precompute_reference"])
    if batch_tokens is not None and batch_tokens < sides * seq_len:
        raise VramEstimateError(
            f"batch_tokens={batch_tokens} cannot hold one pair of two {seq_len}-token sides for "
            f"method={method!r}: raise batch_tokens to at least {sides * seq_len} or leave it out."
        )
    passed = ("precision", "lora_r", "targets", "checkpointing", "optimizer", "gpu", "fused", "loss")
    run = resolve_run(
        arguments["model"],
        seq_len=seq_len,
        batch_tokens=sides * seq_len if batch_tokens is None else batch_tokens,
        **{name: arguments[name] for name in passed},
        trained_fraction=trained_fraction,
        keep_attention=arguments["keep_attention"],
    )
    return run, rollout


def _step_parts(run: ResolvedRun, arguments: dict, rollout: Rollout | None, notes: list[str]) -> StepParts:
    """Steps 2 to 7: each part's bytes (`fastft.vram.part_bytes`), with what the method adds
    (`fastft.vram.methods`); `notes` gets what the table prints under them."""
    method = arguments["method"]
    stored = stored_activations(run, notes)
    loss = logits_and_loss(run)
    if method in PREFERENCE_METHODS:
        loss = with_log_prob_sums(run, loss)
        notes.append(f"{method}: micro-batches of whole pairs, {run.tokens:,} tokens (both sides)")
    dpo_reference = method == "dpo" and not arguments["precompute_reference"]
    reference = reference_pass(run, stored) if dpo_reference else None
    sampling = None
    if rollout is not None:
        loss = with_log_prob_sums(run, loss)
        if rollout.reference_pass:
            reference = reference_pass(run, stored)
        sampling = rollout_bytes(run, stored, rollout)
        notes.append(
            f"grpo: rollouts of {rollout.rows} rows ({rollout.prompts} prompts × G={rollout.generations}) of "
            f"{arguments['seq_len']:,} tokens ({rollout.completion_tokens:,} sampled); the update trains "
            f"{run.tokens:,} tokens a micro-batch"
        )
    adapters = adapter_bytes(run)
    return StepParts(
        weights=weight_bytes(run.inventory, run.profile),
        adapters=adapters,
        stored=stored,
        loss=loss,
        workspace=workspace_bytes(run),
        backward=backward_phase(run, stored, adapters),
        reference=reference,
        rollout=sampling,
    )


# -- host memory: what offloading may pin ------------------------------------------------------------------------


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


def _pinned(stored: Stored) -> int:
    """Host bytes offloading pins: the layer inputs' slabs as `fastft.runtime.host_budget.pinned_bytes` counts
    them (PyTorch pins powers of two), and what layers keep beside them."""
    layers = len(stored.per_layer)
    inputs = stored.host_input_bytes
    return pinned_bytes(inputs // max(1, layers), layers) + stored.host_bytes - inputs


def _within_host_memory(arguments: dict, estimate: VramEstimate, stored: Stored, budget: int) -> VramEstimate:
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

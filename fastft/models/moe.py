"""Fused sparse-MoE blocks: one routing plan, grouped GEMMs, LoRA on experts without W + ΔW.

What a fused Qwen3-MoE / Qwen2-MoE / Mixtral / gpt-oss MoE block runs for ``x [T, H]`` (``M = T * k``
routed slots; shapes of the plan in `fastft.runtime.routing`)::

    logits  = x @ W_router.T (+ b_router)                                         [T, E]
    plan    = build_routing_plan(logits, router_spec(config))                     once per forward
    g       = grouped_mm(x, W_gu, gather_rows=plan.sorted_slots, top_k=k) (+ b_gu[e])  [M, 2I] expert-sorted
    h       = act(g)                                                              [M, I]
    y       = grouped_mm(h, W_down, scatter_rows=plan.sorted_slots) (+ b_down[e])  [M, H] token-major slots
    out[t]  = sum_j weights[t, j] * y[t * k + j]                                  [T, H] (a batched matmul)
    (+ sigmoid(x @ w_shared_gate) * shared_expert(x) for Qwen2-MoE)

``act`` is ``act(gate) * up`` over the concatenated ``[gate; up]`` halves (fastft's fused gated-activation
kernel for SiLU/GELU experts), or the experts module's own ``_apply_gate`` where transformers defines one
(gpt-oss: interleaved gate/up columns, ``gate`` clamped above at ``limit``, ``up`` to ``±limit``,
``(up + 1) * gate * sigmoid(alpha * gate)``). Combining is a reshape and a weighted sum over the k
choices (no scatter-add, no atomics), so the same inputs give bit-identical outputs run to run.

The down projection and the combine are one autograd node (`fastft.kernels.down_combine`):
its backward takes the routing weights' gradient from ``h`` and the unweighted ``dh`` it computes anyway,
so the ``[M, H]`` expert outputs are never saved, and when activation checkpointing re-runs the block
(whose output only enters additions) the node skips its GEMMs.

Expert weights are read as transformers stores them: ``[E, N, K]`` (Qwen, Mixtral) or transposed
``[E, K, N]`` (gpt-oss, passed to the grouped GEMM as a transposed view, never copied).

LoRA on experts. PEFT (0.21) hosts it: ``LoraConfig(target_parameters=["experts.gate_up_proj",
"experts.down_proj"])`` wraps the experts module in one ``ParamWrapper`` per parameter, stores
``lora_A`` as ``[E * r, K]`` (expert-major rows) and ``lora_B`` as ``[N, r * E]`` (column ``j * E + e`` is
rank ``j`` of expert ``e``), and saves/loads them like any adapter. Its own forward, however, folds
``W + s * B_e A_e`` for every expert into a full-size temporary weight on each call. Here the same
parameters are read as stacks ``A [E, r, K]`` (a view) and ``B [E, N, r]`` (a permuted view), and the
low-rank term takes its own grouped path on the same plan::

    y = grouped_mm(x, W) + s * grouped_mm(grouped_mm(x, A), B)        = x (W_e + s B_e A_e)^T per row

so nothing of the experts' size is materialised and the adapter stays a plain PEFT adapter.

Each call decides whether it applies (`expert_weights`); otherwise the block's original forward runs:
several active adapters, a merged adapter that PEFT must first unmerge, a non-float (quantised) expert
weight, and Mixtral's router jitter while training take transformers' path.

FP8 experts (``load_in_fp8=True``, `fastft.models.fp8.FP8Experts`: e4m3 stacks with per-expert,
per-output-channel scales) are dequantised to the compute dtype once per call (`expert_weights`), and the
grouped GEMMs above run on that 16-bit copy, which lives for the layer's forward (with activation
checkpointing) or until its backward (without). transformers' own forward refuses them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastft.kernels.fp8 import FP8_DTYPE, compute_dtype, dequantize_experts
from fastft.kernels.lora import _in_recompute
from fastft.models import fusion
from fastft.runtime.context import ROUTING, KeptTensors, layer_context
from fastft.runtime.model_state import model_state
from fastft.runtime.routing import (
    RouterCollector,
    RouterSpec,
    build_routing_plan,
    plan_from_order,
    plan_from_top_k,
    router_spec,
    watch_unfused_routers,
)

# Function-local imports: peft imports bitsandbytes, which asks the hub for a kernel: peft loads first under
# `fastft.data.hub.hub_offline_while_importing` (fastft.models.lora); tests replace these names on their modules, so
# they are looked up when called.


@dataclass(frozen=True)
class ExpertLora:
    """One adapter on one stacked expert weight: ``A [E, r, K]``, ``B [E, N, r]`` and the scale ``s``."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float


@dataclass(frozen=True)
class ExpertWeights:
    """What the grouped path needs of an experts module this call: weights as ``[E, N, K]`` (views),
    biases ``[E, N]`` or None, LoRA or None for each projection."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    gate_up_lora: ExpertLora | None
    down_lora: ExpertLora | None


# ------------------------------------------------------------------------------------ the grouped path


def expert_projection(
    x: torch.Tensor,
    weight: torch.Tensor,
    plan,
    lora: ExpertLora | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' first projection of token-major ``x [T, K]``: ``[M, N]`` in expert order
    (``weight [E, N, K]``); row ``m`` reads token ``plan.sorted_slots[m] // k``, fused into the GEMM's loads.
    The bias rows go in as the base GEMM's ``add``; the LoRA term is two more grouped GEMMs on the same
    offsets, the second adding the base result before its one rounding, so no separate elementwise pass
    runs::

        y = add(bias[e]) + x W_e^T;   y = y + ((x A_e^T) * s) B_e^T
    """
    from fastft.kernels.grouped_gemm import grouped_mm

    rows = {"gather_rows": plan.sorted_slots, "top_k": plan.top_k}
    add = None if bias is None else bias.index_select(0, plan.sorted_experts)
    y = grouped_mm(x, weight, plan.group_end, add=add, **rows)
    if lora is not None:
        low = grouped_mm(x, lora.A, plan.group_end, **rows) * lora.scale
        y = grouped_mm(low, lora.B, plan.group_end, add=y)
    return y


def gated(experts: torch.nn.Module, gate_up: torch.Tensor, kind: str | None) -> torch.Tensor:
    """The experts' activation of ``gate_up [M, 2I]`` → ``[M, I]`` (module docstring)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if kind is not None:
        from fastft.kernels.swiglu import gated_activation

        return gated_activation(gate, up, kind)
    if hasattr(experts, "_apply_gate"):
        return experts._apply_gate(gate_up)
    return experts.act_fn(gate) * up


def moe_experts(
    x: torch.Tensor,
    plan,
    weights: ExpertWeights,
    experts: torch.nn.Module,
    kind: str | None,
    output_discarded_in_recompute: bool = False,
) -> torch.Tensor:
    """The routed experts of ``x [T, H]`` under ``plan``, combined: ``[T, H]``.

    The down projection and the combine are one autograd node (`fastft.kernels.down_combine`)
    that saves ``h`` but not the ``[T * k, H]`` expert outputs. ``output_discarded_in_recompute``: the
    caller's output only enters additions (a decoder layer's residual), so when activation checkpointing
    re-runs the layer, that node skips its GEMMs (about a third of the experts' FLOPs).
    """
    from fastft.kernels.down_combine import down_combine

    g = expert_projection(x, weights.gate_up, plan, weights.gate_up_lora, weights.gate_up_bias)
    h = gated(experts, g, kind)
    lora = weights.down_lora
    return down_combine(
        h,
        weights.down,
        plan.group_end,
        plan.sorted_slots,
        plan.weights,
        weights.down_bias,
        None if lora is None else (lora.A, lora.B, lora.scale),
        sorted_experts=plan.sorted_experts,
        skip=output_discarded_in_recompute and _in_recompute(),
    )


# ------------------------------------------------------------------------------------ module plumbing


_FALLBACK = object()


def _wrapper_lora(wrapper, num_experts: int):
    """The active adapter of one PEFT ``ParamWrapper`` as `ExpertLora`; None when the base weight alone
    is right this call; `_FALLBACK` when PEFT's own forward must run."""
    if wrapper.disable_adapters:  # PEFT unmerges a merged adapter first: leave that to its forward
        return _FALLBACK if wrapper.merged else None
    if wrapper.merged:
        return None
    active = [name for name in wrapper.active_adapters if name in wrapper.lora_A]
    if not active:
        return None
    if len(active) > 1 or wrapper.num_experts != num_experts:
        return _FALLBACK
    name = active[0]
    if wrapper.lora_B[name].bias is not None:
        return _FALLBACK
    a = wrapper.lora_A[name].weight  # [E * r, K], expert-major rows
    b = wrapper.lora_B[name].weight  # [N, r * E], column j * E + e
    rank = a.shape[0] // num_experts
    # B as [E, N, r] is a permuted view whose elements sit E apart along r and r * E apart along N: every
    # load of the grouped GEMM would touch its own cache line. One contiguous copy per call (r * E * N
    # elements, 12.6 MB in fp32 for Qwen3-30B-A3B's gate/up) makes its tiles dense; autograd takes the
    # gradient back through the copy.
    return ExpertLora(
        a.view(num_experts, rank, a.shape[1]),
        b.view(b.shape[0], rank, num_experts).permute(2, 0, 1).contiguous(),
        float(wrapper.scaling[name]),
    )


def unwrap_experts(module: torch.nn.Module) -> tuple[torch.nn.Module, list]:
    """The experts module under any PEFT ``ParamWrapper`` layers, and those wrappers (outermost first)."""
    from peft.tuners.lora import ParamWrapper

    wrappers = []
    while isinstance(module, ParamWrapper):
        wrappers.append(module)
        module = module.base_layer
    return module, wrappers


def is_expert_module(module: torch.nn.Module) -> bool:
    """A transformers experts module: stacked 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    parameters = dict(module.named_parameters(recurse=False))
    return all(name in parameters and parameters[name].dim() == 3 for name in ("gate_up_proj", "down_proj"))


def _float(weight: torch.Tensor) -> bool:
    return weight.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class MoeBlockInfo:
    """What `patch` learns once about a supported MoE block (stored on the instance)."""

    spec: RouterSpec
    router_name: str  # "gate" (Qwen, Mixtral) or "router" (gpt-oss)
    kind: str | None  # fused gated-activation kind, or None: the experts' own gate (`gated`)
    transposed: bool  # expert weights stored [E, K, N] (gpt-oss) rather than [E, N, K]
    bias: bool  # per-expert biases gate_up_proj_bias [E, 2I], down_proj_bias [E, H] (gpt-oss)
    returns_scores: bool  # gpt-oss blocks return (hidden, router_scores)
    shared_expert: bool  # Qwen2-MoE: + sigmoid(shared_expert_gate(x)) * shared_expert(x)


def expert_weights(
    experts_wrapper: torch.nn.Module, info: MoeBlockInfo, dtype: torch.dtype | None = None
) -> ExpertWeights | None:
    """`ExpertWeights` for the grouped path this call, or None when the original forward must run. FP8
    experts (`fastft.models.fp8.FP8Experts`) are dequantised to `dtype`, the call's compute dtype, here."""
    experts, wrappers = unwrap_experts(experts_wrapper)
    gate_up, down = experts.gate_up_proj, experts.down_proj
    # e4m3 stacks with their scales beside them (`fastft.models.fp8.FP8Experts`, which imports this module)
    fp8 = gate_up.dtype == FP8_DTYPE and getattr(experts, "gate_up_proj_scale", None) is not None
    if not fp8 and not (_float(gate_up) and _float(down)):
        return None
    num_experts = gate_up.shape[0]
    loras = {}
    for wrapper in wrappers:
        lora = _wrapper_lora(wrapper, num_experts)
        if lora is _FALLBACK or wrapper.parameter_name not in ("gate_up_proj", "down_proj"):
            return None
        loras[wrapper.parameter_name] = lora
    if fp8:  # the e4m3 stacks times their per-expert channel scales, this call only
        dtype = dtype or torch.bfloat16
        gate_up = dequantize_experts(gate_up, experts.gate_up_proj_scale, dtype)
        down = dequantize_experts(down, experts.down_proj_scale, dtype)
    if info.transposed:  # stored [E, K, N]: pass [E, N, K] views
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return ExpertWeights(
        gate_up,
        down,
        experts.gate_up_proj_bias if info.bias else None,
        experts.down_proj_bias if info.bias else None,
        loras.get("gate_up_proj"),
        loras.get("down_proj"),
    )


def moe_block_info(block: torch.nn.Module, config) -> MoeBlockInfo | None:
    """`MoeBlockInfo` when `block` is a sparse-MoE block the fused forward reproduces, else None. Whether
    the config's MoE blocks are fused, and their experts' activation, is its `fastft.models.fusion` plan's."""
    fusion_plan = fusion.plan(config)
    model_type = fusion_plan.model_type
    if not fusion_plan.moe or not hasattr(block, "experts"):
        return None
    experts, _ = unwrap_experts(block.experts)
    if not is_expert_module(experts) or not getattr(experts, "has_gate", True):
        return None
    router_name = "router" if model_type == "gpt_oss" else "gate"
    router = getattr(block, router_name, None)
    weight = getattr(router, "weight", None)
    spec = router_spec(config)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (spec.num_experts, config.hidden_size):
        return None
    # transformers' experts decorator gives every experts class without its own gate `_default_apply_gate`
    # (chunk into [gate; up], act(gate) * up): that one is the fused gated activation when the activation
    # has a kernel; any other gate (gpt-oss's clamped, interleaved one) runs as the model defines it
    apply_gate = getattr(type(experts), "_apply_gate", None)
    own_gate = apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate"
    kind = None
    if not own_gate:
        if model_type == "gpt_oss" or not getattr(experts, "is_concatenated", True):
            return None  # an older transformers without the model's own gate function: nothing to call
        kind = fusion_plan.activation
        if kind is None and apply_gate is None and not hasattr(experts, "act_fn"):
            return None
    shared = model_type == "qwen2_moe"
    if shared and not (hasattr(block, "shared_expert") and hasattr(block, "shared_expert_gate")):
        return None
    return MoeBlockInfo(
        spec=spec,
        router_name=router_name,
        kind=kind,
        transposed=bool(getattr(experts, "is_transposed", model_type == "gpt_oss")),
        bias=bool(getattr(experts, "has_bias", hasattr(experts, "gate_up_proj_bias"))),
        returns_scores=model_type == "gpt_oss",
        shared_expert=shared,
    )


def _routing_plan(
    router: torch.nn.Module, x: torch.Tensor, spec: RouterSpec, kept: KeptTensors | None = None
):
    """The layer's `RoutingPlan`. Under offloaded checkpointing (`kept`: the layer call's `KeptTensors`) the
    forward keeps its routing order (``sorted_slots`` as int32 and ``group_end``: 4 bytes per routed slot)
    beside the layer input, and the recompute rebuilds the plan from it (`plan_from_order`): the router GEMM
    runs again for its gradient, the top-k and the sort do not, so the plan is built once per layer and step."""
    if router._forward_hooks or router._forward_pre_hooks:
        # someone watches the router (transformers' output_router_logits capture, a profiler): run the
        # module itself so they see its call; its outputs are exactly what the builder would compute
        logits, weights, expert_ids = router(x)
        return plan_from_top_k(expert_ids, weights, spec.num_experts, router_logits=logits)
    logits = F.linear(x, router.weight, getattr(router, "bias", None))
    if kept is not None and not kept.recording:
        entry = kept.take(ROUTING)
        if entry is not None:
            (sorted_slots, group_end), _ = entry
            return plan_from_order(logits, spec, sorted_slots, group_end)
    plan = build_routing_plan(logits, spec)
    if kept is not None and kept.recording and kept.wants(ROUTING):
        kept.keep(ROUTING, (plan.sorted_slots.to(torch.int32), plan.group_end))
    return plan


def _collecting(block: torch.nn.Module) -> RouterCollector | None:
    """The model's router collector (through the block's layer context) while it collects, else None."""
    context = layer_context(block)
    routers = None if context is None else context.model_state.routers
    return routers if routers is not None and routers.collecting else None


def _original_with_stats(self, hidden_states, info: MoeBlockInfo):
    """The block's original forward; with router statistics being collected, its router's logits are
    captured on the way (a hook for this call only) so the load-balancing loss still sees the layer."""
    routers = _collecting(self)
    if routers is None:
        return self._fastft_original_forward(hidden_states)
    captured = []
    router = getattr(self, info.router_name)
    handle = router.register_forward_hook(lambda module, args, output: captured.append(output[0]))
    try:
        output = self._fastft_original_forward(hidden_states)
    finally:
        handle.remove()
    for logits in captured:
        routers.record_logits(logits, info.spec)
    return output


def moe_block_forward(self, hidden_states: torch.Tensor):
    """The fused forward installed on a sparse-MoE block instance by `fastft.patch` (module docstring)."""
    info: MoeBlockInfo = self._fastft_moe
    weights = expert_weights(self.experts, info, compute_dtype(hidden_states))
    if weights is None or (self.training and getattr(self, "jitter_noise", 0.0)):  # Mixtral's router jitter
        return _original_with_stats(self, hidden_states, info)
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    context = layer_context(self)
    plan = _routing_plan(getattr(self, info.router_name), x, info.spec, getattr(context, "kept", None))
    routers = _collecting(self)
    if routers is not None:
        routers.record_logits(plan.router_logits, info.spec)
    experts, _ = unwrap_experts(self.experts)
    # the block's output only enters additions (the shared expert's, the residual): discarded in a re-run
    out = moe_experts(x, plan, weights, experts, info.kind, output_discarded_in_recompute=True)
    if info.shared_expert:
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
    out = out.reshape(shape)
    return (out, plan.weights) if info.returns_scores else out


@contextlib.contextmanager
def collect_moe_router_stats(model: torch.nn.Module):
    """Open a collection on the model's `RouterCollector` (``model_state(model).routers``) for one forward
    of `model` and yield the list it fills: fused MoE blocks record their plans; any MoE block running
    transformers' forward has its router's logits captured by a hook for the duration, so every layer is
    counted once, fused or not."""
    config = getattr(model, "config", None)
    routers = model_state(model).routers

    def record(logits):
        # the statistics need only the top-k ids and the softmax: the generic rule picks the same ids
        routers.record_logits(logits, RouterSpec(config.num_experts_per_tok, logits.shape[-1]))

    with routers.collect() as stats:
        handles = watch_unfused_routers(model, record)
        try:
            yield stats
        finally:
            for handle in handles:
                handle.remove()


__all__ = [
    "collect_moe_router_stats",
    "ExpertLora",
    "ExpertWeights",
    "MoeBlockInfo",
    "expert_projection",
    "expert_weights",
    "is_expert_module",
    "moe_block_forward",
    "moe_block_info",
    "moe_experts",
    "unwrap_experts",
]

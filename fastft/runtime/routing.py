"""Mixture-of-experts routing: one `RoutingPlan` per MoE layer forward, shared by every expert GEMM.

A router scores each of ``T`` tokens against ``E`` experts (``router_logits [T, E]``) and sends the token
to ``k`` of them with weights. The plan turns that choice into what a grouped GEMM needs, once::

    expert_ids, weights = top_k(router_logits)                    [T, k]: per the architecture (below)
    slot s = t * k + j                                            the j-th choice of token t, M = T * k slots
    sorted_experts, sorted_slots = stable_sort(expert_ids.flat)   [M]: slots grouped by expert, in token order
    group_end[e] = #{s : expert_ids.flat[s] <= e}                 [E] int32, inclusive cumulative counts
    counts[e] = group_end[e] - group_end[e - 1]                   tokens routed to expert e (0 allowed)

The gate/up grouped GEMM reads ``x[sorted_slots // k]`` (the gather fused into its loads), the down grouped
GEMM writes row ``m`` to slot ``sorted_slots[m]`` (the scatter fused into its stores), the LoRA grouped
GEMMs reuse the same offsets, and autograd keeps the plan's index tensors for backward: routing is
never recomputed within a layer's forward and backward. Under offloaded checkpointing (fastft's default
on a GPU) the forward also keeps the routing order (``sorted_slots``, ``group_end``) with the layer input,
and the recompute rebuilds the same plan from it (`plan_from_order`: gathers and a binary search, no
top-k, no sort), so the plan is built once per layer and training step; plain recompute
(``gradient_checkpointing=True``) re-runs the whole layer, the plan with it.

Everything stays on the device: `torch.sort` and `torch.searchsorted` need no host sync, where
``torch.bincount`` on CUDA reads the input's maximum back to the host to size its output (even with
``minlength``), so the counts come from the sorted ids.

Top-k and weights, per architecture (each as transformers 5 computes it; `RouterSpec`):

==============  ==========================================================================  ===========
architecture    weights                                                                     dtype
==============  ==========================================================================  ===========
Qwen3-MoE,      ``p = softmax(logits, fp32)``; ``w, ids = topk(p, k)``; ``w /= sum(w)`` if    logits'
Qwen2-MoE       ``norm_topk_prob``
Mixtral         ``p = softmax(logits, fp32)``; ``w, ids = topk(p, k)``; ``w /= sum(w)``       fp32
                (the same as a softmax over the k chosen logits)
gpt-oss         ``v, ids = topk(logits + bias, k)``; ``w = softmax(v)`` (router bias inside    logits'
                the logits)
==============  ==========================================================================  ===========

The router's auxiliary load-balancing loss (Switch Transformer, eqs. 4-6; transformers'
``load_balancing_loss_func`` without an attention mask: packed batches have no padding) pools every
layer's top-k counts ``c_l`` and softmax probabilities ``p_l`` over ``R = L * T`` rows::

    aux = E * sum_e (sum_l c_l[e] / R) * (sum_l sum_t p_l[t, e] / R)

While the model's `RouterCollector` collects (the loss opens it), each MoE layer records its router
logits and `RouterSpec` (`RouterCollector.record_logits`: a reference, no computation inside the layer,
so a checkpointed layer saves the same tensors in its forward and its recompute); `load_balancing_loss`
turns each record into `RouterStats` (top-k counts, probability sums, rows) outside the layers and
combines them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

SCORINGS = ("softmax_topk", "topk_softmax")


class RoutingError(ValueError):
    """Router logits or settings that no plan can be built from; the message names the fix."""


@dataclass(frozen=True)
class RouterSpec:
    """How an architecture turns router logits into top-k expert ids and weights.

    ``scoring``: ``"softmax_topk"`` (softmax over all experts in fp32, then top-k of the probabilities,
    renormalised over the k when ``renormalize``) or ``"topk_softmax"`` (top-k of the logits, then a
    softmax over those k in the logits' dtype). ``weights_in_logits_dtype``: the weights are cast to the
    logits' dtype (Qwen) rather than kept in fp32 (Mixtral).
    """

    top_k: int
    num_experts: int
    scoring: str = "softmax_topk"
    renormalize: bool = True
    weights_in_logits_dtype: bool = True

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise RoutingError(f"scoring={self.scoring!r}: use one of {SCORINGS}")
        if not 0 < self.top_k <= self.num_experts:
            raise RoutingError(
                f"top_k={self.top_k} must be between 1 and the number of experts ({self.num_experts})"
            )


def router_spec(config) -> RouterSpec:
    """The `RouterSpec` of a transformers MoE config (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss)."""
    model_type = getattr(config, "model_type", None)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        top_k, experts = config.num_experts_per_tok, config.num_experts
        return RouterSpec(top_k, experts, "softmax_topk", bool(config.norm_topk_prob), True)
    if model_type == "mixtral":
        return RouterSpec(config.num_experts_per_tok, config.num_local_experts, "softmax_topk", True, False)
    if model_type == "gpt_oss":
        return RouterSpec(config.num_experts_per_tok, config.num_local_experts, "topk_softmax", False, True)
    raise RoutingError(
        f"no router specification for model type {model_type!r}: fastft routes qwen2_moe, qwen3_moe, "
        "mixtral and gpt_oss"
    )


@dataclass(frozen=True)
class RouterStats:
    """One layer's share of the load-balancing loss: top-k ``counts`` per expert (fp32 ``[E]``), the sum
    over tokens of the softmax probabilities (``prob_sum``, fp32 ``[E]``, differentiable) and ``rows``
    (tokens, a host number)."""

    counts: torch.Tensor
    prob_sum: torch.Tensor
    rows: int


@dataclass(frozen=True)
class RouterRecord:
    """One MoE layer forward's router logits ``[T, E]`` and how that layer routes: what the load-balancing
    loss needs, kept as a reference and turned into `RouterStats` after the forward."""

    logits: torch.Tensor
    spec: RouterSpec

    def stats(self) -> RouterStats:
        return build_routing_plan(self.logits, self.spec).stats()


@dataclass(frozen=True)
class RoutingPlan:
    """Where every routed token goes, built once per MoE layer forward (shapes in the module docstring).

    ``router_logits [T, E]`` (the model's dtype, bias included); ``probs [T, E]`` fp32 softmax over all
    experts where the scoring computed it, else None; ``expert_ids [T, k]`` int64; ``weights [T, k]``
    (differentiable through the router logits); ``sorted_slots``, ``sorted_experts`` ``[M]`` int64; ``counts``, ``group_end`` ``[E]`` int32. All on the logits' device.
    """

    top_k: int
    num_experts: int
    router_logits: torch.Tensor
    probs: torch.Tensor | None
    expert_ids: torch.Tensor
    weights: torch.Tensor
    sorted_slots: torch.Tensor
    sorted_experts: torch.Tensor
    counts: torch.Tensor
    group_end: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.expert_ids.shape[0]

    @property
    def num_slots(self) -> int:
        return self.sorted_slots.shape[0]

    def stats(self) -> RouterStats:
        """This layer's `RouterStats` for the load-balancing loss (softmax in fp32 when the plan has none)."""
        probs = self.probs
        if probs is None:
            probs = torch.softmax(self.router_logits.float(), dim=-1)
        return RouterStats(self.counts.float(), probs.sum(dim=0), self.num_tokens)


def top_k_routing(
    router_logits: torch.Tensor, spec: RouterSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(weights [T, k], expert_ids [T, k] int64, probs [T, E] fp32 or None)`` per `RouterSpec`."""
    if router_logits.dim() != 2 or router_logits.shape[-1] != spec.num_experts:
        raise RoutingError(
            f"router logits must be [tokens, {spec.num_experts}], got {tuple(router_logits.shape)}"
        )
    if spec.scoring == "topk_softmax":
        probs = None
        expert_ids = torch.topk(router_logits, spec.top_k, dim=-1).indices
    else:
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        expert_ids = torch.topk(probs, spec.top_k, dim=-1).indices
    weights, probs = routing_weights(router_logits, expert_ids, spec, probs)
    return weights, expert_ids, probs


def plan_from_top_k(
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    *,
    router_logits: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
) -> RoutingPlan:
    """The plan for a given top-k choice (``expert_ids``, ``weights``: ``[T, k]``): one stable sort of the
    flattened expert ids, then the inclusive offsets by binary search. No host sync."""
    if expert_ids.dim() != 2 or weights.shape != expert_ids.shape:
        raise RoutingError(
            f"expert_ids and weights must both be [tokens, top_k], got {tuple(expert_ids.shape)} and "
            f"{tuple(weights.shape)}"
        )
    top_k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).long()
    sorted_experts, sorted_slots = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=flat.dtype)
    group_end = torch.searchsorted(sorted_experts, experts, right=True, out_int32=True)
    counts = torch.diff(group_end, prepend=group_end.new_zeros(1))
    if router_logits is None:
        router_logits = weights.new_zeros(expert_ids.shape[0], num_experts)
    return RoutingPlan(
        top_k=top_k,
        num_experts=num_experts,
        router_logits=router_logits,
        probs=probs,
        expert_ids=expert_ids.long(),
        weights=weights,
        sorted_slots=sorted_slots,
        sorted_experts=sorted_experts,
        counts=counts,
        group_end=group_end,
    )


def routing_weights(
    router_logits: torch.Tensor,
    expert_ids: torch.Tensor,
    spec: RouterSpec,
    probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weights [T, k], probs or None)`` of a chosen top-k (``expert_ids``): the scores at those experts
    (a gather, differentiable through the logits), normalised per `RouterSpec`. `top_k_routing` chooses
    with a top-k and passes the fp32 softmax it chose from (``probs``); `plan_from_order` passes the
    forward's choice, so the recompute's weights are the forward's bit for bit."""
    if spec.scoring == "topk_softmax":
        top = router_logits.gather(1, expert_ids)
        return torch.softmax(top, dim=1, dtype=top.dtype), None
    if probs is None:
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(1, expert_ids)
    if spec.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.weights_in_logits_dtype:
        weights = weights.to(router_logits.dtype)
    return weights, probs


def plan_from_order(
    router_logits: torch.Tensor, spec: RouterSpec, sorted_slots: torch.Tensor, group_end: torch.Tensor
) -> RoutingPlan:
    """The plan of a layer whose routing order is known (``sorted_slots [M]``, ``group_end [E]`` of an
    earlier `build_routing_plan` on the same logits): no top-k and no sort, only gathers and a binary
    search. Offloaded checkpointing keeps those two with the layer input (`fastft.models.moe`), so the
    recompute rebuilds the plan the forward had, bit for bit, and the router's gradient still flows
    through ``weights``."""
    tokens, k = router_logits.shape[0], spec.top_k
    sorted_slots = sorted_slots.long()
    positions = torch.arange(tokens * k, device=sorted_slots.device)
    sorted_experts = torch.searchsorted(group_end, positions, right=True)  # expert of each sorted row
    expert_ids = torch.empty_like(sorted_experts).index_copy_(0, sorted_slots, sorted_experts).view(tokens, k)
    weights, probs = routing_weights(router_logits, expert_ids, spec)
    return RoutingPlan(
        top_k=k,
        num_experts=spec.num_experts,
        router_logits=router_logits,
        probs=probs,
        expert_ids=expert_ids,
        weights=weights,
        sorted_slots=sorted_slots,
        sorted_experts=sorted_experts,
        counts=torch.diff(group_end, prepend=group_end.new_zeros(1)),
        group_end=group_end,
    )


def build_routing_plan(router_logits: torch.Tensor, spec: RouterSpec) -> RoutingPlan:
    """Router logits ``[T, E]`` → top-k per `spec` → `RoutingPlan` (module docstring). No host sync."""
    weights, expert_ids, probs = top_k_routing(router_logits, spec)
    return plan_from_top_k(expert_ids, weights, spec.num_experts, router_logits=router_logits, probs=probs)


# ------------------------------------------------------------------------------ load-balancing loss


class RouterCollector:
    """Where one model's MoE layers hand their router logits while its loss collects them (the model's
    ``fastft.runtime.model_state.ModelState.routers``; the layers reach it through their
    `fastft.runtime.context.LayerContext`).

    `collect` opens a collection and yields the list it fills; collections nest, and each record goes to
    the innermost open one only (offloaded checkpointing opens one per layer call inside the loss's, to
    hand the layer's logits out of its autograd node). Nothing is recorded while none is open."""

    __slots__ = ("_open",)

    def __init__(self):
        self._open: list[list] = []

    @property
    def collecting(self) -> bool:
        return bool(self._open)

    @contextlib.contextmanager
    def collect(self):
        stats: list[RouterStats | RouterRecord] = []
        self._open.append(stats)
        try:
            yield stats
        finally:
            for index in range(len(self._open) - 1, -1, -1):  # by identity: lists compare by contents
                if self._open[index] is stats:
                    del self._open[index]
                    break

    def record(self, stats: RouterStats | RouterRecord) -> None:
        """Hand one layer's `RouterStats` (or `RouterRecord`) to the innermost open collection, if any."""
        if self._open:
            self._open[-1].append(stats)

    def record_logits(self, logits: torch.Tensor, spec: RouterSpec) -> None:
        """What an MoE layer calls while collecting: its router logits, by reference (see `RouterRecord`)."""
        if self._open:
            self._open[-1].append(RouterRecord(logits, spec))


def load_balancing_loss(
    stats: list[RouterStats | RouterRecord], num_experts: int | None = None
) -> torch.Tensor:
    """``E * sum_e (C_e / R) (P_e / R)`` over all recorded layers (module docstring): transformers'
    ``load_balancing_loss_func`` for unpadded rows. An fp32 scalar, differentiable through ``prob_sum``
    (the router logits). `num_experts` defaults to the statistics' width."""
    if not stats:
        raise RoutingError("no router statistics were recorded: the model ran no fused MoE layer")
    stats = [s.stats() if isinstance(s, RouterRecord) else s for s in stats]
    num_experts = num_experts or stats[0].counts.numel()
    rows = float(sum(s.rows for s in stats))
    counts = torch.stack([s.counts for s in stats]).sum(dim=0)
    prob_sum = torch.stack([s.prob_sum for s in stats]).sum(dim=0)
    return (counts / rows * (prob_sum / rows)).sum() * num_experts


def watch_unfused_routers(module: torch.nn.Module, on_logits) -> list:
    """Forward hooks calling ``on_logits(router_logits)`` on the routers of the MoE blocks in `module` that
    run transformers' forward (fused blocks record their own); returns the handles to remove."""
    handles = []
    for block in module.modules():
        if not hasattr(block, "experts") or hasattr(block, "_fastft_moe"):
            continue
        router = getattr(block, "router", None) or getattr(block, "gate", None)
        if router is not None and not isinstance(router, torch.nn.Linear):
            handles.append(router.register_forward_hook(lambda m, args, output: on_logits(output[0])))
    return handles


__all__ = [
    "watch_unfused_routers",
    "RouterCollector",
    "RouterRecord",
    "RouterSpec",
    "RouterStats",
    "RoutingError",
    "RoutingPlan",
    "build_routing_plan",
    "load_balancing_loss",
    "plan_from_top_k",
    "router_spec",
    "top_k_routing",
]

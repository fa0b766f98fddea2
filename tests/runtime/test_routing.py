"""fastft.runtime.routing: the routing plan against transformers' routers, its sort/offsets invariants,
the load-balancing loss against transformers' ``load_balancing_loss_func``, and no host sync.

fp32 on the CPU, fixed seeds, awkward sizes (37 tokens, 7 experts, experts that receive nothing).
"""

from __future__ import annotations

import pytest
import torch
from host_syncs import SyncTrap
from transformers import AutoConfig

from fastft.runtime.routing import (
    RouterCollector,
    RouterSpec,
    RoutingError,
    build_routing_plan,
    load_balancing_loss,
    plan_from_order,
    plan_from_top_k,
    router_spec,
    top_k_routing,
)

HIDDEN = 40


def _config(model_type: str, **extra):
    experts = {"num_experts": 7} if model_type in ("qwen2_moe", "qwen3_moe") else {"num_local_experts": 7}
    fields = dict(
        hidden_size=HIDDEN,
        intermediate_size=24,
        moe_intermediate_size=24,
        num_experts_per_tok=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=1,
        vocab_size=64,
        **experts,
    )
    fields.update(extra)
    return AutoConfig.for_model(model_type, **fields)


def _router(model_type: str, config):
    """transformers' own router module for the architecture, with random weights (and bias)."""
    import importlib

    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    name = {"qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral", "gpt_oss": "GptOss"}
    router = getattr(module, f"{name[model_type]}TopKRouter")(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in router.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return router


CASES = [
    ("qwen3_moe", {"norm_topk_prob": True}),
    ("qwen3_moe", {"norm_topk_prob": False}),
    ("qwen2_moe", {"norm_topk_prob": False}),
    ("mixtral", {}),
    ("gpt_oss", {}),
]


@pytest.mark.parametrize("model_type,extra", CASES, ids=[f"{m}-{e}" for m, e in CASES])
def test_plan_matches_the_transformers_router(model_type, extra):
    config = _config(model_type, **extra)
    router = _router(model_type, config)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(0))
    logits, want_weights, want_ids = router(x)
    spec = router_spec(config)
    plan = build_routing_plan(
        torch.nn.functional.linear(x, router.weight, getattr(router, "bias", None)), spec
    )
    assert torch.equal(plan.router_logits, logits)
    assert torch.equal(plan.expert_ids, want_ids)
    assert plan.weights.dtype == want_weights.dtype
    torch.testing.assert_close(plan.weights, want_weights, rtol=1e-6, atol=0)
    assert plan.top_k == 3 and plan.num_experts == 7 and plan.num_slots == 37 * 3


def test_mixtral_weights_are_a_softmax_over_the_chosen_logits():
    """transformers 5's MixtralTopKRouter renormalises the top-k probabilities; that is the softmax of the k
    chosen logits (the two orders differ only by rounding)."""
    config = _config("mixtral")
    logits = torch.randn(37, 7, generator=torch.Generator().manual_seed(1))
    plan = build_routing_plan(logits, router_spec(config))
    torch.testing.assert_close(plan.weights, torch.softmax(logits.gather(1, plan.expert_ids), dim=-1))


def test_sort_and_offsets_group_every_slot_under_its_expert_in_token_order():
    generator = torch.Generator().manual_seed(2)
    num_experts, tokens, top_k = 7, 23, 2
    # experts 0, 3 and 6 receive no token: empty groups at the start, the middle and the end
    choices = torch.tensor([1, 2, 4, 5])
    ids = torch.stack([choices[torch.randperm(4, generator=generator)[:top_k]] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    plan = plan_from_top_k(ids, weights, num_experts)
    flat = ids.reshape(-1)
    assert torch.equal(torch.sort(plan.sorted_slots).values, torch.arange(tokens * top_k))  # a permutation
    assert torch.equal(plan.sorted_experts, flat[plan.sorted_slots])
    counts = torch.bincount(flat, minlength=num_experts)
    assert plan.counts.dtype == plan.group_end.dtype == torch.int32
    assert torch.equal(plan.counts.long(), counts) and plan.counts[[0, 3, 6]].tolist() == [0, 0, 0]
    assert torch.equal(plan.group_end.long(), torch.cumsum(counts, 0))
    start = 0
    for expert, end in enumerate(plan.group_end.tolist()):
        rows = plan.sorted_slots[start:end]
        assert (flat[rows] == expert).all()
        assert torch.equal(rows, torch.sort(rows).values)  # stable: token order within an expert
        start = end


def test_one_token_and_top_k_equal_to_the_number_of_experts():
    logits = torch.randn(1, 4, generator=torch.Generator().manual_seed(4))
    plan = build_routing_plan(logits, RouterSpec(4, 4))
    assert plan.group_end.tolist() == [1, 2, 3, 4]
    assert float(plan.weights.sum()) == pytest.approx(1.0)


def test_spec_refuses_what_no_router_does():
    with pytest.raises(RoutingError, match="top_k"):
        RouterSpec(top_k=9, num_experts=8)
    with pytest.raises(RoutingError, match="scoring"):
        RouterSpec(2, 8, scoring="sigmoid")
    with pytest.raises(RoutingError, match=r"\[tokens, 8\]"):
        top_k_routing(torch.zeros(3, 5), RouterSpec(2, 8))
    with pytest.raises(RoutingError, match="llama"):
        router_spec(AutoConfig.for_model("llama"))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_load_balancing_loss_equals_transformers(model_type):
    import importlib

    reference = importlib.import_module(
        f"transformers.models.{model_type}.modeling_{model_type}"
    ).load_balancing_loss_func
    spec = router_spec(_config(model_type))
    generator = torch.Generator().manual_seed(5)
    layers = [torch.randn(37, 7, generator=generator, requires_grad=True) for _ in range(3)]
    want = reference(tuple(layers), 7, 3)
    routers = RouterCollector()
    with routers.collect() as stats:
        for logits in layers:
            routers.record(build_routing_plan(logits, spec).stats())
    got = load_balancing_loss(stats, 7)
    assert len(stats) == 3
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    want_grads = torch.autograd.grad(want, layers)
    for g, w in zip(torch.autograd.grad(got, layers), want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)


def test_statistics_go_only_to_the_innermost_open_collection():
    stats = build_routing_plan(torch.randn(5, 4), RouterSpec(2, 4)).stats()
    routers = RouterCollector()
    routers.record(stats)  # nothing open: dropped
    with routers.collect() as outer:
        routers.record(stats)
        with routers.collect() as inner:
            routers.record(stats)
            routers.record(stats)
        routers.record(stats)
    assert len(outer) == 2 and len(inner) == 2
    with pytest.raises(RoutingError, match="no router statistics"):
        load_balancing_loss([], 4)


SPECS = [
    RouterSpec(3, 7),
    RouterSpec(3, 7, renormalize=False),
    RouterSpec(3, 7, weights_in_logits_dtype=False),
    RouterSpec(3, 7, scoring="topk_softmax"),
    RouterSpec(7, 7),
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_plan_rebuilt_from_its_order_is_the_plan_bit_for_bit(spec, dtype):
    """What the offloaded recompute does (`plan_from_order`, from the kept sorted slots and offsets): every
    field, and the router logits' gradient through the weights, equal to building the plan again."""
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(37, 7, generator=generator).to(dtype).requires_grad_(True)
    upstream = torch.randn(37, spec.top_k, generator=generator)
    plan = build_routing_plan(logits, spec)
    rebuilt = plan_from_order(logits, spec, plan.sorted_slots.to(torch.int32), plan.group_end)
    for field in ("expert_ids", "weights", "sorted_slots", "sorted_experts", "counts", "group_end"):
        assert torch.equal(getattr(rebuilt, field), getattr(plan, field)), field
    assert (rebuilt.probs is None) == (plan.probs is None)
    assert plan.probs is None or torch.equal(rebuilt.probs, plan.probs)
    (grad,) = torch.autograd.grad((plan.weights.float() * upstream).sum(), logits)
    (rebuilt_grad,) = torch.autograd.grad((rebuilt.weights.float() * upstream).sum(), logits)
    assert torch.equal(rebuilt_grad, grad)


def test_rebuilding_a_plan_from_its_order_never_waits_for_the_device(monkeypatch):
    logits = torch.randn(37, 7, generator=torch.Generator().manual_seed(6), requires_grad=True)
    spec = RouterSpec(3, 7)
    plan = build_routing_plan(logits, spec)
    with SyncTrap() as trap:
        rebuilt = plan_from_order(logits, spec, plan.sorted_slots.to(torch.int32), plan.group_end)
        rebuilt.weights.sum().backward()
    assert trap.syncs == []


def test_building_a_plan_never_waits_for_the_device(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail(".tolist() in the routing plan"))
    logits = torch.randn(37, 7, generator=torch.Generator().manual_seed(6), requires_grad=True)
    with SyncTrap() as trap:
        for scoring in ("softmax_topk", "topk_softmax"):
            plan = build_routing_plan(logits, RouterSpec(3, 7, scoring=scoring))
            loss = (plan.weights * plan.weights).sum() + load_balancing_loss([plan.stats()], 7)
            loss.backward()
    assert trap.syncs == []
    with SyncTrap() as trap:  # the trap does catch what it should
        torch.bincount(plan.expert_ids.reshape(-1), minlength=7)
        bool(plan.counts[0] > 0)
    assert trap.syncs == ["aten.bincount", "aten._local_scalar_dense"]


@pytest.mark.gpu
def test_building_a_plan_on_the_gpu_has_no_sync():
    from fastft.bench.common import count_syncs

    logits = torch.randn(4096, 128, device="cuda", requires_grad=True)
    spec = RouterSpec(8, 128)
    plan = build_routing_plan(logits, spec)  # warm up
    assert count_syncs(lambda: build_routing_plan(logits, spec).weights.sum().backward()) == 0
    order = (plan.sorted_slots.to(torch.int32), plan.group_end)
    rebuilt = plan_from_order(logits, spec, *order)
    assert torch.equal(rebuilt.weights, plan.weights) and torch.equal(rebuilt.expert_ids, plan.expert_ids)
    assert count_syncs(lambda: plan_from_order(logits, spec, *order).weights.sum().backward()) == 0

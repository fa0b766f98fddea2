"""fastft.models.moe: fused sparse-MoE blocks and LoRA on experts against transformers + PEFT.

fp32 on the CPU (the grouped GEMM's and gated activation's plain-PyTorch references), fixed seeds, awkward
sizes (37 tokens, 7 experts, top-3). Tolerance: 1e-5 relative (``||a - b|| / ||b||``) for outputs, losses
and every gradient. The Triton grouped GEMM is checked on the GPU (``-m gpu``) in bf16 to 2e-2.
"""

from __future__ import annotations

import copy
import importlib
import json
import types
import warnings

import pytest
import torch
from host_syncs import SyncTrap
from transformers import AutoConfig

import fastft
from fastft.data.batch import PackedBatch
from fastft.models.moe import (
    expert_projection,
    moe_block_forward,
    moe_block_info,
)
from fastft.models.patch import UnfusedWarning, patch, unpatch
from fastft.runtime.model_state import model_state
from fastft.runtime.routing import RouterSpec, build_routing_plan
from fastft.training.loss import causal_lm_loss_sum

MOE_PRESETS = ("tiny-moe", "tiny-mixtral", "tiny-gpt-oss")
HIDDEN = 40
BLOCKS = {
    "qwen3_moe": "Qwen3MoeSparseMoeBlock",
    "qwen2_moe": "Qwen2MoeSparseMoeBlock",
    "mixtral": "MixtralSparseMoeBlock",
    "gpt_oss": "GptOssMLP",
}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().norm() / want.detach().norm())


# ------------------------------------------------------------------------------------------- one block


def _config(model_type: str):
    experts = {"num_experts": 7} if model_type in ("qwen2_moe", "qwen3_moe") else {"num_local_experts": 7}
    return AutoConfig.for_model(
        model_type,
        hidden_size=HIDDEN,
        intermediate_size=24,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=20,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=1,
        vocab_size=64,
        **experts,
    )


def _random_block(model_type: str):
    """transformers' block of `model_type` with random weights and biases (the same every call), and its
    config."""
    config = _config(model_type)
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    block = getattr(module, BLOCKS[model_type])(config)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return block, config


def _fuse(block, info):
    """`block` running fastft's fused MoE forward (as `fastft.models.patch` sets it up)."""
    block._fastft_moe = info
    block._fastft_original_forward = block.forward
    block.forward = types.MethodType(moe_block_forward, block)
    return block


def _blocks(model_type: str):
    """transformers' block with random weights and biases, and a copy running the fused forward."""
    block, config = _random_block(model_type)
    fused = copy.deepcopy(block)
    info = moe_block_info(fused, config)
    assert info is not None
    return block, _fuse(fused, info)


def _first(output):
    return output[0] if isinstance(output, tuple) else output


@pytest.mark.parametrize("model_type", list(BLOCKS))
def test_fused_block_matches_transformers_block(model_type):
    block, fused = _blocks(model_type)
    generator = torch.Generator().manual_seed(12)
    x = torch.randn(1, 37, HIDDEN, generator=generator) * 2  # gpt-oss: some gate/up values pass the clamp
    upstream = torch.randn(1, 37, HIDDEN, generator=generator)
    results = []
    for module in (block, fused):
        inputs = x.clone().requires_grad_()
        output = module(inputs)
        grads = torch.autograd.grad(_first(output), [inputs, *module.parameters()], upstream)
        results.append((output, grads))
    (want, want_grads), (got, got_grads) = results
    assert _rel(_first(got), _first(want)) <= 1e-5
    if model_type == "gpt_oss":  # it returns the router scores too
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    names = ["x"] + [name for name, _ in block.named_parameters()]
    for name, g, w in zip(names, got_grads, want_grads, strict=True):
        assert _rel(g, w) <= 1e-5, name


def test_grouped_projection_gathers_and_adds_the_low_rank_term():
    """The experts' first projection against a per-row loop: row m (expert order) reads token
    sorted_slots[m] // k; W_e + s B_e A_e is never formed by the fused path but is the per-row reference."""
    from fastft.models.moe import ExpertLora

    generator = torch.Generator().manual_seed(13)
    experts, tokens, k_in, n_out, rank = 5, 9, 12, 10, 3
    plan = build_routing_plan(torch.randn(tokens, experts, generator=generator), RouterSpec(2, experts))
    x = torch.randn(tokens, k_in, generator=generator)
    weight = torch.randn(experts, n_out, k_in, generator=generator)
    bias = torch.randn(experts, n_out, generator=generator)
    lora = ExpertLora(
        torch.randn(experts, rank, k_in, generator=generator),
        torch.randn(experts, n_out, rank, generator=generator),
        0.7,
    )
    got = expert_projection(x, weight, plan, lora, bias)
    want = torch.empty(tokens * 2, n_out)
    for m, slot in enumerate(plan.sorted_slots.tolist()):
        e = int(plan.sorted_experts[m])
        w = weight[e] + lora.scale * lora.B[e] @ lora.A[e]
        want[m] = x[slot // 2] @ w.T + bias[e]
    assert _rel(got, want) <= 1e-6


# ------------------------------------------------------------------------------------------- whole models


def _batch(lengths=(7, 19, 3, 11), seed: int = 0) -> PackedBatch:
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 500, (n,), generator=generator).numpy() for n in lengths]
    return PackedBatch.from_sequences(ids, [i.copy() for i in ids])


def _lora_model(name: str, targets=("q_proj", "k_proj", "v_proj", "o_proj", "experts"), **kwargs):
    model, tokenizer = fastft.load_model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnfusedWarning)
        model = fastft.add_lora(
            model, r=4, alpha=8, target_modules=list(targets), gradient_checkpointing=False, **kwargs
        )
    with torch.no_grad():  # B = 0 at init would make every A gradient zero: give the adapters some weight
        generator = torch.Generator().manual_seed(1)
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
            if "gate_up_proj_bias" in parameter_name or "down_proj_bias" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)  # gpt-oss: zeros
    model.train()
    return model, tokenizer


def _loss_and_grads(model, batch):
    lora = [p for _, p in model.named_parameters() if p.requires_grad]
    loss = causal_lm_loss_sum(model, batch)
    return loss.detach(), torch.autograd.grad(loss, lora)


def _count_grouped_mm(monkeypatch) -> list:
    """Record each grouped GEMM call ("mm") and each down projection + combine ("down", with its `skip`)."""
    from fastft.kernels import down_combine, grouped_gemm

    calls = []
    inside_down = []  # off the GPU the down side composes grouped_mm itself: count it once, as "down"
    original, original_down = grouped_gemm.grouped_mm, down_combine.down_combine

    def counted(*args, **kwargs):
        if not inside_down:
            calls.append("mm")
        return original(*args, **kwargs)

    def counted_down(*args, **kwargs):
        calls.append("down, skipped" if kwargs.get("skip") else "down")
        inside_down.append(1)
        try:
            return original_down(*args, **kwargs)
        finally:
            inside_down.pop()

    monkeypatch.setattr(grouped_gemm, "grouped_mm", counted)
    monkeypatch.setattr(down_combine, "down_combine", counted_down)
    return calls


@pytest.mark.parametrize(
    "name,checkpointing", [(name, False) for name in MOE_PRESETS] + [("tiny-gpt-oss", True)]
)
def test_patched_moe_model_matches_transformers_and_peft(name, checkpointing, monkeypatch):
    model, _ = _lora_model(name, fused=False)
    assert any("experts" in n and "lora_A" in n for n, _ in model.named_parameters())
    fastft.models.lora.set_gradient_checkpointing(model, checkpointing)
    batch = _batch()
    expected_loss, expected = _loss_and_grads(model, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnfusedWarning)
        report = patch(model)
    assert report.fused["moe"] == 2
    calls = _count_grouped_mm(monkeypatch)
    loss, grads = _loss_and_grads(model, batch)
    # per layer: the gate/up GEMM and its adapter's two, then the down projection + combine (its adapter
    # inside); recompute runs the forward again, skipping the down side whose output it discards
    layer = ["mm"] * 3 + ["down"]
    recomputed = ["mm"] * 3 + ["down, skipped"]
    assert calls == 2 * layer + (2 * recomputed if checkpointing else [])
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-5)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name_, got, want in zip(names, grads, expected, strict=True):
        assert _rel(got, want) <= 1e-5, name_


@pytest.mark.parametrize("checkpointing", [False, True])
def test_qwen2_moe_with_a_shared_expert_matches_transformers_and_peft(monkeypatch, checkpointing):
    """Qwen2-MoE (no preset: built from a small config): routed experts fused, the shared expert's MLP on
    the fused LoRA MLP, its sigmoid gate left out of the LoRA targets like the router. Recomputed in
    backward too: the gate's product saves the shared expert's output, so the re-run must produce it
    (it once skipped that down projection, and the gradients read uninitialised memory)."""
    from transformers import AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2_moe",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=6,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    )
    models = []
    for fused in (False, True):
        torch.manual_seed(7)
        model = fastft.add_lora(
            AutoModelForCausalLM.from_config(config),
            r=4,
            alpha=8,
            gradient_checkpointing=checkpointing and fused,
            fused=fused,
        )
        with torch.no_grad():
            generator = torch.Generator().manual_seed(1)
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
        models.append(model.train())
    trainable = [n for n, p in models[1].named_parameters() if p.requires_grad]
    assert any(".shared_expert.gate_proj." in n for n in trainable) and any(
        ".experts." in n for n in trainable
    )
    assert not any("shared_expert_gate" in n for n in trainable)
    assert model_state(models[1]).kernels.report.fused["moe"] == 2
    batch = _batch()
    expected_loss, expected = _loss_and_grads(models[0], batch)
    loss, grads = _loss_and_grads(models[1], batch)
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-5)
    for name_, got, want in zip(trainable, grads, expected, strict=True):
        assert _rel(got, want) <= 1e-5, name_


def test_two_runs_give_bit_identical_losses_and_gradients():
    model, _ = _lora_model("tiny-moe")
    batch = _batch(seed=3)
    first_loss, first = _loss_and_grads(model, batch)
    second_loss, second = _loss_and_grads(model, batch)
    assert torch.equal(first_loss, second_loss)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def _sync_free_grouped_mm(a, weight, group_end, *, gather_rows=None, scatter_rows=None, top_k=1, add=None):
    """A second grouped GEMM (each row's expert by binary search, one batched matmul): unlike the reference
    per-expert loop it needs no host copy of the offsets, so the trap below sees only fastft's own syncs."""
    rows = a.repeat_interleave(top_k, 0, output_size=a.shape[0] * top_k) if gather_rows is None else a
    if gather_rows is not None:
        rows = a.index_select(0, torch.div(gather_rows, top_k, rounding_mode="floor"))
    positions = torch.arange(rows.shape[0], device=a.device)
    expert = torch.searchsorted(group_end.long(), positions, right=True)
    w = weight.to(a.dtype).index_select(0, expert)
    y = torch.bmm(rows.unsqueeze(1), w.transpose(1, 2)).squeeze(1)
    y = y if scatter_rows is None else torch.empty_like(y).index_copy(0, scatter_rows, y)
    return y if add is None else y + add


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_fused_moe_forward_and_backward_never_wait_for_the_device(name, monkeypatch):
    from fastft.kernels import grouped_gemm

    model, _ = _lora_model(name)
    block = model.get_base_model().model.layers[0].mlp
    x = torch.randn(1, 37, model.config.hidden_size)
    x.requires_grad_()
    want = _first(block(x))
    host_reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: host_reads.append(".tolist()") or tolist(self))
    monkeypatch.setattr(grouped_gemm, "grouped_mm", _sync_free_grouped_mm)
    with SyncTrap() as trap:
        output = _first(block(x))
        output.square().sum().backward()
    assert trap.syncs == [] and host_reads == []
    assert _rel(output.detach(), want.detach()) <= 1e-5  # the double computes the same thing
    with SyncTrap() as trap:  # the reference grouped GEMM does read the offsets: the trap sees it
        grouped_gemm.grouped_mm_reference(x[0], torch.randn(2, 3, x.shape[-1]), torch.tensor([20, 37]))
    assert host_reads == [".tolist()"]


def test_expert_adapter_saves_and_reloads_with_plain_peft(tmp_path):
    from peft import PeftModel

    model, tokenizer = _lora_model("tiny-moe", targets=("q_proj", "experts"))
    path = fastft.save_adapter(model, tmp_path / "adapter", tokenizer)
    config = json.loads((path / "adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"]
    assert config["target_modules"] == ["q_proj"]
    base, _ = fastft.load_model("tiny-moe")
    reloaded = PeftModel.from_pretrained(base, path)  # transformers' modules, PEFT's own expert forward
    ids = torch.randint(3, 500, (1, 23), generator=torch.Generator().manual_seed(4))
    model.eval()
    with torch.no_grad():
        want = reloaded(input_ids=ids).logits
        assert _rel(model(input_ids=ids).logits, want) <= 1e-5
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnfusedWarning)
            patch(reloaded)
        assert _rel(reloaded(input_ids=ids).logits, want) <= 1e-5


def test_merged_moe_model_loads_with_plain_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model, tokenizer = _lora_model("tiny-gpt-oss")
    fastft.save_merged(model, tmp_path / "merged", tokenizer, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.randint(3, 500, (1, 23), generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        assert _rel(merged(input_ids=ids).logits, model(input_ids=ids).logits) <= 1e-5


def test_moe_patch_is_idempotent_reversible_and_per_instance():
    patched, _ = _lora_model("tiny-mixtral")
    plain, _ = _lora_model("tiny-mixtral", fused=False)
    block = patched.get_base_model().model.layers[1].mlp
    assert "forward" in vars(block) and patch(patched) is patch(patched)
    assert "forward" not in vars(plain.get_base_model().model.layers[1].mlp)
    batch = _batch()
    plain_loss = causal_lm_loss_sum(plain, batch).detach()
    unpatch(patched)
    assert "forward" not in vars(block) and not [key for key in vars(block) if key.startswith("_fastft_")]
    assert torch.equal(causal_lm_loss_sum(patched, batch).detach(), plain_loss)


def test_disabled_and_merged_adapters_match_peft(monkeypatch):
    patched, _ = _lora_model("tiny-moe")
    plain, _ = _lora_model("tiny-moe", fused=False)
    ids = torch.randint(3, 500, (1, 19), generator=torch.Generator().manual_seed(6))
    calls = _count_grouped_mm(monkeypatch)
    for model in (patched, plain):
        model.eval()
    with torch.no_grad():
        with patched.disable_adapter(), plain.disable_adapter():  # fused, base weights only
            assert _rel(patched(input_ids=ids).logits, plain(input_ids=ids).logits) <= 1e-5
        assert len(calls) == 2 * 2
        patched.merge_adapter()
        plain.merge_adapter()
        assert _rel(patched(input_ids=ids).logits, plain(input_ids=ids).logits) <= 1e-5
        assert len(calls) == 2 * 2 * 2  # merged: the adapters are inside the weights, still fused
        with patched.disable_adapter(), plain.disable_adapter():  # PEFT must unmerge: its forward runs
            assert _rel(patched(input_ids=ids).logits, plain(input_ids=ids).logits) <= 1e-5


def test_mixtral_router_jitter_while_training_takes_transformers_path(monkeypatch):
    model, _ = _lora_model("tiny-mixtral")
    for layer in model.get_base_model().model.layers:
        layer.mlp.jitter_noise = 0.1
    calls = _count_grouped_mm(monkeypatch)
    causal_lm_loss_sum(model, _batch())
    assert calls == []
    model.eval()
    causal_lm_loss_sum(model, _batch())
    assert calls == 2 * (["mm"] * 3 + ["down"])


def test_router_aux_loss_joins_the_loss_when_the_config_asks():
    """With ``output_router_logits`` the training loss is transformers' ``loss + coef * aux_loss`` (per
    trained token), fused or not, and its gradient reaches the adapters; without it, the loss is unchanged."""
    batch = _batch(lengths=(29,))
    ids = torch.as_tensor(batch.input_ids)
    losses = {}
    for fused in (False, True):
        model, _ = _lora_model("tiny-moe", fused=fused)
        config = model.get_base_model().config
        model.get_base_model().router_aux_loss_coef = 0.5  # large enough that a missing term would show
        plain, _ = _loss_and_grads(model, batch)
        config.output_router_logits = True
        losses[fused] = _loss_and_grads(model, batch)
        with torch.no_grad():
            output = model(input_ids=ids, labels=ids)
        assert float(losses[fused][0]) / batch.num_trained_tokens == pytest.approx(
            float(output.loss), rel=1e-5
        )
        assert float(losses[fused][0]) > float(plain) * (1 + 1e-4)
    for got, want in zip(losses[True][1], losses[False][1], strict=True):
        assert _rel(got, want) <= 1e-5


def test_experts_are_a_lora_target_and_the_router_is_not():
    from fastft.models.lora import LoraTargetError, linear_layer_names

    for name in MOE_PRESETS:
        model, _ = fastft.load_model(name)
        assert linear_layer_names(model)[-1] == "experts"
        wrapped = fastft.add_lora(model, r=4, gradient_checkpointing=False)  # "all-linear"
        trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
        assert any(".experts." in n for n in trainable)
        assert not any(".gate." in n or ".router." in n for n in trainable)
        assert linear_layer_names(wrapped.get_base_model())[-1] == "experts"
    llama, _ = fastft.load_model("tiny-llama")
    with pytest.raises(LoraTargetError, match="experts"):
        fastft.add_lora(llama, target_modules=["experts"])
    moe, _ = fastft.load_model("tiny-moe")
    with pytest.raises(ValueError, match="dropout"):
        fastft.add_lora(moe, target_modules=["q_proj", "experts"], dropout=0.1)
    with pytest.warns(UserWarning, match="leaves \\['experts'\\] out") as caught:
        wrapped = fastft.add_lora(moe, dropout=0.1, gradient_checkpointing=False)
    assert [w.filename for w in caught if "leaves" in str(w.message)] == [__file__]  # points at the caller
    assert model_state(wrapped).lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    moe, _ = fastft.load_model("tiny-moe")
    only_attention = fastft.add_lora(
        moe, target_modules=["q_proj"], dropout=0.1, gradient_checkpointing=False
    )
    assert not any("experts" in n for n, p in only_attention.named_parameters() if p.requires_grad)


def test_gpt_oss_fuses_its_moe_blocks_and_names_the_rest():
    model, _ = fastft.load_model("tiny-gpt-oss")
    with pytest.warns(UnfusedWarning, match="attention and RMSNorm of gpt_oss"):
        report = patch(model)
    assert report.fused == {"moe": 2, "cross_entropy": 1}


def test_packed_attention_refuses_gpt_oss_sinks_rather_than_dropping_them():
    from fastft.runtime.attention import AttentionBackendError, patch_packed_attention

    model, _ = _lora_model("tiny-gpt-oss")
    patch_packed_attention(model, "sdpa_masked")
    with pytest.raises(AttentionBackendError, match="attention=None"):
        causal_lm_loss_sum(model, _batch())


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", MOE_PRESETS)
def test_gpu_bf16_fused_moe_model_matches_peft_and_never_syncs(name):
    """bf16 on the GPU with the Triton grouped GEMM, against an fp32 copy of transformers + PEFT: the loss
    within 2e-2, and all LoRA gradients together within 2e-2 or 1.5x the error of transformers + PEFT in
    bf16 (its noise floor: bf16 router logits send a few tokens to other experts, which moves single expert
    gradients by several per cent in either implementation), whichever is larger. Then the fused MoE
    block's forward and backward on 4096 tokens without a host sync."""
    from fastft.bench.common import count_syncs

    batch = _batch(lengths=(70, 190, 33, 111)).to("cuda")
    results = {}
    for dtype, fused in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        model, _ = _lora_model(name, fused=fused)
        model.to(device="cuda", dtype=dtype)
        results[dtype, fused] = _loss_and_grads(model, batch)
    assert model_state(model).kernels.report.fused["moe"] == 2  # the fused blocks did run

    def flat(grads):
        return torch.cat([g.float().reshape(-1) for g in grads])

    ref_loss, ref = results[torch.float32, False]
    loss, grads = results[torch.bfloat16, True]
    assert float(loss) == pytest.approx(float(ref_loss), rel=2e-2)
    floor = _rel(flat(results[torch.bfloat16, False][1]), flat(ref))
    assert _rel(flat(grads), flat(ref)) <= max(2e-2, 1.5 * floor)
    block = model.get_base_model().model.layers[0].mlp
    x = torch.randn(
        1, 4096, model.config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True
    )
    _first(block(x)).float().square().sum().backward()  # warm up (autotuning, allocator)
    assert count_syncs(lambda: _first(block(x)).float().square().sum().backward()) == 0


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode,force", [(True, None), ("offload", "sync"), ("offload-single", "deferred")])
def test_router_aux_loss_gradient_survives_every_checkpointing_mode(fused, mode, force):
    """Offloaded checkpointing runs each layer's forward without autograd; the router statistics leave the
    layer as outputs of its autograd node, so the load-balancing loss trains the same as without
    checkpointing (the offload protocol runs on CPU tensors through its test stand-ins)."""
    import copy_stand_ins

    from fastft.runtime import offload

    batch = _batch(lengths=(29, 13))
    results = {}
    for checkpointing in (False, mode):
        model, _ = _lora_model("tiny-moe", fused=fused)
        base = model.get_base_model()
        base.router_aux_loss_coef = 0.5
        base.config.output_router_logits = True
        if checkpointing:
            from fastft.models.lora import set_gradient_checkpointing

            set_gradient_checkpointing(
                model, "offload" if checkpointing == "offload-single" else checkpointing
            )
            if force is not None:
                offload.enable_offload(
                    model, double_buffer=checkpointing == "offload", copies=copy_stand_ins.copies(force)
                )
        results[checkpointing] = _loss_and_grads(model, batch)
        if checkpointing and force is not None:
            assert offload.offloader_of(model).counts["layers_offloaded"] > 0
    (loss, grads), (want_loss, want) = results[mode], results[False]
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-6)
    for got, expected in zip(grads, want, strict=True):
        assert _rel(got, expected) <= 1e-5


def test_expert_lora_reaches_the_grouped_gemm_as_dense_tiles():
    """PEFT keeps an expert LoRA B as ``[N, r * E]`` (column ``j * E + e``); the grouped GEMM gets it as one
    contiguous ``[E, N, r]`` copy, never as the permuted view (whose loads would each touch a cache line)."""
    from fastft.models.moe import expert_weights

    model, _ = _lora_model("tiny-moe", fused=True)
    block = model.get_base_model().model.layers[0].mlp
    weights = expert_weights(block.experts, block._fastft_moe)
    for lora in (weights.gate_up_lora, weights.down_lora):
        experts, n, rank = lora.B.shape
        assert lora.B.is_contiguous() and lora.A.is_contiguous()
        assert experts == 8 and rank == 4
    wrapper = block.experts  # the outermost ParamWrapper adapts down_proj
    b = wrapper.lora_B["default"].weight
    assert torch.equal(weights.down_lora.B[3, :, 1], b[:, 1 * 8 + 3])  # expert 3, rank 1

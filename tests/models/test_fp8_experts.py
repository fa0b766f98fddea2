"""FP8 MoE experts (`load_in_fp8=True` on MoE models, `fastft.models.fp8.FP8Experts`): the stacked expert
weights stored e4m3 with per-expert, per-output-channel scales; fastft's fused MoE forward dequantises them
and runs its grouped GEMMs. On the CPU that path is exactly the 16-bit path over the dequantised weights
(bit for bit, fp32 and bf16), on awkward sizes (37 tokens, 7 experts, top-3, widths 40 and 24)."""

from __future__ import annotations

import copy

import pytest
import torch

# the block helpers of the fused-MoE tests (same awkward sizes, every supported block type)
from test_moe import BLOCKS, HIDDEN, _batch, _first, _fuse, _loss_and_grads, _random_block, _rel
from transformers import AutoModelForCausalLM

import fastft
from fastft.kernels import fp8 as kernels
from fastft.models import fp8
from fastft.models.errors import QuantizationError
from fastft.models.moe import moe_block_info


@pytest.mark.parametrize("transposed", [False, True])
def test_quantize_experts_is_each_expert_quantised_per_output_channel(transposed):
    torch.manual_seed(0)
    weight = torch.randn(7, 24, 40) * torch.logspace(-3, 1, 7).view(
        -1, 1, 1
    )  # experts of very different size
    weight[2, 5] = 0  # an all-zero channel
    stored = weight.transpose(1, 2).contiguous() if transposed else weight
    q, scale = kernels.quantize_experts(stored, transposed)
    assert q.dtype == torch.float8_e4m3fn and q.shape == stored.shape
    assert scale.shape == ((7, 1, 24) if transposed else (7, 24, 1))
    back = kernels.dequantize_experts(q, scale, torch.float32)
    for expert in range(7):
        want_q, want_scale = kernels.quantize_weight(weight[expert])
        got_q = q[expert].t() if transposed else q[expert]
        assert torch.equal(got_q.float(), want_q.float())
        assert torch.equal(scale[expert].flatten(), want_scale)
        dense = kernels.dequantize_weight(want_q, want_scale, torch.float32)
        assert torch.equal(back[expert].t() if transposed else back[expert], dense)
    assert torch.equal(back[2].t()[5] if transposed else back[2, 5], torch.zeros(40))
    with pytest.raises(ValueError, match="3-D"):
        kernels.quantize_experts(weight[0])


def _fp8_blocks(model_type: str, dtype: torch.dtype):
    """transformers' block with random weights, an FP8 copy running the fused forward, and a 16-bit copy
    holding the FP8 copy's dequantised expert weights, running the fused forward too."""
    block, config = _random_block(model_type)
    block.to(dtype)
    info = moe_block_info(block, config)
    quantised, dense = copy.deepcopy(block), copy.deepcopy(block)
    fp8._convert_experts(quantised.experts, torch.device("cpu"), info.transposed)
    quantised.to(dtype)  # keeps the e4m3 weights and their fp32 scales
    assert (
        fp8.is_fp8_experts(quantised.experts) and quantised.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    )
    with torch.no_grad():
        for name, value in zip(
            fp8.EXPERT_PARAMETERS, fp8.dense_experts(quantised.experts, dtype), strict=True
        ):
            getattr(dense.experts, name).copy_(value)
    return block, _fuse(quantised, info), _fuse(dense, info)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", list(BLOCKS))
def test_fp8_experts_are_the_dequantised_16_bit_experts_bit_for_bit(model_type, dtype):
    block, quantised, dense = _fp8_blocks(model_type, dtype)
    generator = torch.Generator().manual_seed(12)
    x = (torch.randn(1, 37, HIDDEN, generator=generator) * 2).to(dtype)
    upstream = torch.randn(1, 37, HIDDEN, generator=generator).to(dtype)
    results = []
    for module in (quantised, dense):
        inputs = x.clone().requires_grad_()
        trained = [
            p for n, p in module.named_parameters() if n.rsplit(".", 1)[-1] not in fp8.EXPERT_PARAMETERS
        ]
        output = module(inputs)
        results.append((_first(output), torch.autograd.grad(_first(output), [inputs, *trained], upstream)))
    (got, got_grads), (want, want_grads) = results
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.equal(g, w)
    # and close to the unquantised block: the e4m3 weights' rounding
    assert _rel(got.float(), _first(block(x)).float()) < 0.05


def _with_lora(model):
    """LoRA on attention and experts, non-zero B (as `test_moe._lora_model`), on a loaded model."""
    model = fastft.add_lora(
        model, r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "experts"], seed=5
    )
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.train()


def test_a_loaded_fp8_moe_model_trains_as_the_dequantised_16_bit_model():
    model, _ = fastft.load_model("tiny-moe", load_in_fp8=True, device="cpu")
    experts = [m for m in model.modules() if fp8.is_fp8_experts(m)]
    assert len(experts) == model.config.num_hidden_layers and fp8.is_fp8(model)
    for module in experts:
        assert module.gate_up_proj.dtype == module.down_proj.dtype == torch.float8_e4m3fn
        assert module.gate_up_proj_scale.shape == (*module.gate_up_proj.shape[:2], 1)
    estimate = fastft.estimate_vram(model, seq_len=256, lora_r=8)
    assert estimate.settings.precision == "fp8"
    constants = next(c for c in estimate.components if c.key == "quant_constants").bytes
    assert constants == sum(4 * scale.numel() for scale in fp8.fp8_scales(model).values())  # experts' E * N
    reference, _ = fastft.load_model("tiny-moe", device="cpu")
    with torch.no_grad():  # the 16-bit model holding the FP8 model's dequantised weights
        for name, module in model.named_modules():
            if isinstance(module, fp8.FP8Linear):
                reference.get_submodule(name).weight.copy_(module.dense_weight(torch.float32))
            elif fp8.is_fp8_experts(module):
                for key, value in zip(
                    fp8.EXPERT_PARAMETERS, fp8.dense_experts(module, torch.float32), strict=True
                ):
                    getattr(reference.get_submodule(name), key).copy_(value)
    model, reference = _with_lora(model), _with_lora(reference)
    adapters = dict(model.named_parameters())
    with torch.no_grad():  # the same adapters on both (PEFT's init draws differ between the two bases)
        for name, parameter in reference.named_parameters():
            if parameter.requires_grad:
                parameter.copy_(adapters[name])
    batch = _batch()
    results = [_loss_and_grads(base, batch) for base in (model, reference)]
    (loss, grads), (want_loss, want_grads) = results
    assert torch.equal(loss, want_loss)
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.equal(got, want)


def test_transformers_own_forward_refuses_fp8_experts_naming_the_fix():
    model, _ = fastft.load_model(
        "tiny-moe", load_in_fp8=True, device="cpu"
    )  # not patched: transformers' path
    with pytest.raises(QuantizationError, match="fused MoE forward only.*load the model in 16-bit"):
        model(input_ids=torch.tensor([[5, 6, 7]]))


def test_the_merged_export_holds_the_dequantised_experts(tmp_path):
    model, tokenizer = fastft.load_model("tiny-moe", load_in_fp8=True, device="cpu")
    model = fastft.add_lora(model, r=4, seed=2, target_modules=["q_proj"])
    fastft.save_merged(model, tmp_path / "merged", tokenizer, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any(name.endswith("_scale") for name in merged.state_dict())
    experts = model.get_base_model().model.layers[1].mlp.experts
    gate_up, down = fp8.dense_experts(experts, torch.float32)
    torch.testing.assert_close(merged.model.layers[1].mlp.experts.gate_up_proj, gate_up, rtol=0, atol=0)
    torch.testing.assert_close(merged.model.layers[1].mlp.experts.down_proj, down, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_fp8_experts_are_the_dequantised_16_bit_experts_on_the_grouped_gemms():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _, quantised, dense = _fp8_blocks("qwen3_moe", torch.bfloat16)
    quantised.cuda(), dense.cuda()
    assert (
        quantised.experts.gate_up_proj.dtype == torch.float8_e4m3fn and quantised.experts.gate_up_proj.is_cuda
    )
    x = torch.randn(1, 37, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    got = _first(quantised(x))
    (got_dx,) = torch.autograd.grad(got, x, torch.ones_like(got))
    want = _first(dense(x))
    (want_dx,) = torch.autograd.grad(want, x, torch.ones_like(want))
    assert torch.equal(got, want) and torch.equal(got_dx, want_dx)


def test_the_vram_estimate_of_an_fp8_moe_counts_its_experts_as_loading_stores_them():
    def component(estimate, key):
        return next(c for c in estimate.components if c.key == key).bytes

    model, _ = fastft.load_model("tiny-moe", load_in_fp8=True, device="cpu")
    args = dict(seq_len=256, lora_r=8)
    loaded = fastft.estimate_vram(model, **args)
    by_name = fastft.estimate_vram("tiny-moe", precision="fp8", **args)
    # the preset holds its weights in fp32 on the CPU; the estimate counts the 16-bit ones in bf16
    sixteen_bit = sum(p.numel() for p in model.parameters() if p.dtype != torch.float8_e4m3fn)
    assert component(by_name, "weights") == component(loaded, "weights") - 2 * sixteen_bit
    assert component(by_name, "quant_constants") == component(loaded, "quant_constants")

"""FP8 base weights (`load_model(..., load_in_fp8=True)`, `fastft.models.fp8`) on the CPU, where the
dequantised reference runs: which modules become FP8 and which stay 16-bit, a few training steps against the
16-bit run, the refusal on a card without FP8 tensor cores, the merged export, the refused resume of another
weight format, and the VRAM estimate's bytes."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import fastft
from fastft.data.skills import generate
from fastft.kernels import fp8 as kernels
from fastft.models import fp8
from fastft.models.errors import QuantizationError
from fastft.training.checkpoint import ResumeMismatchError
from fastft.training.trainer import TrainConfig, Trainer

ROWS = list(generate(24, seed=5))
PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _load(load_in_fp8: bool):
    return fastft.load_model("tiny-llama", max_seq_length=128, load_in_fp8=load_in_fp8, device="cpu")


def test_the_projections_become_fp8_and_everything_else_stays_as_loaded():
    model, _ = _load(True)
    reference, _ = _load(False)
    assert model.fastft_info.quantization == "fp8" and fp8.is_fp8(model) and not fp8.is_fp8(reference)
    converted = {name for name, module in model.named_modules() if isinstance(module, fp8.FP8Linear)}
    assert {name.rsplit(".", 1)[-1] for name in converted} == PROJECTIONS
    assert len(converted) == len(PROJECTIONS) * model.config.num_hidden_layers
    weights = dict(reference.named_parameters())
    for name, parameter in model.named_parameters():
        if name.removesuffix(".weight") in converted:
            module = model.get_submodule(name.removesuffix(".weight"))
            assert parameter.dtype == torch.float8_e4m3fn and not parameter.requires_grad
            # the seeded preset's weight, quantised: within an e4m3 half-step per channel
            dense = module.dense_weight(torch.float32)
            assert (dense - weights[name]).abs().max() <= weights[name].abs().amax() * 2**-4
        else:  # norms, embeddings, head: the 16-bit model's own
            assert torch.equal(parameter, weights[name])


@pytest.fixture
def no_triton(monkeypatch):
    """The ops' PyTorch references instead of the Triton interpreter: what FP8 changes is the projections'
    weights, which the reference path reads the same way, and the interpreter would take most of the time."""
    monkeypatch.setenv("FASTFT_NO_TRITON", "1")


@pytest.mark.slow  # two short runs; most of their time is the loaded CI machine's matmuls
@pytest.mark.filterwarnings("ignore::fastft.kernels.capability.KernelFallbackWarning")
def test_fp8_trains_a_few_steps_with_losses_close_to_16_bit(no_triton):
    losses = {}
    for load_in_fp8 in (False, True):
        model, tokenizer = _load(load_in_fp8)
        model = fastft.add_lora(model, r=8, seed=3)
        data = fastft.pack(ROWS, tokenizer, 128)
        config = TrainConfig(max_steps=2, learning_rate=2e-3, seed=1, attention=None)
        result = Trainer(model, tokenizer, data, config=config).train()
        losses[load_in_fp8] = [event.loss for event in result.steps]
    assert all(math.isfinite(loss) for loss in losses[True])
    for fp8_loss, loss in zip(losses[True], losses[False], strict=True):  # measured: within 1 %
        assert abs(fp8_loss - loss) < 0.02 * loss


def test_a_card_without_fp8_tensor_cores_is_refused_naming_it_and_the_alternatives(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(QuantizationError, match=r"NVIDIA A100-SXM4-80GB is sm80.*16-bit.*load_in_4bit=True"):
        fastft.load_model("tiny-llama", load_in_fp8=True, device="cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    fp8.check_fp8_device(torch.device("cuda"))  # an L4 / RTX 40xx passes


def test_fp8_with_4_bit_is_refused():
    with pytest.raises(QuantizationError, match="Choose one of load_in_fp8=True, load_in_4bit=True"):
        fastft.load_model("tiny-llama", load_in_fp8=True, load_in_4bit=True, device="cpu")


def test_the_merged_export_is_the_dequantised_weight_plus_the_delta(tmp_path):
    model, tokenizer = _load(True)
    model = fastft.add_lora(model, r=4, seed=2, target_modules=["q_proj", "down_proj"])
    with torch.no_grad():  # a non-zero delta
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    fastft.save_merged(model, tmp_path / "merged", tokenizer, dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any(name.endswith("weight_scale") for name in merged.state_dict())
    layer = model.get_base_model().model.layers[0]
    q = layer.self_attn.q_proj
    want = kernels.dequantize_weight(q.base_layer.weight, q.base_layer.weight_scale, torch.float32)
    want = want + q.get_delta_weight("default").float()
    torch.testing.assert_close(merged.model.layers[0].self_attn.q_proj.weight, want)
    up = layer.mlp.up_proj  # not adapted: the dequantised weight alone
    torch.testing.assert_close(merged.model.layers[0].mlp.up_proj.weight, up.dense_weight(torch.float32))
    # and the merged model computes what the FP8 model with its adapter computes
    ids = torch.tensor([tokenizer("the merged model")["input_ids"]])
    fastft.unpatch(model)  # PEFT's own forward over the FP8 layers (the reference path)
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, model(input_ids=ids).logits, atol=1e-4)


@pytest.mark.filterwarnings("ignore::fastft.kernels.capability.KernelFallbackWarning")
def test_resuming_with_another_weight_format_is_refused(tmp_path, no_triton):
    def trainer(load_in_fp8: bool, **config):
        model, tokenizer = _load(load_in_fp8)
        model = fastft.add_lora(model, r=4, seed=4)
        settings = dict(max_steps=2, seed=9, attention=None, output_dir=str(tmp_path / "run"), save_every=1)
        return Trainer(
            model, tokenizer, fastft.pack(ROWS, tokenizer, 128), config=TrainConfig(**settings | config)
        )

    first = trainer(True)
    first.train(steps=1)  # checkpoint-1, then paused
    first.close()
    with pytest.raises(ResumeMismatchError, match="weights 'fp8' → '16-bit'"):
        trainer(False, resume_from="latest").train()
    assert trainer(True, resume_from="latest").train().steps[-1].step == 2  # the same format resumes


def test_the_vram_estimate_counts_one_byte_a_projection_weight_and_its_scales():
    args = dict(seq_len=512, lora_r=8)
    bf16 = fastft.estimate_vram("tiny-llama", precision="bf16", **args)
    fp8_estimate = fastft.estimate_vram("tiny-llama", precision="fp8", **args)
    nf4 = fastft.estimate_vram("tiny-llama", precision="nf4", **args)

    def component(estimate, key):
        return next(c for c in estimate.components if c.key == key)

    model, _ = _load(True)
    linear = [m for m in model.modules() if isinstance(m, fp8.FP8Linear)]
    projection_params = sum(m.weight.numel() for m in linear)
    saved = projection_params  # 2 bytes each in bf16, 1 in fp8
    weights = component(bf16, "weights").bytes - component(fp8_estimate, "weights").bytes
    assert weights == saved
    assert component(fp8_estimate, "quant_constants").bytes == sum(4 * m.out_features for m in linear)
    assert component(nf4, "weights").bytes < component(fp8_estimate, "weights").bytes
    # a loaded FP8 model is read as one
    loaded = fastft.estimate_vram(model, **args)
    assert loaded.settings.precision == "fp8"
    assert component(loaded, "quant_constants").bytes == component(fp8_estimate, "quant_constants").bytes


@pytest.mark.gpu
def test_gpu_fp8_trains_on_fp8_tensor_cores_with_losses_close_to_16_bit():
    if not torch.cuda.is_available() or not kernels.fp8_supported(torch.device("cuda")):
        pytest.skip("needs a CUDA card with FP8 tensor cores (sm89+)")
    losses = {}
    for load_in_fp8 in (False, True):
        model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128, load_in_fp8=load_in_fp8)
        model = fastft.add_lora(model, r=8, seed=3)
        if load_in_fp8:  # q/k/v/o (128 wide) take the FP8 GEMMs; gate/up (344) the dequantised reference
            q = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
            assert q.weight.is_cuda and kernels.fp8_gemm_runs(torch.empty(1, 128, device="cuda"), q.weight)
        config = TrainConfig(max_steps=4, learning_rate=2e-3, seed=1)
        result = Trainer(model, tokenizer, fastft.pack(ROWS, tokenizer, 128), config=config).train()
        losses[load_in_fp8] = [event.loss for event in result.steps]
    for fp8_loss, loss in zip(losses[True], losses[False], strict=True):
        assert abs(fp8_loss - loss) < 0.03 * loss

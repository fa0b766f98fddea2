"""Loading (presets, local folders, errors), LoRA targets, export and the Unsloth-style facade."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, LlamaConfig

import fastft
from fastft.models.loading import (
    ModelLoadError,
    QuantizationError,
    UnknownModelError,
    UnsupportedArchitectureError,
    load_model,
)
from fastft.models.lora import (
    LoraTargetError,
    add_lora,
    is_checkpointing,
    linear_layer_names,
    trainable_parameter_count,
)
from fastft.models.presets import FAMILY_CHATS, PRESETS, preset_eos_ids
from fastft.runtime.model_state import model_state

PROMPT = [
    {"role": "user", "content": "Reverse the letters of 'lemon'."},
    {"role": "assistant", "content": "nomel"},
]


def _ids(tokenizer) -> torch.Tensor:
    return tokenizer(tokenizer.apply_chat_template(PROMPT, tokenize=False), return_tensors="pt")["input_ids"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_loads_offline_and_trains_with_lora(name):
    model, tokenizer = load_model(name, max_seq_length=128)
    assert model.config.model_type == PRESETS[name].model_type
    assert model.dtype == torch.float32  # dtype=None on the CPU
    assert model.fastft_info.source == "preset" and tokenizer.model_max_length == 128
    family = FAMILY_CHATS[PRESETS[name].chat] if PRESETS[name].chat else None
    assert tokenizer.eos_token == (family.eos if family else "<|im_end|>") and tokenizer.chat_template
    assert len(tokenizer) == PRESETS[name].vocab_size == model.config.vocab_size
    # the config names the tokenizer's BOS / EOS / pad (else transformers' Trainer rewrites it at train time)
    for kind in ("bos", "eos", "pad"):
        expected = (
            preset_eos_ids(name, tokenizer) if kind == "eos" else getattr(tokenizer, f"{kind}_token_id")
        )
        assert getattr(model.config, f"{kind}_token_id") == expected, kind
        assert getattr(model.generation_config, f"{kind}_token_id") == expected, kind
    model = add_lora(model, r=4, alpha=8)
    ids = _ids(tokenizer)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss)
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_grads and all(g is not None for g in lora_grads)
    assert sum(float(g.abs().sum()) for g in lora_grads) > 0
    frozen = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert all(not p.requires_grad and p.grad is None for p in frozen)


def test_preset_weights_are_the_same_in_every_load():
    a, _ = load_model("tiny-qwen3")
    b, _ = load_model("tiny-qwen3")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_explicit_dtype_is_honoured():
    model, _ = load_model("tiny-llama", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.fastft_info.dtype == torch.bfloat16
    model, _ = load_model("tiny-llama", dtype="float16")
    assert model.dtype == torch.float16


def test_save_then_load_folder_round_trip(tmp_path):
    model, tokenizer = load_model("tiny-mistral")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model(str(tmp_path), max_seq_length=64)
    assert loaded.fastft_info.source == "local"
    assert loaded_tokenizer.model_max_length == 64
    ids = _ids(tokenizer)
    assert (
        loaded_tokenizer(tokenizer.decode(ids[0]), add_special_tokens=False)["input_ids"] == ids[0].tolist()
    )
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        actual = loaded(input_ids=ids, use_cache=False).logits
    assert torch.equal(expected, actual)


def test_hub_id_path_is_tried_and_wrapped_offline(monkeypatch):
    with pytest.raises(ModelLoadError, match="offline|Could not"):
        load_model("some-org/some-model-that-does-not-exist")


def test_unknown_model_names_presets_and_close_matches():
    with pytest.raises(UnknownModelError) as error:
        load_model("tiny-lama")
    assert "tiny-llama" in str(error.value) and "Did you mean" in str(error.value)


def test_four_bit_on_cpu_loads_through_bitsandbytes_and_says_it_is_slow():
    import bitsandbytes as bnb

    with pytest.warns(UserWarning, match="CPU backend, which is slow"):
        model, _ = load_model("tiny-llama", load_in_4bit=True, device="cpu")
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, bnb.nn.Linear4bit) and layer.weight.quant_type == "nf4"
    assert model.fastft_info.quantization == "nf4"
    packed = layer.weight.data.clone()
    with torch.no_grad():  # an inference call (eval mode, no grad) leaves the NF4 weight as loaded
        model.eval()(input_ids=torch.tensor([[5, 17, 42, 99, 7]]))
        x = torch.randn(3, layer.in_features, generator=torch.Generator().manual_seed(0))
        expected = x @ bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).T
        assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.weight.data, packed) and layer.weight.quant_state.shape == (128, 128)
    with pytest.raises(QuantizationError, match="not both"):
        load_model("tiny-llama", load_in_4bit=True, load_in_8bit=True)


def test_unsupported_architecture_is_named(tmp_path):
    config = {"model_type": "vit", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="vit"):
        load_model(str(tmp_path))


def test_remote_code_is_refused_without_consent(tmp_path):
    config = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32).to_dict()
    config.update(model_type="my-custom-llm", auto_map={"AutoModelForCausalLM": "modeling.MyModel"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="trust_remote_code=True"):
        load_model(str(tmp_path))


def test_pickled_weights_are_refused(tmp_path):
    model, _ = load_model("tiny-qwen3")
    model.save_pretrained(tmp_path, safe_serialization=False)
    if (tmp_path / "model.safetensors").exists():  # transformers 5 always writes safetensors
        (tmp_path / "model.safetensors").unlink()
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(str(tmp_path))


def test_unknown_lora_target_lists_the_real_linear_layers():
    model, _ = load_model("tiny-llama")
    with pytest.raises(LoraTargetError) as error:
        add_lora(model, target_modules=["q_proj", "query"])
    message = str(error.value)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in message
    assert "'query'" in message


def test_all_linear_skips_output_head_and_moe_router():
    model, _ = load_model("tiny-moe")
    names = linear_layer_names(model)
    assert "lm_head" not in names and "gate" not in names
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(names)
    assert names[-1] == "experts"  # the stacked expert weights (fastft.models.moe), last
    llama, _ = load_model("tiny-llama")
    assert linear_layer_names(llama) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]


def test_add_lora_is_idempotent_and_refuses_a_second_config():
    model, _ = load_model("tiny-llama")
    lora = add_lora(model, r=8, alpha=16)
    assert add_lora(lora, r=8, alpha=16) is lora  # re-running the notebook cell
    with pytest.raises(ValueError, match="already has LoRA"):
        add_lora(lora, r=4)
    trainable, total = trainable_parameter_count(lora)
    layers, hidden, inter, kv = 4, 128, 344, 64
    per_layer = 8 * ((hidden + hidden) * 2 + (hidden + kv) * 2 + (hidden + inter) * 3)
    assert trainable == layers * per_layer and total > trainable


def test_lora_init_follows_the_seed_not_the_global_rng():
    a = add_lora(load_model("tiny-llama")[0], r=4, seed=7)
    torch.manual_seed(999)
    b = add_lora(load_model("tiny-llama")[0], r=4, seed=7)
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if "lora_A" in n:
            assert torch.equal(x, y), n


def test_adapter_reloads_with_plain_peft(tmp_path):
    model, tokenizer = load_model("tiny-qwen3")
    model = add_lora(model, r=4, alpha=8)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    path = fastft.save_adapter(model, tmp_path / "adapter", tokenizer)
    assert (path / "adapter_config.json").exists() and (path / "adapter_model.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    base, _ = load_model("tiny-qwen3")
    reloaded = PeftModel.from_pretrained(base, path)
    ids = _ids(tokenizer)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, reloaded(input_ids=ids).logits, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])  # untied and tied embeddings
def test_merged_model_loads_with_plain_transformers(tmp_path, name):
    model, tokenizer = load_model(name)
    model = add_lora(model, r=4, alpha=8)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.05)
    ids = _ids(tokenizer)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    fastft.save_merged(model, tmp_path / "fp32", tokenizer, dtype=torch.float32)
    fastft.save_merged(model, tmp_path / "bf16", tokenizer)
    exact = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert half.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.allclose(exact(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        relative = (half(input_ids=ids).logits.float() - expected).norm() / expected.norm()
        assert relative < 2e-2  # the bf16 tolerance
        assert torch.equal(model(input_ids=ids).logits, expected)  # merging left the LoRA model alone


def test_facade_maps_unsloth_arguments():
    model, tokenizer = fastft.FastLanguageModel.from_pretrained(
        model_name="tiny-llama", max_seq_length=96, dtype=None, load_in_4bit=False
    )
    assert model.dtype == torch.float32 and tokenizer.model_max_length == 96
    model = fastft.FastLanguageModel.get_peft_model(
        model,
        r=8,
        target_modules=["q_proj", "v_proj"],
        lora_alpha=16,
        lora_dropout=0.0,
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=3407,
    )
    lora = model_state(model).lora
    assert lora.r == 8 and lora.target_modules == ("q_proj", "v_proj")
    assert lora.gradient_checkpointing == fastft.Checkpointing("offload")  # Unsloth's name, parsed once
    assert is_checkpointing(model)
    same = fastft.add_lora(
        load_model("tiny-llama")[0], r=8, alpha=16, target_modules=["q_proj", "v_proj"], seed=3407
    )
    for (n, x), (_, y) in zip(model.named_parameters(), same.named_parameters(), strict=True):
        assert torch.equal(x, y), n
    with pytest.raises(TypeError, match="unexpected"):
        fastft.FastLanguageModel.get_peft_model(load_model("tiny-llama")[0], bogus=1)

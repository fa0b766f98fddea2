"""The Unsloth calls people type, each written as Unsloth's notebooks write it, with ``unsloth`` replaced by
``fastft``: chat templates, responses-only training, bf16 detection, `FastModel`, loading a saved adapter
folder, `modules_to_save`, DoRA, and adapters that record their base."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

import fastft
from fastft.runtime.model_state import model_state
from fastft.unsloth import FastLanguageModel, FastModel, is_bfloat16_supported
from fastft.unsloth.chat_templates import get_chat_template, train_on_responses_only

CONVERSATIONS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8"},
    ],
    [
        {"role": "user", "content": "Spell cat backwards."},
        {"role": "assistant", "content": "tac"},
    ],
] * 4
REPLIES = [[m["content"] for m in c if m["role"] == "assistant"] for c in CONVERSATIONS]


def _sft_config(tmp_path, **overrides):
    from trl import SFTConfig

    settings = dict(
        output_dir=str(tmp_path / "outputs"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=2,
        learning_rate=2e-4,
        logging_steps=1,
        bf16=is_bfloat16_supported(),
        optim="adamw_torch",
        seed=3407,
        report_to="none",
        max_length=128,
        use_cpu=not torch.cuda.is_available(),
    )
    return SFTConfig(**{**settings, **overrides})


def _unsloth_model(name="tiny-llama", **peft):
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=name, max_seq_length=128, dtype=None, load_in_4bit=False
    )
    settings = dict(
        r=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=16,
        lora_dropout=0,
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=3407,
    )
    return FastLanguageModel.get_peft_model(model, **{**settings, **peft}), tokenizer


def test_preset_template_renders_as_before_and_trl_trains_only_the_assistant(tmp_path):
    from trl import SFTTrainer

    model, tokenizer = _unsloth_model()
    text = tokenizer.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    assert text == "<|im_start|>user\nSpell cat backwards.<|im_end|>\n<|im_start|>assistant\ntac<|im_end|>\n"
    trainer = SFTTrainer(
        model=model,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"messages": CONVERSATIONS}),
        args=_sft_config(tmp_path, assistant_only_loss=True),
    )
    row = trainer.train_dataset[1]
    trained = [i for i, label in zip(row["input_ids"], row["labels"], strict=True) if label != -100]
    assert tokenizer.decode(trained) == "tac<|im_end|>"
    assert trainer.train().training_loss > 0


def test_train_on_responses_only(tmp_path):
    from trl import SFTTrainer

    model, tokenizer = _unsloth_model()
    tokenizer = get_chat_template(tokenizer, chat_template="chatml")

    def formatting_prompts_func(examples):
        convos = examples["conversations"]
        texts = [
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False) for c in convos
        ]
        return {"text": texts}

    dataset = Dataset.from_dict({"conversations": CONVERSATIONS}).map(formatting_prompts_func, batched=True)
    trainer = SFTTrainer(
        model=model,
        processing_class=tokenizer,
        train_dataset=dataset,
        args=_sft_config(tmp_path, dataset_text_field="text"),
    )
    trainer = train_on_responses_only(
        trainer, instruction_part="<|im_start|>user\n", response_part="<|im_start|>assistant\n"
    )
    for row, replies in zip(trainer.train_dataset, REPLIES, strict=True):
        trained = [i for i, label in zip(row["input_ids"], row["labels"], strict=True) if label != -100]
        # every reply with its end-of-turn; nothing appended to the text (as Unsloth: TRL alone adds an eos)
        expected = "".join(f"{reply}<|im_end|>\n" for reply in replies)
        assert tokenizer.decode(trained) == expected
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer_stats = trainer.train()
    assert trainer_stats.training_loss > 0
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="response_part"):
        train_on_responses_only(trainer, instruction_part="<|im_start|>user\n", response_part="### Reply:")


def test_the_drop_in_names_are_also_fastfts():
    assert fastft.FastLanguageModel is FastLanguageModel and fastft.FastModel is FastModel
    assert fastft.is_bfloat16_supported is is_bfloat16_supported


def test_is_bfloat16_supported(monkeypatch):
    assert is_bfloat16_supported() == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert is_bfloat16_supported() is True
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert is_bfloat16_supported() is False


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-moe"])
def test_fast_model(name):
    model, tokenizer = FastModel.from_pretrained(
        model_name=name, max_seq_length=128, load_in_4bit=False, load_in_8bit=False, full_finetuning=False
    )
    model = FastModel.get_peft_model(
        model,
        finetune_vision_layers=False,
        finetune_language_layers=True,
        finetune_attention_modules=True,
        finetune_mlp_modules=False,
        r=8,
        lora_alpha=8,
        lora_dropout=0,
        bias="none",
        random_state=3407,
    )
    assert set(model_state(model).lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    both = FastModel.get_peft_model(FastModel.from_pretrained(model_name=name)[0], r=8, lora_alpha=8)
    assert set(model_state(both).lora.target_modules) == set(fastft.linear_layer_names(both.get_base_model()))
    with pytest.raises(ValueError, match="full_finetuning=False"):
        FastModel.from_pretrained(model_name=name, full_finetuning=True)


def test_fast_model_tokenizer_renders_text_by_default_as_unsloths_processor():
    """Gemma 3 notebooks: text = tokenizer.apply_chat_template(messages, add_generation_prompt=True), then
    tokenizer([text], return_tensors="pt"): FastModel's tokenizer gives the text, as Unsloth's processor does;
    FastLanguageModel's gives the ids (a tokenizer's default), and explicit arguments are obeyed by both."""
    messages = [{"role": "user", "content": "Why is the sky blue?"}]
    _, tokenizer = FastModel.from_pretrained("tiny-llama")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    batch = tokenizer([text], return_tensors="pt")
    assert batch.input_ids.shape[0] == 1
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    assert torch.equal(ids[0], batch.input_ids[0])
    assert isinstance(tokenizer.apply_chat_template(messages, tokenize=True)[0], int)
    _, plain = FastLanguageModel.from_pretrained("tiny-llama")
    assert plain.apply_chat_template(messages, add_generation_prompt=True) == batch.input_ids[0].tolist()


def test_sharegpt_messages_on_an_unmapped_template_name_the_mapping(tmp_path, monkeypatch):
    """Llama3_(8B)-Conversational: the tokenizer is mapped to ShareGPT keys, the adapter saved without it
    (model.save_pretrained only), and the reload cell reads it back: the tokenizer is the base's, as with
    Unsloth, and ShareGPT messages given to it fail with an error naming the mapping, not jinja's."""
    monkeypatch.chdir(tmp_path)
    sharegpt = {"role": "from", "content": "value", "user": "human", "assistant": "gpt"}
    messages = [{"from": "human", "value": "What is a famous tall tower in Paris?"}]
    model, tokenizer = _unsloth_model("tiny-llama3")
    tokenizer = get_chat_template(tokenizer, chat_template="llama-3", mapping=sharegpt)
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_tensors="pt"
    )
    assert ids.shape[0] == 1
    model.save_pretrained("lora_model")

    _, reloaded = FastLanguageModel.from_pretrained(
        model_name="lora_model", max_seq_length=128, load_in_4bit=False
    )
    with pytest.raises(ValueError, match=r"keys \['from', 'value'\].*mapping=.*tokenizer.save_pretrained"):
        reloaded.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_tensors="pt")
    with pytest.raises(ValueError, match="keys"):  # a batch of conversations too
        reloaded.apply_chat_template([messages, messages], tokenize=False)
    assert "What is" in reloaded.apply_chat_template([{"role": "user", "content": "What is"}], tokenize=False)
    reloaded = get_chat_template(reloaded, chat_template="llama-3", mapping=sharegpt)  # the fix it names
    again = reloaded.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_tensors="pt"
    )
    assert torch.equal(again, ids)


def test_from_pretrained_on_a_saved_adapter_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, tokenizer = _unsloth_model()
    fastft.train(model, tokenizer, [{"messages": c} for c in CONVERSATIONS], max_steps=2, progress=False)
    model.save_pretrained("lora_model")  # Local saving
    tokenizer.save_pretrained("lora_model")

    loaded, loaded_tokenizer = FastLanguageModel.from_pretrained(
        model_name="lora_model", max_seq_length=128, dtype=None, load_in_4bit=False
    )
    FastLanguageModel.for_inference(loaded)
    FastLanguageModel.for_inference(model)
    ids = tokenizer("What is 2 + 3?", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6, rtol=0)
    assert loaded_tokenizer.get_vocab() == tokenizer.get_vocab() and loaded_tokenizer.model_max_length == 128
    assert fastft.is_fused(loaded) and model_state(loaded).lora.r == 8
    assert any(p.requires_grad for n, p in loaded.named_parameters() if "lora_" in n)  # training can go on


def test_modules_to_save_trains_and_saves_the_embeddings_and_head(tmp_path, monkeypatch):
    """Unsloth's continued-pretraining notebook lists embed_tokens and lm_head among the target modules."""
    monkeypatch.chdir(tmp_path)
    model, tokenizer = _unsloth_model(
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "embed_tokens",
            "lm_head",
        ],  # fmt: skip
    )
    assert model_state(model).lora.modules_to_save == ("embed_tokens", "lm_head")
    base = model.get_base_model()
    embedding, head = base.get_input_embeddings().weight, base.get_output_embeddings().weight
    original = fastft.load_model("tiny-llama")[0]
    assert embedding.requires_grad and head.requires_grad
    fastft.train(model, tokenizer, [{"messages": c} for c in CONVERSATIONS], max_steps=3, progress=False)
    assert not torch.equal(embedding, original.get_input_embeddings().weight)
    assert not torch.equal(head, original.get_output_embeddings().weight)
    model.save_pretrained("lora_model")
    saved = load_file("lora_model/adapter_model.safetensors")
    assert any("embed_tokens" in key for key in saved) and any("lm_head" in key for key in saved)
    loaded, _ = FastLanguageModel.from_pretrained(model_name="lora_model", max_seq_length=128)
    loaded_base = loaded.get_base_model()
    assert torch.equal(loaded_base.get_input_embeddings().weight, embedding)
    assert torch.equal(loaded_base.get_output_embeddings().weight, head)
    with pytest.raises(ValueError, match="embed_tokens"):
        fastft.add_lora(fastft.load_model("tiny-llama")[0], modules_to_save=["embeddings"])


def test_modules_to_save_keeps_tied_embeddings_tied(tmp_path):
    model, tokenizer = _unsloth_model("tiny-qwen3", modules_to_save=["embed_tokens", "lm_head"])
    base = model.get_base_model()
    assert base.config.tie_word_embeddings
    before = base.get_input_embeddings().weight.detach().clone()
    fastft.train(model, tokenizer, [{"messages": c} for c in CONVERSATIONS], max_steps=2, progress=False)
    embedding, head = base.get_input_embeddings().weight, base.get_output_embeddings().weight
    assert embedding.requires_grad and embedding is head and not torch.equal(embedding, before)
    model.save_pretrained(tmp_path / "lora_model")
    loaded, _ = FastLanguageModel.from_pretrained(model_name=str(tmp_path / "lora_model"), max_seq_length=128)
    ids = tokenizer("What is 2 + 3?", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(
            loaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits, atol=1e-6
        )


def test_a_head_trained_whole_keeps_the_fused_loss_and_its_value():
    from fastft.data.batch import PackedBatch
    from fastft.training.loss import causal_lm_loss_sum

    model, _ = _unsloth_model(modules_to_save=["lm_head"])
    head = model.get_base_model().get_output_embeddings()
    with torch.no_grad():
        head.modules_to_save["default"].weight.mul_(1.5)  # the trained copy differs from the original
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 500, (n,), generator=generator) for n in (17, 9)]
    batch = PackedBatch.from_sequences(ids, [i.clone() for i in ids])
    calls = []
    import fastft.kernels.fused_linear_ce as ce

    real = ce.fused_linear_cross_entropy
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ce, "fused_linear_cross_entropy", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
        fused = causal_lm_loss_sum(model, batch)
    assert calls and calls[0] is head.modules_to_save["default"].weight  # the trained copy, fused
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits[0]
    eager = torch.nn.functional.cross_entropy(
        logits[batch.target_positions].float(), batch.target_ids, reduction="sum"
    )
    assert torch.allclose(fused, eager, rtol=1e-5, atol=1e-4)


def test_use_dora_trains_dora_or_names_the_alternative():
    model, tokenizer = _unsloth_model(use_dora=True)
    magnitudes = [n for n, p in model.named_parameters() if "lora_magnitude_vector" in n and p.requires_grad]
    assert magnitudes and model_state(model).lora.use_dora
    result = fastft.train(
        model, tokenizer, [{"messages": c} for c in CONVERSATIONS], max_steps=2, progress=False
    )
    assert all(torch.isfinite(torch.tensor(e.loss)) for e in result.steps)
    with pytest.raises(ValueError, match="use_dora=False"):  # expert weights take plain LoRA only
        _unsloth_model("tiny-moe", target_modules="all-linear", use_dora=True)
    with pytest.raises(ValueError, match="layers_to_transform"):  # refused, not dropped
        _unsloth_model(layers_to_transform=[0, 1])
    assert model_state(_unsloth_model(layers_to_transform=None)[0]).lora.r == 8


def test_adapter_records_its_base_for_fastft_and_for_auto_peft(tmp_path, monkeypatch):
    from peft import AutoPeftModelForCausalLM

    monkeypatch.chdir(tmp_path)
    model, tokenizer = _unsloth_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no lookup of "tiny-llama" on the hub while saving, no warning
        fastft.save_adapter(model, "lora_model", tokenizer)
    config = json.loads((tmp_path / "lora_model" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny-llama"
    by_fastft, _ = fastft.load_model("lora_model")  # the preset name resolves to the embedded preset
    fastft.load_model("tiny-llama")[0].save_pretrained("tiny-llama")  # a saved base folder of that name
    by_peft = AutoPeftModelForCausalLM.from_pretrained("lora_model")
    ids = tokenizer("Spell cat backwards.", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        assert torch.allclose(by_fastft.eval()(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
        assert torch.allclose(by_peft.eval()(input_ids=ids).logits, expected, atol=1e-5, rtol=0)

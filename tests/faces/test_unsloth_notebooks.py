"""Conformance with Unsloth's official notebooks: one test per notebook pattern, each making on a tiny preset, on
the CPU, the whole sequence of calls such a notebook makes after ``from fastft.unsloth import ...``, from
``from_pretrained`` to ``save_pretrained_merged`` / ``save_pretrained_gguf``, then reloading what it saved with
plain transformers / peft and generating from it. The notebooks themselves, run cell by cell, are recorded in
docs/unsloth-compatibility.md; these tests are this project's own code, not copies of them."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from datasets import Dataset

from fastft.unsloth import (
    FastLanguageModel,
    PatchDPOTrainer,
    PatchFastRL,
    SamplingParams,
    standardize_sharegpt,
    to_sharegpt,
)
from fastft.unsloth.chat_templates import apply_chat_template, get_chat_template, train_on_responses_only

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALPACA = "Below is an instruction.\n\n### Instruction:\n{}\n\n### Input:\n{}\n\n### Response:\n{}"
N = 8  # rows of each local dataset


def _peft(model, r=8, **overrides):
    """get_peft_model with every argument the notebooks pass."""
    settings = dict(
        r=r,
        target_modules=TARGETS,
        lora_alpha=r,
        lora_dropout=0,
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=3407,
        use_rslora=False,
        loftq_config=None,
    )
    return FastLanguageModel.get_peft_model(model, **{**settings, **overrides})


def _args(**overrides):
    """The training arguments every notebook passes, at two steps."""
    settings = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        warmup_steps=0,
        max_steps=2,
        learning_rate=2e-4,
        logging_steps=1,
        optim="adamw_torch",  # the notebooks' adamw_8bit needs bitsandbytes' GPU optimizer
        weight_decay=0.01,
        lr_scheduler_type="linear",
        seed=3407,
        output_dir="outputs",
        report_to="none",
    )
    return {**settings, **overrides}


def _losses(trainer) -> list[float]:
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(math.isfinite(loss) for loss in losses), trainer.state.log_history
    return losses


def _qa(i: int) -> tuple[str, str]:
    return f"What is {i} plus {i + 1}?", str(2 * i + 1)


def _generate(model, tokenizer, text: str, new: int = 3) -> list[int]:
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    return out[0, ids.shape[1] :].tolist()


def _reload_merged(folder, prompt="Hello"):
    """The merged folder with plain transformers; it generates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    assert getattr(model.config, "quantization_config", None) is None
    return model, tokenizer, _generate(model, tokenizer, prompt)


def _reload_adapter(folder, prompt="Hello"):
    """The adapter folder with plain peft on its recorded base; it generates."""
    import json

    from peft import PeftModel
    from transformers import AutoTokenizer

    import fastft

    base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(fastft.load_model(base)[0], str(folder))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return _generate(model, tokenizer, prompt)


def _gguf_tensors(path) -> int:
    import gguf

    return len(gguf.GGUFReader(str(path)).tensors)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the notebooks save into relative folders


@pytest.mark.skipif(torch.cuda.is_available(), reason="the notebooks' 4-bit load, without CUDA")
def test_alpaca_sft_in_4bit_to_merged_16bit_and_gguf(tmp_path):
    """Llama-3.1 Alpaca: 4-bit load, top-level SFTTrainer arguments, save the adapter, reload it, merge
    (into the dequantised NF4 weights, as Unsloth does), GGUF q8_0 then f16 into the same folder."""
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="tiny-llama", max_seq_length=128, dtype=None, load_in_4bit=True
    )
    model = _peft(model)
    eos = tokenizer.eos_token
    rows = [dict(instruction=_qa(i)[0], input="", output=_qa(i)[1]) for i in range(N)]
    dataset = Dataset.from_list(rows).map(
        lambda x: {"text": [ALPACA.format(*row) + eos for row in zip(x["instruction"], x["input"], x["output"])]},
        batched=True,
    )
    trainer = SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        dataset_text_field="text",
        max_seq_length=128,
        packing=False,
        args=SFTConfig(**_args()),
    )
    trainer.train()
    _losses(trainer)
    FastLanguageModel.for_inference(model)
    _generate(model, tokenizer, ALPACA.format("Continue the sequence.", "1, 1, 2", ""))

    model.save_pretrained("lora_model")
    tokenizer.save_pretrained("lora_model")
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="lora_model", max_seq_length=128, dtype=None, load_in_4bit=True
    )
    FastLanguageModel.for_inference(model)
    with pytest.warns(UserWarning, match="dequantised NF4"):
        model.save_pretrained_merged("model", tokenizer, save_method="merged_16bit")
    merged, _, _ = _reload_merged(tmp_path / "model")
    # the merged weights are the NF4 base dequantised plus the trained delta: the reloaded model computes
    # what the 4-bit model with its adapter does, up to the 16-bit rounding of the saved weights
    ids = tokenizer("What is 1 plus 2?", return_tensors="pt").input_ids
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits.float(), merged.float()(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=0.15), (ours - theirs).abs().max()
    with pytest.raises(ValueError, match="merged_16bit"):
        model.save_pretrained_merged("model_4bit", tokenizer, save_method="merged_4bit")

    q8 = model.save_pretrained_gguf("model", tokenizer)  # Unsloth's default: q8_0
    f16 = model.save_pretrained_gguf("model", tokenizer, quantization_method="f16")
    assert _gguf_tensors(q8.path) == _gguf_tensors(f16.path) > 0 and q8.path.is_file()
    assert (tmp_path / "model" / "model.safetensors").is_file()  # the merged model is still there
    assert "FROM" in tokenizer._ollama_modelfile  # what the Ollama notebook prints
    assert _reload_adapter(tmp_path / "lora_model", ALPACA.format("Hi", "", ""))

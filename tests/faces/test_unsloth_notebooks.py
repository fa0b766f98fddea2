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
    apply_chat_template,
    standardize_sharegpt,
    to_sharegpt,
)
from fastft.unsloth.chat_templates import get_chat_template, train_on_responses_only

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
        out = model.generate(
            input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
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
        lambda x: {
            "text": [
                ALPACA.format(*row) + eos
                for row in zip(x["instruction"], x["input"], x["output"], strict=True)
            ]
        },
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

    # Unsloth's default, q8_0; the file's read-back check is the export's own tests' (tests/export), here: where
    # the files land, beside the merged model, and that they read back
    q8 = model.save_pretrained_gguf("model", tokenizer, check=False)
    f16 = model.save_pretrained_gguf("model", tokenizer, quantization_method="f16", check=False)
    assert _gguf_tensors(q8.path) == _gguf_tensors(f16.path) > 0 and q8.path.is_file()
    assert (tmp_path / "model" / "model.safetensors").is_file()  # the merged model is still there
    assert "FROM" in tokenizer._ollama_modelfile  # what the Ollama notebook prints
    assert _reload_adapter(tmp_path / "lora_model", ALPACA.format("Hi", "", ""))


def _sharegpt(i: int) -> list[dict]:
    question, answer = _qa(i)
    turns = [{"from": "human", "value": question}, {"from": "gpt", "value": f"It is {answer}."}]
    return turns + ([{"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}] if i % 2 else [])


def test_conversational_sft_trains_only_the_replies_and_merges(tmp_path):
    """Llama-3.2 / Mistral conversational: get_chat_template with a ShareGPT mapping, standardize_sharegpt,
    SFTTrainer with DataCollatorForSeq2Seq, train_on_responses_only(trainer) without markers, generation from
    apply_chat_template(tokenize=True, return_tensors="pt"), adapter and merged saves reloaded."""
    from transformers import DataCollatorForSeq2Seq
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="tiny-mistral", max_seq_length=128, dtype=None, load_in_4bit=False
    )
    model = _peft(model)
    tokenizer = get_chat_template(
        tokenizer,
        chat_template="chatml",
        mapping={"role": "from", "content": "value", "user": "human", "assistant": "gpt"},
        map_eos_token=True,
    )
    dataset = standardize_sharegpt(Dataset.from_list([{"conversations": _sharegpt(i)} for i in range(N)]))
    dataset = dataset.map(
        lambda x: {"text": [tokenizer.apply_chat_template(c, tokenize=False) for c in x["conversations"]]},
        batched=True,
    )
    trainer = SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        dataset_text_field="text",
        max_seq_length=128,
        data_collator=DataCollatorForSeq2Seq(tokenizer=tokenizer),
        packing=False,
        args=SFTConfig(**_args()),
    )
    trainer = train_on_responses_only(trainer)
    row = trainer.train_dataset[1]
    trained = tokenizer.decode(
        [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != -100]
    )
    assert "It is 3." in trained and "Yes." in trained and tokenizer.eos_token in trained
    assert not any(text in trained for text in ("What is", "Sure?", "user", "assistant"))
    trainer.train()
    _losses(trainer)

    FastLanguageModel.for_inference(model)
    inputs = tokenizer.apply_chat_template(
        [{"from": "human", "value": "Continue: 1, 1, 2,"}],
        tokenize=True,
        add_generation_prompt=True,
        return_tensors="pt",
    ).to(model.device)
    assert torch.is_tensor(
        inputs
    )  # ids, as transformers 4 returned them (the notebooks pass them as input_ids)
    assert model.generate(input_ids=inputs, max_new_tokens=3, use_cache=True).shape[1] > inputs.shape[1]

    model.save_pretrained("mistral_lora")
    tokenizer.save_pretrained("mistral_lora")
    model.save_pretrained_merged("mistral_16bit", tokenizer, save_method="merged_16bit")
    _, merged_tokenizer, _ = _reload_merged("mistral_16bit")
    chat = [{"role": "user", "content": "Hi"}]
    assert merged_tokenizer.apply_chat_template(chat, tokenize=False) == tokenizer.apply_chat_template(
        chat, tokenize=False
    )
    assert _reload_adapter(tmp_path / "mistral_lora")


def test_reasoning_sft_with_thinking_turns_on_qwen3(tmp_path):
    """Qwen3 reasoning + conversational: Qwen3's template on columns of conversations (datasets' lazy columns),
    thinking turns mixed with standardized ShareGPT chats through pandas, SFTConfig(dataset_text_field=...),
    generation with enable_thinking off and on, merged save whose tokenizer renders as the trained one."""
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="tiny-qwen3",
        max_seq_length=128,
        load_in_4bit=False,
        load_in_8bit=False,
        full_finetuning=False,
    )
    model = _peft(model, r=8)
    problems = Dataset.from_list(
        [
            {"problem": _qa(i)[0], "generated_solution": f"<think>\nAdd.\n</think>\n{_qa(i)[1]}"}
            for i in range(N)
        ]
    )
    conversations = problems.map(
        lambda x: {
            "conversations": [
                [{"role": "user", "content": p}, {"role": "assistant", "content": s}]
                for p, s in zip(x["problem"], x["generated_solution"], strict=True)
            ]
        },
        batched=True,
    )["conversations"]
    reasoning = tokenizer.apply_chat_template(conversations, tokenize=False)
    assert len(reasoning) == N and "<think>\nAdd.\n</think>" in reasoning[0]
    chats = standardize_sharegpt(Dataset.from_list([{"conversations": _sharegpt(i)} for i in range(4)]))
    non_reasoning = tokenizer.apply_chat_template(chats["conversations"], tokenize=False)
    data = pd.concat([pd.Series(reasoning), pd.Series(non_reasoning).sample(2, random_state=2407)])
    data.name = "text"
    dataset = Dataset.from_pandas(pd.DataFrame(data)).shuffle(seed=3407)
    trainer = SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        eval_dataset=None,
        args=SFTConfig(**_args(), dataset_text_field="text"),
    )
    trainer.train()
    _losses(trainer)

    messages = [{"role": "user", "content": "Solve (x + 2)^2 = 0."}]
    for thinking in (False, True):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
        )
        assert text.endswith("<think>\n\n</think>\n\n") != thinking
        model.generate(**tokenizer(text, return_tensors="pt").to(model.device), max_new_tokens=3, top_k=20)

    model.save_pretrained_merged("model", tokenizer, save_method="merged_16bit")
    _, merged_tokenizer, _ = _reload_merged(tmp_path / "model")
    assert merged_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    ) == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )


def test_grpo_with_several_rewards_then_fast_generate_and_merge(tmp_path):
    """Qwen3 / Llama GRPO: vLLM's loading arguments, a custom chat template, a formatting SFT first, GRPO with
    vllm_sampling_params and four reward functions (each logged), fast_generate without and with the saved
    LoRA, the saved adapter non-zero, then the merged model reloaded."""
    import re

    from safetensors import safe_open
    from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    PatchFastRL("GRPO", FastLanguageModel)
    with pytest.warns(UserWarning, match="vLLM"):
        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name="tiny-qwen3",
            max_seq_length=96,
            load_in_4bit=False,
            fast_inference=True,
            max_lora_rank=8,
            gpu_memory_utilization=0.9,
        )
    model = FastLanguageModel.get_peft_model(
        model,
        r=8,
        target_modules=TARGETS,
        lora_alpha=16,
        use_gradient_checkpointing="unsloth",
        random_state=3407,
    )
    start, end, sol, sol_end = "<start_working_out>", "<end_working_out>", "<SOLUTION>", "</SOLUTION>"
    system = f"Think between {start} and {end}, then answer between {sol}{sol_end}"
    tokenizer.chat_template = (
        "{{ messages[0]['content'] + eos_token }}"
        "{% for message in messages[1:] %}{% if message['role'] == 'user' %}{{ message['content'] }}"
        "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
        f"{{% if add_generation_prompt %}}{{{{ '{start}' }}}}{{% endif %}}"
    )
    format_rows = [
        {
            "text": tokenizer.apply_chat_template(
                [
                    {"role": "system", "content": system},
                    {"role": "user", "content": _qa(i)[0]},
                    {"role": "assistant", "content": f"{start}Add.{end}{sol}{_qa(i)[1]}{sol_end}"},
                ],
                tokenize=False,
            )
        }
        for i in range(4)
    ]
    sft = SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=Dataset.from_list(format_rows),
        args=SFTConfig(**_args(max_steps=1), dataset_text_field="text"),
    )
    sft.train()

    dataset = Dataset.from_list([{"question": _qa(i)[0], "answer": _qa(i)[1]} for i in range(4)]).map(
        lambda x: {
            "prompt": [{"role": "system", "content": system}, {"role": "user", "content": x["question"]}]
        }
    )
    match_format = re.compile(rf"{end}.*?{sol}(.+?){sol_end}", flags=re.DOTALL)

    def match_format_exactly(completions, **kwargs):
        return [3.0 if match_format.search(c[0]["content"]) else 0.0 for c in completions]

    def match_format_approximately(completions, **kwargs):
        return [
            sum(0.5 if c[0]["content"].count(t) == 1 else -1.0 for t in (end, sol, sol_end))
            for c in completions
        ]

    def check_answer(prompts, completions, answer, **kwargs):
        found = [match_format.search(c[0]["content"]) for c in completions]
        return [
            -2.0 if m is None else 5.0 if m.group(1) == a else -1.0
            for m, a in zip(found, answer, strict=True)
        ]

    def length(completions, **kwargs):  # varies between completions, so the step has an advantage to learn
        return [len(c[0]["content"]) / 10 for c in completions]

    params = SamplingParams(min_p=0.1, top_p=1.0, top_k=-1, seed=3407, stop=[tokenizer.eos_token])
    with pytest.warns(UserWarning, match="max_prompt_length"):
        args = GRPOConfig(
            **_args(warmup_steps=None, max_steps=1, learning_rate=5e-5, per_device_train_batch_size=2),
            vllm_sampling_params=params,
            temperature=1.0,
            warmup_ratio=0.0,
            num_generations=2,
            max_prompt_length=64,
            max_completion_length=8,
            save_steps=100,
        )
    rewards = [match_format_exactly, match_format_approximately, check_answer, length]
    trainer = GRPOTrainer(
        model=model, processing_class=tokenizer, reward_funcs=rewards, args=args, train_dataset=dataset
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    assert all(f"rewards/{f.__name__}/mean" in logged for f in rewards), sorted(logged)

    text = "What is the sqrt of 101?"
    base = model.fast_generate(
        [text], sampling_params=SamplingParams(temperature=1.0, top_k=50, max_tokens=6)
    )
    assert isinstance(base[0].outputs[0].text, str)
    model.save_lora("grpo_saved_lora")
    with safe_open("grpo_saved_lora/adapter_model.safetensors", framework="pt") as f:
        assert all((f.get_tensor(k) != 0).any() for k in f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=False,
    )
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with_lora = model.fast_generate(
        prompt, sampling_params=greedy, lora_request=model.load_lora("grpo_saved_lora")
    )
    assert (
        with_lora[0].outputs[0].token_ids
        == _generate(model.eval(), tokenizer, prompt, 4)[: len(with_lora[0].outputs[0].token_ids)]
    )

    model.save_pretrained_merged("model", tokenizer, save_method="merged_16bit")
    merged, merged_tokenizer, _ = _reload_merged(tmp_path / "model", prompt)
    assert merged_tokenizer.chat_template == tokenizer.chat_template


def _preferences(tokenizer) -> Dataset:
    rows = []
    for i in range(N):
        question, answer = _qa(i)
        prompt = tokenizer.apply_chat_template(
            [{"role": "system", "content": ""}, {"role": "user", "content": question}],
            tokenize=False,
            add_generation_prompt=True,
        )
        rows.append(
            dict(
                prompt=prompt,
                chosen=f"It is {answer}.{tokenizer.eos_token}",
                rejected=f"It is {i}.{tokenizer.eos_token}",
            )
        )
    return Dataset.from_list(rows)


def test_dpo_as_the_zephyr_notebook(tmp_path):
    """Zephyr DPO: PatchDPOTrainer, DPOTrainer with ref_model=None, warmup_ratio, and beta / tokenizer /
    max_length / max_prompt_length at the top level; the merged model reloaded."""
    from transformers import TrainingArguments  # noqa: F401 (the notebook imports it beside DPOConfig)
    from trl import DPOConfig, DPOTrainer

    PatchDPOTrainer()
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="tiny-mistral", max_seq_length=128, dtype=None, load_in_4bit=False
    )
    model = _peft(model, r=16)
    PatchDPOTrainer()
    with pytest.warns(UserWarning, match="max_prompt_length=48 is not applied"):
        trainer = DPOTrainer(
            model=model,
            ref_model=None,
            args=DPOConfig(**_args(learning_rate=5e-5, weight_decay=0.0), warmup_ratio=0.1),
            beta=0.1,
            train_dataset=_preferences(tokenizer),
            tokenizer=tokenizer,
            max_length=96,
            max_prompt_length=48,
        )
    trainer.train()
    _losses(trainer)
    assert any("rewards/chosen" in entry for entry in trainer.state.log_history)
    model.save_pretrained_merged("model", tokenizer, save_method="merged_16bit")
    _reload_merged(tmp_path / "model")


def test_orpo_as_the_llama3_notebook(tmp_path):
    """Llama-3 ORPO: `from trl import ORPOConfig, ORPOTrainer`, its config with the old length arguments,
    tokenizer= at the top level; the adapter reloaded with peft, then a GGUF file."""
    from trl import ORPOConfig, ORPOTrainer

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="tiny-llama", max_seq_length=128, dtype=None, load_in_4bit=False
    )
    model = _peft(model)
    dataset = Dataset.from_list(
        [dict(instruction=_qa(i)[0], input="", accepted=_qa(i)[1], rejected=str(i)) for i in range(N)]
    ).map(
        lambda s: dict(
            prompt=ALPACA.format(s["instruction"], s["input"], ""),
            chosen=s["accepted"] + tokenizer.eos_token,
            rejected=s["rejected"] + tokenizer.eos_token,
        )
    )
    PatchDPOTrainer()
    with pytest.warns(UserWarning, match="max_prompt_length"):
        args = ORPOConfig(
            **_args(),
            max_length=128,
            max_prompt_length=64,
            max_completion_length=64,
            beta=0.1,
        )
    trainer = ORPOTrainer(model=model, train_dataset=dataset, tokenizer=tokenizer, args=args)
    trainer.train()
    _losses(trainer)
    model.save_pretrained("lora_model")
    tokenizer.save_pretrained("lora_model")
    assert _reload_adapter(tmp_path / "lora_model", ALPACA.format("Hi", "", ""))
    f16 = model.save_pretrained_gguf("model", tokenizer, quantization_method="f16", check=False)
    assert _gguf_tensors(f16.path) > 0 and (tmp_path / "model" / "Modelfile").is_file()


def test_moe_gpt_oss_sft_on_the_experts_to_merged(tmp_path):
    """gpt-oss fine-tuning: 4-bit load, gate/up/down targets (the experts here), messages with thinking
    through standardize_sharegpt, train_on_responses_only, adapter saved and reloaded by from_pretrained,
    merged 16-bit (mxfp4 refused with the alternative) reloaded with transformers."""
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="tiny-gpt-oss", dtype=None, max_seq_length=1024, load_in_4bit=True, full_finetuning=False
    )  # the notebook's length: its harmony rows (~240 tokens here) are truncated there, as by Unsloth
    model = _peft(model, r=8, lora_alpha=16)
    experts = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n and "lora" in n}
    assert experts, "gate/up/down put no adapter on the experts"
    rows = [
        {
            "messages": [
                {"role": "system", "content": "reasoning language: French"},
                {"role": "user", "content": _qa(i)[0]},
                {"role": "assistant", "content": f"It is {_qa(i)[1]}.", "thinking": "Add."},
            ]
        }
        for i in range(N)
    ]
    dataset = standardize_sharegpt(Dataset.from_list(rows))
    dataset = dataset.map(
        lambda x: {"text": [tokenizer.apply_chat_template(c, tokenize=False) for c in x["messages"]]},
        batched=True,
    )
    trainer = SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        args=SFTConfig(**_args(gradient_accumulation_steps=1)),
    )
    trainer = train_on_responses_only(trainer)
    trainer.train()
    _losses(trainer)
    assert any(not torch.equal(experts[n], p) for n, p in model.named_parameters() if n in experts)

    model.save_pretrained("finetuned_model")
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="finetuned_model", max_seq_length=128, dtype=None, load_in_4bit=True
    )
    with pytest.raises(ValueError, match="merged_16bit"):
        model.save_pretrained_merged("finetuned_model", tokenizer, save_method="mxfp4")
    with pytest.warns(UserWarning, match="dequantised NF4"):
        model.save_pretrained_merged("merged", tokenizer, save_method="merged_16bit")
    _reload_merged(tmp_path / "merged")


def test_ollama_notebook_one_exchange_template_to_gguf_and_modelfile(tmp_path):
    """Llama-3 Ollama: to_sharegpt / standardize_sharegpt / apply_chat_template from fastft.unsloth's top level,
    with the notebook's one-exchange template (split as Unsloth splits it), training, then save_pretrained_gguf
    and the Modelfile the notebook prints from the tokenizer."""
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = FastLanguageModel.from_pretrained(model_name="tiny-llama", max_seq_length=128)
    model = _peft(model)
    rows = [dict(instruction=_qa(i)[0], input=str(i) if i % 2 else "", output=_qa(i)[1]) for i in range(N)]
    dataset = to_sharegpt(
        Dataset.from_list(rows),
        merged_prompt="{instruction}[[\nYour input is:\n{input}]]",
        output_column_name="output",
        conversation_extension=2,
    )
    dataset = standardize_sharegpt(dataset)
    template = "Some tasks.\n\n### Instruction:\n{INPUT}\n\n### Response:\n{OUTPUT}"
    dataset = apply_chat_template(dataset, tokenizer=tokenizer, chat_template=template)
    eos = tokenizer.eos_token
    chat = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}] * 2
    assert tokenizer.apply_chat_template(chat, tokenize=False) == (
        f"Some tasks.\n\n### Instruction:\nA\n\n### Response:\nB{eos}\n\n### Instruction:\nA\n\n### Response:\nB{eos}"
    )
    assert dataset[0]["text"].startswith("Some tasks.\n\n### Instruction:\n")
    # the example has no {SYSTEM}: a system message is passed over, the fixed text stays (the export's check
    # renders conversations that open with one)
    system = [{"role": "system", "content": "Be brief."}, *chat[:2]]
    assert tokenizer.apply_chat_template(system, tokenize=False) == (
        f"Some tasks.\n\n### Instruction:\nA\n\n### Response:\nB{eos}"
    )
    trainer = SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        dataset_text_field="text",
        max_seq_length=128,
        packing=False,
        args=SFTConfig(**_args(max_steps=1)),
    )
    trainer.train()
    _losses(trainer)
    q8 = model.save_pretrained_gguf("model", tokenizer, check=False)
    assert _gguf_tensors(q8.path) > 0
    assert tokenizer._ollama_modelfile == (tmp_path / "model" / "Modelfile").read_text()


def test_continued_pretraining_with_embeddings_trained_whole_merges_them(tmp_path):
    """Mistral CPT: embed_tokens / lm_head in target_modules (trained whole), use_rslora, UnslothTrainer with
    embedding_learning_rate; the merged model (and the GGUF) carry the trained embeddings and head."""
    from fastft.unsloth import UnslothTrainer, UnslothTrainingArguments

    model, tokenizer = FastLanguageModel.from_pretrained(model_name="tiny-mistral", max_seq_length=128)
    model = _peft(model, r=8, target_modules=[*TARGETS, "embed_tokens", "lm_head"], use_rslora=True)
    eos = tokenizer.eos_token
    dataset = Dataset.from_list([{"text": f"Article {i}: {_qa(i)[0]} {_qa(i)[1]}.{eos}"} for i in range(N)])
    trainer = UnslothTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        dataset_text_field="text",
        max_seq_length=128,
        dataset_num_proc=1,
        args=UnslothTrainingArguments(**_args(learning_rate=5e-3), embedding_learning_rate=1e-3),
    )
    trainer.train()
    _losses(trainer)
    trained = model.get_base_model().model.embed_tokens.modules_to_save["default"].weight.detach().clone()
    original = model.get_base_model().model.embed_tokens.original_module.weight
    assert not torch.equal(trained, original)
    model.save_pretrained("lora_model")
    model.save_pretrained_merged("model", tokenizer, save_method="merged_16bit")
    merged, _, _ = _reload_merged(tmp_path / "model")
    assert torch.equal(merged.model.embed_tokens.weight, trained.to(merged.dtype))
    f16 = model.save_pretrained_gguf("gguf", tokenizer, quantization_method="f16", check=False)
    assert _gguf_tensors(f16.path) > 0

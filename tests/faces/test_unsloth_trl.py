"""TRL's trainers as Unsloth's notebooks call them, after ``from fastft.unsloth import ...``: the older argument
names (``tokenizer=``, top-level ``dataset_text_field`` / ``max_seq_length`` / ``packing`` / ``beta`` …,
``warmup_ratio``, ``from trl import ORPOTrainer``) with Unsloth's meaning, adapted only when the drop-in layer
is imported; each notebook pattern trained for a step or two on a tiny preset."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from datasets import Dataset

from fastft.runtime.model_state import model_state
from fastft.unsloth import (
    FastLanguageModel,
    PatchDPOTrainer,
    PatchFastRL,
    SamplingParams,
    UnslothTrainer,
    UnslothTrainingArguments,
    is_bfloat16_supported,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALPACA = "### Instruction:\n{}\n\n### Response:\n{}"


def _model(name="tiny-llama", **peft):
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=name, max_seq_length=96, dtype=None, load_in_4bit=False
    )
    settings = dict(
        r=8,
        target_modules=TARGETS,
        lora_alpha=16,
        lora_dropout=0,
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=3407,
        use_rslora=False,
        loftq_config=None,
    )
    return FastLanguageModel.get_peft_model(model, **{**settings, **peft}), tokenizer


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _changed(model, before) -> bool:
    return any(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)


def _common(tmp_path, **overrides):
    """What every notebook's config passes (Unsloth's values), on the CPU-sized scale."""
    settings = dict(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=2,
        learning_rate=2e-4,
        logging_steps=1,
        optim="adamw_torch",
        weight_decay=0.01,
        lr_scheduler_type="linear",
        seed=3407,
        output_dir=str(tmp_path / "outputs"),
        report_to="none",
    )
    return {**settings, **overrides}


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_a_plain_import_fastft_leaves_trl_as_it_is():
    out = _run(
        "import fastft, trl, transformers\n"
        "model, tokenizer = fastft.load_model('tiny-llama')\n"
        "import sys\n"
        "assert 'fastft.unsloth' not in sys.modules\n"
        "for cls in (trl.SFTTrainer, trl.DPOTrainer, trl.GRPOTrainer, trl.SFTConfig, transformers.TrainingArguments):\n"
        "    assert not hasattr(cls.__init__, '_fastft_unsloth_original'), cls\n"
        "assert not hasattr(trl, 'ORPOTrainer')\n"
        "try:\n"
        "    trl.SFTConfig(output_dir='x', warmup_ratio=0.1)\n"
        "except TypeError:\n"
        "    print('refused')\n"
    )
    assert out.strip().endswith("refused")


def test_importing_fastft_unsloth_adapts_trl_in_place_once():
    out = _run(
        "import trl\n"
        "before = trl.SFTTrainer\n"
        "import fastft.unsloth\n"
        "from fastft.unsloth import PatchDPOTrainer, PatchFastRL\n"
        "from fastft.unsloth.trl_compat import adapt_trl, is_adapted\n"
        "PatchDPOTrainer(); PatchFastRL('GRPO', fastft.unsloth.FastLanguageModel); adapt_trl()\n"
        "from trl import SFTTrainer, DPOTrainer, GRPOTrainer, ORPOConfig, ORPOTrainer, SFTConfig\n"
        "assert SFTTrainer is before and is_adapted(SFTTrainer) and is_adapted(ORPOTrainer)\n"
        "original = SFTTrainer.__init__._fastft_unsloth_original\n"
        "assert not hasattr(original, '_fastft_unsloth_original')  # wrapped once, not once per call\n"
        "print(SFTConfig(output_dir='x', warmup_ratio=0.1, max_seq_length=64, bf16=False).warmup_steps)\n"
    )
    lines = out.strip().splitlines()
    assert sum("fastft.unsloth: TRL's trainers" in line for line in lines) == 1  # the notice, once
    assert lines[-1] == "0.1"


def _trl_has_ppo() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) for m in ("trl.trainer.ppo_trainer", "trl.experimental.ppo"))


@pytest.mark.skipif(_trl_has_ppo(), reason="this TRL has PPO: the import gives TRL's own classes")
def test_ppo_notebook_import_runs_and_using_the_removed_ppo_says_why_and_the_ways_on():
    """Unsloth's PPO notebook (written for TRL 0.22) runs ``from trl import PPOConfig, PPOTrainer`` then builds
    them; TRL 1.x has removed PPO, so the import line works after ``import fastft.unsloth`` and building either
    raises the reason and the ways on instead of a bare ImportError."""
    out = _run(
        "import trl\n"
        "try:\n"
        "    from trl import PPOConfig\n"
        "except ImportError:\n"
        "    print('bare import error')\n"
        "import fastft.unsloth\n"
        "from trl import PPOConfig, PPOTrainer\n"
        "for cls, kwargs in ((PPOConfig, dict(learning_rate=1e-4, output_dir='x')), (PPOTrainer, dict(args=None))):\n"
        "    try:\n"
        "        cls(**kwargs)\n"
        "    except NotImplementedError as error:\n"
        "        text = str(error)\n"
        "        print(cls.__name__, f'trl.{cls.__name__}' in text, 'GRPOTrainer(' in text, 'reward_funcs=' in text,\n"
        "              'trl==0.22.2' in text)\n"
    )
    lines = out.strip().splitlines()
    assert lines[0] == "bare import error"  # TRL's own ImportError, without fastft.unsloth
    assert lines[-2:] == ["PPOConfig True True True True", "PPOTrainer True True True True"]


def test_configs_take_the_removed_arguments_with_their_meaning():
    from transformers import TrainingArguments
    from trl import DPOConfig, GRPOConfig, SFTConfig

    assert SFTConfig(output_dir="x", warmup_ratio=0.25, max_seq_length=64).warmup_steps == 0.25
    assert SFTConfig(output_dir="x", max_seq_length=64).max_length == 64
    # a warmup_steps given as well wins, as it did in transformers 4
    assert TrainingArguments(output_dir="x", warmup_ratio=0.1, warmup_steps=7).warmup_steps == 7
    with pytest.raises(ValueError, match="warmup_steps instead"):
        SFTConfig(output_dir="x", warmup_ratio=5)
    with pytest.warns(UserWarning, match="max_prompt_length=32 is not applied"):
        DPOConfig(output_dir="x", max_prompt_length=32, max_length=64)
    with pytest.warns(UserWarning, match="no vLLM"):
        assert GRPOConfig(output_dir="x", use_vllm=True).use_vllm is False
    params = SamplingParams(min_p=0.1, top_p=0.9, top_k=-1, seed=3407, stop=["<|im_end|>"])
    with pytest.warns(UserWarning, match="stop not applied"):
        config = GRPOConfig(output_dir="x", vllm_sampling_params=params, temperature=0.7)
    assert (config.min_p, config.top_p, config.top_k, config.temperature) == (0.1, 0.9, 0, 0.7)
    with pytest.raises(TypeError, match="from fastft.unsloth import SamplingParams"):
        GRPOConfig(output_dir="x", vllm_sampling_params=object())
    with pytest.raises(TypeError, match="presence_penalty"):
        SamplingParams(presence_penalty=1.0)
    # the GRPO notebooks' batch of 1 with 4 generations: Unsloth makes the batch one whole group
    with pytest.warns(UserWarning, match="set to 4, as Unsloth does"):
        grpo = GRPOConfig(output_dir="x", per_device_train_batch_size=1, num_generations=4)
    assert grpo.per_device_train_batch_size == 4 and grpo.generation_batch_size % 4 == 0
    assert (
        GRPOConfig(
            output_dir="x", per_device_train_batch_size=6, num_generations=3
        ).per_device_train_batch_size
        == 6
    )


def test_configs_without_output_dir_save_no_checkpoint_as_unslosths():
    """Llama_FP8_GRPO's SFTConfig (and most notebooks' configs) give no output_dir: Unsloth then saves no
    checkpoint, where TRL would write trainer_output/checkpoint-N at the end of training. A folder or save
    setting of the user's keeps TRL's saving; transformers' own TrainingArguments is left as it is."""
    from transformers import TrainingArguments
    from trl import GRPOConfig, SFTConfig

    for config in (SFTConfig(max_steps=2), GRPOConfig(max_steps=2), SFTConfig()):
        assert config.save_strategy == "no"
    for config in (
        SFTConfig(output_dir="outputs"),
        SFTConfig("outputs"),
        SFTConfig(save_steps=100),
        GRPOConfig(output_dir="outputs", save_steps=100),
        SFTConfig(eval_strategy="steps", load_best_model_at_end=True),
        TrainingArguments(),
    ):
        assert config.save_strategy == "steps"
    assert SFTConfig(save_strategy="epoch").save_strategy == "epoch"


def test_alpaca_sft_with_the_old_top_level_arguments(tmp_path):
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = _model()
    rows = {"instruction": ["Add 1 and 2.", "Spell cat backwards."] * 4, "output": ["3", "tac"] * 4}
    dataset = Dataset.from_dict(rows).map(
        lambda ex: {
            "text": [
                ALPACA.format(i, o) + tokenizer.eos_token
                for i, o in zip(ex["instruction"], ex["output"], strict=True)
            ]
        },
        batched=True,
    )
    trainer = SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        dataset_text_field="text",
        max_seq_length=96,
        dataset_num_proc=1,
        packing=False,
        args=SFTConfig(**_common(tmp_path, warmup_ratio=0.5)),
    )
    assert trainer.processing_class is tokenizer
    assert (trainer.args.max_length, trainer.args.dataset_text_field, trainer.args.packing) == (
        96,
        "text",
        False,
    )
    assert trainer.args.warmup_steps == 0.5 and trainer.args.get_warmup_steps(2) == 1
    assert trainer.args.bf16 == is_bfloat16_supported()
    before = _trainable(model)
    stats = trainer.train()
    assert stats.training_loss > 0 and _changed(model, before)
    with pytest.raises(TypeError, match="not_an_argument"):
        SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=dataset, not_an_argument=1)


def test_training_arguments_become_the_trainers_config_with_the_same_values(tmp_path):
    from transformers import TrainingArguments
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = _model()
    dataset = Dataset.from_dict({"text": ["a b c d" + tokenizer.eos_token] * 4})
    args = TrainingArguments(**_common(tmp_path, learning_rate=3e-4, warmup_ratio=0.1, max_steps=1))
    trainer = SFTTrainer(
        model=model, tokenizer=tokenizer, train_dataset=dataset, dataset_text_field="text", args=args
    )
    assert isinstance(trainer.args, SFTConfig)
    assert (trainer.args.learning_rate, trainer.args.warmup_steps, trainer.args.max_steps) == (3e-4, 0.1, 1)
    assert trainer.args.output_dir == args.output_dir


def test_unsloth_trainer_gives_the_embeddings_their_learning_rate(tmp_path):
    model, tokenizer = _model(target_modules=[*TARGETS, "embed_tokens", "lm_head"], use_rslora=True)
    assert model_state(model).lora.use_rslora
    dataset = Dataset.from_dict({"text": ["one two three" + tokenizer.eos_token] * 4})
    trainer = UnslothTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        dataset_text_field="text",
        max_seq_length=96,
        dataset_num_proc=1,
        args=UnslothTrainingArguments(
            **_common(tmp_path, learning_rate=5e-5, max_steps=1, warmup_steps=0), embedding_learning_rate=1e-5
        ),
    )
    optimizer = trainer.create_optimizer()
    names = {id(p): n for n, p in model.named_parameters()}
    rates = {"modules_to_save" in names[id(p)]: g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert rates == {True: 1e-5, False: 5e-5}
    assert trainer.train().training_loss > 0


def _preference_rows(tokenizer):
    return Dataset.from_dict(
        {
            "prompt": [ALPACA.format(q, "") for q in ("Add 1 and 2.", "Spell cat backwards.")] * 2,
            "chosen": ["3" + tokenizer.eos_token, "tac" + tokenizer.eos_token] * 2,
            "rejected": ["4" + tokenizer.eos_token, "cat" + tokenizer.eos_token] * 2,
        }
    )


def test_dpo_with_tokenizer_beta_and_lengths_at_the_top_level(tmp_path):
    from trl import DPOConfig, DPOTrainer

    PatchDPOTrainer()
    model, tokenizer = _model()
    with pytest.warns(UserWarning, match="max_prompt_length=48 is not applied"):
        trainer = DPOTrainer(
            model=model,
            ref_model=None,
            args=DPOConfig(**_common(tmp_path, warmup_ratio=0.1, learning_rate=5e-5)),  # 1 warmup step of 2
            beta=0.25,
            train_dataset=_preference_rows(tokenizer),
            tokenizer=tokenizer,
            max_length=96,
            max_prompt_length=48,
        )
    assert (trainer.args.beta, trainer.args.max_length, trainer.args.warmup_steps) == (0.25, 96, 0.1)
    before = _trainable(model)
    assert trainer.train().training_loss > 0 and _changed(model, before)


def test_orpo_from_trl_top_level_with_its_old_config(tmp_path):
    from trl import ORPOConfig, ORPOTrainer

    model, tokenizer = _model()
    with pytest.warns(UserWarning, match="max_prompt_length"):
        args = ORPOConfig(
            **_common(tmp_path, max_steps=1),
            max_length=96,
            max_prompt_length=48,
            max_completion_length=48,
            beta=0.1,
        )
    trainer = ORPOTrainer(
        model=model, train_dataset=_preference_rows(tokenizer), tokenizer=tokenizer, args=args
    )
    assert trainer.processing_class is tokenizer and trainer.args.max_completion_length == 48
    before = _trainable(model)
    assert trainer.train().training_loss > 0 and _changed(model, before)


def test_grpo_notebook_from_vllm_arguments_to_fast_generate(tmp_path, monkeypatch):
    from safetensors import safe_open
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.chdir(tmp_path)
    PatchFastRL("GRPO", FastLanguageModel)
    with pytest.warns(UserWarning, match="fast_inference, gpu_memory_utilization, max_lora_rank are vLLM's"):
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
    system = "Answer with a number."
    dataset = Dataset.from_dict(
        {"question": ["What is 1 + 2?", "What is 2 + 2?"] * 2, "answer": ["3", "4"] * 2}
    ).map(
        lambda x: {
            "prompt": [{"role": "system", "content": system}, {"role": "user", "content": x["question"]}]
        }
    )

    def match_format(completions, **kwargs):  # varies between completions, so every step learns
        return [len(c[0]["content"]) / 10 for c in completions]

    def check_answer(prompts, completions, answer, **kwargs):
        return [
            2.0 if c[0]["content"].strip() == a else -1.0 for c, a in zip(completions, answer, strict=True)
        ]

    params = SamplingParams(min_p=0.1, top_p=1.0, top_k=-1, seed=3407, stop=[tokenizer.eos_token])
    with pytest.warns(UserWarning, match="max_prompt_length"):
        args = GRPOConfig(
            vllm_sampling_params=params,
            temperature=1.0,
            learning_rate=5e-5,
            weight_decay=0.01,
            warmup_ratio=0.0,  # one step: no warmup (it would train at learning rate 0)
            lr_scheduler_type="linear",
            optim="adamw_torch",
            logging_steps=1,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=1,
            num_generations=2,
            max_prompt_length=48,
            max_completion_length=8,
            max_steps=1,
            save_steps=100,
            report_to="none",
            output_dir="outputs",
        )
    assert args.min_p == 0.1 and args.top_k == 0
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[match_format, check_answer],
        args=args,
        train_dataset=dataset,
    )
    before = _trainable(model)
    trainer.train()
    assert _changed(model, before)

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    sampled = SamplingParams(temperature=1.0, top_k=50, max_tokens=8)
    output = model.fast_generate([text], sampling_params=sampled, lora_request=None)[0].outputs[0].text
    assert isinstance(output, str)

    model.save_lora("grpo_saved_lora")
    with safe_open("grpo_saved_lora/adapter_model.safetensors", framework="pt") as f:
        assert all((f.get_tensor(k) != 0).any() for k in f.keys())  # noqa: SIM118 (safe_open has no __iter__)
    request = model.load_lora("grpo_saved_lora")
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids

    def greedy_ids():
        with torch.no_grad():
            return (
                model.eval()
                .generate(input_ids=ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1] :]
                .tolist()
            )

    saved_answer = greedy_ids()
    with torch.no_grad():  # the adapter in memory moves on from the saved one
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    moved = _trainable(model)
    with model.disable_adapter():
        base_answer = greedy_ids()
    assert greedy_ids() != saved_answer or greedy_ids() != base_answer  # the three differ somewhere
    greedy = SamplingParams(temperature=0, max_tokens=6)
    with_lora = model.fast_generate(text, sampling_params=greedy, lora_request=request)[0].outputs[0]
    assert with_lora.token_ids == saved_answer[: len(with_lora.token_ids)]  # the saved adapter's weights
    assert not _changed(model, moved)  # and the ones in memory back after the call
    without = model.fast_generate(text, sampling_params=greedy, lora_request=None)[0].outputs[0]
    assert without.token_ids == base_answer[: len(without.token_ids)]  # None: the base model, as in Unsloth
    with pytest.raises(FileNotFoundError, match="save_lora"):
        model.load_lora("no_such_folder")


def _text_sft(model, tokenizer, dataset, tmp_path):
    """The conversational notebooks' trainer: SFTTrainer over the rendered `text` column, the old top-level
    arguments."""
    from trl import SFTConfig, SFTTrainer

    return SFTTrainer(
        model=model,
        tokenizer=tokenizer,
        train_dataset=dataset,
        dataset_text_field="text",
        max_seq_length=96,
        packing=False,
        args=SFTConfig(**_common(tmp_path)),
    )


def test_sft_text_rendered_with_the_bos_gets_one_bos_as_with_unsloth(tmp_path):
    """Llama 3.x conversational notebooks: the rows are apply_chat_template text, which starts with
    <|begin_of_text|>, and SFTTrainer(dataset_text_field="text") tokenizes them: one BOS, as Unsloth gives (TRL
    alone adds the tokenizer's BOS again); the caller's dataset is left as it was."""

    from fastft.unsloth.chat_templates import get_chat_template

    model, tokenizer = _model("tiny-llama3")
    tokenizer = get_chat_template(tokenizer, chat_template="llama-3.1")
    chats = [
        [{"role": "user", "content": f"{i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]
        for i in range(4)
    ]
    dataset = Dataset.from_dict({"text": [tokenizer.apply_chat_template(c, tokenize=False) for c in chats]})
    assert dataset[0]["text"].startswith(tokenizer.bos_token)
    trainer = _text_sft(model, tokenizer, dataset, tmp_path)
    ids = trainer.train_dataset[0]["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    assert ids == tokenizer(dataset[0]["text"], add_special_tokens=False)["input_ids"][: len(ids)]
    assert dataset[0]["text"].startswith(tokenizer.bos_token)  # the caller's rows are unchanged


def test_sft_formatting_func_written_for_batches_formats_batches_as_with_unsloth(tmp_path):
    """CodeForces-cot notebook: formatting_prompts_func(example) loops over example['problem'][i] and returns a
    list of texts (Unsloth's batched convention; TRL 1.x calls it on one row, where it loops over the characters
    of the problem, and fails where the answer is shorter). Each row is trained on its formatted text, not on
    the `messages` column beside it; a
    formatting_func of TRL 1.x's own form (one row -> one str) is still TRL's; the caller's dataset is unchanged."""
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = _model()
    problems, answers = [f"Print {i} + 1 in Python." for i in range(4)], [f"print({i} + 1)" for i in range(4)]
    dataset = Dataset.from_dict(
        {
            "problem": problems,
            "generation": answers,
            "messages": [
                [{"role": "user", "content": p}, {"role": "assistant", "content": a}]
                for p, a in zip(problems, answers, strict=True)
            ],
        }
    )

    def formatting_prompts_func(example):
        return [
            f"### Problem: {example['problem'][i]}\n ### Response: {example['generation'][i]}"
            for i in range(len(example["problem"]))
        ]

    def one_row(example):
        return f"### Problem: {example['problem']}\n ### Response: {example['generation']}"

    text_only = dataset.remove_columns("messages")  # TRL 1.x trains on `messages` when a row has them
    for func, rows in ((formatting_prompts_func, dataset), (one_row, text_only)):
        trainer = SFTTrainer(
            model=model,
            tokenizer=tokenizer,
            train_dataset=rows,
            eval_dataset={"held_out": rows.select([3])},
            max_seq_length=96,
            formatting_func=func,
            packing=False,
            args=SFTConfig(**_common(tmp_path)),
        )
        for prepared, row, problem in (
            (trainer.train_dataset, 2, 2),
            (trainer.eval_dataset["held_out"], 0, 3),
        ):
            text = f"### Problem: {problems[problem]}\n ### Response: {answers[problem]}"
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert prepared[row]["input_ids"][: len(ids)] == ids, func.__name__
            if func is formatting_prompts_func:  # as Unsloth: the text as given, no EOS appended
                assert prepared[row]["input_ids"] == ids
    assert dataset.column_names == ["problem", "generation", "messages"]
    before = _trainable(model)
    trainer.train()
    assert _changed(model, before)


def test_sft_text_rows_are_trained_as_given_as_with_unsloth(tmp_path):
    """Conversational notebooks: the rows hold the ShareGPT `conversations` and the `text` rendered from them
    (Llama3_(8B)-Conversational), or ChatML text ending in `<|im_end|>` and a newline (Qwen, Mistral ChatML,
    Magistral). Unsloth trains the text as it is; TRL 1.x alone trains the conversations (with the roles
    `human` / `gpt` of the mapped template) and appends a second `<|im_end|>` to every ChatML row."""

    from fastft.unsloth.chat_templates import get_chat_template

    sharegpt = {"role": "from", "content": "value", "user": "human", "assistant": "gpt"}
    conversations = [
        [{"from": "human", "value": f"What is {i} plus 2?"}, {"from": "gpt", "value": f"It is {i + 2}."}]
        for i in range(4)
    ]
    cases = [("tiny-llama3", "llama-3", sharegpt), ("tiny-qwen3", "chatml", sharegpt)]
    for preset, template, mapping in cases:
        model, tokenizer = _model(preset)
        tokenizer = get_chat_template(tokenizer, chat_template=template, mapping=mapping)
        texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
        dataset = Dataset.from_dict({"conversations": conversations, "text": texts})
        trainer = _text_sft(model, tokenizer, dataset, tmp_path)
        for row, text in enumerate(texts):
            assert (
                trainer.train_dataset[row]["input_ids"]
                == tokenizer(text, add_special_tokens=False)["input_ids"]
            )
        decoded = tokenizer.decode(trainer.train_dataset[0]["input_ids"])
        assert "user" in decoded and "human" not in decoded, preset
        assert dataset.column_names == ["conversations", "text"]  # the caller's rows are unchanged
    assert texts[0].endswith("<|im_end|>\n") and tokenizer.eos_token == "<|im_end|>"


def test_sft_without_a_length_truncates_at_the_models_max_seq_length_as_with_unsloth(tmp_path):
    """Qwen3_(4B)-Instruct, Gemma3_(4B) and the other conversational notebooks pass max_seq_length only to
    from_pretrained; Unsloth's SFTTrainer then truncates at it, TRL alone at its default of 1,024 tokens (found
    on the H100: the Qwen3 notebook's rows over 1,024 tokens were cut short on fastft only)."""
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name="tiny-qwen3", max_seq_length=1536, dtype=None, load_in_4bit=False
    )
    model = FastLanguageModel.get_peft_model(model, r=4, target_modules=TARGETS, lora_alpha=4)
    long_text = " ".join(f"word{i}" for i in range(900))  # about 2,700 tokens
    assert len(tokenizer(long_text)["input_ids"]) > 1536
    dataset = Dataset.from_dict({"text": [long_text, "short row"]})

    def trainer(**given):
        return SFTTrainer(
            model=model,
            tokenizer=tokenizer,
            train_dataset=dataset,
            args=SFTConfig(**_common(tmp_path), dataset_text_field="text", **given.pop("config", {})),
            **given,
        )

    assert SFTConfig().max_length == 1024  # TRL's default, which the drop-in replaces
    unset = trainer()
    assert unset.args.max_length == 1536
    assert len(unset.train_dataset[0]["input_ids"]) == 1536  # TRL alone: 1,024
    assert trainer(max_seq_length=512).args.max_length == 512  # given explicitly: kept
    assert trainer(config={"max_length": 300}).args.max_length == 300

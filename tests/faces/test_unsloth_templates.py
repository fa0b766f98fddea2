"""Unsloth's ``unsloth.chat_templates`` calls on fastft (``fastft.unsloth.chat_templates``), as the notebooks
make them: ``get_chat_template(tokenizer, chat_template=NAME, mapping=…)`` for every name Unsloth offers,
``train_on_responses_only(trainer)`` with no markers, ``standardize_sharegpt`` / ``standardize_data_formats``,
``to_sharegpt`` and ``apply_chat_template``. Expected texts are written out from each family's public chat
template."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
from datasets import Dataset

import fastft
from fastft.data.chat_templates import ALIASES, TEMPLATES
from fastft.models.presets import load_preset_tokenizer
from fastft.unsloth.chat_templates import (
    apply_chat_template,
    get_chat_template,
    response_parts,
    standardize_data_formats,
    standardize_sharegpt,
    to_sharegpt,
    train_on_responses_only,
)

# the special tokens of the families, added to the tiny preset tokenizer (its EOS stays <|im_end|>)
FAMILY_TOKENS = [
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>",
    "<end_of_turn>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|im_sep|>", "[INST]", "[/INST]",
    "<|start|>", "<|message|>", "<|channel|>", "<|return|>", "<|turn>", "<turn|>", "<|end_of_turn|>",
]  # fmt: skip
CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
E = "<|im_end|>"  # the tokenizer's EOS, where a template writes eos_token
# each template's rendering of CHAT, written from the family's template
EXPECTED = {
    "unsloth": f"You are a helpful assistant to the user\n>>> User: Hi\n>>> Assistant: Hello{E}\n"
    f">>> User: 2+2?\n>>> Assistant: 4{E}\n",
    "zephyr": f"<|user|>\nHi{E}\n<|assistant|>\nHello{E}\n<|user|>\n2+2?{E}\n<|assistant|>\n4{E}\n",
    "chatml": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "mistral": f"[INST] Hi [/INST]Hello{E}[INST] 2+2? [/INST]4{E}",
    "llama": f"[INST] Hi [/INST] Hello {E}[INST] 2+2? [/INST] 4 {E}",
    "vicuna": "A chat between a curious user and an artificial intelligence assistant. The assistant gives "
    f"helpful, detailed, and polite answers to the user's questions. USER: Hi ASSISTANT: Hello{E}"
    f"USER: 2+2? ASSISTANT: 4{E}",
    "vicuna_old": "A chat between a curious human and an artificial intelligence assistant. The assistant gives "
    f"helpful, detailed, and polite answers to the human's questions.\n### Human: Hi\n### Assistant: Hello{E}\n"
    f"### Human: 2+2?\n### Assistant: 4{E}\n",
    "alpaca": "Below are some instructions that describe some tasks. Write responses that appropriately "
    f"complete each request.\n\n### Instruction:\nHi\n\n### Response:\nHello{E}\n\n### Instruction:\n2+2?\n\n"
    f"### Response:\n4{E}\n\n",
    "gemma": "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
    "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "gemma_chatml": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "llama-3": "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
    "\n\nHello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
    "phi-3": "<|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n<|user|>\n2+2?<|end|>\n<|assistant|>\n4<|end|>\n",
    "llama-3.1": "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
    "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>user<|end_header_id|>"
    "\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
    "qwen-2.5": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4<|im_end|>\n",
    "phi-4": "<|im_start|>user<|im_sep|>Hi<|im_end|><|im_start|>assistant<|im_sep|>Hello<|im_end|>"
    "<|im_start|>user<|im_sep|>2+2?<|im_end|><|im_start|>assistant<|im_sep|>4<|im_end|>",
    "gemma-3": "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
    "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    # hybrid thinking: the reply after the last user message shows its (here empty) reasoning
    "qwen3": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n2+2?"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n",
    "gemma-4": "<|turn>user\nHi<turn|>\n<|turn>model\nHello<turn|>\n<|turn>user\n2+2?<turn|>\n<|turn>model\n4<turn|>\n",
    "gpt-oss": "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: DATE\n\nReasoning: medium\n\n# Valid channels: analysis, "
    "commentary, final. Channel must be included for every message.<|end|><|start|>user<|message|>Hi<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello<|end|><|start|>user<|message|>2+2?<|end|>"
    "<|start|>assistant<|channel|>final<|message|>4<|return|>",
    "qwen3-instruct": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n"
    "2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "lfm-2": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n2+2?"
    "<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n",
    "starling": "GPT4 Correct User: Hi<|end_of_turn|>GPT4 Correct Assistant: Hello<|end_of_turn|>"
    "GPT4 Correct User: 2+2?<|end_of_turn|>GPT4 Correct Assistant: 4<|end_of_turn|>",
}
EXPECTED["gemma2"], EXPECTED["gemma2_chatml"], EXPECTED["gemma-3n"] = (
    EXPECTED["gemma"],
    EXPECTED["gemma_chatml"],
    EXPECTED["gemma-3"],
)
EXPECTED["gemma-4-thinking"], EXPECTED["qwen3-thinking"] = EXPECTED["gemma-4"], EXPECTED["qwen3"]
EXPECTED["yi-chat"] = EXPECTED["qwen3-instruct"]
GENERATION = {  # what add_generation_prompt appends after a user turn
    "mistral": "",
    "llama": "",
    "vicuna": "ASSISTANT:",
    "vicuna_old": "### Assistant:",
    "alpaca": "### Response:\n",
    "unsloth": ">>> Assistant: ",
    "qwen3-thinking": "<|im_start|>assistant\n<think>\n",
    "gemma-4-thinking": "<|turn>model\n<|channel>thought\n<channel|>",
    "gpt-oss": "<|start|>assistant",
    "starling": "GPT4 Correct Assistant:",
}


def family_tokenizer():
    tokenizer = load_preset_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": FAMILY_TOKENS})
    return tokenizer


def with_template(name, tokenizer=None, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_chat_template(tokenizer or family_tokenizer(), chat_template=name, **kwargs)


def reply_spans(input_ids, labels, tokenizer):
    """The decoded runs of trained tokens, after checking each trained label is its input token."""
    runs, current = [], []
    for token, label in zip(input_ids, labels, strict=True):
        assert label in (token, -100)
        if label == -100 and current:
            runs.append(tokenizer.decode(current))
            current = []
        elif label != -100:
            current.append(token)
    return runs + ([tokenizer.decode(current)] if current else [])


def test_every_unsloth_template_name_is_known():
    unsloth_names = {
        "unsloth",
        "zephyr",
        "chatml",
        "mistral",
        "llama",
        "vicuna",
        "vicuna_old",
        "vicuna old",
        "alpaca",
        "gemma",
        "gemma_chatml",
        "gemma2",
        "gemma2_chatml",
        "llama-3",
        "llama3",
        "phi-3",
        "phi-35",
        "phi-3.5",
        "llama-3.1",
        "llama-31",
        "llama-3.2",
        "llama-3.3",
        "llama-32",
        "llama-33",
        "qwen-2.5",
        "qwen-25",
        "qwen25",
        "qwen2.5",
        "phi-4",
        "gemma-3",
        "gemma3",
        "qwen-3",
        "qwen3",
        "gemma-3n",
        "gemma3n",
        "gemma-4",
        "gemma4",
        "gemma-4-thinking",
        "gemma4-thinking",
        "gpt-oss",
        "gptoss",
        "qwen3-instruct",
        "qwen3-thinking",
        "lfm-2",
        "lfm-2.5",
        "starling",
        "yi-chat",
    }  # fmt: skip  (unsloth/chat_templates.py's CHAT_TEMPLATES keys)
    assert unsloth_names <= set(TEMPLATES) | set(ALIASES)
    assert set(EXPECTED) == set(TEMPLATES)
    with pytest.raises(ValueError, match="not a template fastft knows: use one of .*phi-4.*qwen3-instruct"):
        get_chat_template(family_tokenizer(), chat_template="qwen-7")


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_template_renders_the_family_text_and_marks_the_replies(name):
    from datetime import date

    tokenizer = with_template(name)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert text == EXPECTED[name].replace("DATE", date.today().isoformat())
    prompt = tokenizer.apply_chat_template(CHAT[:1], tokenize=False, add_generation_prompt=True)
    plain = tokenizer.apply_chat_template(CHAT[:1], tokenize=False)
    assert prompt == plain + GENERATION.get(name, EXPECTED[name][len(plain) : EXPECTED[name].index("Hello")])
    out = tokenizer.apply_chat_template(
        CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    trained = "".join(reply_spans(out["input_ids"], [i if m else -100 for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True)], tokenizer))  # fmt: skip
    end = TEMPLATES[name].end or tokenizer.eos_token
    assert trained.replace(" ", "").replace("<think>\n\n</think>\n\n", "").replace(
        "<|channel|>final<|message|>", ""
    ) == (
        f"Hello{'<|end|>' if name == 'gpt-oss' else end}4{end}"
    )  # every reply and its end-of-turn marker, nothing else


@pytest.mark.parametrize("alias,name", [("llama-3.2", "llama-3.1"), ("qwen2.5", "qwen-2.5"), ("gemma3", "gemma-3"),
                                        ("phi-3.5", "phi-3"), ("qwen-3", "qwen3"), ("gptoss", "gpt-oss")])  # fmt: skip
def test_aliases_give_the_same_template(alias, name):
    assert with_template(alias).chat_template == with_template(name).chat_template


def test_eos_follows_unsloth_chatml_and_gemma_map_it_the_others_leave_it():
    tokenizer = with_template("gemma")  # the tokenizer has <end_of_turn>: it becomes the EOS
    assert (
        tokenizer.eos_token == "<end_of_turn>"
        and tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<end_of_turn>")
    )
    plain = load_preset_tokenizer()  # no <end_of_turn>: the EOS token is renamed, its id kept
    plain = with_template("gemma-2", plain)
    assert (
        plain.eos_token == "<end_of_turn>"
        and plain.eos_token_id == 2
        and "<|im_end|>" not in plain.get_vocab()
    )
    assert plain("a<end_of_turn>").input_ids[-1] == 2
    kept = with_template(
        "llama-3.1", map_eos_token=True
    )  # Unsloth maps no EOS for llama-3.1, whatever is asked
    assert kept.eos_token == "<|im_end|>"
    with pytest.warns(UserWarning, match="no '<\\|eot_id\\|>' token"):
        get_chat_template(load_preset_tokenizer(), chat_template="llama-3")


def test_mapping_reads_sharegpt_keys_and_system_message_replaces_the_default():
    mapping = {"role": "from", "content": "value", "user": "human", "assistant": "gpt"}
    tokenizer = with_template("chatml", mapping=mapping)
    sharegpt = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    assert tokenizer.apply_chat_template(sharegpt, tokenize=False) == want
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                                         tokenize=False) == want  # fmt: skip
    qwen3 = with_template("qwen3", mapping=mapping)  # a template reading message.role works mapped too
    assert qwen3.apply_chat_template(sharegpt, tokenize=False).startswith("<|im_start|>user\nhi<|im_end|>\n")
    alpaca = with_template("alpaca", system_message="Answer in French.")
    assert alpaca.apply_chat_template(CHAT[:2], tokenize=False).startswith(
        "Answer in French.\n\n### Instruction:"
    )


def masked_rows(tokenizer, conversations, **markers):
    """train_on_responses_only on a trainer-like object holding the tokenized conversations."""
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    dataset = Dataset.from_dict(
        {"input_ids": [tokenizer(t, add_special_tokens=False).input_ids for t in texts]}
    )
    trainer = SimpleNamespace(
        processing_class=tokenizer, train_dataset=dataset, eval_dataset=None, data_collator=None
    )
    return train_on_responses_only(trainer, **markers).train_dataset


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_train_on_responses_only_without_markers_trains_exactly_the_replies(name):
    tokenizer = with_template(name)
    row = masked_rows(tokenizer, [CHAT])[0]
    runs = reply_spans(row["input_ids"], row["labels"], tokenizer)
    end = TEMPLATES[name].end or tokenizer.eos_token
    first_end = "<|end|>" if name == "gpt-oss" else end
    assert len(runs) == 2, runs
    # each reply from its first token through its end-of-turn (and the newline some templates put after it)
    assert runs[0].strip().startswith("Hello") and runs[0].rstrip().endswith(first_end)
    assert runs[1].strip().removeprefix("<think>\n\n</think>\n\n").startswith("4") and runs[
        1
    ].rstrip().endswith(end)
    assert "Hi" not in "".join(runs) and "2+2?" not in "".join(runs)


def test_markers_read_off_the_families_templates():
    cases = {
        "llama-3.1": (
            "<|start_header_id|>user<|end_header_id|>\n\n",
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        "qwen3": ("<|im_start|>user\n", "<|im_start|>assistant\n"),
        "gemma-3": ("<start_of_turn>user\n", "<start_of_turn>model\n"),
        "phi-4": ("<|im_start|>user<|im_sep|>", "<|im_start|>assistant<|im_sep|>"),
        "gpt-oss": ("<|start|>user<|message|>", "<|start|>assistant<|channel|>final<|message|>"),
        "mistral": ("[INST]", "[/INST]"),
        "alpaca": ("### Instruction:\n", "### Response:\n"),
    }  # fmt: skip  (the parts Unsloth's notebooks pass by hand)
    for name, (instruction, response) in cases.items():
        parts = response_parts(with_template(name))
        assert (parts.instruction_part, parts.response_part) == (instruction, response), name


def test_explicit_markers_still_work_and_a_wrong_one_is_refused():
    tokenizer = with_template("llama-3.1")
    markers = dict(
        instruction_part="<|start_header_id|>user<|end_header_id|>\n\n",
        response_part="<|start_header_id|>assistant<|end_header_id|>\n\n",
    )
    row = masked_rows(tokenizer, [CHAT], **markers)[0]
    assert reply_spans(row["input_ids"], row["labels"], tokenizer) == ["Hello<|eot_id|>", "4<|eot_id|>"]
    with pytest.raises(ValueError, match="response_part '### Reply:' was not found"):
        masked_rows(tokenizer, [CHAT], instruction_part="<|start_header_id|>user", response_part="### Reply:")


def test_qwen3_preset_has_qwen3s_template_and_thinking_tokens():
    _, tokenizer = fastft.load_model("tiny-qwen3")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.convert_tokens_to_ids("<think>") >= 512
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6", "reasoning_content": "add again"},
    ]
    # Qwen3's template: reasoning shown only after the last user message; the earlier one is dropped
    assert tokenizer.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4"
        "<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n<think>\nadd again\n</think>\n\n6"
        "<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(
        chat[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tokenizer("<think>\nx\n</think>").input_ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<think>") and ids[
        -1
    ] == tokenizer.convert_tokens_to_ids("</think>")


def test_reasoning_sft_on_tiny_qwen3_trains_the_thinking_and_the_answer(tmp_path):
    """The Qwen3 reasoning notebook's data path: chats rendered with the model's own template as a text
    column, SFTTrainer, then train_on_responses_only(trainer) with no markers."""
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = fastft.load_model("tiny-qwen3", max_seq_length=128)
    model = fastft.add_lora(model, r=4)
    chats = [
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
         {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}],
    ]  # fmt: skip
    texts = tokenizer.apply_chat_template(chats, tokenize=False)
    args = SFTConfig(output_dir=str(tmp_path), max_length=128, report_to="none", use_cpu=True, max_steps=1)
    trainer = SFTTrainer(
        model=model, processing_class=tokenizer, train_dataset=Dataset.from_dict({"text": texts}), args=args
    )
    trainer = train_on_responses_only(trainer)
    first, second = trainer.train_dataset
    # the text as it is (as Unsloth: TRL alone appends an eos after the last reply's newline)
    assert reply_spans(first["input_ids"], first["labels"], tokenizer) == [
        "<think>\nadd\n</think>\n\n4<|im_end|>\n"
    ]
    assert reply_spans(second["input_ids"], second["labels"], tokenizer) == [
        "Hello<|im_end|>\n",
        "<think>\n\n</think>\n\nBye!<|im_end|>\n",
    ]


def test_standardize_sharegpt_and_data_formats():
    sharegpt = Dataset.from_dict(
        {"conversations": [[{"from": "system", "value": "Be kind."}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]]}
    )  # fmt: skip
    assert standardize_sharegpt(sharegpt)[0]["conversations"] == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    messages = Dataset.from_dict({"messages": [[{"role": "user", "content": "hi", "thinking": None},
                                                {"role": "assistant", "content": "yo", "thinking": "greet"}]]})  # fmt: skip
    assert standardize_sharegpt(messages) is messages  # already role / content: unchanged, no KeyError
    human = Dataset.from_dict({"messages": [[{"role": "human", "content": "hi", "thinking": None},
                                             {"role": "gpt", "content": "yo", "thinking": "greet"}]]})  # fmt: skip
    assert standardize_data_formats(human)[0]["messages"] == [
        {"role": "user", "content": "hi", "thinking": None},
        {"role": "assistant", "content": "yo", "thinking": "greet"},
    ]  # the other keys kept
    odd = Dataset.from_dict(
        {"conversations": [[{"speaker": "input", "text": "hi"}, {"speaker": "output", "text": "yo"}]]}
    )
    assert standardize_data_formats(odd)[0]["conversations"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]  # two keys: the one with fewer values is the role
    alpaca = Dataset.from_dict({"instruction": ["a"], "output": ["b"]})
    assert standardize_data_formats(alpaca) is alpaca
    with pytest.raises(ValueError, match="narrator"):
        standardize_sharegpt(Dataset.from_dict({"conversations": [[{"from": "narrator", "value": "x"}]]}))


def test_to_sharegpt_and_apply_chat_template_as_the_ollama_notebook():
    dataset = Dataset.from_dict(
        {"instruction": ["Add", "Greet"], "input": ["2 and 2", ""], "output": ["4", "Hi"]}
    )
    shared = to_sharegpt(
        dataset, merged_prompt="{instruction}[[\nYour input is:\n{input}]]", output_column_name="output"
    )
    assert shared[0]["conversations"] == [
        {"from": "human", "value": "Add\nYour input is:\n2 and 2"},
        {"from": "gpt", "value": "4"},
    ]
    assert (
        shared[1]["conversations"][0]["value"] == "Greet"
    )  # the optional part left out where input is empty
    assert (
        len(to_sharegpt(dataset, merged_prompt="{instruction}", conversation_extension=2)[0]["conversations"])
        == 4
    )
    tokenizer = family_tokenizer()
    template = (
        "{SYSTEM}\n### Input:\n{INPUT}\n### Response:\n{OUTPUT}\n"
        "### Input:\n{INPUT}\n### Response:\n{OUTPUT}\n"
    )
    texts = apply_chat_template(standardize_sharegpt(shared), tokenizer=tokenizer, chat_template=template,
                                default_system_message="Be exact.")  # fmt: skip
    assert (
        texts[0]["text"]
        == "Be exact.\n### Input:\nAdd\nYour input is:\n2 and 2\n### Response:\n4<|im_end|>\n"
    )
    row = masked_rows(tokenizer, [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]])[
        0
    ]
    assert reply_spans(row["input_ids"], row["labels"], tokenizer) == [
        "b<|im_end|>\n"
    ]  # the template's own parts

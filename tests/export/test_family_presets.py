"""The presets of the families Unsloth's notebooks use (tiny-llama3: Llama-3.1, tiny-qwen3 and tiny-moe:
Qwen3, tiny-gemma3: Gemma 3, tiny-gpt-oss: gpt-oss's harmony format): each renders a chat exactly as the family's own template
(expected texts written out from the models' ``tokenizer_config.json``), trains a step, and exports to GGUF
and Ollama with its chat template translated (each translation rendered against the Jinja template)."""

from __future__ import annotations

import re
import time
import warnings

import pytest

import fastft
from fastft.export import save_gguf, save_ollama
from fastft.export.ollama import render_pieces, translate
from fastft.export.reference import read_metadata
from fastft.models.presets import load_preset_tokenizer

CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]
_QWEN3 = (
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n"
)
EXPECTED = {
    "tiny-llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
    "December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
    "2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
    "tiny-qwen3": _QWEN3,
    "tiny-moe": _QWEN3,
    "tiny-gemma3": "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
    "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "tiny-gpt-oss": "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: DATE\n\nReasoning: medium\n\n# Valid channels: analysis, "
    "commentary, final. Channel must be included for every message.<|end|><|start|>user<|message|>Hi<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello<|end|><|start|>user<|message|>2+2?<|end|>"
    "<|start|>assistant<|channel|>final<|message|>4<|return|>",
}
# the tokens each family's tokenizer holds as one id, its EOS and its pad
TOKENS = {
    "tiny-gemma3": (["<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>", "<pad>"], "<eos>", "<pad>"),
    "tiny-llama3": (
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
        "<|finetune_right_pad_id|>",
    ),
    "tiny-qwen3": (["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>", "<|endoftext|>"),
    "tiny-moe": (["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>", "<|endoftext|>"),
    "tiny-gpt-oss": (
        ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"],
        "<|return|>",
        None,
    ),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_family_preset_renders_its_family_template_and_trains_a_step(name):
    model, tokenizer = fastft.load_model(name, max_seq_length=256)
    expected = EXPECTED[name].replace("DATE", time.strftime("%Y-%m-%d"))
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == expected
    specials, eos, pad = TOKENS[name]
    for token in specials:
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token
    # generation stops at the EOS, and at Gemma 3's end of turn as its generation config says
    stops = [
        tokenizer.eos_token_id,
        *tokenizer.convert_tokens_to_ids(["<end_of_turn>"] * (name == "tiny-gemma3")),
    ]
    assert tokenizer.eos_token == eos
    assert model.generation_config.eos_token_id == (stops if len(stops) > 1 else stops[0])
    assert model.config.pad_token_id == tokenizer.pad_token_id and (pad is None or tokenizer.pad_token == pad)
    # the reply and its end-of-turn marker are what is trained
    encoded = tokenizer.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    trained = [t for t, m in zip(encoded["input_ids"], encoded["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(trained).endswith("4" + expected.rsplit("4", 1)[1].rstrip("\n"))
    model = fastft.add_lora(model, r=4, alpha=8, gradient_checkpointing="none")
    rows = fastft.load_dataset("bundled:skills").select(range(8))
    # gpt-oss's attention sinks run transformers' attention (fastft's packed kernel has none yet)
    attention = {"attention": None} if name == "tiny-gpt-oss" else {}
    data = fastft.pack(rows, tokenizer, 256)
    result = fastft.train(model, tokenizer, data, max_steps=1, progress=False, **attention)
    assert result.final_loss is not None and 0 < result.final_loss < 20


@pytest.mark.parametrize("name, bos", [("tiny-llama3", "<|begin_of_text|>"), ("tiny-gemma3", "<bos>")])
def test_family_tokenizer_prepends_its_bos_as_the_familys_does(name, bos):
    tokenizer = load_preset_tokenizer(name)
    ids = tokenizer("Hi")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == tokenizer.convert_tokens_to_ids(bos)
    assert tokenizer("Hi", add_special_tokens=False)["input_ids"] == ids[1:]
    # the model's config names the same BOS, as Llama 3's does (else transformers' Trainer rewrites the config
    # at the first step, saying the tokenizer's special tokens differ from the model's)
    model, tokenizer = fastft.load_model("tiny-llama3")
    assert model.config.bos_token_id == model.generation_config.bos_token_id == tokenizer.bos_token_id


# conversations Ollama hands a template: a system message, several turns, a reply to continue with its reasoning
CONVERSATIONS = [
    ([{"role": "user", "content": "Hi"}], True, {}),
    ([{"role": "system", "content": "Be terse."}, *CHAT[:3]], True, {}),
    (CHAT[:3], True, {"think": False}),
    (CHAT[:3], True, {"think_level": "high"}),
    ([*CHAT[:3], {"role": "assistant", "content": "4", "thinking": "two and two"}], False, {}),
]


def _go_render(template: str, messages: list[dict], think: bool | None = None, think_level: str = "") -> str:
    """Ollama's rendering of `template` (the subset of Go's text/template fastft writes: text, if / else if /
    else, range over .Messages, variables, eq ne and or not len slice index currentDate), to check the Go text
    itself and not only `render_pieces`."""
    parts = re.split(r"(\{\{.*?\}\})", template, flags=re.S)
    root = {
        "Messages": [
            {"Role": m["role"], "Content": m["content"], "Thinking": m.get("thinking", "")} for m in messages
        ],
        "IsThinkSet": think is not None,
        "Think": bool(think),
        "ThinkLevel": think_level,
    }
    position = 0

    def block(stop: tuple[str, ...]) -> list:
        nonlocal position
        nodes = []
        while position < len(parts):
            part = parts[position]
            position += 1
            if not part.startswith("{{"):
                nodes.append(("text", part))
                continue
            action = part[2:-2].strip()
            word = action.split(" ")[0]
            if word in stop or action.startswith("else"):
                position -= 1
                return nodes
            if word == "if":
                branches, other = [(action[3:], block(("end", "else")))], []
                while parts[position][2:-2].strip().startswith("else"):
                    head = parts[position][2:-2].strip()
                    position += 1
                    if head.startswith("else if "):
                        branches.append((head[8:], block(("end", "else"))))
                    else:
                        other = block(("end",))
                position += 1  # {{ end }}
                nodes.append(("if", branches, other))
            elif word == "range":
                body = block(("end",))
                position += 1
                nodes.append(("range", action, body))
            else:
                nodes.append(("action", action))
        return nodes

    def value(expression: str, dot, names: dict):
        tokens = [
            (m.group(), m.start(), m.end()) for m in re.finditer(r'"[^"]*"|\(|\)|\$?\.?\w+|\$', expression)
        ]

        def operand(i):
            text, _, end = tokens[i]
            if text == "(":
                result, i = command(i + 1)
                i += 1  # ")"
                if i < len(tokens) and tokens[i][0].startswith(".") and tokens[i][1] == tokens[i - 1][2]:
                    result, i = result[tokens[i][0][1:]], i + 1  # (expr).Field
                return result, i
            if text.startswith('"'):
                return text[1:-1], i + 1
            if text.isdigit():
                return int(text), i + 1
            if text.startswith("$."):
                return root[text[2:]], i + 1
            if text.startswith("$"):
                return names[text], i + 1
            if text.startswith("."):
                return dot[text[1:]], i + 1
            return FUNCTIONS[text], i + 1

        def command(i):
            args = []
            while i < len(tokens) and tokens[i][0] != ")":
                arg, i = operand(i)
                args.append(arg)
            return (args[0](*args[1:]) if callable(args[0]) else args[0]), i

        return command(0)[0]

    def run(nodes, dot, names) -> str:
        out = []
        for node in nodes:
            if node[0] == "text":
                out.append(node[1])
            elif node[0] == "action":
                target, _, expression = node[1].rpartition(":=")
                result = value(expression, dot, names)
                if target:
                    names[target.strip()] = result
                else:
                    out.append(str(result))
            elif node[0] == "if":
                body = next((b for condition, b in node[1] if value(condition, dot, names)), node[2])
                out.append(run(body, dot, names))
            else:
                for i, message in enumerate(root["Messages"]):
                    out.append(run(node[2], message, {**names, "$i": i, "$_": message}))
        return "".join(out)

    tree = block(())
    return run(tree, root, {})


def _and(*args):
    return next((a for a in args if not a), args[-1])


def _or(*args):
    return next((a for a in args if a), args[-1])


FUNCTIONS = {
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "and": _and,
    "or": _or,
    "not": lambda a: not a,
    "len": len,
    "slice": lambda items, start: items[start:],
    "index": lambda items, i: items[i],
    "currentDate": lambda: time.strftime("%Y-%m-%d"),
}


# Gemma 3's template opens the first user turn with the system message, which has no faithful Go template
# (the export test below: the Modelfile says so)
@pytest.mark.parametrize("name", [name for name in EXPECTED if name != "tiny-gemma3"])
def test_family_template_translates_to_ollama_and_renders_as_the_jinja(name):
    tokenizer = load_preset_tokenizer(name)
    template, pieces = translate(tokenizer)
    for messages, generation, options in CONVERSATIONS:
        variables = {"enable_thinking": False} if options.get("think") is False else {}
        if "think_level" in options:
            variables["reasoning_effort"] = options["think_level"]
        jinja = [{**m, "reasoning_content": m["thinking"]} if "thinking" in m else m for m in messages]
        want = tokenizer.apply_chat_template(
            jinja, tokenize=False, add_generation_prompt=generation, **variables
        )
        want = want.removeprefix(tokenizer.bos_token or "\0")
        got = render_pieces(pieces, messages, generation, **options)
        # Ollama's rendering of the Go text: the same (it writes the generation prompt after a last user message)
        assert _go_render(template, messages, options.get("think"), options.get("think_level", "")) == got
        if generation:
            assert got == want, (messages, options)
        else:  # a reply Ollama has the model continue: the same text, up to its end-of-turn marker
            assert want == got + pieces.end and pieces.end in ("<|eot_id|>", "<|im_end|>\n", "<|return|>")
    family = {
        "tiny-llama3": [
            '{{ if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>\n\n{{ .Content }}<|eot_id|>',
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n{{ .Content }}<|eot_id|>",
        ],
        "tiny-qwen3": [
            "<|im_start|>assistant\n{{ if and $last .Thinking }}<think>\n{{ .Thinking }}\n</think>\n\n",
            "{{ if and $.IsThinkSet (not $.Think) }}<think>\n\n</think>\n\n{{ end }}",
        ],
        "tiny-gpt-oss": [
            "Current date: {{ currentDate }}\n\nReasoning: {{ if $.ThinkLevel }}{{ $.ThinkLevel }}{{ else }}medium"
            "{{ end }}",
            "<|start|>assistant<|channel|>{{ if and $last .Thinking }}analysis<|message|>{{ .Thinking }}<|end|>"
            "<|start|>assistant<|channel|>final<|message|>",
        ],
    }
    for snippet in family.get(name, family["tiny-qwen3"] if name == "tiny-moe" else []):
        assert snippet in template


# Qwen3's: tests/export/test_gguf.py (tiny-qwen3, tiny-moe)
@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-gemma3"])
def test_family_preset_exports_to_gguf_and_ollama(name, tmp_path):
    model, tokenizer = fastft.load_model(name, max_seq_length=128)
    prompts = [[{"role": "user", "content": "Reverse the letters of 'lemon'."}]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = save_ollama(model, tmp_path / "ollama", tokenizer, "bf16", prompts=prompts)
    assert result.check.passed, result.check.table()
    text = result.modelfile.read_text()
    if (
        name == "tiny-gemma3"
    ):  # no Go template (see above): the Modelfile says what to do, the GGUF keeps Jinja's
        assert "# fastft could not translate the chat template" in text
        assert any("could not translate the chat template" in str(w.message) for w in caught)
        assert 'PARAMETER stop "<end_of_turn>"' in text  # its generation config's stop
    else:
        assert f'TEMPLATE """{translate(tokenizer)[0]}"""' in text
    assert f'PARAMETER stop "{tokenizer.eos_token}"' in text
    meta = read_metadata(result.path)
    assert meta["tokenizer.chat_template"] == tokenizer.chat_template
    assert meta["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert meta["tokenizer.ggml.pad_token_id"] == tokenizer.pad_token_id
    assert meta["tokenizer.ggml.add_bos_token"]  # both families prepend their BOS


def test_a_template_without_translation_still_exports_and_the_modelfile_says_what_to_do(tmp_path):
    """Mistral's template merges the system prompt into the first user turn: no faithful Go template."""
    from fastft.unsloth.chat_templates import get_chat_template

    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = get_chat_template(tokenizer, chat_template="mistral")
    with pytest.warns(UserWarning, match="could not translate the chat template"):
        result = save_ollama(model, tmp_path / "ollama", tokenizer, "bf16", check=False)
    text = result.modelfile.read_text()
    assert text.startswith("FROM ./model.BF16.gguf\n") and not any(
        line.startswith("TEMPLATE") for line in text.splitlines()
    )
    assert "# fastft could not translate the chat template" in text and "ollama show NAME --template" in text
    assert read_metadata(result.path)["tokenizer.chat_template"] == tokenizer.chat_template
    again = save_gguf(model, tmp_path / "m.gguf", tokenizer, "bf16", check=False)  # plain GGUF: no warning
    assert read_metadata(again.path)["tokenizer.chat_template"] == tokenizer.chat_template

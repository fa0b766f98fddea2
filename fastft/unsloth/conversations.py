"""Unsloth's dataset helpers of ``unsloth.chat_templates`` (re-exported there, and at `fastft.unsloth`'s top
level, under Unsloth's names):

- `standardize_sharegpt` / `standardize_data_formats` turn ShareGPT rows (``from`` / ``value``) into role /
  content messages;
- `to_sharegpt` merges columns into one-turn conversations;
- `apply_chat_template` builds a chat template from a two-example prompt (the Ollama notebooks' ``{SYSTEM}`` /
  ``{INPUT}`` / ``{OUTPUT}``);
- `remove_special_tokens` drops the tokenizer's BOS from the start of a prompt.

Where fastft's result differs from Unsloth's, the docstring says so.
"""

from __future__ import annotations

import json
import re

from datasets import concatenate_datasets

_SYSTEM_ALIASES = ("system",)
_USER_ALIASES = ("user", "human", "input")
_ASSISTANT_ALIASES = ("gpt", "assistant", "output")


def standardize_data_formats(
    dataset,
    tokenizer=None,
    aliases_for_system=_SYSTEM_ALIASES,
    aliases_for_user=_USER_ALIASES,
    aliases_for_assistant=_ASSISTANT_ALIASES,
    batch_size: int = 1000,
    num_proc: int | None = None,
):
    """ShareGPT-style conversations as role / content messages, in the same column (Unsloth's function).

    The column is ``conversations`` (or, where there is none, ``messages``: Unsloth leaves a dataset without
    ``conversations`` untouched, fastft also standardizes ``messages``). Each message's role key and content
    key are found from the first rows (``role`` / ``content``, ``from`` / ``value``, or, with just two keys,
    the one with fewer distinct values is the role); speakers map to system / user / assistant through the
    aliases; other keys (``thinking``, ``weight``) are kept. A dataset already in role / content form with
    those roles comes back unchanged. For a multimodal `tokenizer` (a processor), contents become
    ``[{"type": "text", "text": …}]``.
    """
    column = next((c for c in ("conversations", "messages") if c in (dataset.column_names or [])), None)
    if column is None:
        return dataset
    head = list(dataset.select(range(min(10, len(dataset))))) if hasattr(dataset, "select") else []
    messages = [m for row in head for m in (row[column] or [])]
    role_key, content_key = _message_keys(messages, column)
    roles = {name: "system" for name in aliases_for_system}
    roles |= {name: "user" for name in aliases_for_user} | {
        name: "assistant" for name in aliases_for_assistant
    }
    unknown = sorted({m[role_key] for m in messages} - set(roles), key=str)
    if unknown:
        raise ValueError(
            f"standardize_data_formats: speakers {unknown} of column {column!r} are in no alias list: add them to "
            "aliases_for_system, aliases_for_user or aliases_for_assistant."
        )
    multimodal = tokenizer is not None and (
        hasattr(tokenizer, "image_processor") or hasattr(tokenizer, "tokenizer")
    )
    standard = (role_key, content_key) == ("role", "content") and all(
        m["role"] in ("system", "user", "assistant") for m in messages
    )
    if standard and not multimodal:
        return dataset

    def convert(examples):
        conversations = []
        for conversation in examples[column]:
            out = []
            for message in conversation or []:
                speaker = message[role_key]
                if speaker not in roles:
                    raise ValueError(
                        f"standardize_data_formats: speaker {speaker!r} is in no alias list: add it to "
                        "aliases_for_system, aliases_for_user or aliases_for_assistant."
                    )
                content = message[content_key]
                extra = {
                    k: v for k, v in message.items() if k not in (role_key, content_key, "role", "content")
                }
                out.append(
                    {
                        "role": roles[speaker],
                        "content": [{"type": "text", "text": content}] if multimodal else content,
                        **extra,
                    }
                )
            conversations.append(out)
        return {column: conversations}

    kwargs = {"batched": True, "batch_size": batch_size}
    if hasattr(dataset, "__len__"):
        kwargs |= {"num_proc": num_proc, "desc": "Standardizing formats"}
    return dataset.map(convert, **kwargs)


standardize_sharegpt = standardize_data_formats  # Unsloth made the two one function


def remove_special_tokens(tokenizer, prompt: str) -> str:
    """Unsloth's ``remove_special_tokens``: `prompt` without a leading BOS token (text rendered by a chat template
    that writes the BOS, about to be tokenized again, which would add a second one)."""
    bos = tokenizer.bos_token
    return prompt[len(bos) :] if bos and prompt.startswith(bos) else prompt


def _message_keys(messages: list[dict], column: str) -> tuple[str, str]:
    keys = {k for m in messages for k, v in m.items() if v is not None}
    for pair in (("role", "content"), ("from", "value")):
        if set(pair) <= keys:
            return pair
    if len(keys) == 2:
        first, second = sorted(keys)
        distinct = {k: len({str(m.get(k)) for m in messages}) for k in keys}
        return (first, second) if distinct[first] <= distinct[second] else (second, first)
    raise ValueError(
        f"standardize_data_formats: the messages of column {column!r} have keys {sorted(keys)}; expected role / "
        "content or from / value."
    )


def to_sharegpt(
    dataset,
    merged_prompt: str = "",
    merged_column_name: str = "instruction",
    output_column_name: str = "output",
    remove_unused_columns: bool = True,
    conversation_extension: int = 1,
    random_state: int = 3407,
):
    """Columns merged into one-turn ShareGPT conversations (``conversations`` of human / gpt messages), as
    Unsloth's function does.

    `merged_prompt` writes the user message from the columns: ``{column}`` is the column's value, and a part
    in ``[[…]]`` is left out where its first column is empty, e.g. ``"{instruction}[[\\nInput:\\n{input}]]"``.
    `output_column_name` is the reply. `conversation_extension` > 1 joins that many randomly drawn rows
    (seed `random_state`) into each multi-turn conversation.
    """
    if (
        "conversations" in dataset.column_names
        and len(dataset)
        and isinstance(dataset[0]["conversations"], list)
    ):
        raise TypeError("to_sharegpt: the dataset already has ShareGPT conversations.")
    pieces = _prompt_pieces(merged_prompt, dataset.column_names)
    if output_column_name not in dataset.column_names:
        raise KeyError(
            f"to_sharegpt: output_column_name={output_column_name!r} is not a column: {dataset.column_names}."
        )

    def convert(examples):
        n = len(examples[output_column_name])
        conversations = []
        for i in range(n):
            prompt = "".join(_filled(piece, examples, i) for piece in pieces)
            conversations.append(
                [
                    {"from": "human", "value": prompt},
                    {"from": "gpt", "value": str(examples[output_column_name][i])},
                ]
            )
        return {"conversations": conversations}

    remove = dataset.column_names if remove_unused_columns else None
    dataset = dataset.map(convert, batched=True, remove_columns=remove, desc="Converting to ShareGPT")
    extra = max(conversation_extension - 1, 0)
    if not extra:
        return dataset

    columns = [dataset.rename_column("conversations", "conversations0")]
    for j in range(1, extra + 1):
        shuffled = dataset.shuffle(seed=random_state + j).flatten_indices()
        columns.append(
            shuffled.select_columns(["conversations"]).rename_column("conversations", f"conversations{j}")
        )
    joined = concatenate_datasets(columns, axis=1)
    names = [f"conversations{j}" for j in range(extra + 1)]

    def combine(examples):
        return {
            "conversations": [sum(turns, []) for turns in zip(*(examples[n] for n in names), strict=True)]
        }

    return joined.map(combine, batched=True, remove_columns=joined.column_names if remove_unused_columns else names,
                      desc="Extending conversations")  # fmt: skip


def _prompt_pieces(merged_prompt: str, columns: list[str]) -> list[tuple[bool, str, list[str]]]:
    """`merged_prompt` as (optional, text, its columns) pieces; every ``{column}`` must be a column."""
    named = re.findall(r"\{(.+?)\}", merged_prompt)
    missing = [c for c in named if c not in columns]
    if missing:
        raise KeyError(f"to_sharegpt: merged_prompt names {missing}, which are not columns: {columns}.")
    pieces = []
    for part in re.split(r"(\[\[.+?\]\])", merged_prompt, flags=re.DOTALL):
        if not part:
            continue
        optional = part.startswith("[[") and part.endswith("]]")
        text = part[2:-2] if optional else part
        needed = re.findall(r"\{(.+?)\}", text)
        if optional and not needed:
            raise ValueError(f"to_sharegpt: the optional part {part!r} names no {{column}}.")
        pieces.append((optional, text, needed))
    return pieces


def _filled(piece: tuple[bool, str, list[str]], examples, i: int) -> str:
    optional, text, needed = piece
    if optional and examples[needed[0]][i] in (None, ""):
        return ""
    out = text
    for column in needed:
        out = out.replace("{" + column + "}", str(examples[column][i]))
    return out


def apply_chat_template(
    dataset,
    tokenizer=None,
    chat_template: str = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n{INPUT}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{OUTPUT}<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n{INPUT}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n{OUTPUT}<|eot_id|>"
    ),
    default_system_message: str | None = (
        "Below are some instructions that describe some tasks. Write responses that appropriately complete "
        "each request."
    ),
    extra_eos_tokens: list[str] | str | None = None,
):
    """Give `tokenizer` the chat template written by example in `chat_template`, and add a ``text`` column of
    each row's ``conversations`` rendered with it (Unsloth's function of this name, from its Ollama notebooks).

    `chat_template` shows two exchanges: ``{INPUT}`` / ``{OUTPUT}`` twice each, or one (as the Ollama notebook
    writes it; split as Unsloth splits it, at the turn separator the reply shares with the user turn),
    ``{SYSTEM}`` optionally once before them (filled with `default_system_message` when a conversation has no system message). The
    tokenizer's EOS is added after ``{OUTPUT}`` when the example ends a reply with no EOS (or
    `extra_eos_tokens`) of its own. The user and reply markers are kept on the tokenizer, so a later
    ``train_on_responses_only(trainer)`` uses them. fastft writes no Ollama Modelfile here:
    ``save_ollama`` / ``save_pretrained_gguf`` translate the chat template themselves.
    """
    if tokenizer is None:
        raise ValueError("apply_chat_template: pass the tokenizer (tokenizer=tokenizer).")
    system_part, input_part, output_part = _split_example(chat_template.lstrip(), tokenizer, extra_eos_tokens)
    jinja = _example_template(tokenizer, system_part, input_part, output_part, default_system_message)
    tokenizer.chat_template = jinja
    tokenizer._unsloth_input_part = input_part[: input_part.index("{INPUT}")]
    tokenizer._unsloth_output_part = output_part[: output_part.index("{OUTPUT}")]

    def render(examples):
        return {
            "text": [
                tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=False)
                for c in examples["conversations"]
            ]
        }

    return dataset.map(render, batched=True)


def _split_example(template: str, tokenizer, extra_eos_tokens) -> tuple[str, str, str]:
    """(system part, user part ending after ``{INPUT}`` and its end marker, reply part) of a two-example
    template, or of a one-example template (as the Ollama notebook writes it: `_split_single`)."""
    eos_tokens = [t for t in [tokenizer.eos_token, *(_as_list(extra_eos_tokens))] if t]
    if template.count("{INPUT}") == 1 and template.count("{OUTPUT}") == 1:
        system_part, input_part, output_part = _split_single(template)
        return system_part, input_part, _with_eos(output_part, eos_tokens)
    if template.count("{INPUT}") != 2 or template.count("{OUTPUT}") != 2:
        raise ValueError(
            "apply_chat_template: the chat_template must show two exchanges, {INPUT} and {OUTPUT} twice each, "
            "e.g. '### Input:\\n{INPUT}\\n\\n### Response:\\n{OUTPUT}\\n### Input:\\n{INPUT}\\n\\n### Response:\\n{OUTPUT}\\n'."
        )
    # the second exchange is the template's tail that also ends just before it: find the longest such tail
    first_output_end = template.index("{OUTPUT}") + len("{OUTPUT}")
    second_input = template.index("{INPUT}", first_output_end)
    for start in range(first_output_end, second_input + 1):
        unit = template[start:]
        if template[:start].endswith(unit):
            break
    else:
        raise ValueError(
            "apply_chat_template: the two exchanges in chat_template differ; write the second exactly as the first."
        )
    system_part = template[: start - len(unit)]
    input_end = (
        re.search(r"\{INPUT\}\s*(?:" + "|".join(re.escape(t) for t in eos_tokens) + r")?", unit).end()
        if eos_tokens
        else unit.index("{INPUT}") + 7
    )
    return system_part, unit[:input_end], _with_eos(unit[input_end:], eos_tokens)


def _with_eos(output_part: str, eos_tokens: list[str]) -> str:
    """The reply part with the EOS after ``{OUTPUT}`` unless the example ends replies with one already."""
    if eos_tokens and not any(
        output_part[output_part.index("{OUTPUT}") + 8 :].startswith(t) for t in eos_tokens
    ):
        output_part = output_part.replace("{OUTPUT}", "{OUTPUT}" + eos_tokens[0], 1)
    return output_part


def _split_single(template: str) -> tuple[str, str, str]:
    """A one-exchange template split as Unsloth splits it: the reply part runs from after ``{INPUT}`` (and the
    text that ends a reply, when it ends the input too) to the end; the user part starts at the longest
    beginning of the reply part that also appears before ``{INPUT}`` (the turn separator, e.g. ``"\n\n### "``);
    what precedes it is the system part."""
    input_at, output_at = template.index("{INPUT}"), template.index("{OUTPUT}")
    ending = template[output_at + len("{OUTPUT}") :]
    input_end = input_at + len("{INPUT}")
    if ending and template.startswith(ending, input_end):
        input_end += len(ending)
    reply = template[input_end:]
    separator = ""
    for length in range(1, len(reply) + 1):
        found = template.find(reply[:length], 0, input_at)
        if found == -1 or found + length >= input_at:
            break
        separator = reply[:length]
    if output_at < input_at or not separator:
        raise ValueError(
            "apply_chat_template: with one exchange, chat_template must show the user turn's opening again before "
            "the reply (e.g. '### Instruction:\n{INPUT}\n\n### Response:\n{OUTPUT}'), or show two exchanges, "
            "{INPUT} and {OUTPUT} twice each."
        )
    start = template.rfind(separator, 0, input_at)
    return template[:start], template[start:input_end], reply


def _as_list(value) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def _example_template(tokenizer, system_part: str, input_part: str, output_part: str, default_system) -> str:
    def literal(text: str) -> str:
        return json.dumps(text)

    def around(part: str, slot: str, expression: str) -> str:
        before, after = part.split(slot, 1)
        return " + ".join(
            x for x in (literal(before) if before else "", expression, literal(after) if after else "") if x
        )

    bos = getattr(tokenizer, "bos_token", None)
    head = ""
    if bos and system_part.startswith(bos):
        system_part, head = system_part[len(bos) :], "{{- bos_token -}}"
    parts = [head, "{%- set loop_messages = messages -%}"]
    if system_part:
        if "{SYSTEM}" in system_part:
            default = literal(default_system or "")
            parts += [
                "{%- if messages and messages[0]['role'] == 'system' -%}",
                "{{- " + around(system_part, "{SYSTEM}", "messages[0]['content']") + " -}}",
                "{%- set loop_messages = messages[1:] -%}",
                "{%- else -%}{{- " + around(system_part, "{SYSTEM}", default) + " -}}{%- endif -%}",
            ]
        else:  # fixed text: a system message has no place, and is passed over (Unsloth's template's intent)
            parts += [
                "{{- " + literal(system_part) + " -}}",
                "{%- if messages and messages[0]['role'] == 'system' -%}{%- set loop_messages = messages[1:] -%}"
                "{%- endif -%}",
            ]
    reply_open, reply_rest = output_part.split("{OUTPUT}", 1)
    parts += [
        "{%- for message in loop_messages -%}",
        "{%- if message['role'] == 'user' -%}{{- "
        + around(input_part, "{INPUT}", "message['content']")
        + " -}}",
        "{%- elif message['role'] == 'assistant' -%}{{- " + literal(reply_open) + " -}}",
        "{%- generation -%}{{- message['content']"
        + (" + " + literal(reply_rest) if reply_rest else "")
        + " -}}{%- endgeneration -%}",
        "{%- else -%}{{- raise_exception('This template has user and assistant turns only') -}}{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}{{- " + literal(reply_open) + " -}}{%- endif -%}",
    ]
    return "".join(parts)

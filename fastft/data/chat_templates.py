"""Chat templates of the common model families, with ``{% generation %}`` markers, and `get_chat_template`.

Each family's turn format (`ChatFormat`) is rendered into one Jinja template by `build_template`. The
assistant's reply and its end-of-turn marker sit inside ``{% generation %}…{% endgeneration %}``, so
``tokenizer.apply_chat_template(..., return_assistant_tokens_mask=True)`` marks exactly what the model must
learn to write, stop marker included, and TRL's ``SFTConfig(assistant_only_loss=True)`` accepts the template.
fastft's own tokenizer (`fastft.data.tokenize`) finds assistant turns by rendering prefixes, so it reads these
templates like any other.

`get_chat_template(tokenizer, "llama-3.1")` is Unsloth's call of that name (``unsloth.chat_templates``).
Plain data and strings: no torch, no transformers at import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DEFAULT_MAPPING = {"role": "role", "content": "content", "user": "user", "assistant": "assistant"}


@dataclass(frozen=True)
class ChatFormat:
    """How one family writes a conversation.

    `user` / `system`: (prefix, suffix) around a user / system turn's content; `system=None` folds the system
    message into the first user turn (Gemma and Mistral have no system role). `assistant`: (prefix, text
    after the end-of-turn marker). `stop`: the end-of-turn marker ending each assistant reply (None: the
    tokenizer's ``eos_token``). `generation_prompt`: what opens the assistant's turn for generation.
    `default_system`: the system message used when a conversation has none; `system_preamble`: text every
    system turn starts with (Llama 3.1's knowledge-date lines). `bos`: starts with the tokenizer's
    ``bos_token``; `trim`: contents are stripped of surrounding whitespace (as Llama 3 does).
    """

    name: str
    user: tuple[str, str]
    assistant: tuple[str, str]
    stop: str | None
    generation_prompt: str
    system: tuple[str, str] | None = None
    default_system: str = ""
    system_preamble: str = ""
    bos: bool = False
    trim: bool = False


def _llama3_header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


def _chatml_header(role: str) -> str:
    return f"<|im_start|>{role}\n"


_LLAMA3 = dict(
    user=(_llama3_header("user"), "<|eot_id|>"),
    assistant=(_llama3_header("assistant"), ""),
    stop="<|eot_id|>",
    generation_prompt=_llama3_header("assistant"),
    system=(_llama3_header("system"), "<|eot_id|>"),
    bos=True,
    trim=True,
)
_CHATML = dict(
    user=(_chatml_header("user"), "<|im_end|>\n"),
    assistant=(_chatml_header("assistant"), "\n"),
    stop="<|im_end|>",
    generation_prompt=_chatml_header("assistant"),
    system=(_chatml_header("system"), "<|im_end|>\n"),
)

FORMATS: dict[str, ChatFormat] = {
    f.name: f
    for f in (
        ChatFormat("llama-3", **_LLAMA3),
        ChatFormat(
            "llama-3.1",
            **_LLAMA3,
            system_preamble="Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
        ),
        ChatFormat("chatml", **_CHATML),
        ChatFormat(
            "qwen-2.5",
            **_CHATML,
            default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
        ),
        ChatFormat(
            "mistral",
            user=("[INST] ", " [/INST]"),
            assistant=("", ""),
            stop=None,
            generation_prompt="",
            bos=True,
        ),
        ChatFormat(
            "gemma",
            user=("<start_of_turn>user\n", "<end_of_turn>\n"),
            assistant=("<start_of_turn>model\n", "\n"),
            stop="<end_of_turn>",
            generation_prompt="<start_of_turn>model\n",
            bos=True,
        ),
        ChatFormat(
            "phi-3",
            user=("<|user|>\n", "<|end|>\n"),
            assistant=("<|assistant|>\n", "\n"),
            stop="<|end|>",
            generation_prompt="<|assistant|>\n",
            system=("<|system|>\n", "<|end|>\n"),
        ),
    )
}
# Other names people type for the same formats (Unsloth's among them).
ALIASES = {
    "llama3": "llama-3",
    "llama-31": "llama-3.1",
    "llama-3.2": "llama-3.1",
    "llama-32": "llama-3.1",
    "llama-3.3": "llama-3.1",
    "llama-33": "llama-3.1",
    "qwen2.5": "qwen-2.5",
    "qwen-25": "qwen-2.5",
    "qwen25": "qwen-2.5",
    "qwen-2": "qwen-2.5",
    "gemma-2": "gemma",
    "gemma2": "gemma",
    "gemma-3": "gemma",
    "gemma3": "gemma",
    "phi-3.5": "phi-3",
    "phi3": "phi-3",
    "mistral-v0.3": "mistral",
}


class ChatTemplateError(ValueError):
    """A chat template name fastft does not know; the message lists the ones it does."""


def _text(value: str) -> str:
    """`value` as a Jinja expression that prints it (JSON string literals are Jinja string literals)."""
    return "{{ " + json.dumps(value) + " }}" if value else ""


def build_template(chat_format: ChatFormat, stop: str | None = None, mapping: dict | None = None) -> str:
    """The Jinja chat template of `chat_format`, its end-of-turn marker written as `stop` (default: the
    format's own; None there means the tokenizer's ``eos_token``), reading messages through `mapping`
    (Unsloth's: which keys hold the role and the content, and which role values mean user and assistant)."""
    mapping = {**DEFAULT_MAPPING, **(mapping or {})}
    roles = {mapping["user"]: "user", mapping["assistant"]: "assistant", "system": "system"}

    def role_of(message: str) -> str:
        key = json.dumps(mapping["role"])
        return f"{json.dumps(roles)}.get({message}[{key}], {message}[{key}])"

    content = f"m[{json.dumps(mapping['content'])}]" + (" | trim" if chat_format.trim else "")
    stop = stop if stop is not None else chat_format.stop
    if chat_format.stop is not None and stop != chat_format.stop:  # one marker ends every turn
        chat_format = _with_marker(chat_format, chat_format.stop, stop)
    stop_expression = json.dumps(stop) if stop is not None else "eos_token"
    parts = [
        "{%- set ns = namespace(system=" + json.dumps(chat_format.default_system) + ", start=0) -%}",
        "{%- if messages and " + role_of("messages[0]") + " == 'system' -%}",
        "{%- set ns.system = messages[0][" + json.dumps(mapping["content"]) + "] -%}{%- set ns.start = 1 -%}",
        "{%- endif -%}",
    ]
    if chat_format.bos:
        parts.append("{%- if bos_token -%}{{ bos_token }}{%- endif -%}")
    if chat_format.system is not None:
        prefix, suffix = chat_format.system
        preamble = json.dumps(chat_format.system_preamble)
        condition = "true" if chat_format.system_preamble else "ns.system"
        parts.append(
            "{%- if " + condition + " -%}" + _text(prefix) + "{{ " + preamble + " + ns.system"
            + (" | trim" if chat_format.trim else "") + " }}" + _text(suffix) + "{%- endif -%}"
        )  # fmt: skip
    fold = (
        "{%- if loop.first and ns.system -%}{{ ns.system + '\\n\\n' }}{%- endif -%}"
        if chat_format.system is None
        else ""
    )
    user_prefix, user_suffix = chat_format.user
    assistant_prefix, assistant_after = chat_format.assistant
    parts += [
        "{%- for m in messages[ns.start:] -%}",
        "{%- set role = " + role_of("m") + " -%}",
        "{%- if role == 'user' -%}"
        + _text(user_prefix)
        + fold
        + "{{ "
        + content
        + " }}"
        + _text(user_suffix),
        "{%- elif role == 'assistant' -%}" + _text(assistant_prefix),
        "{% generation %}{{ " + content + " + " + stop_expression + " }}{% endgeneration %}",
        _text(assistant_after),
        "{%- else -%}{{ raise_exception('The " + chat_format.name + " chat template has user, assistant and "
        "system turns only, not ' + role) }}",
        "{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}" + _text(chat_format.generation_prompt) + "{%- endif -%}",
    ]
    return "".join(parts)


def resolve_format(name: str) -> ChatFormat:
    """The `ChatFormat` called `name` (or one of its `ALIASES`), case-insensitive."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in FORMATS:
        known = ", ".join([*FORMATS, *ALIASES])
        raise ChatTemplateError(f"chat_template={name!r} is not a template fastft knows: use one of {known}.")
    return FORMATS[key]


def get_chat_template(
    tokenizer,
    chat_template: str | tuple[str, str] = "chatml",
    mapping: dict | None = None,
    map_eos_token: bool = True,
    system_message: str | None = None,
):
    """Give `tokenizer` the chat template `chat_template` (a name of `FORMATS` / `ALIASES`, or a
    ``(jinja, end_of_turn)`` pair of one's own) and return it, as Unsloth's function of this name does.

    `mapping` reads other message keys (ShareGPT's ``{"role": "from", "content": "value", "user": "human",
    "assistant": "gpt"}``). With `map_eos_token`, the template's end-of-turn marker is what generation stops
    at: if the tokenizer has the marker as a token it becomes its ``eos_token``; if not (a tokenizer of
    another family), the template writes the tokenizer's own ``eos_token`` in its place, so the model learns
    to end its turns with a token it has. `system_message` replaces the format's default system message.
    """
    if isinstance(chat_template, tuple):
        template, stop = chat_template
        if map_eos_token and stop not in tokenizer.get_vocab():
            raise ChatTemplateError(
                f"the end-of-turn marker {stop!r} of this template is not a token of the tokenizer: use one "
                f"of its tokens (its eos_token is {tokenizer.eos_token!r}), or map_eos_token=False."
            )
    else:
        chat_format = resolve_format(chat_template)
        if system_message is not None:
            chat_format = _with_default_system(chat_format, system_message)
        stop = chat_format.stop
        if map_eos_token and stop is not None and stop not in tokenizer.get_vocab():
            stop = tokenizer.eos_token
        template = build_template(chat_format, stop=stop, mapping=mapping)
        stop = stop if stop is not None else tokenizer.eos_token
    tokenizer.chat_template = template
    if map_eos_token and stop is not None and tokenizer.eos_token != stop:
        tokenizer.eos_token = stop
    return tokenizer


def _with_marker(chat_format: ChatFormat, old: str, new: str) -> ChatFormat:
    """`chat_format` with every `old` end-of-turn marker in its fixed strings written as `new`."""
    from dataclasses import replace

    def swap(pair):
        return None if pair is None else tuple(text.replace(old, new) for text in pair)

    return replace(
        chat_format,
        user=swap(chat_format.user),
        assistant=swap(chat_format.assistant),
        system=swap(chat_format.system),
        generation_prompt=chat_format.generation_prompt.replace(old, new),
        stop=new,
    )


def _with_default_system(chat_format: ChatFormat, system_message: str) -> ChatFormat:
    from dataclasses import replace

    return replace(chat_format, default_system=system_message)


__all__ = [
    "ALIASES",
    "FORMATS",
    "ChatFormat",
    "ChatTemplateError",
    "build_template",
    "get_chat_template",
    "resolve_format",
]

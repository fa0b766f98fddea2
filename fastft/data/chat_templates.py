"""The chat templates of the common model families, by Unsloth's names, as data.

`TEMPLATES` holds one `ChatTemplate` per name Unsloth's ``get_chat_template`` offers ("llama-3.1",
"qwen3", "gemma-3", "phi-4", "gpt-oss", "chatml", "alpaca", …; `ALIASES` holds the other spellings it
accepts). Each Jinja text renders a conversation of system / user / assistant turns exactly as the family's
own template does (its ``tokenizer_config.json`` on the hub; Unsloth's copy where the family has none), and
wraps each reply and its end-of-turn marker in ``{% generation %}…{% endgeneration %}``, so
``apply_chat_template(..., return_assistant_tokens_mask=True)`` and TRL's ``assistant_only_loss`` mark what
the model must learn to write. Tool definitions and tool calls are left to the model's own template: these
copies refuse them with a clear error instead of dropping them.

`get_chat_template` (fastft.unsloth.chat_templates) installs one on a tokenizer. Plain data and strings:
no torch, no transformers at import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DEFAULT_MAPPING = {"role": "role", "content": "content", "user": "user", "assistant": "assistant"}
SYSTEM_PLACEHOLDER = "__FASTFT_DEFAULT_SYSTEM__"  # replaced by the default system message, a Jinja literal


@dataclass(frozen=True)
class ChatTemplate:
    """One named template.

    `jinja`: the template text (a template with a default system message holds `SYSTEM_PLACEHOLDER`).
    `end`: the marker the template writes after each reply (None: the tokenizer's ``eos_token``).
    `map_eos_token`: Unsloth's flag for this template: the tokenizer's EOS becomes `end` (ChatML and the
    Gemma templates); for every other template Unsloth leaves the EOS alone, whatever the caller asks.
    `default_system`: the system message used when a conversation has none (None: the template has none).
    `renames`: tokens Unsloth renames in the vocabulary for this template, ``(old, new)`` pairs.
    """

    name: str
    jinja: str
    end: str | None
    map_eos_token: bool = False
    default_system: str | None = None
    renames: tuple[tuple[str, str], ...] = ()

    def text(self, system_message: str | None = None) -> str:
        """The Jinja text with the default system message (`system_message` if given) written in."""
        if self.default_system is None:
            return self.jinja
        message = self.default_system if system_message is None else system_message
        return self.jinja.replace(SYSTEM_PLACEHOLDER, json.dumps(message))


def _j(*parts: str) -> str:
    return "".join(parts)


def _no_tools(name: str) -> str:
    return (
        "{%- if tools or custom_tools -%}{{- raise_exception('fastft\\'s " + name + " template renders chats "
        "without tools: keep the model\\'s own chat template for tool calling') -}}{%- endif -%}"
    )


def _only_user_assistant(name: str) -> str:
    return (
        "{{- raise_exception('The " + name + " template has user and assistant turns only, not ' + role) -}}"
    )


def _reply(body: str, after: str = "") -> str:
    """An assistant reply (`body`, a Jinja expression ending with the end-of-turn marker), marked as trained,
    then `after` (a Jinja expression, e.g. the newline after the marker)."""
    return (
        "{%- generation -%}{{- "
        + body
        + " -}}{%- endgeneration -%}"
        + ("{{- " + after + " -}}" if after else "")
    )


def _simple(
    name: str,
    *,
    user: tuple[str, str],
    assistant: tuple[str, str, str],
    generation: str,
    other: str,
    bos: bool = False,
    trim: bool = False,
    head_system: tuple[str, str] | None = None,
) -> str:
    """A template where each turn is a fixed prefix and suffix around the content.

    `user`: (prefix, suffix) as Jinja expressions; `assistant`: (prefix, body end, after); `other`: the
    Jinja statement for any other role (``role`` is set); `head_system`: (prefix, suffix) of a system
    message that always opens the conversation, the default one (``default_system``) when it has none.
    """
    content = "message['content']" + (" | trim" if trim else "")
    parts = ["{{- bos_token -}}" if bos else ""]
    loop = "messages"
    if head_system is not None:
        parts += [
            "{%- set default_system = " + SYSTEM_PLACEHOLDER + " -%}",
            "{%- if messages and messages[0]['role'] == 'system' -%}",
            "{{- " + head_system[0] + " + messages[0]['content'] + " + head_system[1] + " -}}",
            "{%- set loop_messages = messages[1:] -%}",
            "{%- else -%}{{- " + head_system[0] + " + default_system + " + head_system[1] + " -}}",
            "{%- set loop_messages = messages -%}{%- endif -%}",
        ]
        loop = "loop_messages"
    prefix, end, after = assistant
    parts += [
        "{%- for message in " + loop + " -%}{%- set role = message['role'] -%}",
        "{%- if role == 'user' -%}{{- " + user[0] + " + " + content + " + " + user[1] + " -}}",
        "{%- elif role == 'assistant' -%}{{- " + prefix + " -}}" + _reply(content + " + " + end, after),
        "{%- else -%}" + other + "{%- endif -%}{%- endfor -%}",
        "{%- if add_generation_prompt -%}{{- " + generation + " -}}{%- endif -%}",
    ]
    return _j(*parts)


_NL = "'\\n'"

UNSLOTH = _simple(
    "unsloth",
    bos=True,
    head_system=("''", _NL),
    user=("'>>> User: '", _NL),
    assistant=("'>>> Assistant: '", "eos_token", _NL),
    generation="'>>> Assistant: '",
    other=_only_user_assistant("unsloth"),
)
ZEPHYR = _simple(
    "zephyr",
    user=("'<|user|>\\n'", "eos_token + '\\n'"),
    assistant=("'<|assistant|>\\n'", "eos_token", _NL),
    generation="'<|assistant|>\\n'",
    other="{{- '<|system|>\\n' + message['content'] + eos_token + '\\n' -}}",
)
CHATML = _simple(
    "chatml",
    user=("'<|im_start|>user\\n'", "'<|im_end|>\\n'"),
    assistant=("'<|im_start|>assistant\\n'", "'<|im_end|>'", _NL),
    generation="'<|im_start|>assistant\\n'",
    other="{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' -}}",
)
VICUNA = _simple(
    "vicuna",
    bos=True,
    head_system=("''", "' '"),
    user=("'USER: '", "' '"),
    assistant=("'ASSISTANT: '", "eos_token", ""),
    generation="'ASSISTANT:'",
    other=_only_user_assistant("vicuna"),
)
VICUNA_OLD = _simple(
    "vicuna_old",
    bos=True,
    head_system=("''", _NL),
    user=("'### Human: '", _NL),
    assistant=("'### Assistant: '", "eos_token", _NL),
    generation="'### Assistant:'",
    other=_only_user_assistant("vicuna_old"),
)
ALPACA = _simple(
    "alpaca",
    bos=True,
    head_system=("''", "'\\n\\n'"),
    user=("'### Instruction:\\n'", "'\\n\\n'"),
    assistant=("'### Response:\\n'", "eos_token", "'\\n\\n'"),
    generation="'### Response:\\n'",
    other=_only_user_assistant("alpaca"),
)
LLAMA3 = _simple(
    "llama-3",
    bos=True,
    trim=True,
    user=("'<|start_header_id|>user<|end_header_id|>\\n\\n'", "'<|eot_id|>'"),
    assistant=("'<|start_header_id|>assistant<|end_header_id|>\\n\\n'", "'<|eot_id|>'", ""),
    generation="'<|start_header_id|>assistant<|end_header_id|>\\n\\n'",
    other="{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' -}}",
)
PHI3 = _simple(
    "phi-3",
    user=("'<|user|>\\n'", "'<|end|>\\n'"),
    assistant=("'<|assistant|>\\n'", "'<|end|>'", _NL),
    generation="'<|assistant|>\\n'",
    other="{{- '<|' + role + '|>\\n' + message['content'] + '<|end|>\\n' -}}",
)
PHI4 = _simple(
    "phi-4",
    user=("'<|im_start|>user<|im_sep|>'", "'<|im_end|>'"),
    assistant=("'<|im_start|>assistant<|im_sep|>'", "'<|im_end|>'", ""),
    generation="'<|im_start|>assistant<|im_sep|>'",
    other="{%- if role == 'system' -%}{{- '<|im_start|>system<|im_sep|>' + message['content'] + '<|im_end|>' -}}"
    "{%- endif -%}",
)
LFM2 = _simple(
    "lfm-2",
    bos=True,
    user=("'<|im_start|>user\\n'", "'<|im_end|>\\n'"),
    assistant=("'<|im_start|>assistant\\n'", "'<|im_end|>'", _NL),
    generation="'<|im_start|>assistant\\n'",
    other="{{- '<|im_start|>' + role + '\\n' + message['content'] + '<|im_end|>\\n' -}}",
)
STARLING = _simple(
    "starling",
    bos=True,
    user=("'GPT4 Correct User: '", "'<|end_of_turn|>'"),
    assistant=("'GPT4 Correct Assistant: '", "'<|end_of_turn|>'", ""),
    generation="'GPT4 Correct Assistant:'",
    other="{{- 'GPT4 Correct ' + role.title() + ': ' + message['content'] + '<|end_of_turn|>' -}}",
)
YI_CHAT = _simple(
    "yi-chat",
    user=("'<|im_start|>user\\n'", "'<|im_end|>\\n'"),
    assistant=("'<|im_start|>assistant\\n'", "'<|im_end|>'", _NL),
    generation="'<|im_start|>assistant\\n'",
    other="{{- '<|im_start|>' + role + '\\n' + message['content'] + '<|im_end|>\\n' -}}",
)

# Mistral Instruct v0.1/v0.2 as Unsloth writes it: no system role, so a system message opens the first
# [INST] block; each reply ends with the EOS.
MISTRAL = _j(
    "{{- bos_token -}}",
    "{%- set loop_messages = messages -%}",
    "{%- if messages and messages[0]['role'] == 'system' -%}",
    "{%- if messages | length > 1 and messages[1]['role'] == 'user' -%}",
    "{{- '[INST] ' + messages[0]['content'] + ' ' + messages[1]['content'] + ' [/INST]' -}}",
    "{%- set loop_messages = messages[2:] -%}",
    "{%- else -%}{{- '[INST] ' + messages[0]['content'] + ' [/INST]' -}}{%- set loop_messages = messages[1:] -%}",
    "{%- endif -%}{%- endif -%}",
    "{%- for message in loop_messages -%}{%- set role = message['role'] -%}",
    "{%- if role == 'user' -%}{{- '[INST] ' + message['content'] + ' [/INST]' -}}",
    "{%- elif role == 'assistant' -%}" + _reply("message['content'] + eos_token"),
    "{%- else -%}" + _only_user_assistant("mistral") + "{%- endif -%}{%- endfor -%}",
)

# Llama 2 chat: <<SYS>> inside the first [INST] block, a BOS before every [INST].
LLAMA2 = _j(
    "{%- set bos = bos_token if bos_token is defined else '' -%}{%- set loop_messages = messages -%}",
    "{%- if messages and messages[0]['role'] == 'system' -%}",
    "{%- if messages | length > 1 and messages[1]['role'] == 'user' -%}",
    "{{- bos + '[INST] <<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' + messages[1]['content']"
    " + ' [/INST]' -}}",
    "{%- set loop_messages = messages[2:] -%}",
    "{%- else -%}{{- bos + '[INST] ' + messages[0]['content'] + ' [/INST]' -}}",
    "{%- set loop_messages = messages[1:] -%}{%- endif -%}{%- endif -%}",
    "{%- for message in loop_messages -%}{%- set role = message['role'] -%}",
    "{%- if role == 'user' -%}{{- bos + '[INST] ' + message['content'].strip() + ' [/INST]' -}}",
    "{%- elif role == 'assistant' -%}{{- ' ' -}}" + _reply("message['content'].strip() + ' ' + eos_token"),
    "{%- else -%}" + _only_user_assistant("llama") + "{%- endif -%}{%- endfor -%}",
)

# Gemma 1 and 2: no system role (it joins the first user turn), the assistant is "model", contents trimmed.
GEMMA = _j(
    "{{- bos_token -}}",
    "{%- set loop_messages = messages -%}",
    "{%- if messages and messages[0]['role'] == 'system' -%}",
    "{{- '<start_of_turn>user\\n' + messages[0]['content'] | trim + ' ' + messages[1]['content'] | trim"
    " + '<end_of_turn>\\n' -}}",
    "{%- set loop_messages = messages[2:] -%}{%- endif -%}",
    "{%- for message in loop_messages -%}{%- set role = message['role'] -%}",
    "{%- if role == 'user' -%}{{- '<start_of_turn>user\\n' + message['content'] | trim + '<end_of_turn>\\n' -}}",
    "{%- elif role == 'assistant' -%}{{- '<start_of_turn>model\\n' -}}"
    + _reply("message['content'] | trim + '<end_of_turn>'", _NL),
    "{%- else -%}" + _only_user_assistant("gemma") + "{%- endif -%}{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}",
)


def _gemma3(name: str, image: str, audio: str | None) -> str:
    """Gemma 3 / 3n: the system message opens the first user turn, roles must alternate, a content may be a
    list of parts (text, image, audio)."""
    audio_part = "{%- elif item['type'] == 'audio' -%}{{- '" + audio + "' -}}" if audio else ""
    return _j(
        "{%- macro body(content) -%}",
        "{%- if content is string -%}{{- content | trim -}}",
        "{%- elif content is iterable -%}{%- for item in content -%}",
        "{%- if item['type'] == 'image' -%}{{- '" + image + "' -}}" + audio_part,
        "{%- elif item['type'] == 'text' -%}{{- item['text'] | trim -}}{%- endif -%}{%- endfor -%}",
        "{%- else -%}{{- raise_exception('Invalid content type') -}}{%- endif -%}",
        "{%- endmacro -%}",
        "{{- bos_token -}}",
        "{%- if messages and messages[0]['role'] == 'system' -%}",
        "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}",
        "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}{%- endif -%}",
        "{%- set loop_messages = messages[1:] -%}",
        "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}",
        "{%- for message in loop_messages -%}",
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}",
        "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}",
        "{%- endif -%}",
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}",
        "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') -}}",
        "{%- if role == 'model' -%}" + _reply("body(message['content']) + '<end_of_turn>'", _NL),
        "{%- else -%}{{- body(message['content']) + '<end_of_turn>\\n' -}}{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}",
    )


def _gemma4(thinking: bool) -> str:
    """Gemma 4: ``<|turn>role … <turn|>``, a system turn (with ``<|think|>`` when ``enable_thinking``); the
    model's earlier thoughts (``<|channel>…<channel|>``) are dropped from its replies."""
    generation = "{{- '<|turn>model\\n' -}}"
    if thinking:
        generation += "{%- if not thinking -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}"
    return _j(
        "{%- macro strip_thinking(text) -%}{%- set ns = namespace(result='') -%}",
        "{%- for part in text.split('<channel|>') -%}",
        "{%- if '<|channel>' in part -%}{%- set ns.result = ns.result + part.split('<|channel>')[0] -%}",
        "{%- else -%}{%- set ns.result = ns.result + part -%}{%- endif -%}{%- endfor -%}",
        "{{- ns.result | trim -}}{%- endmacro -%}",
        "{%- macro body(content, model) -%}",
        "{%- if content is string -%}{{- strip_thinking(content) if model else content | trim -}}",
        "{%- elif content is iterable -%}{%- for item in content -%}",
        "{%- if item['type'] == 'audio' -%}{{- '<|audio|>' -}}{%- elif item['type'] == 'image' -%}{{- '<|image|>' -}}",
        "{%- elif item['type'] == 'video' -%}{{- '<|video|>' -}}",
        "{%- elif item['type'] == 'text' -%}{{- strip_thinking(item['text']) if model else item['text'] | trim -}}",
        "{%- endif -%}{%- endfor -%}",
        "{%- else -%}{{- raise_exception('Invalid content type') -}}{%- endif -%}{%- endmacro -%}",
        "{%- set thinking = enable_thinking is defined and enable_thinking -%}",
        "{%- set loop_messages = messages -%}",
        "{%- if (messages and messages[0]['role'] in ['system', 'developer']) or thinking -%}",
        "{{- '<|turn>system\\n' -}}{%- if thinking -%}{{- '<|think|>\\n' -}}{%- endif -%}",
        "{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}",
        "{{- messages[0]['content'] | trim -}}{%- set loop_messages = messages[1:] -%}{%- endif -%}",
        "{{- '<turn|>\\n' -}}{%- endif -%}",
        "{%- for message in loop_messages -%}",
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}",
        "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}",
        "{%- endif -%}",
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}",
        "{{- '<|turn>' + role + '\\n' -}}",
        "{%- if role == 'model' -%}" + _reply("body(message['content'], true) + '<turn|>'", _NL),
        "{%- else -%}{{- body(message['content'], false) + '<turn|>\\n' -}}{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}" + generation + "{%- endif -%}",
    )


# Llama 3.1 Instruct (also 3.2 and 3.3, as Unsloth maps them): a system turn always opens the chat, with the
# knowledge-date lines; ``date_string`` may be passed to apply_chat_template. Contents are trimmed.
LLAMA31 = _j(
    "{{- bos_token -}}",
    _no_tools("llama-3.1"),
    "{%- if not date_string is defined -%}{%- set date_string = '26 Jul 2024' -%}{%- endif -%}",
    "{%- set default_system = " + SYSTEM_PLACEHOLDER + " -%}",
    "{%- if messages and messages[0]['role'] == 'system' -%}",
    "{%- set system_message = messages[0]['content'] | trim -%}{%- set loop_messages = messages[1:] -%}",
    "{%- else -%}{%- set system_message = default_system -%}{%- set loop_messages = messages -%}{%- endif -%}",
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + 'Cutting Knowledge Date: December 2023\\n'"
    " + 'Today Date: ' + date_string + '\\n\\n' + system_message + '<|eot_id|>' -}}",
    "{%- for message in loop_messages -%}",
    "{%- set role = 'ipython' if message['role'] in ['tool', 'ipython'] else message['role'] -%}",
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' -}}",
    "{%- if role == 'assistant' -%}" + _reply("message['content'] | trim + '<|eot_id|>'"),
    "{%- else -%}{{- message['content'] | trim + '<|eot_id|>' -}}{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}",
)

_QWEN_TOOL = _j(
    "{%- elif message.role == 'tool' -%}",
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') -%}{{- '<|im_start|>user' -}}{%- endif -%}",
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' -}}",
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') -%}{{- '<|im_end|>\\n' -}}{%- endif -%}",
)
_NO_TOOL_CALLS = (
    "{%- if message.tool_calls -%}{{- raise_exception('fastft\\'s copy of this template renders chats without "
    "tool calls: keep the model\\'s own chat template for tool calling') -}}{%- endif -%}"
)

# Qwen 2.5 Instruct: a system turn always opens the chat (Qwen's default one when there is none).
QWEN25 = _j(
    _no_tools("qwen-2.5"),
    "{%- set default_system = " + SYSTEM_PLACEHOLDER + " -%}",
    "{%- if messages and messages[0]['role'] == 'system' -%}",
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' -}}",
    "{%- else -%}{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' -}}{%- endif -%}",
    "{%- for message in messages -%}",
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}",
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}",
    "{%- elif message.role == 'assistant' -%}" + _NO_TOOL_CALLS + "{{- '<|im_start|>assistant\\n' -}}",
    _reply("message.content + '<|im_end|>'", _NL),
    _QWEN_TOOL,
    "{%- endif -%}{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
)


def _qwen3(think_when: str, generation: str) -> str:
    """Qwen3's templates: a reply after the last user query shows its reasoning in ``<think>…</think>``
    (from ``reasoning_content``, or split out of a content holding ``</think>``), earlier replies drop it.
    `think_when`: the condition (besides coming after the last query) for writing the think block;
    `generation`: the generation prompt statements."""
    return _j(
        _no_tools("qwen3"),
        "{%- if messages and messages[0].role == 'system' -%}",
        "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}{%- endif -%}",
        "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages | length - 1) -%}",
        "{%- for message in messages[::-1] -%}{%- set index = (messages | length - 1) - loop.index0 -%}",
        "{%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not"
        " (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) -%}",
        "{%- set ns.multi_step_tool = false -%}{%- set ns.last_query_index = index -%}{%- endif -%}",
        "{%- endfor -%}",
        "{%- for message in messages -%}",
        "{%- set content = message.content if message.content is string else '' -%}",
        "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}",
        "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' -}}",
        "{%- elif message.role == 'assistant' -%}" + _NO_TOOL_CALLS,
        "{%- set reasoning_content = '' -%}",
        "{%- if message.reasoning_content is string -%}{%- set reasoning_content = message.reasoning_content -%}",
        "{%- elif '</think>' in content -%}",
        "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}",
        "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}",
        "{{- '<|im_start|>assistant\\n' -}}{%- generation -%}",
        "{%- if loop.index0 > ns.last_query_index and (" + think_when + ") -%}",
        "{{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}",
        "{%- else -%}{{- content -}}{%- endif -%}",
        "{{- '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}",
        _QWEN_TOOL.replace("message.content", "content"),
        "{%- endif -%}{%- endfor -%}",
        "{%- if add_generation_prompt -%}" + generation + "{%- endif -%}",
    )


# Qwen3 (hybrid thinking: Qwen3-0.6B … 32B, Qwen3-30B-A3B): ``enable_thinking=False`` closes an empty think
# block in the generation prompt.
QWEN3 = _qwen3(
    "loop.last or reasoning_content",
    "{{- '<|im_start|>assistant\\n' -}}{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}",
)
QWEN3_INSTRUCT = _qwen3("reasoning_content", "{{- '<|im_start|>assistant\\n' -}}")  # Qwen3-…-Instruct-2507
QWEN3_THINKING = _qwen3("loop.last or reasoning_content", "{{- '<|im_start|>assistant\\n<think>\\n' -}}")

# gpt-oss (OpenAI's harmony format): a system block with the model identity, dates and reasoning effort
# (``reasoning_effort=`` and ``model_identity=`` may be passed to apply_chat_template), the system message as
# developer instructions, replies on the ``final`` channel; the last reply of a training conversation also
# writes its ``thinking`` on the ``analysis`` channel and ends with ``<|return|>``.
GPT_OSS = _j(
    _no_tools("gpt-oss"),
    "{%- if model_identity is not defined -%}",
    "{%- set model_identity = 'You are ChatGPT, a large language model trained by OpenAI.' -%}{%- endif -%}",
    "{%- if reasoning_effort is not defined -%}{%- set reasoning_effort = 'medium' -%}{%- endif -%}",
    "{{- '<|start|>system<|message|>' + model_identity + '\\n' + 'Knowledge cutoff: 2024-06\\n'"
    " + 'Current date: ' + strftime_now('%Y-%m-%d') + '\\n\\n' + 'Reasoning: ' + reasoning_effort + '\\n\\n'"
    " + '# Valid channels: analysis, commentary, final. Channel must be included for every message.'"
    " + '<|end|>' -}}",
    "{%- if developer_instructions is defined and developer_instructions is not none -%}",
    "{%- set developer_message = developer_instructions -%}{%- set loop_messages = messages -%}",
    "{%- elif messages and messages[0].role in ['developer', 'system'] -%}",
    "{%- set developer_message = messages[0].content -%}{%- set loop_messages = messages[1:] -%}",
    "{%- else -%}{%- set developer_message = '' -%}{%- set loop_messages = messages -%}{%- endif -%}",
    "{%- if developer_message -%}",
    "{{- '<|start|>developer<|message|>' + '# Instructions\\n\\n' + developer_message + '<|end|>' -}}",
    "{%- endif -%}",
    "{%- for message in loop_messages -%}",
    "{%- if message.role == 'assistant' -%}" + _NO_TOOL_CALLS,
    "{%- if '<|channel|>' in message.content -%}{{- raise_exception('Pass the analysis text in the thinking"
    " field and the final text in the content field, without <|channel|> tags.') -}}{%- endif -%}",
    "{{- '<|start|>assistant' -}}{%- generation -%}",
    "{%- if loop.last and not add_generation_prompt -%}",
    "{%- if message.thinking is string -%}",
    "{{- '<|channel|>analysis<|message|>' + message.thinking + '<|end|>' + '<|start|>assistant' -}}",
    "{%- endif -%}{{- '<|channel|>final<|message|>' + message.content + '<|return|>' -}}",
    "{%- else -%}{{- '<|channel|>final<|message|>' + message.content + '<|end|>' -}}{%- endif -%}",
    "{%- endgeneration -%}",
    "{%- elif message.role == 'user' -%}{{- '<|start|>user<|message|>' + message.content + '<|end|>' -}}",
    "{%- elif message.role == 'tool' -%}{{- raise_exception('fastft\\'s gpt-oss template renders chats without"
    " tool calls: keep the model\\'s own chat template for tool calling') -}}",
    "{%- endif -%}{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}",
)

_VICUNA_SYSTEM = (
    "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
    "detailed, and polite answers to the user's questions."
)
_VICUNA_OLD_SYSTEM = (
    "A chat between a curious human and an artificial intelligence assistant. The assistant gives helpful, "
    "detailed, and polite answers to the human's questions."
)
_ALPACA_SYSTEM = (
    "Below are some instructions that describe some tasks. Write responses that appropriately complete each "
    "request."
)
_GEMMA3 = _gemma3("gemma-3", "<start_of_image>", None)
_GEMMA3N = _gemma3("gemma-3n", "<image_soft_token>", "<audio_soft_token>")

TEMPLATES: dict[str, ChatTemplate] = {
    t.name: t
    for t in (
        ChatTemplate("unsloth", UNSLOTH, None, default_system="You are a helpful assistant to the user"),
        ChatTemplate("zephyr", ZEPHYR, None),
        ChatTemplate("chatml", CHATML, "<|im_end|>", map_eos_token=True),
        ChatTemplate("mistral", MISTRAL, None),
        ChatTemplate("llama", LLAMA2, None),
        ChatTemplate("vicuna", VICUNA, None, default_system=_VICUNA_SYSTEM),
        ChatTemplate("vicuna_old", VICUNA_OLD, None, default_system=_VICUNA_OLD_SYSTEM),
        ChatTemplate("alpaca", ALPACA, None, default_system=_ALPACA_SYSTEM),
        ChatTemplate("gemma", GEMMA, "<end_of_turn>", map_eos_token=True),
        ChatTemplate(
            "gemma_chatml",
            "{{- bos_token -}}" + CHATML,
            "<|im_end|>",
            map_eos_token=True,
            renames=(("<start_of_turn>", "<|im_start|>"), ("<eos>", "<|im_end|>")),
        ),
        ChatTemplate("llama-3", LLAMA3, "<|eot_id|>"),
        ChatTemplate("phi-3", PHI3, "<|end|>"),
        ChatTemplate("llama-3.1", LLAMA31, "<|eot_id|>", default_system=""),
        ChatTemplate(
            "qwen-2.5",
            QWEN25,
            "<|im_end|>",
            default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
        ),
        ChatTemplate("phi-4", PHI4, "<|im_end|>"),
        ChatTemplate("gemma-3", _GEMMA3, "<end_of_turn>"),
        ChatTemplate("qwen3", QWEN3, "<|im_end|>"),
        ChatTemplate("gemma-3n", _GEMMA3N, "<end_of_turn>"),
        ChatTemplate("gemma-4", _gemma4(thinking=False), "<turn|>"),
        ChatTemplate("gemma-4-thinking", _gemma4(thinking=True), "<turn|>"),
        ChatTemplate("gpt-oss", GPT_OSS, "<|return|>"),
        ChatTemplate("qwen3-instruct", QWEN3_INSTRUCT, "<|im_end|>"),
        ChatTemplate("qwen3-thinking", QWEN3_THINKING, "<|im_end|>"),
        ChatTemplate("lfm-2", LFM2, "<|im_end|>"),
        ChatTemplate("starling", STARLING, "<|end_of_turn|>"),
        ChatTemplate("yi-chat", YI_CHAT, "<|im_end|>"),
    )
}
TEMPLATES["gemma2"] = TEMPLATES["gemma"]
TEMPLATES["gemma2_chatml"] = TEMPLATES["gemma_chatml"]

# The other names Unsloth (and people) use for the same templates.
ALIASES = {
    "vicuna old": "vicuna_old",
    "gemma-2": "gemma2",
    "llama3": "llama-3",
    "phi-35": "phi-3",
    "phi-3.5": "phi-3",
    "phi3": "phi-3",
    "phi4": "phi-4",
    "llama-31": "llama-3.1",
    "llama-3.2": "llama-3.1",
    "llama-3.3": "llama-3.1",
    "llama-32": "llama-3.1",
    "llama-33": "llama-3.1",
    "qwen-25": "qwen-2.5",
    "qwen25": "qwen-2.5",
    "qwen2.5": "qwen-2.5",
    "qwen-2": "qwen-2.5",
    "gemma3": "gemma-3",
    "qwen-3": "qwen3",
    "gemma3n": "gemma-3n",
    "gemma4": "gemma-4",
    "gemma4-thinking": "gemma-4-thinking",
    "gptoss": "gpt-oss",
    "lfm-2.5": "lfm-2",
    "mistral-v0.3": "mistral",
}


class ChatTemplateError(ValueError):
    """A chat template name fastft does not know; the message lists the ones it does."""


def template_names() -> list[str]:
    """Every name `resolve_template` accepts."""
    return [*TEMPLATES, *ALIASES]


def resolve_template(name: str) -> ChatTemplate:
    """The `ChatTemplate` called `name` (or one of its `ALIASES`), case-insensitive."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in TEMPLATES:
        raise ChatTemplateError(
            f"chat_template={name!r} is not a template fastft knows: use one of {', '.join(template_names())}, "
            "or pass your own as a (jinja_template, end_of_turn_token) tuple."
        )
    return TEMPLATES[key]


def mapped(jinja: str, mapping: dict | None) -> str:
    """`jinja` reading messages whose keys and role names are `mapping`'s (Unsloth's ``mapping``: ShareGPT's
    ``{"role": "from", "content": "value", "user": "human", "assistant": "gpt"}``); messages already in the
    role / content form still render as before."""
    mapping = {**DEFAULT_MAPPING, **(mapping or {})}
    if mapping == DEFAULT_MAPPING:
        return jinja
    roles = json.dumps({mapping["user"]: "user", mapping["assistant"]: "assistant"})
    role, content = json.dumps(mapping["role"]), json.dumps(mapping["content"])
    return _j(
        "{%- set _fastft = namespace(messages=[]) -%}{%- for m in messages -%}",
        "{%- if " + role + " in m -%}",
        "{%- set _fastft.messages = _fastft.messages + [{'role': "
        + roles
        + ".get(m["
        + role
        + "], m["
        + role
        + "]),"
        " 'content': m[" + content + "]}] -%}",
        "{%- else -%}{%- set _fastft.messages = _fastft.messages + [m] -%}{%- endif -%}{%- endfor -%}",
        "{%- set messages = _fastft.messages -%}",
        jinja,
    )


__all__ = [
    "ALIASES",
    "DEFAULT_MAPPING",
    "TEMPLATES",
    "ChatTemplate",
    "ChatTemplateError",
    "mapped",
    "resolve_template",
    "template_names",
]

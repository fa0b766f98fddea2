"""An Ollama ``Modelfile`` from the tokenizer: the chat template translated to Ollama's (Go) template
language, the stop tokens and default parameters.

A Jinja chat template cannot be translated in general, so the translation is measured, not parsed: the
template renders conversations holding marker strings, and the text around each marker gives the pieces
(what comes before and after a system, user and assistant message, and the generation prompt). The Go
template is built from those pieces; `render_pieces` renders the same pieces in Python, and `translate`
keeps the translation only if that rendering equals the Jinja template's on several conversations
(with and without a system message, one and several turns, a reply the model is to continue).

Besides fixed text, the pieces hold what the families' templates vary on: a reply that ends the
conversation written differently from earlier ones (Qwen3 shows its reasoning, ``<think>…</think>``, only
there), its reasoning (``reasoning_content`` / ``thinking``: Ollama's ``.Thinking``), the generation prompt
when thinking is turned off (Qwen3's ``enable_thinking=False``: Ollama's ``think: false``), and gpt-oss's
current date and reasoning effort (Ollama's ``currentDate`` and ``.ThinkLevel``). A template whose messages
depend on each other in other ways (the system prompt merged into the first user turn, tool calls) has
no faithful translation: `modelfile` then leaves the TEMPLATE out and says what to do (the GGUF carries
the chat template itself).
"""

from __future__ import annotations

import difflib
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from fastft.checks import SettingError, real_number, whole_number
from fastft.models.stops import stop_token_ids
from fastft.runtime.model_state import base_model

_S, _U, _A, _U2, _T = (
    "⟦fastft-system⟧",
    "⟦fastft-user⟧",
    "⟦fastft-assistant⟧",
    "⟦fastft-user2⟧",
    "⟦fastft-thinking⟧",
)
_DATE, _EFFORT = "⟦fastft-date⟧", "⟦fastft-effort⟧"  # strftime_now('%Y-%m-%d') and reasoning_effort


class TemplateTranslationError(ValueError):
    """The chat template has no faithful Ollama translation; the message says which conversation differed."""


@dataclass(frozen=True)
class Pieces:
    """The literal text around each message of a chat template (see the module doc). Texts may hold the
    `_DATE` and `_EFFORT` markers, rendered as today's date and the reasoning effort."""

    head: str  # before the first message unless it is a system one with its own piece (a default system
    # block, or ""; BOS excluded: llama.cpp adds it)
    system: tuple[str, str] | None  # before / after a system message's content; None: no system role
    user: tuple[str, str]
    assistant: tuple[str, str]  # before an earlier reply's content / after it
    generation: str  # after the last user message, when the model is to answer
    last: str | None = None  # before a reply that ends the conversation, when not `assistant[0]`
    thinking: tuple[str, str] | None = (
        None  # before / after the reasoning of a reply ending the conversation,
    )
    # the text between them and the reply's content; None: the template writes no reasoning
    no_think: str = ""  # after `generation` when thinking is turned off
    effort: str | None = None  # the default reasoning effort, when the template takes one
    end: str = ""  # after a reply that ends a conversation: its end marker, which Ollama leaves to the model


def _render(tokenizer, messages: list[dict], generation: bool, **variables) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, **variables
    )


def _split(text: str, marker: str) -> tuple[str, str]:
    if text.count(marker) != 1:
        raise TemplateTranslationError(
            f"the chat template does not render each message's content once ({marker})"
        )
    before, _, after = text.partition(marker)
    return before, after


def _common_suffix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return a[len(a) - n :]


def _effort_default(tokenizer) -> str | None:
    """The reasoning effort the template writes when none is passed; None when it takes none."""
    messages = [{"role": "user", "content": _U}]
    marked = _render(tokenizer, messages, False, reasoning_effort=_EFFORT)
    if marked.count(_EFFORT) != 1:
        return None
    plain = _render(tokenizer, messages, False)
    before, after = marked.split(_EFFORT)
    if not (plain.startswith(before) and plain.endswith(after)):
        return None
    return plain[len(before) : len(plain) - len(after)]


def measure(tokenizer) -> Pieces:
    """The `Pieces` of the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateTranslationError("the tokenizer has no chat template to translate")
    effort = _effort_default(tokenizer)
    variables = {} if effort is None else {"reasoning_effort": _EFFORT}
    today = time.strftime("%Y-%m-%d")  # gpt-oss's current date (strftime_now), Ollama's currentDate

    def render(messages, generation=False, **extra):
        return _render(tokenizer, messages, generation, **variables, **extra).replace(today, _DATE)

    user_only = render([{"role": "user", "content": _U}])
    with_generation = render([{"role": "user", "content": _U}], True)
    if not with_generation.startswith(user_only):
        raise TemplateTranslationError("the generation prompt is not appended after the last message")
    generation = with_generation[len(user_only) :]
    no_think = ""
    without_thinking = render([{"role": "user", "content": _U}], True, enable_thinking=False)
    if without_thinking != with_generation:
        if not without_thinking.startswith(with_generation):
            raise TemplateTranslationError("enable_thinking=False changes more than the generation prompt")
        no_think = without_thinking[len(with_generation) :]
    first_pre, user_post = _split(user_only, _U)
    two = [{"role": "user", "content": _U}, {"role": "assistant", "content": _A}]
    final = render(two)
    if not final.startswith(user_only):
        raise TemplateTranslationError("an assistant message changes how the user message before it renders")
    last_pre, last_post = _split(final[len(user_only) :], _A)
    three = render([*two, {"role": "user", "content": _U2}])
    if not three.startswith(user_only):
        raise TemplateTranslationError("a later message changes how the first user message renders")
    assistant_pre, rest = _split(three[len(user_only) :], _A)
    between, rest = _split(rest, _U2)
    if rest != user_post:
        raise TemplateTranslationError("the second user message ends differently from the first")
    # where an earlier reply's end stops and the next user message's start begins: after the end the last
    # reply has (ChatML, Llama 3, Qwen3), else after the end of a user message (gpt-oss: <|end|>, where the
    # last reply ends with <|return|>), else where the text stops being the first user message's start. Only
    # the Go template's look depends on it: each split renders the same text.
    for end in (last_post, user_post):
        if between.startswith(end) and first_pre.endswith(between[len(end) :]):
            assistant_post, user_pre = end, between[len(end) :]
            break
    else:
        user_pre = _common_suffix(first_pre, between)
        assistant_post = between[: len(between) - len(user_pre)]
    if not user_pre:
        raise TemplateTranslationError("the first user message starts differently from later ones")
    head = first_pre[: len(first_pre) - len(user_pre)]
    bos = getattr(tokenizer, "bos_token", None)
    if bos and head.startswith(bos):
        head = head[len(bos) :]
    thinking = None
    try:
        reasoned = render(
            [two[0], {"role": "assistant", "content": _A, "reasoning_content": _T, "thinking": _T}]
        )
    except Exception:  # noqa: BLE001 - a template that rejects the reasoning fields: it writes none
        reasoned = final
    if _T in reasoned:
        if not reasoned.startswith(user_only):
            raise TemplateTranslationError(
                "a reply's reasoning changes how the user message before it renders"
            )
        think_pre, rest = _split(reasoned[len(user_only) :], _T)
        think_post, rest = _split(rest, _A)
        thinking = (think_pre, think_post)
    system = None
    try:
        with_system = render([{"role": "system", "content": _S}, {"role": "user", "content": _U}])
    except Exception:  # noqa: BLE001 - a template that rejects system messages: no system piece
        with_system = None
    if with_system is not None and _S in with_system:
        if bos and with_system.startswith(bos):
            with_system = with_system[len(bos) :]
        system_pre, rest = _split(with_system, _S)
        suffix = user_pre + _U + user_post
        if not rest.endswith(suffix):
            raise TemplateTranslationError("a system message changes how the user message after it renders")
        # the head (a default system block, or text before every conversation) is replaced by a system
        # message's own text when the conversation opens with one
        system = (system_pre, rest[: len(rest) - len(suffix)])
    return Pieces(
        head=head,
        system=system,
        user=(user_pre, user_post),
        assistant=(assistant_pre, assistant_post),
        generation=generation,
        last=None if last_pre == assistant_pre else last_pre,
        thinking=thinking,
        no_think=no_think,
        effort=effort,
        end=last_post,
    )


def render_pieces(
    pieces: Pieces,
    messages: list[dict],
    generation: bool,
    think: bool | None = None,
    think_level: str | None = None,
) -> str:
    """What the Go template built by `go_template` renders for `messages` (Ollama's .Messages: a message's
    reasoning is its ``thinking``), `think` and `think_level` (the request's ``think``: a bool, or a level)."""
    opens_with_system = bool(messages) and messages[0]["role"] == "system" and pieces.system is not None
    out = [] if opens_with_system else [pieces.head]
    for i, message in enumerate(messages):
        last = i == len(messages) - 1
        role, content = message["role"], message["content"]
        if role == "system" and pieces.system is not None:
            out += [pieces.system[0], content, pieces.system[1]]
        elif role == "user":
            out += [pieces.user[0], content, pieces.user[1]]
            if last and generation:
                out.append(pieces.generation + (pieces.no_think if think is False else ""))
        elif role == "assistant":
            if last and message.get("thinking") and pieces.thinking is not None:
                out += [pieces.thinking[0], message["thinking"], pieces.thinking[1]]
            elif last and pieces.last is not None:
                out.append(pieces.last)
            else:
                out.append(pieces.assistant[0])
            out.append(content)
            if not last:
                out.append(pieces.assistant[1])
    text = "".join(out).replace(_DATE, time.strftime("%Y-%m-%d"))
    return text.replace(_EFFORT, think_level or pieces.effort or "")


def go_template(pieces: Pieces) -> str:
    """Ollama's TEMPLATE for `pieces`: a range over .Messages with one branch per role. No ``{{-``: the
    pieces' own newlines are kept exactly."""

    def literal(text: str) -> str:
        if "{{" in text or "}}" in text or '"""' in text:
            raise TemplateTranslationError(f'the template text {text!r} holds {{{{, }}}} or """')
        effort = f"{{{{ if $.ThinkLevel }}}}{{{{ $.ThinkLevel }}}}{{{{ else }}}}{pieces.effort}{{{{ end }}}}"
        return text.replace(_DATE, "{{ currentDate }}").replace(_EFFORT, effort)

    system = ""
    if pieces.system is not None:
        system = f'{{{{ if eq .Role "system" }}}}{literal(pieces.system[0])}{{{{ .Content }}}}{literal(pieces.system[1])}{{{{ else }}}}'
    head = literal(pieces.head)
    if head and pieces.system is not None:
        head = f'{{{{ if or (not .Messages) (ne (index .Messages 0).Role "system") }}}}{head}{{{{ end }}}}'
    # the text every reply opens with stays outside the branches, so the reasoning's branch opens with its own
    # tag (Ollama reads its thinking tags from the text around .Thinking: <think> and </think> for Qwen3)
    prefixes = [pieces.assistant[0], pieces.last, pieces.thinking and pieces.thinking[0]]
    shared = os.path.commonprefix([p for p in prefixes if p is not None])
    n = len(shared)
    reply = literal(pieces.assistant[0][n:])
    if pieces.last is not None:
        reply = f"{{{{ if $last }}}}{literal(pieces.last[n:])}{{{{ else }}}}{reply}{{{{ end }}}}"
    if pieces.thinking is not None:
        thought = f"{literal(pieces.thinking[0][n:])}{{{{ .Thinking }}}}{literal(pieces.thinking[1])}"
        reply = f"{{{{ if and $last .Thinking }}}}{thought}{{{{ else }}}}{reply}{{{{ end }}}}"
    reply = literal(shared) + reply
    reply_end = (
        f"{{{{ if not $last }}}}{literal(pieces.assistant[1])}{{{{ end }}}}" if pieces.assistant[1] else ""
    )
    prompt = literal(pieces.generation)
    if pieces.no_think:
        prompt += f"{{{{ if and $.IsThinkSet (not $.Think) }}}}{literal(pieces.no_think)}{{{{ end }}}}"
    return (
        head
        + "{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"
        + system
        + f'{{{{ if eq .Role "user" }}}}{literal(pieces.user[0])}{{{{ .Content }}}}{literal(pieces.user[1])}'
        f"{{{{ if $last }}}}{prompt}{{{{ end }}}}"
        f'{{{{ else if eq .Role "assistant" }}}}{reply}{{{{ .Content }}}}'
        f"{reply_end}{{{{ end }}}}" + ("{{ end }}" if pieces.system is not None else "") + "{{ end }}"
    )


def translate(tokenizer) -> tuple[str, Pieces]:
    """The Go template of the tokenizer's chat template, verified against it on several conversations: each
    ending with a user message (with the generation prompt), and each ending with a reply the model is to
    continue (the Jinja template's text up to the end-of-reply marker)."""
    pieces = measure(tokenizer)
    bos = getattr(tokenizer, "bos_token", None) or ""
    chat = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
    ]
    cases: list[tuple[list[dict], bool, dict]] = [
        ([{"role": "user", "content": "Hi"}], True, {}),
        (chat, True, {}),
    ]
    if pieces.system is not None:
        cases.append(([{"role": "system", "content": "Be brief."}, *chat], True, {}))
    if pieces.no_think:
        cases.append((chat, True, {"think": False}))
    if pieces.effort is not None:
        cases.append((chat, True, {"think_level": "high"}))
    answer = {"role": "assistant", "content": "6"}
    cases.append(([*chat, answer], False, {}))
    if pieces.thinking is not None:
        cases.append(([*chat, {**answer, "thinking": "3 and 3"}], False, {}))
    for messages, generation, options in cases:
        variables = {}
        if "think" in options:
            variables["enable_thinking"] = options["think"]
        if "think_level" in options:
            variables["reasoning_effort"] = options["think_level"]
        jinja_messages = [
            {**m, "reasoning_content": m["thinking"]} if "thinking" in m else m for m in messages
        ]
        want = _render(tokenizer, jinja_messages, generation, **variables)
        if bos and want.startswith(bos):
            want = want[len(bos) :]
        got = render_pieces(pieces, messages, generation, **options)
        continued = not generation and want.startswith(got) and want[len(got) :] == pieces.end
        if got != want and not continued:
            raise TemplateTranslationError(
                f"the chat template could not be translated faithfully: on {messages} ({options or 'defaults'}) it "
                f"renders {want!r}, the translation {got!r}."
            )
    return go_template(pieces), pieces


def stop_tokens(model, tokenizer) -> list[str]:
    """The strings that end an answer: the tokenizer's EOS and every EOS id of the generation config."""
    return [tokenizer.convert_ids_to_tokens(i) for i in stop_token_ids(base_model(model), tokenizer)]


def default_parameters(model) -> dict[str, object]:
    """Ollama PARAMETERs: greedy (temperature 0) unless the generation config samples; the context of the
    run (or of the model, capped at 4096)."""
    base = base_model(model)
    generation = getattr(base, "generation_config", None)
    sampling = bool(getattr(generation, "do_sample", False))
    parameters: dict[str, object] = {
        "temperature": float(getattr(generation, "temperature", 0.7) or 0.7) if sampling else 0.0
    }
    if sampling and getattr(generation, "top_p", None):
        parameters["top_p"] = float(generation.top_p)
    context = getattr(base, "max_seq_length", None) or min(int(base.config.max_position_embeddings), 4096)
    parameters["num_ctx"] = int(context)
    return parameters


# Ollama's Modelfile PARAMETERs (its docs' "Valid Parameters and Values", and the runner options of its API),
# each with the kind of value it takes and the range Ollama gives it (None: open). mirostat* are left out:
# Ollama deprecates them and ignores them with a warning.
PARAMETERS: dict[str, tuple[type, float | None, float | None]] = {
    "num_ctx": (int, 1, None),
    "num_predict": (int, -2, None),  # -1: no limit, -2: until the context is full
    "num_keep": (int, -1, None),
    "num_batch": (int, 1, None),
    "num_gpu": (int, -1, None),
    "num_thread": (int, 0, None),
    "repeat_last_n": (int, -1, None),  # -1: the whole context
    "repeat_penalty": (float, 0, None),
    "presence_penalty": (float, None, None),
    "frequency_penalty": (float, None, None),
    "temperature": (float, 0, None),
    "top_k": (int, 0, None),
    "top_p": (float, 0, 1),
    "min_p": (float, 0, 1),
    "typical_p": (float, 0, 1),
    "seed": (int, None, None),
    "stop": (str, None, None),  # a text, or a list of texts: one PARAMETER stop line each
}


def parameter_lines(parameters: Mapping | None) -> list[str]:
    """``PARAMETER name value`` lines for `parameters`, each name known to Ollama and each value of its kind
    and range; `SettingError` naming the parameter and the fix otherwise. Texts are quoted so that no value
    can end its line early (`modelfile_text`)."""
    if parameters is None:
        return []
    if not isinstance(parameters, Mapping):
        raise SettingError(
            f"parameters must be a dict of Ollama parameters, got {type(parameters).__name__}: "
            "e.g. parameters={'temperature': 0.7, 'num_ctx': 4096}."
        )
    lines = []
    for name, value in parameters.items():
        if name not in PARAMETERS:
            close = difflib.get_close_matches(str(name), PARAMETERS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise SettingError(
                f"parameters[{name!r}] is not an Ollama Modelfile parameter.{hint} Valid ones: "
                f"{', '.join(sorted(PARAMETERS))}."
            )
        kind, low, high = PARAMETERS[name]
        setting = f"parameters[{name!r}]"
        if kind is str:
            texts = [value] if isinstance(value, str) else value
            if not isinstance(texts, (list, tuple)) or not texts:
                raise SettingError(f"{setting} must be a text or a list of texts, got {value!r}.")
            lines += [f"PARAMETER {name} {modelfile_text(text, setting)}" for text in texts]
        elif kind is int:
            number = whole_number(setting, value, minimum=low, fix=f"Ollama's {name} is a whole number.")
            if high is not None and number > high:
                raise SettingError(f"{setting} must be at most {high}, got {number}.")
            lines.append(f"PARAMETER {name} {number}")
        else:
            number = real_number(setting, value, low=low, high=high, fix=f"Ollama's {name} is a number.")
            lines.append(f"PARAMETER {name} {number!r}")
    return lines


def modelfile_text(value, what: str, multiline: bool = False) -> str:
    """`value` quoted for a Modelfile so that Ollama reads back exactly `value` and nothing after it.

    Ollama's parser has no escape character: a value ends at a line break where its quotes are closed, and
    characters that are not printable are dropped. So a one-line value (a PARAMETER) holds no line break and
    is put in three double quotes where it holds a quote (in one pair otherwise); a multi-line one (SYSTEM,
    TEMPLATE) is put in three double quotes and may not hold three in a row; neither may hold a control or
    other unprintable character, which Ollama would drop without a word. `what` names the value in errors."""
    if not isinstance(value, str):
        raise SettingError(f"{what} must be a text, got {value!r} ({type(value).__name__}).")
    allowed = "\t\n\r" if multiline else "\t"
    bad = next((c for c in value if not c.isprintable() and c not in allowed), None)
    if bad is not None:
        kind = "a line break" if bad in "\n\r" else f"the unprintable character {bad!r} (U+{ord(bad):04X})"
        where = " (a PARAMETER value is one line)" if bad in "\n\r" else ""
        raise SettingError(
            f"{what} holds {kind}{where}, which an Ollama Modelfile cannot hold: {value!r}. Fix: remove it."
        )
    if multiline:
        if '"""' in value:
            raise SettingError(f'{what} holds """, which would end its block in the Modelfile: {value!r}.')
        return f'"""{value}"""'
    return f'"""{value}"""' if '"' in value else f'"{value}"'


def modelfile(
    model, tokenizer, gguf_name: str, parameters: dict | None = None, system: str | None = None
) -> str:
    """The Modelfile text: FROM the GGUF file, TEMPLATE, a PARAMETER stop per stop token, the parameters.

    `parameters` are Ollama's (`PARAMETERS`: each value of its kind and range; a ``stop`` adds to the
    tokenizer's), replacing the defaults of the same name; `system` a default system prompt. No value can add a
    line of its own (`modelfile_text`).

    A chat template without a faithful translation (`translate` raises) leaves the TEMPLATE out, with a
    warning and a comment in the Modelfile saying what to do: the GGUF file holds the chat template, from
    which Ollama picks one of its own."""
    user_lines = parameter_lines(parameters)
    system_text = None if system is None else modelfile_text(system, "system", multiline=True)
    lines = [f"FROM {gguf_name}"]
    try:
        template, _ = translate(tokenizer)
    except TemplateTranslationError as error:
        note = (
            f"fastft could not translate the chat template to Ollama's template language ({error}). The GGUF "
            "file holds the chat template (tokenizer.chat_template), from which Ollama picks a template of its "
            "own: after `ollama create`, compare `ollama show NAME --template` with the chat template, and if "
            'they differ add TEMPLATE """...""" here by hand (see docs/template.md in github.com/ollama/ollama).'
        )
        warnings.warn(note, stacklevel=2)
        lines += ["# " + line for line in _wrap(note)]
    else:
        lines.append(f"TEMPLATE {modelfile_text(template, 'the translated chat template', True)}")
    if system:
        lines.append(f"SYSTEM {system_text}")
    for token in stop_tokens(model, tokenizer):
        lines.append(f"PARAMETER stop {modelfile_text(token, f'the stop token {token!r}')}")
    given = {name for name in (parameters or {}) if name != "stop"}
    defaults = {name: value for name, value in default_parameters(model).items() if name not in given}
    lines += parameter_lines(defaults) + user_lines
    return "\n".join(lines) + "\n"


def _wrap(text: str, width: int = 100) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line]

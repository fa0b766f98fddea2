"""An Ollama ``Modelfile`` from the tokenizer: the chat template translated to Ollama's (Go) template
language, the stop tokens and default parameters.

A Jinja chat template cannot be translated in general, so the translation is measured, not parsed: the
template renders conversations holding marker strings, and the text around each marker gives the pieces
(what comes before and after a system, user and assistant message, and the generation prompt). The Go
template is built from those pieces; `render_pieces` renders the same pieces in Python, and `translate`
keeps the translation only if that rendering equals the Jinja template's on several conversations
(with and without a system message, one and several turns). A template whose messages depend on each
other in other ways (a default system prompt injected, tool calls) fails with `TemplateTranslationError`,
and ``save_ollama(..., parameters=...)`` still works after the user writes the TEMPLATE by hand.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass

from fastft.checks import SettingError, real_number, whole_number

_S, _U, _A, _U2, _A2 = (
    "⟦fastft-system⟧",
    "⟦fastft-user⟧",
    "⟦fastft-assistant⟧",
    "⟦fastft-user2⟧",
    "⟦fastft-assistant2⟧",
)


class TemplateTranslationError(ValueError):
    """The chat template has no faithful Ollama translation; the message says which conversation differed."""


@dataclass(frozen=True)
class Pieces:
    """The literal text around each message of a chat template (see the module doc)."""

    head: str  # before the first message unless it is a system one with its own piece (a default system
    # block, or ""; BOS excluded: llama.cpp adds it)
    system: tuple[str, str] | None  # before / after a system message's content; None: no system role
    user: tuple[str, str]
    assistant: tuple[str, str]
    generation: str  # after the last user message, when the model is to answer


def _render(tokenizer, messages: list[dict], generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _split(text: str, marker: str) -> tuple[str, str]:
    if text.count(marker) != 1:
        raise TemplateTranslationError(
            f"the chat template does not render each message's content once ({marker})"
        )
    before, _, after = text.partition(marker)
    return before, after


def measure(tokenizer) -> Pieces:
    """The `Pieces` of the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateTranslationError("the tokenizer has no chat template to translate")
    user_only = _render(tokenizer, [{"role": "user", "content": _U}], False)
    with_generation = _render(tokenizer, [{"role": "user", "content": _U}], True)
    if not with_generation.startswith(user_only):
        raise TemplateTranslationError("the generation prompt is not appended after the last message")
    generation = with_generation[len(user_only) :]
    first_pre, user_post = _split(user_only, _U)
    two = [{"role": "user", "content": _U}, {"role": "assistant", "content": _A}]
    after_answer = _render(tokenizer, two, False)
    if not after_answer.startswith(user_only):
        raise TemplateTranslationError("an assistant message changes how the user message before it renders")
    assistant = _split(after_answer[len(user_only) :], _A)
    three = _render(tokenizer, [*two, {"role": "user", "content": _U2}], False)
    if not three.startswith(after_answer):
        raise TemplateTranslationError("a later user message changes how the earlier messages render")
    user_pre, rest = _split(three[len(after_answer) :], _U2)
    if rest != user_post:
        raise TemplateTranslationError("the second user message ends differently from the first")
    if not first_pre.endswith(user_pre):
        raise TemplateTranslationError("the first user message starts differently from later ones")
    head = first_pre[: len(first_pre) - len(user_pre)]
    bos = getattr(tokenizer, "bos_token", None)
    if bos and head.startswith(bos):
        head = head[len(bos) :]
    system = None
    try:
        with_system = _render(
            tokenizer, [{"role": "system", "content": _S}, {"role": "user", "content": _U}], False
        )
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
        head=head, system=system, user=(user_pre, user_post), assistant=assistant, generation=generation
    )


def render_pieces(pieces: Pieces, messages: list[dict], generation: bool) -> str:
    """What the Go template built by `go_template` renders for `messages` (Ollama's .Messages)."""
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
                out.append(pieces.generation)
        elif role == "assistant":
            out += [pieces.assistant[0], content]
            if not last:
                out.append(pieces.assistant[1])
    return "".join(out)


def go_template(pieces: Pieces) -> str:
    """Ollama's TEMPLATE for `pieces`: a range over .Messages with one branch per role. No ``{{-``: the
    pieces' own newlines are kept exactly."""

    def literal(text: str) -> str:
        if "{{" in text or "}}" in text or '"""' in text:
            raise TemplateTranslationError(f'the template text {text!r} holds {{{{, }}}} or """')
        return text

    system = ""
    if pieces.system is not None:
        system = f'{{{{ if eq .Role "system" }}}}{literal(pieces.system[0])}{{{{ .Content }}}}{literal(pieces.system[1])}{{{{ else }}}}'
    head = literal(pieces.head)
    if head and pieces.system is not None:
        head = f'{{{{ if or (not .Messages) (ne (index .Messages 0).Role "system") }}}}{head}{{{{ end }}}}'
    return (
        head
        + "{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"
        + system
        + f'{{{{ if eq .Role "user" }}}}{literal(pieces.user[0])}{{{{ .Content }}}}{literal(pieces.user[1])}'
        f"{{{{ if $last }}}}{literal(pieces.generation)}{{{{ end }}}}"
        f'{{{{ else if eq .Role "assistant" }}}}{literal(pieces.assistant[0])}{{{{ .Content }}}}'
        f"{{{{ if not $last }}}}{literal(pieces.assistant[1])}{{{{ end }}}}{{{{ end }}}}"
        + ("{{ end }}" if pieces.system is not None else "")
        + "{{ end }}"
    )


def translate(tokenizer) -> tuple[str, Pieces]:
    """The Go template of the tokenizer's chat template, verified against it on several conversations."""
    pieces = measure(tokenizer)
    bos = getattr(tokenizer, "bos_token", None) or ""
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3?"},
        ],
    ]
    if pieces.system is not None:
        conversations.append([{"role": "system", "content": "Be brief."}, *conversations[1]])
    for messages in conversations:
        want = _render(tokenizer, messages, True)
        if bos and want.startswith(bos):
            want = want[len(bos) :]
        got = render_pieces(pieces, messages, True)
        if got != want:
            raise TemplateTranslationError(
                f"the chat template could not be translated faithfully: on {messages} it renders {want!r}, the "
                f"translation {got!r}. Write the Modelfile's TEMPLATE by hand."
            )
    return go_template(pieces), pieces


def stop_tokens(model, tokenizer) -> list[str]:
    """The strings that end an answer: the tokenizer's EOS and every EOS id of the generation config."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    extra = getattr(getattr(base, "generation_config", None), "eos_token_id", None)
    for token_id in extra if isinstance(extra, (list, tuple)) else [extra]:
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return [tokenizer.convert_ids_to_tokens(int(i)) for i in ids]


def default_parameters(model) -> dict[str, object]:
    """Ollama PARAMETERs: greedy (temperature 0) unless the generation config samples; the context of the
    run (or of the model, capped at 4096)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
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
    line of its own (`modelfile_text`)."""
    user_lines = parameter_lines(parameters)
    system_text = None if system is None else modelfile_text(system, "system", multiline=True)
    template, _ = translate(tokenizer)
    lines = [
        f"FROM {gguf_name}",
        f"TEMPLATE {modelfile_text(template, 'the translated chat template', True)}",
    ]
    if system:
        lines.append(f"SYSTEM {system_text}")
    for token in stop_tokens(model, tokenizer):
        lines.append(f"PARAMETER stop {modelfile_text(token, f'the stop token {token!r}')}")
    given = {name for name in (parameters or {}) if name != "stop"}
    defaults = {name: value for name, value in default_parameters(model).items() if name not in given}
    lines += parameter_lines(defaults) + user_lines
    return "\n".join(lines) + "\n"

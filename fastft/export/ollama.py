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

from dataclasses import dataclass

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


def modelfile(
    model, tokenizer, gguf_name: str, parameters: dict | None = None, system: str | None = None
) -> str:
    """The Modelfile text: FROM the GGUF file, TEMPLATE, a PARAMETER stop per stop token, the parameters."""
    template, _ = translate(tokenizer)
    lines = [f"FROM {gguf_name}", f'TEMPLATE """{template}"""']
    if system:
        if '"""' in system:
            raise ValueError('the system prompt may not contain """')
        lines.append(f'SYSTEM """{system}"""')
    for token in stop_tokens(model, tokenizer):
        lines.append(f"PARAMETER stop {_quote(token)}")
    for key, value in {**default_parameters(model), **(parameters or {})}.items():
        lines.append(f"PARAMETER {key} {value}")
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

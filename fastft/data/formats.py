"""Row formats fastft understands, and how each becomes the normalised schema.

A normalised row is either a chat, ``{"messages": [{"role": ..., "content": ...}, ...]}`` with
roles in ``system``/``user``/``assistant``/``tool``, or plain text, ``{"text": ...}``.

Formats:

* ``alpaca``: ``instruction``, optional ``input``, ``output``, optional ``system``.
* ``sharegpt``: ``conversations``, a list of ``{"from": "human"|"gpt"|..., "value": ...}``, and an
  optional top-level ``system`` string.
* ``messages``: ``messages`` (or ``conversations``) as a list of ``{"role": ..., "content": ...}``.
* ``text``: a ``text`` string.
* ``preference``: ``chosen`` and ``rejected`` (strings, or lists of messages), with an optional ``prompt``
  (a string, or a list of messages). Chat lists that repeat the prompt (UltraFeedback-binarized: each side is
  the whole conversation) keep only what follows it; without ``prompt`` the two sides' common leading
  messages are the prompt. Normalised to one ``pair`` field, ``{"prompt": [...], "chosen": [...],
  "rejected": [...]}``, each a list of messages (`fastft.data.pairs`).

Each ``from_*`` function takes one row (a mapping) and returns only the normalised field
(``{"messages": [...]}`` or ``{"text": ...}``); it raises `FastftDataError` with a reason (no
location: the loader adds the file and line). Keys other than those in `consumed_fields` are
the row's extra columns, which the loader keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .errors import FastftDataError

__all__ = [
    "FORMATS",
    "ROLES",
    "SHAREGPT_ROLES",
    "consumed_fields",
    "converter",
    "describe",
    "detect_format",
    "from_alpaca",
    "from_messages",
    "from_sharegpt",
    "from_preference",
    "from_text",
    "output_column",
]

FORMATS: tuple[str, ...] = ("alpaca", "sharegpt", "messages", "text", "preference")
"""Format names accepted by ``load_dataset(format=...)`` besides ``"auto"``."""

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")
"""Roles allowed in a normalised chat."""

SHAREGPT_ROLES: dict[str, str] = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}
"""ShareGPT ``from`` values and the role each becomes."""

_MAPPING = (dict, Mapping)  # dict first: isinstance against the Mapping ABC alone is slow per message
_MESSAGE_RULE = 'each message needs "role" and "content" strings'
_SHAREGPT_RULE = 'each sharegpt turn needs "from" and "value" strings'
_EXPECTED = {
    "alpaca": "alpaca rows need 'instruction' and 'output' strings, optionally 'input' and 'system'",
    "sharegpt": 'sharegpt rows need \'conversations\', a list of {"from": ..., "value": ...}',
    "messages": "messages rows need 'messages' (or 'conversations'), a list of {\"role\": ..., \"content\": ...}",
    "text": "text rows need a 'text' string",
    "preference": "preference rows need 'chosen' and 'rejected' (strings or lists of messages) and optionally "
    "'prompt' (a string or a list of messages)",
}


def describe(value: Any) -> str:
    """Name a value's type the way a JSON user thinks of it: 'a string', 'a number', 'null'..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"


def _missing(field: str, fmt: str) -> FastftDataError:
    return FastftDataError(f"no '{field}' field, which the {fmt} format needs ({_EXPECTED[fmt]})")


def _require_str(row: Mapping[str, Any], field: str, fmt: str) -> str:
    if field not in row:
        raise _missing(field, fmt)
    value = row[field]
    if not isinstance(value, str):
        raise FastftDataError(f"'{field}' is {describe(value)}, not a string ({_EXPECTED[fmt]})")
    return value


def _optional_str(row: Mapping[str, Any], field: str, fmt: str) -> str | None:
    value = row.get(field)
    if value is None:
        return None
    if not isinstance(value, str):
        raise FastftDataError(f"'{field}' is {describe(value)}, not a string or null ({_EXPECTED[fmt]})")
    return value if value.strip() else None


def _turn_list(row: Mapping[str, Any], field: str) -> list:
    turns = row[field]
    if not isinstance(turns, (list, tuple)):
        raise FastftDataError(f"'{field}' is {describe(turns)}, not a list of messages")
    if not turns:
        raise FastftDataError(f"'{field}' is an empty list (a chat row needs at least one message)")
    return list(turns)


def from_alpaca(row: Mapping[str, Any]) -> dict[str, list[dict[str, str]]]:
    """Alpaca row to chat: [system?] user(instruction, then a blank line and input if any), assistant(output)."""
    instruction = _require_str(row, "instruction", "alpaca")
    output = _require_str(row, "output", "alpaca")
    extra_input = _optional_str(row, "input", "alpaca")
    system = _optional_str(row, "system", "alpaca")
    user = f"{instruction}\n\n{extra_input}" if extra_input is not None else instruction
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": user})
    messages.append({"role": "assistant", "content": output})
    return {"messages": messages}


def from_sharegpt(row: Mapping[str, Any]) -> dict[str, list[dict[str, str]]]:
    """ShareGPT row to chat: map each turn's ``from`` through `SHAREGPT_ROLES`; keep ``value`` as content.

    A top-level ``system`` string becomes a leading system message unless the conversation has one.
    """
    if "conversations" not in row:
        raise _missing("conversations", "sharegpt")
    turns = _turn_list(row, "conversations")
    messages = []
    for i, turn in enumerate(turns, 1):
        if not isinstance(turn, _MAPPING):
            raise FastftDataError(
                f"turn {i} of 'conversations' is {describe(turn)}, not an object ({_SHAREGPT_RULE})"
            )
        if "from" not in turn:
            hint = "; it has 'role', so use format='messages'" if "role" in turn else ""
            raise FastftDataError(f"turn {i} of 'conversations' has no 'from' ({_SHAREGPT_RULE}{hint})")
        source = turn["from"]
        if not isinstance(source, str):
            raise FastftDataError(f"turn {i} 'from' is {describe(source)}, not a string ({_SHAREGPT_RULE})")
        role = SHAREGPT_ROLES.get(source.strip().lower())
        if role is None:
            valid = ", ".join(SHAREGPT_ROLES)
            raise FastftDataError(f"turn {i} has unknown 'from' value {source!r} (valid values: {valid})")
        if "value" not in turn:
            raise FastftDataError(f"{source} turn has no 'value' ({_SHAREGPT_RULE})")
        value = turn["value"]
        if not isinstance(value, str):
            raise FastftDataError(
                f"{source} turn 'value' is {describe(value)}, not a string ({_SHAREGPT_RULE})"
            )
        messages.append({"role": role, "content": value})
    system = _optional_str(row, "system", "sharegpt")
    if system is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return {"messages": messages}


def from_messages(row: Mapping[str, Any]) -> dict[str, list[dict[str, str]]]:
    """Chat row (``messages``, or ``conversations`` with role/content) to chat, checking every message.

    Only ``role`` and ``content`` are kept from each message; other keys (``name``, ``weight``...) are dropped.
    """
    field = "messages" if "messages" in row else "conversations"
    if field not in row:
        raise _missing("messages", "messages")
    messages = []
    for i, message in enumerate(_turn_list(row, field), 1):
        if not isinstance(message, _MAPPING):
            raise FastftDataError(f"message {i} is {describe(message)}, not an object ({_MESSAGE_RULE})")
        if "role" not in message:
            hint = "; it has 'from', so use format='sharegpt'" if "from" in message else ""
            raise FastftDataError(f"message {i} has no 'role' ({_MESSAGE_RULE}{hint})")
        role = message["role"]
        if not isinstance(role, str):
            raise FastftDataError(f"message {i} 'role' is {describe(role)}, not a string ({_MESSAGE_RULE})")
        if role not in ROLES:
            raise FastftDataError(f"message {i} has unknown role {role!r} (valid roles: {', '.join(ROLES)})")
        if "content" not in message:
            raise FastftDataError(f"{role} message has no 'content' ({_MESSAGE_RULE})")
        content = message["content"]
        if not isinstance(content, str):
            hint = "; content lists (multimodal parts) are not supported" if isinstance(content, list) else ""
            raise FastftDataError(
                f"{role} message 'content' is {describe(content)}, not a string ({_MESSAGE_RULE}{hint})"
            )
        messages.append({"role": role, "content": content})
    return {"messages": messages}


def from_text(row: Mapping[str, Any]) -> dict[str, str]:
    """Text row: the ``text`` string as is."""
    return {"text": _require_str(row, "text", "text")}


def _side(row: Mapping[str, Any], field: str, default_role: str) -> list[dict[str, str]]:
    """One field of a preference row as messages: a string is one `default_role` message."""
    if field not in row or row[field] is None:
        raise _missing(field, "preference")
    value = row[field]
    if isinstance(value, str):
        if not value.strip():
            raise FastftDataError(f"'{field}' is an empty string ({_EXPECTED['preference']})")
        return [{"role": default_role, "content": value}]
    if not isinstance(value, (list, tuple)):
        raise FastftDataError(f"'{field}' is {describe(value)}, not a string or a list of messages")
    try:
        return from_messages({"messages": value})["messages"]
    except FastftDataError as e:
        raise FastftDataError(f"'{field}': {e}") from None


def from_preference(row: Mapping[str, Any]) -> dict[str, dict[str, list[dict[str, str]]]]:
    """Preference row to ``{"pair": {"prompt": [...], "chosen": [...], "rejected": [...]}}``.

    Each response must be non-empty and end with an assistant message; the prompt must end with a user
    (or tool) message, so the responses are what the model says next."""
    chosen = _side(row, "chosen", "assistant")
    rejected = _side(row, "rejected", "assistant")
    if row.get("prompt") is not None:
        prompt = _side(row, "prompt", "user")
        for side in (chosen, rejected):
            if len(side) > len(prompt) and side[: len(prompt)] == prompt:
                side[:] = side[len(prompt) :]  # the side repeats the conversation: keep the answer
    else:
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not prompt:
            raise FastftDataError(
                "no 'prompt' field, and 'chosen' and 'rejected' share no leading messages to take as the "
                "prompt: add a 'prompt' (a string or a list of messages)"
            )
    if prompt[-1]["role"] not in ("user", "tool"):
        raise FastftDataError(
            f"the prompt ends with a {prompt[-1]['role']} message: it must end with a user (or tool) message, "
            "so that chosen and rejected are the answers to it"
        )
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        if side[-1]["role"] != "assistant" or any(m["role"] == "system" for m in side):
            raise FastftDataError(f"'{name}' must be the assistant's answer (end with an assistant message)")
        if not any(m["content"].strip() for m in side if m["role"] == "assistant"):
            raise FastftDataError(f"'{name}' is an empty answer")
    return {"pair": {"prompt": prompt, "chosen": chosen, "rejected": rejected}}


_CONVERTERS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "alpaca": from_alpaca,
    "sharegpt": from_sharegpt,
    "messages": from_messages,
    "text": from_text,
    "preference": from_preference,
}
_CONSUMED: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "input", "output", "system"),
    "sharegpt": ("conversations", "system"),
    "messages": ("messages",),
    "text": ("text",),
    "preference": ("prompt", "chosen", "rejected"),
}


def converter(fmt: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The ``from_*`` function of a format name; unknown names raise `FastftDataError` listing the valid ones."""
    try:
        return _CONVERTERS[fmt]
    except (KeyError, TypeError):
        valid = ", ".join(("auto", *FORMATS))
        raise FastftDataError(f"unknown format {fmt!r}; valid formats: {valid}") from None


def output_column(fmt: str) -> str:
    """The normalised column a format produces: ``"text"`` for text, ``"pair"`` for preference rows, else
    ``"messages"``."""
    return {"text": "text", "preference": "pair"}.get(fmt, "messages")


def consumed_fields(fmt: str, row: Mapping[str, Any]) -> tuple[str, ...]:
    """Fields of `row` that a format turns into the normalised column; the rest are kept as extra columns.

    The output column is always included, so an existing column of that name is replaced, not duplicated.
    """
    if fmt == "messages" and "messages" not in row:
        return ("conversations", "messages")
    return (*_CONSUMED[fmt], output_column(fmt))


def detect_format(row: Mapping[str, Any]) -> str:
    """Guess the format of one row from its fields.

    ``chosen`` with ``rejected`` (preference) wins, then ``messages``, then ``conversations`` (sharegpt when its first turn has ``from``/``value``, messages
    when it has ``role``/``content``), then ``instruction`` (alpaca), then ``text``. Fields whose value is
    None count as absent. A row that fits none raises `FastftDataError` naming its fields and the expected
    ones.
    """
    if not isinstance(row, Mapping):
        raise FastftDataError(f"a row must be an object with named fields, not {describe(row)}")
    row = {k: v for k, v in row.items() if v is not None}  # a dataset column that is null here is absent
    if "chosen" in row and "rejected" in row:  # before messages: preference sets often carry one too
        return "preference"
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        turns = row["conversations"]
        first = turns[0] if isinstance(turns, (list, tuple)) and turns else None
        if isinstance(first, Mapping) and ("role" in first or "content" in first) and "from" not in first:
            return "messages"
        return "sharegpt"
    if "instruction" in row:
        return "alpaca"
    if "text" in row:
        return "text"
    fields = ", ".join(repr(k) for k in list(row)[:12]) or "none"
    raise FastftDataError(
        f"can't tell the format of a row with fields {fields}; expected 'messages' (chat), "
        "'conversations' (sharegpt), 'instruction' and 'output' (alpaca), 'text', or 'chosen' and "
        "'rejected' (preference pairs). "
        "Rename the fields, or pass format= explicitly"
    )

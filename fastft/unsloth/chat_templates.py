"""Unsloth's ``unsloth.chat_templates`` under the same names and arguments, so a notebook switches with one
import::

    from fastft.unsloth.chat_templates import get_chat_template, train_on_responses_only

- `get_chat_template(tokenizer, chat_template="llama-3.1", mapping=…, map_eos_token=…, system_message=…)`
  gives the tokenizer one of the family templates of `fastft.data.chat_templates` (Unsloth's names), and
  makes the template's end-of-turn marker the EOS where Unsloth does (ChatML and the Gemma templates).
- `train_on_responses_only(trainer)` masks the labels of the trainer's tokenized datasets so only the
  assistant's replies train. Without ``instruction_part`` / ``response_part`` the two markers are read off
  the tokenizer's chat template (`response_parts`), as Unsloth does.
- `standardize_sharegpt` / `standardize_data_formats`, `to_sharegpt`, `apply_chat_template` and
  `remove_special_tokens`, the dataset helpers Unsloth keeps in this module, live in
  `fastft.unsloth.conversations` and are re-exported here.

Where fastft's result differs from Unsloth's, the docstring says so (and a warning says it once at run time).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass

from tokenizers import Tokenizer
from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

from fastft.data.chat_templates import (
    DEFAULT_MAPPING,
    TEMPLATES,
    ChatTemplateError,
    mapped,
    resolve_template,
    template_names,
)
from fastft.unsloth.conversations import (
    apply_chat_template,
    remove_special_tokens,
    standardize_data_formats,
    standardize_sharegpt,
    to_sharegpt,
)

IGNORE_INDEX = -100  # the label PyTorch's cross-entropy and every HF trainer skip


# ---------------------------------------------------------------------------------------------- templates


def get_chat_template(
    tokenizer,
    chat_template: str | tuple[str, str] = "chatml",
    mapping: dict | None = None,
    map_eos_token: bool = True,
    system_message: str | None = None,
    patch_saving: bool = True,
    use_zoo_tokenizer_patch: bool = False,
):
    """Give `tokenizer` the chat template `chat_template` and return it, as Unsloth's function does.

    `chat_template`: a name of `fastft.data.chat_templates.TEMPLATES` or `ALIASES` ("llama-3.1", "qwen3",
    "qwen3-instruct", "gemma-3", "phi-4", "mistral", "chatml", "alpaca", "gpt-oss", …), or a
    ``(jinja, end_of_turn)`` pair of one's own (``"eos_token"`` as the end: the tokenizer's EOS).
    `mapping`: which message keys hold the role and the content and which role values mean user and
    assistant (ShareGPT: ``{"role": "from", "content": "value", "user": "human", "assistant": "gpt"}``);
    messages already in role / content form still render. `system_message` replaces the default system
    message of the templates that have one (alpaca, vicuna, unsloth, llama-3.1, qwen-2.5).

    EOS, as Unsloth: for a named template `map_eos_token` is the template's own choice (True for ChatML and
    the Gemma templates, False for the others, whatever is passed); for a pair it is the argument. When it
    holds, the end-of-turn marker becomes the tokenizer's ``eos_token``: a tokenizer without that token has
    its EOS token renamed to it (same id, so the model's embeddings and ``eos_token_id`` stay). One
    difference: where the tokenizer already has the marker as a token, fastft makes that token the EOS,
    while Unsloth swaps the two tokens' names so the EOS keeps its id. A template whose end-of-turn marker is
    not a token of the tokenizer writes it as plain text (as Unsloth does): a warning says so, since the
    model then never learns a single token that stops generation. `patch_saving` and
    `use_zoo_tokenizer_patch` are accepted for Unsloth's signature; they change nothing here.
    """
    if not isinstance(map_eos_token, bool):
        raise TypeError(f"get_chat_template: map_eos_token must be True or False, got {map_eos_token!r}.")
    is_gemma = type(tokenizer).__name__.startswith("Gemma")
    renames: tuple[tuple[str, str], ...] = ()
    if isinstance(chat_template, (tuple, list)):
        if len(chat_template) != 2 or not all(isinstance(part, str) for part in chat_template):
            raise TypeError(
                "get_chat_template: a custom chat_template is a (jinja_template, end_of_turn) pair."
            )
        jinja, stop = chat_template
        end = None if stop == "eos_token" else stop
        map_eos = map_eos_token and end is not None
    elif isinstance(chat_template, str):
        name = "gemma_chatml" if is_gemma and chat_template.strip().lower() == "chatml" else chat_template
        template = resolve_template(name)
        if system_message is not None and template.default_system is None:
            warnings.warn(
                f"get_chat_template: the {template.name} template has no default system message, so "
                "system_message is ignored: put the system message in your data.",
                stacklevel=2,
            )
        jinja, end, map_eos, renames = (
            template.text(system_message),
            template.end,
            template.map_eos_token,
            template.renames,
        )
    else:
        raise TypeError(
            "get_chat_template: chat_template is a template name or a (jinja_template, end_of_turn) pair; "
            f"the names are {', '.join(template_names())}."
        )
    if is_gemma and not jinja.lstrip().startswith(("{{ bos_token }}", "{{- bos_token", "{{bos_token}}")):
        jinja = "{{- bos_token -}}" + jinja  # Gemma needs its BOS, or the loss starts far too high
    for old, new in renames:
        _rename_token(tokenizer, old, new)
    if map_eos and end is not None:
        _make_eos(tokenizer, end)
    tokenizer.chat_template = mapped(jinja, mapping)
    if end is not None and end not in tokenizer.get_vocab():
        warnings.warn(
            f"get_chat_template: this tokenizer has no {end!r} token, so the template writes that end-of-turn "
            "marker as plain text (as Unsloth does) and the model never learns one token to stop at. Use the "
            "template of the model's family, or 'chatml' (which makes the EOS its marker).",
            stacklevel=2,
        )
    tokenizer._system_message = system_message
    return tokenizer


def _make_eos(tokenizer, marker: str) -> None:
    """Make `marker` the tokenizer's EOS: the existing token of that name, or the EOS token renamed."""
    old = tokenizer.eos_token
    if old == marker:
        return
    if marker in tokenizer.get_vocab() or old is None:
        if marker not in tokenizer.get_vocab():
            tokenizer.add_special_tokens({"eos_token": marker})
        tokenizer.eos_token = marker
        return
    _rename_token(tokenizer, old, marker)


def _rename_token(tokenizer, old: str, new: str) -> None:
    """Rename token `old` to `new` in a fast tokenizer, keeping its id (Unsloth's way of giving a model a
    new end-of-turn token without new embeddings). Special-token attributes naming `old` follow."""
    vocab = tokenizer.get_vocab()
    if new in vocab:
        return
    if old not in vocab:
        raise ChatTemplateError(
            f"get_chat_template: {old!r} is not a token of this tokenizer, so it cannot become {new!r}."
        )
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ChatTemplateError(
            f"get_chat_template: renaming {old!r} to {new!r} needs a fast tokenizer (load it with use_fast=True)."
        )

    data = json.loads(backend.to_str())
    for token in data.get("added_tokens", []):
        if token["content"] == old:
            token["content"] = new
    model_vocab = data["model"].get("vocab")
    if isinstance(model_vocab, dict) and old in model_vocab:
        model_vocab[new] = model_vocab.pop(old)
    elif isinstance(model_vocab, list):  # Unigram: [piece, score] pairs
        data["model"]["vocab"] = [
            [new, score] if piece == old else [piece, score] for piece, score in model_vocab
        ]
    data["post_processor"] = _replaced(data.get("post_processor"), old, new)
    tokenizer._tokenizer = Tokenizer.from_str(json.dumps(data))
    for attribute in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if getattr(tokenizer, attribute, None) == old:
            setattr(tokenizer, attribute, new)


def _replaced(value, old: str, new: str):
    if isinstance(value, dict):
        return {(new if k == old else k): _replaced(v, old, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_replaced(v, old, new) for v in value]
    return new if value == old else value


# ---------------------------------------------------------------------------------- responses-only training


@dataclass(frozen=True)
class ResponseParts:
    """The markers that open a user turn (`instruction_part`) and an assistant turn (`response_part`), as
    text and as the token ids they have inside a rendered conversation."""

    instruction_part: str
    response_part: str
    instruction_ids: list[int]
    response_ids: list[int]


_PROBES = ("fastftprobeuserone", "fastftprobereplyone", "fastftprobeusertwo", "fastftprobereplytwo")


def response_parts(tokenizer) -> ResponseParts:
    """Read the user and assistant turn markers off `tokenizer`'s chat template.

    A probe conversation (user, assistant, user, assistant) is rendered; the text between a reply's end and
    the next user message, less the reply's own end-of-turn text, opens a user turn (``"<|im_start|>user\\n"``);
    the text between a user message's end and the reply, less the user turn's own end, opens an assistant
    turn (``"<|im_start|>assistant\\n"``; for a template where the user turn's end opens the reply, as
    Mistral's ``[/INST]``, that end). Reasoning scaffolding a template adds to the last reply only (Qwen3's
    empty ``<think></think>``) is not part of the marker, so it trains with the reply. The token ids are
    those the markers have inside the rendered text, so whitespace merged into a neighbouring token never
    makes a marker unmatchable.
    """
    u1, a1, u2, a2 = _PROBES
    turns = [("user", u1), ("assistant", a1), ("user", u2), ("assistant", a2)]
    try:
        text = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in turns], tokenize=False, add_generation_prompt=False
        )
        alone = tokenizer.apply_chat_template(
            [{"role": "user", "content": u1}], tokenize=False, add_generation_prompt=False
        )
    except Exception as error:  # noqa: BLE001 - any template failure means: the markers must be given
        raise ValueError(
            f"train_on_responses_only: the tokenizer's chat template cannot render a user/assistant probe ({error}), "
            "so the markers cannot be read off it: pass instruction_part=... and response_part=... (the text that "
            "opens a user turn and an assistant turn)."
        ) from None
    spans, cursor = {}, 0
    for _, probe in turns:
        start = text.find(probe, cursor)
        if start < 0 or text.count(probe) != 1:
            raise ValueError(
                "train_on_responses_only: the chat template does not render each message once, so the markers "
                "cannot be read off it: pass instruction_part=... and response_part=...."
            )
        spans[probe] = (start, start + len(probe))
        cursor = start + len(probe)
    user_end = alone[alone.index(u1) + len(u1) :] if u1 in alone else ""
    reply_end = text[spans[a2][1] :]
    # the user marker: between the first reply and the second user message, less the reply's end
    between = text[spans[a1][1] : spans[u2][0]]
    if user_end.strip() and between.lstrip().startswith(user_end.strip()):  # a reply ends as a user turn does
        instruction = between.lstrip()[len(user_end.strip()) :]
    else:
        instruction = between[len(_common_prefix(between, reply_end)) :]
    instruction = instruction.lstrip()
    instruction_start = spans[u2][0] - len(instruction)
    # the assistant marker: between each user message and its reply, less the user turn's end
    gaps = [(spans[u][1], text[spans[u][1] : spans[a][0]]) for u, a in ((u1, a1), (u2, a2))]
    cut = len(_common_prefix(gaps[0][1], user_end))
    response = _common_prefix(gaps[0][1][cut:], gaps[1][1][len(_common_prefix(gaps[1][1], user_end)) :])
    if not response.strip():  # nothing of its own opens a reply: the user turn's end does ("[/INST]")
        cut, response = 0, gaps[0][1]
    stripped = response.lstrip()
    response_start = gaps[0][0] + cut + len(response) - len(stripped)
    if not instruction.strip() or not stripped.strip():
        raise ValueError(
            "train_on_responses_only: the chat template writes nothing between turns to tell user and assistant "
            "apart: pass instruction_part=... and response_part=...."
        )
    instruction_ids, instruction = _ids_inside(
        tokenizer, text, instruction_start, instruction_start + len(instruction)
    )
    response_ids, response = _ids_inside(tokenizer, text, response_start, response_start + len(stripped))
    return ResponseParts(instruction, response, instruction_ids, response_ids)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _ids_inside(tokenizer, text: str, start: int, end: int) -> tuple[list[int], str]:
    """The ids of the tokens of `text` lying wholly inside characters [start, end), and their text."""
    if not getattr(tokenizer, "is_fast", False):
        part = text[start:end]
        return _ids(tokenizer, part, "marker"), part
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    inside = [
        (token, s, e)
        for token, (s, e) in zip(encoded["input_ids"], encoded["offset_mapping"], strict=True)
        if start <= s and e <= end and e > s
    ]
    if not inside:
        raise ValueError(
            f"train_on_responses_only: the marker {text[start:end]!r} merges with the text around it into other "
            "tokens: pass instruction_part=... and response_part=... explicitly."
        )
    return [token for token, _, _ in inside], text[inside[0][1] : inside[-1][2]]


def train_on_responses_only(
    trainer,
    instruction_part: str | None = None,
    response_part: str | None = None,
    force_match: bool = True,
    tokenizer=None,
    return_function: bool = False,
    num_proc: int | None = None,
):
    """Mask every token but the assistant's replies in `trainer`'s datasets (labels -100) and return the trainer.

    A reply is what follows `response_part` (e.g. ``"<|im_start|>assistant\\n"``) up to the next
    `instruction_part` (``"<|im_start|>user\\n"``) or the end, its end-of-turn marker included. Without the
    two markers they are read off the tokenizer's chat template (`response_parts`), or taken from
    `apply_chat_template`'s custom template; given, they are written as the template renders them and
    matched as token sequences. Works on a `trl.SFTTrainer` and a `transformers.Trainer` whose datasets hold
    ``input_ids``; rows left with nothing to train are dropped (with a count), as Unsloth does; a
    language-modelling collator that would rebuild the labels from the inputs is replaced by one that pads
    the labels given. `return_function=True` returns the batched masking function instead (for a collator
    or a list). `force_match` is accepted for Unsloth's signature (markers always match whole tokens here).
    """
    if tokenizer is None:
        tokenizer = getattr(trainer, "processing_class", None) or getattr(trainer, "tokenizer", None)
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a multimodal processor: its text tokenizer
    parts = _parts(tokenizer, instruction_part, response_part)
    mask = _masking_function(parts.instruction_ids, parts.response_ids)
    if return_function:
        return mask
    for attribute in ("train_dataset", "eval_dataset"):
        dataset = getattr(trainer, attribute, None)
        if dataset is None:
            continue
        if isinstance(dataset, dict):
            setattr(
                trainer,
                attribute,
                {k: _masked(d, mask, num_proc, parts, f"{attribute}[{k!r}]") for k, d in dataset.items()},
            )
        else:
            setattr(trainer, attribute, _masked(dataset, mask, num_proc, parts, attribute))
    _keep_labels_in_collator(trainer, tokenizer)
    return trainer


def _parts(tokenizer, instruction_part: str | None, response_part: str | None) -> ResponseParts:
    if instruction_part is None and response_part is None:
        instruction_part = getattr(tokenizer, "_unsloth_input_part", None)
        response_part = getattr(tokenizer, "_unsloth_output_part", None)
    if instruction_part is None or response_part is None:
        inferred = response_parts(tokenizer)
        if instruction_part is None and response_part is None:
            return inferred
        if instruction_part is None:
            return ResponseParts(inferred.instruction_part, response_part, inferred.instruction_ids,
                                 _ids(tokenizer, response_part, "response_part"))  # fmt: skip
        return ResponseParts(instruction_part, inferred.response_part,
                             _ids(tokenizer, instruction_part, "instruction_part"), inferred.response_ids)  # fmt: skip
    return ResponseParts(
        instruction_part,
        response_part,
        _ids(tokenizer, instruction_part, "instruction_part"),
        _ids(tokenizer, response_part, "response_part"),
    )


def response_labels(input_ids: list[int], instruction_ids: list[int], response_ids: list[int]) -> list[int]:
    """`input_ids` with every token outside a reply set to -100 (a reply: after each `response_ids` run,
    up to the next `instruction_ids` run)."""
    labels = [IGNORE_INDEX] * len(input_ids)
    position, inside = 0, False
    while position < len(input_ids):
        if _starts_with(input_ids, position, response_ids):
            position += len(response_ids)
            inside = True
            continue
        if _starts_with(input_ids, position, instruction_ids):
            inside = False
        if inside:
            labels[position] = input_ids[position]
        position += 1
    return labels


def _masking_function(instruction_ids: list[int], response_ids: list[int]):
    def mask(examples):
        """Batched: ``{"labels": [...]}`` for ``examples["input_ids"]`` (lists or a tensor); labels already
        present stay -100 where they were."""
        rows = examples["input_ids"]
        tensor = hasattr(rows, "tolist") and not isinstance(rows, list)
        rows = rows.tolist() if tensor else rows
        old = examples.get("labels")
        old = old.tolist() if hasattr(old, "tolist") and not isinstance(old, list) else old
        out = []
        for i, ids in enumerate(rows):
            labels = response_labels(list(ids), instruction_ids, response_ids)
            if old is not None:
                labels = [
                    IGNORE_INDEX if before == IGNORE_INDEX else label
                    for label, before in zip(labels, old[i], strict=True)
                ]
            out.append(labels)
        if tensor:
            import torch

            return {"labels": torch.tensor(out, dtype=torch.int64)}
        return {"labels": out}

    return mask


def _ids(tokenizer, text: str, what: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"train_on_responses_only: {what}={text!r} is empty once tokenized.")
    return list(ids)


def _starts_with(sequence: list[int], position: int, part: list[int]) -> bool:
    return sequence[position : position + len(part)] == part


def _masked(dataset, mask, num_proc, parts: ResponseParts, name: str):
    if not hasattr(dataset, "map"):
        raise TypeError(
            f"train_on_responses_only: the trainer's {name} is a {type(dataset).__name__}; it needs a datasets.Dataset."
        )
    if "input_ids" not in (dataset.column_names or []):
        raise ValueError(
            "train_on_responses_only needs tokenized datasets (an 'input_ids' column): call it after building "
            f"the trainer, which tokenizes them. Columns of its {name}: {dataset.column_names}."
        )
    kwargs = (
        {}
        if not hasattr(dataset, "__len__")
        else {"num_proc": num_proc, "desc": "Masking everything but the responses"}
    )
    dataset = dataset.map(mask, batched=True, **kwargs)
    if not hasattr(dataset, "__len__"):  # an IterableDataset: masked lazily, nothing to count
        return dataset
    before = len(dataset)
    kept = dataset.filter(
        lambda labels: any(label != IGNORE_INDEX for label in labels),
        input_columns="labels",
        num_proc=num_proc,
    )
    if before and not len(kept):
        raise ValueError(
            f"train_on_responses_only: response_part {parts.response_part!r} was not found in any row of the "
            f"trainer's {name}, so nothing would be trained. Write it exactly as the chat template renders an "
            "assistant turn's opening (e.g. '<|im_start|>assistant\\n' for ChatML), or leave both markers out to "
            "read them off the tokenizer's chat template."
        )
    if len(kept) < before:
        warnings.warn(
            f"train_on_responses_only: dropped {before - len(kept)} of {before} rows of {name} with no reply left to "
            "train (cut off by max_length, or no assistant turn), as Unsloth does.",
            stacklevel=3,
        )
    return kept


def _keep_labels_in_collator(trainer, tokenizer) -> None:
    """transformers' `DataCollatorForLanguageModeling` rebuilds labels from the inputs: swap in one that pads
    the given labels. TRL's collator of that name already uses a ``labels`` column as is."""

    if type(getattr(trainer, "data_collator", None)) is DataCollatorForLanguageModeling:
        trainer.data_collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)


__all__ = [
    "DEFAULT_MAPPING",
    "TEMPLATES",
    "ChatTemplateError",
    "ResponseParts",
    "apply_chat_template",
    "get_chat_template",
    "remove_special_tokens",
    "response_labels",
    "response_parts",
    "standardize_data_formats",
    "standardize_sharegpt",
    "to_sharegpt",
    "train_on_responses_only",
]

"""Unsloth's ``unsloth.chat_templates`` calls under the same names, so a notebook switches with one import:

from fastft.chat_templates import get_chat_template, train_on_responses_only

`get_chat_template` gives a tokenizer one of the common templates (`fastft.data.chat_templates`, each with
``{% generation %}`` markers); `train_on_responses_only` makes a Hugging Face / TRL trainer learn only the
replies; `standardize_sharegpt` turns ShareGPT rows (``from`` / ``value``) into role / content messages.
"""

from __future__ import annotations

from fastft.data.chat_templates import FORMATS, ChatTemplateError, get_chat_template

IGNORE_INDEX = -100  # the label PyTorch's cross-entropy and every HF trainer skip


def train_on_responses_only(trainer, instruction_part: str, response_part: str, num_proc: int | None = None):
    """Mask every token but the replies in `trainer`'s datasets (labels -100) and return the trainer.

    A reply is what follows `response_part` (e.g. ``"<|im_start|>assistant\\n"``) up to the next
    `instruction_part` (``"<|im_start|>user\\n"``) or the end; both are written exactly as the chat template
    renders them and matched as token sequences. Works on a `trl.SFTTrainer` and on a `transformers.Trainer`
    whose datasets hold ``input_ids`` (the latter's language-modelling collator, which would rebuild the
    labels from the inputs, is replaced by one that pads the labels given).
    """
    tokenizer = getattr(trainer, "processing_class", None) or trainer.tokenizer
    instruction_ids = _ids(tokenizer, instruction_part, "instruction_part")
    response_ids = _ids(tokenizer, response_part, "response_part")

    def mask(example):
        return {"labels": response_labels(example["input_ids"], instruction_ids, response_ids)}

    for attribute in ("train_dataset", "eval_dataset"):
        dataset = getattr(trainer, attribute, None)
        if dataset is None:
            continue
        if isinstance(dataset, dict):
            setattr(trainer, attribute, {k: _masked(d, mask, num_proc) for k, d in dataset.items()})
        else:
            setattr(trainer, attribute, _masked(dataset, mask, num_proc))
    _require_some_response(trainer.train_dataset, response_part)
    _keep_labels_in_collator(trainer, tokenizer)
    return trainer


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


def standardize_sharegpt(dataset, aliases_for_system=("system",), aliases_for_user=("human", "user"),
                         aliases_for_assistant=("gpt", "assistant")):  # fmt: skip
    """ShareGPT rows (``conversations`` of ``{"from": "human"|"gpt", "value": …}``) as role/content messages,
    in the same column (Unsloth's function of this name)."""
    roles = {name: "system" for name in aliases_for_system}
    roles |= {name: "user" for name in aliases_for_user} | {
        name: "assistant" for name in aliases_for_assistant
    }

    def convert(example):
        turns = example["conversations"]
        messages = []
        for turn in turns:
            speaker = turn.get("from", turn.get("role"))
            if speaker not in roles:
                raise ValueError(f"standardize_sharegpt: unknown speaker {speaker!r}; known: {sorted(roles)}")
            messages.append({"role": roles[speaker], "content": turn.get("value", turn.get("content"))})
        return {"conversations": messages}

    return dataset.map(convert)


def _require_some_response(dataset, response_part: str, rows: int = 64) -> None:
    """Raise when none of the first `rows` training rows keeps a label: `response_part` was never found."""
    if dataset is None or not hasattr(dataset, "__len__") or not len(dataset):
        return
    head = dataset.select(range(min(len(dataset), rows)))
    if all(label == IGNORE_INDEX for row in head for label in row["labels"]):
        raise ValueError(
            f"train_on_responses_only: response_part {response_part!r} was not found in the first {len(head)} "
            "training rows, so nothing would be trained. Write it exactly as the chat template renders an "
            "assistant turn's opening, e.g. '<|im_start|>assistant\\n' for ChatML."
        )


def _ids(tokenizer, text: str, what: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"train_on_responses_only: {what}={text!r} is empty once tokenized.")
    return list(ids)


def _starts_with(sequence: list[int], position: int, part: list[int]) -> bool:
    return sequence[position : position + len(part)] == part


def _masked(dataset, mask, num_proc):
    if "input_ids" not in dataset.column_names:
        raise ValueError(
            "train_on_responses_only needs tokenized datasets (an 'input_ids' column): call it after building "
            f"the trainer, which tokenizes them. Columns here: {dataset.column_names}."
        )
    return dataset.map(mask, num_proc=num_proc, desc="Masking everything but the responses")


def _keep_labels_in_collator(trainer, tokenizer) -> None:
    """transformers' `DataCollatorForLanguageModeling` rebuilds labels from the inputs: swap in one that pads
    the given labels. TRL's collator of that name already uses a ``labels`` column as is."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

    if type(trainer.data_collator) is DataCollatorForLanguageModeling:
        trainer.data_collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)


__all__ = [
    "FORMATS",
    "ChatTemplateError",
    "get_chat_template",
    "response_labels",
    "standardize_sharegpt",
    "train_on_responses_only",
]

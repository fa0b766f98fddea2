"""Accuracy on rows with checkable answers (the bundled skills): greedy generation, then two scores.

Format compliance (`score`: the bare answer the system prompt asks for) and content accuracy
(`content_score`: the right answer in any wording). Fine-tuning can teach the first while hurting the
second, so a run is judged on both."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastft.data.skills import content_score, score
from fastft.models.stops import stop_token_ids


@dataclass
class AccuracyResult:
    """Per task and overall ("all"): the share of answers in the requested format (`per_task`) and the
    share of right answers in any wording (`content_per_task`); and each completion."""

    per_task: dict[str, float]
    completions: list[dict] = field(default_factory=list)
    content_per_task: dict[str, float] = field(default_factory=dict)

    @property
    def overall(self) -> float:
        """Format compliance over all rows."""
        return self.per_task.get("all", 0.0)

    @property
    def content(self) -> float:
        """Content accuracy over all rows."""
        return self.content_per_task.get("all", 0.0)


def prompt_messages(row: dict) -> list[dict]:
    """The conversation up to (not including) its final assistant turn."""
    messages = list(row["messages"])
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    return messages


@torch.no_grad()
def generate_answers(
    model, tokenizer, prompts: Sequence[list[dict]], max_new_tokens: int = 16, batch_size: int = 64
) -> list[str]:
    """Greedy completions of chat prompts, batched with left padding."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    answers: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            texts = [
                tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                for p in prompts[start : start + batch_size]
            ]
            inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            output = model.generate(
                **inputs,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=stop_token_ids(model, tokenizer),
            )
            new_tokens = output[:, inputs["input_ids"].shape[1] :]
            answers += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return answers


def evaluate_accuracy(model, tokenizer, rows: Sequence[dict], max_new_tokens: int = 16) -> AccuracyResult:
    """Generate an answer for each row (with ``messages``, ``answer`` and ``task``) and score it twice."""
    rows = list(rows)
    if not rows:
        raise ValueError(
            "evaluate_accuracy got no rows: an accuracy over 0 questions means nothing. Pass eval rows."
        )
    answers = generate_answers(model, tokenizer, [prompt_messages(r) for r in rows], max_new_tokens)
    formatted: dict[str, list[float]] = defaultdict(list)
    right: dict[str, list[float]] = defaultdict(list)
    completions = []
    for row, answer in zip(rows, answers, strict=True):
        task = row.get("task", "all")
        formatted[task].append(score(answer, row["answer"]))
        right[task].append(content_score(answer, row["answer"]))
        completions.append(
            {
                "task": row.get("task"),
                "prompt": prompt_messages(row)[-1]["content"],
                "expected": row["answer"],
                "completion": answer.strip(),
                "correct": bool(formatted[task][-1]),
                "content_correct": bool(right[task][-1]),
            }
        )
    return AccuracyResult(_shares(formatted, len(rows)), completions, _shares(right, len(rows)))


def _shares(scores: dict[str, list[float]], n_rows: int) -> dict[str, float]:
    """Mean score per task, sorted by task, and over all rows under "all"."""
    shares = {task: sum(v) / len(v) for task, v in sorted(scores.items())}
    shares["all"] = sum(sum(v) for v in scores.values()) / max(1, n_rows)
    return shares

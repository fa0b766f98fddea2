"""Accuracy on rows with checkable answers (the bundled skills): greedy generation, then `score`."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from fastft.data.skills import score


@dataclass
class AccuracyResult:
    """Share of correct answers per task and overall ("all"), and each completion."""

    per_task: dict[str, float]
    completions: list[dict] = field(default_factory=list)

    @property
    def overall(self) -> float:
        return self.per_task.get("all", 0.0)


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
                eos_token_id=tokenizer.eos_token_id,
            )
            new_tokens = output[:, inputs["input_ids"].shape[1] :]
            answers += tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return answers


def evaluate_accuracy(model, tokenizer, rows: Sequence[dict], max_new_tokens: int = 16) -> AccuracyResult:
    """Generate an answer for each row (with ``messages``, ``answer`` and ``task``) and score it."""
    rows = list(rows)
    if not rows:
        raise ValueError(
            "evaluate_accuracy got no rows: an accuracy over 0 questions means nothing. Pass eval rows."
        )
    answers = generate_answers(model, tokenizer, [prompt_messages(r) for r in rows], max_new_tokens)
    correct: dict[str, list[float]] = defaultdict(list)
    completions = []
    for row, answer in zip(rows, answers, strict=True):
        ok = score(answer, row["answer"])
        correct[row.get("task", "all")].append(ok)
        completions.append(
            {
                "task": row.get("task"),
                "prompt": prompt_messages(row)[-1]["content"],
                "expected": row["answer"],
                "completion": answer.strip(),
                "correct": bool(ok),
            }
        )
    per_task = {task: sum(v) / len(v) for task, v in sorted(correct.items())}
    per_task["all"] = sum(sum(v) for v in correct.values()) / max(1, len(rows))
    return AccuracyResult(per_task, completions)

"""`evaluate_accuracy` scores each answer twice: content (right answer, any wording) and format (bare answer)."""

from __future__ import annotations

import fastft
from fastft.data.skills import content_score, score
from fastft.training.evaluate import evaluate_accuracy


def test_the_untrained_preset_is_right_in_its_own_words_but_ignores_the_format():
    # tiny-llama was pretrained to answer "… is the answer." with no system prompt: before any fine-tuning
    # it gets some held-out answers right in that wording and none in the bare form the system prompt asks
    model, tokenizer = fastft.load_model("tiny-llama")
    rows = list(fastft.load_dataset("bundled:skills-eval").select(range(24)))
    result = evaluate_accuracy(model, tokenizer, rows)
    assert result.overall == result.per_task["all"] == 0.0
    assert result.content == result.content_per_task["all"] > 0.25
    assert set(result.content_per_task) == set(result.per_task) == {r["task"] for r in rows} | {"all"}
    for completion, row in zip(result.completions, rows, strict=True):
        assert completion["content_correct"] == bool(content_score(completion["completion"], row["answer"]))
        assert completion["correct"] == bool(score(completion["completion"], row["answer"]))
    tasks = {r["task"] for r in rows}
    mean_of_rows = sum(c["content_correct"] for c in result.completions) / len(rows)
    assert abs(result.content - mean_of_rows) < 1e-12 and len(tasks) > 1

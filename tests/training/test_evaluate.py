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


def test_answers_end_at_every_eos_of_the_generation_config():
    """Gemma 3's tokenizer ends text with <eos>, its turns with <end_of_turn> (its generation config lists
    both): an answer ends at the end of its turn, not at the token budget."""
    import torch

    from fastft.models.stops import stop_token_ids
    from fastft.training.evaluate import generate_answers

    model, tokenizer = fastft.load_model("tiny-gemma3")
    end_of_turn, eos = tokenizer.convert_tokens_to_ids("<end_of_turn>"), tokenizer.eos_token_id
    assert stop_token_ids(fastft.add_lora(model, r=4), tokenizer) == [eos, end_of_turn]  # through peft too
    word = tokenizer("cat", add_special_tokens=False)["input_ids"][0]
    steps = []

    def scripted(module, args, logits):  # "cat", then the end of the turn, then "cat" for ever
        logits = torch.full_like(logits, -1e4)
        logits[..., end_of_turn if len(steps) == 1 else word] = 1e4
        steps.append(1)
        return logits

    hook = model.get_output_embeddings().register_forward_hook(scripted)
    try:
        answers = generate_answers(model, tokenizer, [[{"role": "user", "content": "Name an animal."}]], 8)
    finally:
        hook.remove()
    assert answers == [tokenizer.decode([word])] and len(steps) == 2

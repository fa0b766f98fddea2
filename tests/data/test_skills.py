"""The bundled skills data: shipped files match the generator, answers are checkable, eval is held out."""

from __future__ import annotations

import json

from fastft.data import skills


def _read(name: str) -> list[dict]:
    with open(skills.BUNDLED_DIR / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_shipped_files_equal_what_the_generator_makes():
    train_rows, eval_rows = skills.build_rows()
    assert _read("skills.jsonl") == train_rows
    assert _read("skills-eval.jsonl") == eval_rows


def test_every_answer_is_correct_for_its_prompt():
    for row in _read("skills-eval.jsonl"):
        prompt, answer = row["messages"][1]["content"], row["answer"]
        word = prompt.split("'")[1] if "'" in prompt else None
        task = row["task"]
        if task == "uppercase":
            assert answer == word.upper()
        elif task == "reverse":
            assert answer == word[::-1]
        elif task == "count":
            assert answer == str(len(word))
        elif task == "first_letter":
            assert answer == word[0]
        assert row["messages"][-1] == {"role": "assistant", "content": answer}


def test_eval_prompts_never_appear_in_training_or_pretraining_rows():
    held_out = skills.held_out_prompts()
    train_prompts = {r["messages"][1]["content"] for r in _read("skills.jsonl")}
    assert held_out and not held_out & train_prompts
    pretraining = skills.generate(2000, skills.SEED + 7, exclude=held_out, style="verbose")
    assert not {r["messages"][0]["content"] for r in pretraining} & held_out


def test_every_task_is_represented():
    tasks = {r["task"] for r in _read("skills.jsonl")}
    assert tasks == set(skills.TASKS)


def test_score_accepts_the_answer_and_rejects_near_misses():
    assert skills.score("7000 m", "7000 m") == 1.0
    assert skills.score("  7000 m.\nextra", "7000 m") == 1.0
    assert skills.score("The answer is 7000 m.", "7000 m") == 0.0
    assert skills.score("700 m", "7000 m") == 0.0
    assert skills.score("", "7") == 0.0


def test_content_score_reads_the_answer_in_any_wording():
    assert skills.content_score("The answer is 7000 m.", "7000 m") == 1.0
    assert skills.content_score("7000 m is the answer.", "7000 m") == 1.0  # the preset's own wording
    assert skills.content_score("1, 2, 9 is the answer.", "1, 2, 9") == 1.0
    assert skills.content_score("70 m is the answer.", "7000 m") == 0.0
    assert skills.content_score("tac is the answer.", "CAT") == 0.0
    assert skills.content_score("  answer: 7000 m\nmore", "7000 m") == 1.0
    assert skills.content_score("The answer is 'nus'.", "nus") == 1.0
    assert skills.content_score("The answer is K.", "k") == 1.0  # case is no content for a lower-case answer
    assert skills.content_score("The answer is eldEE.", "eelde") == 0.0
    assert skills.content_score("The answer is 6000 g.", "2000 g") == 0.0
    assert skills.content_score("Tiger", "TIGER") == 0.0  # ...but it is the uppercase task's content
    assert skills.content_score("TIGER.", "TIGER") == 1.0
    assert skills.content_score("", "7") == 0.0
    # format compliance still rejects the wordy forms the content score accepts
    assert skills.score("The answer is 7000 m.", "7000 m") == 0.0
    assert skills.score("7000 m is the answer.", "7000 m") == 0.0


def test_verbose_style_has_no_system_prompt():
    row = next(skills.generate(1, 3, style="verbose"))
    assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
    assert row["messages"][1]["content"] == skills.VERBOSE_ANSWER.format(answer=row["answer"])


def test_the_presets_pretraining_rows_hold_no_eval_prompt_and_few_rows_of_the_weak_tasks():
    from fastft.training.warmstart import WEAK_EVERY, WEAK_TASKS, pretraining_rows

    rows = pretraining_rows()
    assert not {r["messages"][0]["content"] for r in rows} & skills.held_out_prompts()
    counts = {task: sum(r["task"] == task for r in rows) for task in skills.TASKS}
    strong = [n for task, n in counts.items() if task not in WEAK_TASKS]
    assert WEAK_TASKS and all(0 < counts[task] <= min(strong) / WEAK_EVERY + 1 for task in WEAK_TASKS)
    assert rows[0]["messages"][1]["content"] == skills.VERBOSE_ANSWER.format(answer=rows[0]["answer"])

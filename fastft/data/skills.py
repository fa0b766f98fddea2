"""The bundled "skills" dataset: short instructions whose answers a program can check.

Every row is a chat (`messages`) with a `task` name and the exact `answer`, so the demo can
measure accuracy before and after training and a later RL trainer can use `score` as its
reward. The rows are generated from a seed, written once to ``bundled/skills*.jsonl`` and
shipped with the package; ``python -m fastft.data.skills`` rewrites them and a test checks
that the shipped files equal what the generator makes.

Tasks (all short enough for a tiny model on a CPU to learn some of them in a minute):
``add``, ``subtract``, ``uppercase``, ``reverse``, ``convert`` (units), ``count`` (letters),
``sort`` (three numbers), ``first_letter``.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path

BUNDLED_DIR = Path(__file__).parent / "bundled"

WORDS = (
    "apple bread chair dream eagle flame grape house igloo jelly koala lemon mango night ocean "
    "piano queen river stone tiger umbra violet water xenon yacht zebra amber berry cloud daisy "
    "ember frost glass honey ivory jewel kitten lotus maple noble olive pearl quilt robin sugar "
    "tulip unity vivid whale yeast zesty brick candle desert forest garden harbor island jungle "
    "ladder marble needle orange pepper rocket silver timber velvet window basket copper dragon "
    "falcon ginger hammer insect jacket kettle lizard magnet nectar parrot rabbit saddle tomato "
    "cat dog sun moon star tree bird fish frog leaf rain snow wind fire milk salt corn rice bean"
).split()

UNITS = (
    # (from, to, factor, noun of the from unit, noun of the to unit)
    ("km", "m", 1000, "kilometres", "metres"),
    ("m", "cm", 100, "metres", "centimetres"),
    ("kg", "g", 1000, "kilograms", "grams"),
    ("L", "mL", 1000, "litres", "millilitres"),
    ("h", "min", 60, "hours", "minutes"),
    ("min", "s", 60, "minutes", "seconds"),
)


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    prompt = rng.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} plus {b}."])
    return prompt.format(a=a, b=b), str(a + b)


def _subtract(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(0, 99)
    b = rng.randint(0, a)
    prompt = rng.choice(["What is {a} - {b}?", "Subtract {b} from {a}.", "Compute {a} minus {b}."])
    return prompt.format(a=a, b=b), str(a - b)


def _uppercase(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    prompt = rng.choice(["Write '{w}' in capital letters.", "Uppercase the word '{w}'."])
    return prompt.format(w=word), word.upper()


def _reverse(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    prompt = rng.choice(["Reverse the letters of '{w}'.", "Spell '{w}' backwards."])
    return prompt.format(w=word), word[::-1]


def _convert(rng: random.Random) -> tuple[str, str]:
    src, dst, factor, src_name, dst_name = rng.choice(UNITS)
    n = rng.randint(1, 9)
    prompt = rng.choice(["Convert {n} {src} to {dst}.", "How many {dst_name} are in {n} {src_name}?"])
    return prompt.format(n=n, src=src, dst=dst, src_name=src_name, dst_name=dst_name), f"{n * factor} {dst}"


def _count(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    prompt = rng.choice(["How many letters are in '{w}'?", "Count the letters of '{w}'."])
    return prompt.format(w=word), str(len(word))


def _sort(rng: random.Random) -> tuple[str, str]:
    numbers = rng.sample(range(10), 3)
    listed = ", ".join(map(str, numbers))
    prompt = rng.choice(["Sort {x} from smallest to largest.", "Put {x} in increasing order."])
    return prompt.format(x=listed), ", ".join(map(str, sorted(numbers)))


def _first_letter(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    prompt = rng.choice(["What is the first letter of '{w}'?", "Which letter does '{w}' start with?"])
    return prompt.format(w=word), word[0]


TASKS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add": _add,
    "subtract": _subtract,
    "uppercase": _uppercase,
    "reverse": _reverse,
    "convert": _convert,
    "count": _count,
    "sort": _sort,
    "first_letter": _first_letter,
}

SYSTEM_PROMPT = "Answer with the result only."
# The tiny-llama preset was pretrained on the tasks with answers in this wordier, answer-first style and
# no system prompt (fastft.training.warmstart); the bundled SFT data teaches it to follow SYSTEM_PROMPT.
VERBOSE_ANSWER = "{answer} is the answer."


def normalize_answer(text: str) -> str:
    """Canonical form for comparing answers: strip, collapse spaces, drop a final period."""
    text = re.sub(r"\s+", " ", text.strip())
    return text[:-1] if text.endswith(".") else text


def _first_line(completion: str) -> str:
    return completion.strip().split("\n", 1)[0] if completion.strip() else ""


def score(completion: str, answer: str) -> float:
    """Format compliance: 1.0 when the completion's first line is exactly the bare answer (after
    `normalize_answer`), else 0.0. "7000 m is the answer." scores 0 here: it ignores the system prompt."""
    return float(normalize_answer(_first_line(completion)) == normalize_answer(answer))


_ANSWER_PREFIX = re.compile(r"^(?:the )?answer(?: is)?\s*:?\s*", re.IGNORECASE)
_ANSWER_SUFFIX = re.compile(r",?\s*(?:is )?the answer$", re.IGNORECASE)


def content_answer(text: str) -> str:
    """What a completion answers, whatever its wording: the first line without a leading "The answer is"
    (or "Answer:"), a trailing "is the answer", a final period, or surrounding quotes, spaces collapsed."""
    text = normalize_answer(_first_line(text))
    text = normalize_answer(_ANSWER_SUFFIX.sub("", _ANSWER_PREFIX.sub("", text)))
    return text[1:-1].strip() if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def content_score(completion: str, answer: str) -> float:
    """Content accuracy: 1.0 when the completion gives the right answer in any wording ("7000 m is the
    answer." and "The answer is 7000 m." count), else 0.0. Case counts only where the answer has capitals
    (the uppercase task): "7000 M" is right for "7000 m", "Tiger" is wrong for "TIGER"."""
    given, expected = content_answer(completion), content_answer(answer)
    if expected == expected.lower():
        given = given.lower()
    return float(given == expected)


def generate(n: int, seed: int, exclude: set[str] | None = None, style: str = "terse") -> Iterator[dict]:
    """Yield `n` rows, round-robin over the tasks, skipping prompts in `exclude`.

    `style="terse"` rows have the system prompt and the bare answer (the bundled data);
    `style="verbose"` rows have no system prompt and answer in `VERBOSE_ANSWER` (pretraining).
    """
    if style not in ("terse", "verbose"):
        raise ValueError(f"style={style!r}: use 'terse' or 'verbose'")
    rng = random.Random(seed)
    names = list(TASKS)
    exclude = exclude or set()
    made = 0
    attempts = 0
    while made < n:
        attempts += 1
        if attempts > 50 * n:
            raise RuntimeError(f"could not make {n} distinct rows; the task space is too small")
        task = names[made % len(names)]
        prompt, answer = TASKS[task](rng)
        if prompt in exclude:
            continue
        if style == "terse":
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": answer},
            ]
        else:
            messages = [
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": VERBOSE_ANSWER.format(answer=answer)},
            ]
        yield {"messages": messages, "task": task, "answer": answer}
        made += 1


TRAIN_ROWS, EVAL_ROWS, SEED = 4000, 256, 20261130


def build_rows() -> tuple[list[dict], list[dict]]:
    """The train and held-out eval rows: no eval prompt appears in train."""
    eval_rows = list(generate(EVAL_ROWS, SEED + 1))
    held_out = held_out_prompts(eval_rows)
    train_rows = list(generate(TRAIN_ROWS, SEED, exclude=held_out))
    return train_rows, eval_rows


def held_out_prompts(eval_rows: list[dict] | None = None) -> set[str]:
    """User prompts of the eval rows: never trained on, in SFT or in the preset's pretraining."""
    rows = eval_rows if eval_rows is not None else list(generate(EVAL_ROWS, SEED + 1))
    return {m["content"] for row in rows for m in row["messages"] if m["role"] == "user"}


def write_bundled(directory: Path = BUNDLED_DIR) -> None:
    train_rows, eval_rows = build_rows()
    for name, rows in (("skills.jsonl", train_rows), ("skills-eval.jsonl", eval_rows)):
        with open(directory / name, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    write_bundled()
    print(f"wrote {TRAIN_ROWS} + {EVAL_ROWS} rows to {BUNDLED_DIR}")

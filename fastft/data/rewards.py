"""Reward functions for GRPO (`fastft.grpo`): plain callables ``(prompts, completions, **row) -> list[float]``.

`prompts` and `completions` hold one entry per completion (a prompt repeats for each of its group's
completions); every other column of the prompt rows comes as a keyword argument, one value per completion.
A reward names the columns it needs as keyword parameters (``answer`` below); `required_columns` reads them
from its signature, and `check_columns` refuses, before any sampling, rows that lack one.

Bundled:

* `exact_match`: the skills checker (`fastft.data.skills.score`, as `fastft.evaluate_accuracy` scores
  format compliance): 1.0 when the completion's first line is exactly the row's ``answer``, else 0.0.
  It counts as the run's accuracy (`StepEvent.grpo["accuracy"]`).
* `content_match`: the right answer in any wording (`fastft.data.skills.content_score`).
* `format_reward(pattern)`: 1.0 when the whole stripped completion matches a regular expression (by
  default a single line of at most 64 characters: the bare answer the skills' system prompt asks for).
* `length_penalty(limit, per_char)`: ``-per_char`` times the characters beyond `limit`, 0 within it.

Each has a name (`NAMED`: ``"exact_match"``, ``"content_match"``, ``"format"``, ``"length"``, the last two with
their defaults) that `resolve_rewards` accepts in place of the callable. A reward that raises is reported with
its name, the step and the completion it failed on, the original exception chained (`score_completions`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence

from fastft.data.skills import content_score, score

Reward = Callable[..., list[float]]


class RewardError(ValueError):
    """A reward function cannot run on these rows, or returned something that is not one number per
    completion."""


def exact_match(prompts: Sequence, completions: Sequence[str], answer: Sequence[str], **row) -> list[float]:
    """1.0 where the completion's first line is exactly the row's ``answer`` (the skills' format check)."""
    return [score(completion, expected) for completion, expected in zip(completions, answer, strict=True)]


exact_match.is_accuracy = True


def content_match(prompts: Sequence, completions: Sequence[str], answer: Sequence[str], **row) -> list[float]:
    """1.0 where the completion gives the row's ``answer`` in any wording (the skills' content check)."""
    return [
        content_score(completion, expected) for completion, expected in zip(completions, answer, strict=True)
    ]


def format_reward(pattern: str = r"[^\n]{1,64}", name: str = "format") -> Reward:
    """A reward of 1.0 where the stripped completion matches `pattern` in full (`re.fullmatch`), else 0.0."""
    compiled = re.compile(pattern)

    def reward(prompts: Sequence, completions: Sequence[str], **row) -> list[float]:
        return [float(compiled.fullmatch(completion.strip()) is not None) for completion in completions]

    reward.__name__ = name
    reward.__doc__ = f"1.0 where the stripped completion matches {pattern!r} in full."
    return reward


def length_penalty(limit: int = 32, per_char: float = 0.01, name: str = "length") -> Reward:
    """A reward of ``-per_char * max(0, len(completion) - limit)``: 0 up to `limit` characters, then lower
    with every character beyond."""
    if not isinstance(limit, int) or limit < 0:
        raise RewardError(f"length_penalty(limit={limit!r}): give a character count >= 0.")
    if not per_char >= 0:
        raise RewardError(f"length_penalty(per_char={per_char!r}): give a penalty >= 0 per character.")

    def reward(prompts: Sequence, completions: Sequence[str], **row) -> list[float]:
        return [-per_char * max(0, len(completion.strip()) - limit) for completion in completions]

    reward.__name__ = name
    reward.__doc__ = f"-{per_char:g} per character beyond {limit}."
    return reward


# the bundled rewards by name (a factory's reward with its defaults)
NAMED: dict[str, Callable[[], Reward]] = {
    "exact_match": lambda: exact_match,
    "content_match": lambda: content_match,
    "format": format_reward,
    "length": length_penalty,
}


def resolve_rewards(rewards) -> list[Reward]:
    """`rewards` (one reward or a sequence of them; each a callable or a name of `NAMED`) as a list of
    callables; `RewardError` names an entry that is neither (a string is one name, never its letters)."""
    if callable(rewards) or isinstance(rewards, str):
        rewards = [rewards]
    try:
        items = list(rewards)
    except TypeError:
        raise RewardError(
            f"rewards={rewards!r}: give a reward function (prompts, completions, **row) -> list[float], the name "
            f"of a bundled one ({', '.join(NAMED)}), or a list of them."
        ) from None
    resolved = []
    for item in items:
        if isinstance(item, str):
            if item not in NAMED:
                raise RewardError(
                    f"The reward {item!r} is not a bundled reward's name: choose one of {', '.join(NAMED)}, or pass "
                    "a function (prompts, completions, **row) -> list[float]."
                )
            item = NAMED[item]()
        elif not callable(item):
            raise RewardError(
                f"rewards must be callables (prompts, completions, **row) -> list[float] or names of bundled ones "
                f"({', '.join(NAMED)}), got {item!r}."
            )
        resolved.append(item)
    return resolved


def reward_name(reward: Reward) -> str:
    return getattr(reward, "__name__", type(reward).__name__)


def required_columns(reward: Reward) -> tuple[str, ...]:
    """The row columns `reward` needs: its parameters after (prompts, completions) without a default."""
    parameters = list(inspect.signature(reward).parameters.values())[2:]
    return tuple(
        p.name
        for p in parameters
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is inspect.Parameter.empty
    )


def check_columns(rewards: Sequence[Reward], columns: Sequence[str]) -> None:
    """Raise `RewardError` naming the first column a reward needs that the rows lack."""
    have = set(columns)
    for reward in rewards:
        if not callable(reward):
            raise RewardError(
                f"rewards must be callables (prompts, completions, **row) -> list[float], got {reward!r}."
            )
        missing = [name for name in required_columns(reward) if name not in have]
        if missing:
            raise RewardError(
                f"The reward {reward_name(reward)!r} needs the column {missing[0]!r}, which the prompt rows lack "
                f"(they have: {', '.join(sorted(have)) or 'nothing'}). Add {missing[0]!r} to every row, or "
                "drop this reward."
            )


def score_completions(
    rewards: Sequence[Reward],
    prompts: list,
    completions: list[str],
    columns: dict[str, list],
    step: int | None = None,
    rows: Sequence[int] | None = None,
) -> list[list[float]]:
    """Each reward's values, ``[rewards][completions]``; a reward gets only the columns it accepts (all of
    them when it takes ``**row``). A reward that raises is called again on each completion alone to find the
    one it fails on; `RewardError` names the reward, `step` (1-based), that completion and its prompt row
    (`rows`: each completion's row index), the original exception chained."""
    values = []
    for reward in rewards:
        parameters = inspect.signature(reward).parameters.values()
        takes_all = any(p.kind == p.VAR_KEYWORD for p in parameters)
        accepted = {p.name for p in parameters}
        given = {k: v for k, v in columns.items() if takes_all or k in accepted}
        try:
            result = reward(prompts, completions, **given)
        except Exception as error:
            raise _failure(reward, error, prompts, completions, given, step, rows) from error
        try:
            result = [float(value) for value in result]
        except (TypeError, ValueError):
            raise RewardError(
                f"The reward {reward_name(reward)!r} returned {type(result).__name__} {result!r:.80}: return a "
                "list with one number per completion."
            ) from None
        if len(result) != len(completions):
            raise RewardError(
                f"The reward {reward_name(reward)!r} returned {len(result)} values for {len(completions)} "
                "completions: return one number per completion."
            )
        values.append(result)
    return values


def _failure(reward, error, prompts, completions, given, step, rows) -> RewardError:
    """The `RewardError` for a reward that raised `error`: where it failed (see `score_completions`)."""
    where = f" at step {step}" if step is not None else ""
    failing = None
    for i in range(len(completions)):
        try:
            reward([prompts[i]], [completions[i]], **{k: [v[i]] for k, v in given.items()})
        except Exception:  # noqa: BLE001 - any failure of the user's function locates it
            failing = i
            break
    if failing is None:
        on = f"on the batch of {len(completions)} completions (each one alone scores without error)"
    else:
        row = f", prompt row {rows[failing]}" if rows is not None else ""
        on = (
            f"on completion {failing} of {len(completions)}{row}: {_short(completions[failing])!r} "
            f"(prompt {_short(prompts[failing])!r})"
        )
    return RewardError(
        f"The reward {reward_name(reward)!r} raised {type(error).__name__}: {error}{where}, {on}. Fix the reward "
        "function (the original error and its traceback are chained above this one)."
    )


def _short(value, width: int = 60) -> str:
    text = value if isinstance(value, str) else str(value)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"

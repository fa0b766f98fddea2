"""Checks of user-given settings at construction: each error names the setting, the value and the fix.

Shared by `TrainConfig`, `add_lora`, `pack`, `load_model` and the CLI, so one wrong value reads the same
everywhere instead of surfacing as a TypeError from deep inside a loop.
"""

from __future__ import annotations

import math
import numbers
import os
import re


class SettingError(ValueError):
    """A setting has a value that cannot work; the message names it and says what to give instead."""


def whole_number(name: str, value, minimum: int | None = None, fix: str = "") -> int:
    """`value` as an int, refusing bools, floats (``3.5``, ``1e9``) and strings."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SettingError(
            f"{name} must be a whole number (an int), got {value!r} ({type(value).__name__}). "
            + (fix or f"Pass e.g. {name}={_example(value, minimum)}.")
        )
    value = int(value)
    if minimum is not None and value < minimum:
        raise SettingError(f"{name} must be at least {minimum}, got {value}. " + fix)
    return value


def real_number(
    name: str,
    value,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    fix: str = "",
) -> float:
    """`value` as a finite float within [low, high] (open at either end when asked)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SettingError(f"{name} must be a number, got {value!r} ({type(value).__name__}). " + fix)
    value = float(value)
    if not math.isfinite(value):
        raise SettingError(f"{name} must be a finite number, got {value}. " + fix)
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise SettingError(f"{name} must be {_range(low, high, low_open, high_open)}, got {value:g}. " + fix)
    return value


def _range(low, high, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'above' if low_open else 'at least'} {low:g}"
    if low is None:
        return f"{'below' if high_open else 'at most'} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def _example(value, minimum: int | None) -> int:
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return max(int(round(value)), minimum or 0)
    return max(1, minimum or 0)


_RUN_NAME = re.compile(r"[\w.-]+")


def run_name(setting: str, value) -> str:
    """`value` as the name of a run: a plain folder name (letters, digits, '-', '_', '.'), never a path. A name
    is joined to an output folder, so '../x', 'a/b' or an absolute path would put the run somewhere else."""
    if not isinstance(value, str):
        raise SettingError(
            f"{setting} must be a text, got {value!r} ({type(value).__name__}). Pass e.g. 'my-run'."
        )
    if _RUN_NAME.fullmatch(value) and value not in (".", "..") and len(value.encode()) <= 200:
        return value
    suggestion = re.sub(r"[^\w.-]+", "-", value).strip("-.")[:100] or "my-run"
    raise SettingError(
        f"{setting}={value!r} is not a run name: it {_why_not_a_name(value)}. A run name is a plain folder name, "
        "created inside the output folder (choose that folder with the output-dir setting). "
        f"Fix: e.g. {setting}={suggestion!r}."
    )


def _why_not_a_name(value: str) -> str:
    if not value.strip():
        return "is empty"
    if "/" in value or "\\" in value or os.path.isabs(value):
        return "is a path (it holds a separator, or is absolute)"
    if value in (".", ".."):
        return "names a folder that is not a new one"
    if len(value.encode()) > 200:
        return "is longer than 200 bytes"
    return "holds characters other than letters, digits, '-', '_' and '.'"

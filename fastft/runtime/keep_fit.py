"""Whether an offloaded layer may keep its attention output for a forward of so many tokens: the question
a conditional `fastft.runtime.offload.KeepPolicy` asks, answered by the VRAM estimator.

The estimator (`fastft.vram`) sits above the runtime (docs/DESIGN.md, "Layers"), so the runtime never
imports it: the answer is plugged in from above. ``fastft/__init__.py``, which runs before any fastft module,
registers `fastft.vram.keeping.keeping_fits` behind a function that imports the estimator on its first call,
so ``import fastft`` stays light. With no answer registered (the runtime used on its own), a conditional
policy keeps nothing: the memory-first choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (model, tokens, device) -> whether the estimate with the attention output kept fits the device
KeepingFits = Callable[[Any, int, Any], bool]

_answer: KeepingFits | None = None


def register(answer: KeepingFits | None) -> None:
    """Make `answer` the one `keeping_fits` asks (None: keep nothing conditional). Registering again replaces
    it, so re-importing is harmless."""
    global _answer
    _answer = answer


def keeping_fits(model: Any, tokens: int, device: Any) -> bool:
    """The registered answer for `tokens` tokens of `model` on `device`; False when none is registered."""
    return _answer is not None and bool(_answer(model, tokens, device))

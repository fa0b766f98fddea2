"""`StepControl`: stop, pause and calls between steps, asked for from any thread, honoured by the training
thread at a step boundary (`Trainer.stop`, `pause`, `unpause`, `call_between_steps`)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class StepControl:
    """The thread-safe control of a run: a stop flag, a pause that holds the training thread between two steps,
    and calls queued for that thread."""

    def __init__(self):
        self._stop = threading.Event()
        self._condition = threading.Condition()  # guards the pause state and the queued calls
        self._paused = False
        self.holding = False  # the training thread waits between two steps because the run is paused
        self._calls: list[Callable[[], object]] = []

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        with self._condition:
            self._stop.set()
            self._condition.notify_all()

    def pause(self) -> None:
        with self._condition:
            self._paused = True

    def unpause(self) -> None:
        with self._condition:
            self._paused = False
            self._condition.notify_all()

    def call_between_steps(self, fn: Callable[[], object]) -> None:
        with self._condition:
            self._calls.append(fn)
            self._condition.notify_all()

    def between_steps(self) -> None:
        """On the training thread at a step boundary: run the queued calls, and hold while paused."""
        while True:
            with self._condition:
                calls, self._calls = self._calls, []
                if not calls:
                    if not self._paused or self._stop.is_set():
                        return
                    self.holding = True
                    try:
                        self._condition.wait()
                    finally:
                        self.holding = False
                    continue
            for call in calls:
                call()

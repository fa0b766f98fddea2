"""`Trainer.pause()` / `unpause()` / `stop()` from another thread: a paused trainer holds its training thread
between two steps for as long as it stays paused, resumes where it held (the same run as without the pause),
runs `call_between_steps` calls where it holds, and `stop()` ends it there."""

from __future__ import annotations

import threading
import time

import fastft
from fastft.data.skills import generate
from fastft.training.events import StepEvent
from fastft.training.trainer import TrainConfig, Trainer

ROWS = list(generate(120, seed=11))


def _trainer(max_steps: int, **config) -> Trainer:
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    model = fastft.add_lora(model, r=8, alpha=16, seed=5)
    data = fastft.pack(ROWS, tokenizer, 128)
    return Trainer(model, tokenizer, data, config=TrainConfig(max_steps=max_steps, seed=9, **config))


def _train_in_background(trainer: Trainer) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def train():
        try:
            outcome["result"] = trainer.train()
        except BaseException as error:  # noqa: BLE001 - the test thread reports it
            outcome["error"] = error

    thread = threading.Thread(target=train, name="fastft-test-train", daemon=True)
    thread.start()
    return thread, outcome


def _until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _losses(result) -> list[float]:
    return [event.loss for event in result.steps]


def test_a_paused_trainer_holds_across_many_step_lengths_then_resumes_the_same_run():
    trainer = _trainer(12)
    thread, outcome = _train_in_background(trainer)
    _until(lambda: trainer.step >= 2)
    trainer.pause()
    _until(lambda: trainer.holding)
    held = trainer.step
    step_seconds = max(event.step_seconds for event in trainer.result.steps)
    for _ in range(3):  # several step-lengths of time, looked at three times: not one step more
        time.sleep(max(0.1, 3 * step_seconds))
        assert trainer.holding and trainer.step == held and thread.is_alive()
    assert held < 12

    trainer.unpause()
    thread.join(60)
    assert not thread.is_alive() and "error" not in outcome
    result = outcome["result"]
    assert not result.stopped_early and [event.step for event in result.steps] == list(range(1, 13))
    assert not trainer.holding
    assert _losses(result) == _losses(_trainer(12).train())  # the pause changed nothing of the run


def test_stop_ends_a_paused_run_where_it_holds_and_calls_run_while_it_holds(tmp_path):
    trainer = _trainer(500, output_dir=str(tmp_path))
    events = []
    trainer.subscribe(lambda event: events.append(event) if isinstance(event, StepEvent) else None)
    thread, outcome = _train_in_background(trainer)
    _until(lambda: trainer.step >= 2)
    trainer.pause()
    _until(lambda: trainer.holding)
    held = trainer.step

    calls = []  # run by the training thread where it holds, which then holds again
    trainer.call_between_steps(lambda: calls.append((threading.current_thread().name, trainer.step)))
    _until(lambda: calls and trainer.holding)
    assert calls == [("fastft-test-train", held)] and trainer.step == held

    trainer.stop()
    thread.join(60)
    assert not thread.is_alive() and "error" not in outcome
    result = outcome["result"]
    assert result.stopped_early and trainer.step == held and len(result.steps) == held
    assert (
        result.checkpoints[-1].endswith(f"checkpoint-{held}") and (tmp_path / f"checkpoint-{held}").is_dir()
    )
    assert [event.step for event in events] == list(range(1, held + 1))

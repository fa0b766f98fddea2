"""Studio runs in a child process (`fastft.studio.worker`), driven through the Run tab's code without a browser:
the run outlives the studio that started it, a new studio follows it live, Stop ends the process, and a
resume from a checkpoint in the Runs view trains the same losses as the run that never stopped."""

from __future__ import annotations

import contextlib
import html
import importlib.machinery
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

import fastft
from fastft.studio.process_run import ProcessRun
from fastft.studio.run import RunPanel
from fastft.studio.run_folder import list_runs, pid_alive, read_run
from fastft.studio.state import LoadSettings, LoraSettings, PackSettings, StudioState
from fastft.training.events import StepEvent

SEQ = 128
WAIT = 120  # seconds: a worker imports torch and loads the model on 2 busy cores
_DATA: dict = {}


def _state(**fields) -> StudioState:
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=SEQ)
    model = fastft.add_lora(model, r=8, alpha=16, seed=5)
    if "packed" not in _DATA:
        rows = fastft.load_dataset("bundled:skills").select(range(160))
        _DATA["rows"], _DATA["packed"] = rows, fastft.pack(rows, tokenizer, SEQ)
    return StudioState(
        model_name="tiny-llama",
        model=model,
        tokenizer=tokenizer,
        load_settings=LoadSettings(max_seq_length=SEQ),
        lora_settings=LoraSettings(r=8, alpha=16),
        dataset_name="bundled:skills",
        rows=_DATA["rows"],
        packed=_DATA["packed"],
        pack_settings=PackSettings(max_seq_length=SEQ),
        **fields,
    )


def _until(condition, timeout: float = WAIT, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.05)


def _text(widget) -> str:
    return html.unescape(widget.value)


def _losses(events) -> dict[int, float]:
    return {e.step: e.loss for e in events if isinstance(e, StepEvent)}


@pytest.fixture
def no_worker_left(tmp_path):
    """A test that fails half-way leaves no worker training in its folder: each is stopped as Stop stops it."""
    yield
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            command = (entry / "cmdline").read_bytes().split(b"\0")
            if b"fastft.studio.worker" in command and any(
                part.startswith(bytes(tmp_path)) for part in command
            ):
                os.kill(int(entry.name), signal.SIGTERM)


def test_a_child_process_run_outlives_its_studio_stops_and_resumes_to_the_same_losses(
    tmp_path, no_worker_left
):
    folder = tmp_path / "runs" / "studio"
    state = _state()
    panel = RunPanel(state, live="text")
    assert panel.train_in.value == "process" and "child process" in _text(panel.where)
    panel.steps.value = 400  # far more than the test waits for: it ends by Stop
    panel.output_dir.value = str(folder)
    panel.threads.value = 1  # the same thread count in both workers: the same float sums
    panel.start_button.click()
    run = panel.run
    assert isinstance(run, ProcessRun), _text(panel.status)
    assert run.pid and pid_alive(run.pid) and run.pid != os.getpid()
    _until(lambda: run.step >= 2, what="the worker's first steps")
    # as the panel's ticker does every second, until the worker's status (rewritten every second) has its threads
    _until(lambda: panel.refresh() or "CPU threads" in _text(panel.where), what="the worker's status")
    where = _text(panel.where)
    assert f"pid {run.pid}" in where and str(folder / "worker.log") in where and "CPU threads 1" in where

    saved = run.save_checkpoint().result(timeout=60)  # the worker writes it between two steps
    kept_step = int(saved.rsplit("-", 1)[1])
    assert (folder / f"checkpoint-{kept_step}").is_dir()

    # the kernel restarts: a new state and a new studio know nothing of the run but its folder
    panel.close()
    studio = fastft.studio(fresh=True, display=False, run=str(folder))
    again = studio.run
    follower = again.run
    assert isinstance(follower, ProcessRun) and follower is not run and follower.model is None
    assert follower.status == "running" and follower.pid == run.pid
    seen = follower.step
    _until(lambda: follower.step >= seen + 3, what="events go on after the restart")
    again.refresh()
    x = list(again.plots.figure.data[0].x)
    assert x == list(range(1, len(x) + 1)) and len(x) >= seen + 3  # the whole curve, from step 1 on
    assert "running" in again.progress_text.value and f"pid {run.pid}" in _text(again.where)

    # a studio opened on the runs folder finds the run still training, unasked
    opened = RunPanel(StudioState(run_settings={"output dir": str(folder)}), live="text")
    assert isinstance(opened.run, ProcessRun) and opened.run.pid == run.pid
    assert [info.status for info in opened.runs.infos] == ["running"]
    opened.close()

    again.stop_button.click()
    assert follower.status == "stopping"
    follower.wait(WAIT)
    assert follower.status == "stopped" and follower.error is None, follower.error_message
    _until(lambda: not pid_alive(run.pid), 30, "the worker ends once stopped")
    stopped_at = follower.step
    assert follower.checkpoints[-1].endswith(f"checkpoint-{stopped_at}") and stopped_at > kept_step + 1
    assert "Stopped at step" in _text(again.status)
    uninterrupted = _losses(follower.events)
    assert sorted(uninterrupted) == list(range(1, stopped_at + 1))
    run.wait(30)  # the first studio's run, started from its model: the trained adapter came back into it
    assert run.status == "stopped" and run.error is None, run.error_message
    from safetensors.torch import load_file

    trained = load_file(str(folder / "trained" / "adapter_model.safetensors"))
    lora = {k: v for k, v in state.model.named_parameters() if v.requires_grad}
    assert len(trained) == len(lora) and all(
        any(
            k.replace(".default", "") == t.replace(".default", "") and (v - w).abs().max() == 0
            for t, w in trained.items()
        )
        for k, v in lora.items()
    )

    # Runs view: resume from the checkpoint saved on request, in a new worker
    again.runs.refresh()
    assert [(info.name, info.status) for info in again.runs.infos] == [("studio", "stopped")]
    again.runs.run_choice.value = str(folder)
    again.runs.checkpoint_choice.value = str(folder / f"checkpoint-{kept_step}")
    again.runs.resume_button.click()
    resumed = again.run
    assert isinstance(resumed, ProcessRun) and resumed is not follower, _text(again.runs.message)
    _until(lambda: resumed.step >= stopped_at, what="the resumed run reaches the stop")
    resumed.stop()
    resumed.wait(WAIT)
    again_losses = _losses(resumed.events)
    assert sorted(again_losses)[:kept_step] == list(range(1, kept_step + 1))  # kept from the first worker
    compared = range(kept_step + 1, stopped_at + 1)
    np.testing.assert_allclose(
        [again_losses[s] for s in compared], [uninterrupted[s] for s in compared], rtol=1e-5, atol=0
    )
    assert len(list(folder.glob("events-*.jsonl"))) == 1  # the first worker's events, kept aside
    assert read_run(folder).status == "stopped"


def test_a_crash_in_the_worker_shows_its_traceback_and_a_vanished_worker_is_failed(tmp_path):
    from fastft.studio import worker

    state = _state()
    folder = tmp_path / "crash"
    run = ProcessRun.create(folder, state, model_name="tiny-llama", method="sft", config={"max_steps": 3})
    spec = json.loads((folder / "run.json").read_text())
    spec["data"]["train"] = "missing.npz"  # the worker fails after loading the model
    (folder / "run.json").write_text(json.dumps(spec))
    assert worker.main([str(folder)]) == 1  # the worker's code, in this process (a child's takes seconds)
    panel = RunPanel(StudioState(), live="text")
    panel.runs.refresh()
    assert [(info.name, info.status) for info in list_runs(tmp_path)] == [("crash", "failed")]
    failed = ProcessRun.attach(folder)
    panel.follow(failed)
    failed.wait(10)
    assert failed.status == "failed" and "missing.npz" in failed.error_message
    assert "Traceback (most recent call last)" in failed.error_message and "worker.py" in failed.traceback
    assert "missing.npz" in _text(panel.status) and "the worker's traceback" in panel.where.value
    del run

    # GRPO: the worker writes its latest rollout, the Run tab reads it back as it reads a trainer's
    from fastft.studio.grpo import rollout_html
    from fastft.training.objectives.grpo import Rollout

    rollout = Rollout(
        prompts=["What is 2 plus 2?"],
        completions=["4", "5"],
        prompt_ids=[np.arange(3)],
        completion_ids=[np.arange(1), np.arange(1)],
        truncated=np.array([False, True]),
        rewards=np.array([[1.0], [0.0]]),
        total=np.array([1.0, 0.0]),
        advantages=np.array([0.7, -0.7]),
        step=4,
    )
    (folder / "rollout.json").write_text(json.dumps(worker._rollout_fields(rollout)))
    again = failed.last_rollout
    assert again.step == 4 and again.completions == ["4", "5"] and again.rewards.shape == (2, 1)
    assert rollout_html(again, ["exact_match"], 2, step=4) == rollout_html(
        rollout, ["exact_match"], 2, step=4
    )

    # a worker killed before it could write its end: its state is "failed", with its log
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    status = json.loads((folder / "status.json").read_text())
    status.update(status="running", pid=int(gone.stdout))
    (folder / "status.json").write_text(json.dumps(status))
    info = read_run(folder)
    assert info.status == "failed" and "ended without saying why" in info.error
    assert [i.status for i in list_runs(tmp_path)] == ["failed"]
    follower = ProcessRun.attach(folder)
    follower.wait(10)
    assert follower.status == "failed" and "worker.log" in follower.error_message
    with pytest.raises(ValueError, match="not the folder of a run the studio started"):
        ProcessRun.attach(tmp_path)


def test_a_tracker_is_named_before_start_and_wandb_is_called_only_when_ticked(tmp_path, monkeypatch):
    state = _state()
    panel = RunPanel(state, live="text")
    panel.train_in.value = "kernel"
    panel.steps.value = 2
    panel.output_dir.value = str(tmp_path / "run")
    panel.tensorboard.value = True
    if importlib.util.find_spec("tensorboard") is None:
        assert "TensorBoard is not installed" in _text(panel.checks) and "pip install tensorboard" in _text(
            panel.checks
        )
    else:
        panel.start_button.click()
        panel.wait(60)
        assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    panel.tensorboard.value = False

    calls = []

    class FakeRun:
        def log(self, values, step):
            calls.append(("log", step, values["train/loss"]))

        def finish(self):
            calls.append(("finish",))

    wandb = types.ModuleType("wandb")
    wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    wandb.init = lambda **kwargs: calls.append(("init", kwargs["dir"])) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    panel.start_button.click()
    panel.wait(60)
    assert calls == []  # not ticked: never initialised
    panel.wandb.value = True
    panel.start_button.click()
    panel.wait(60)
    losses = [e.loss for e in panel.run.events if isinstance(e, StepEvent)]
    assert calls == [
        ("init", str(tmp_path / "run")),
        ("log", 1, losses[0]),
        ("log", 2, losses[1]),
        ("finish",),
    ]

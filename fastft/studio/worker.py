"""``python -m fastft.studio.worker RUN_DIR [--resume-from CHECKPOINT]``: a studio run in a process of its own.

The studio writes the run's folder (`fastft.studio.run_folder`: ``run.json``, the adapter at Start, the data)
and starts this module in a new session, so the run outlives the notebook's kernel. It loads the model and
the adapter, the data, and trains them with the same `Run` (`fastft.studio.run_control`: `fastft.Trainer` on a
thread) as a run in the kernel, every event appended to ``events.jsonl``; checkpoints go to the folder. Its
main thread looks at ``control/`` between polls (pause, stop, save) and writes ``status.json`` at each change
and every second. SIGTERM and SIGINT stop it as Stop does (the step in progress ends, a checkpoint is
written). At the end it saves the trained adapter (``trained/``), writes its final status (with the
traceback when it failed) and exits: 0 finished or stopped, 1 failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from fastft.data.packing import load_packed
from fastft.models.lora import load_adapter
from fastft.studio import run_folder as files
from fastft.training.trainer import TrainConfig

# Function-local imports: tests replace these names on their modules, so they are looked up when called.

POLL_S = 0.1  # how often the control folder is looked at
HEARTBEAT_S = 1.0  # status.json is rewritten at least this often while the run lives


class _Status:
    """``status.json``: the fields so far, written whole when they change (and every `HEARTBEAT_S`)."""

    def __init__(self, folder: Path, **fields):
        self.path = folder / files.STATUS
        self.fields = dict(fields)
        self.written = 0.0
        self.write()

    def update(self, **fields) -> None:
        changed = any(self.fields.get(k) != v for k, v in fields.items())
        self.fields.update(fields)
        if changed or time.monotonic() - self.written >= HEARTBEAT_S:
            self.write()

    def write(self) -> None:
        self.fields["updated"] = time.time()
        files.write_json(self.path, self.fields)
        self.written = time.monotonic()


def _load(spec: dict, folder: Path):
    """The model with the run's starting adapter, the tokenizer with the kernel's chat template."""
    from fastft.models.loading import load_model

    model_spec = spec["model"]
    model, tokenizer = load_model(model_spec["name"], **model_spec.get("load", {}))
    model = load_adapter(
        model, folder / files.START, gradient_checkpointing=model_spec.get("gradient_checkpointing", "auto")
    )
    if model_spec.get("chat_template") is not None:
        tokenizer.chat_template = model_spec["chat_template"]
    return model, tokenizer


def _data(spec: dict, folder: Path):
    """(train data, eval data): packed bins as the Data tab packed them, or GRPO's prompt rows."""

    data = spec["data"]
    if data.get("rows"):
        with open(folder / data["rows"], encoding="utf-8") as lines:
            return [json.loads(line) for line in lines if line.strip()], None
    train = load_packed(folder / data["train"])
    return train, (load_packed(folder / data["eval"]) if data.get("eval") else None)


def _config(spec: dict, folder: Path, resume_from: str | None):
    kwargs = dict(spec["config"], output_dir=str(folder))
    if resume_from:
        kwargs["resume_from"] = (
            str(folder / resume_from) if not Path(resume_from).is_absolute() else resume_from
        )
    if spec.get("method") == "grpo":
        from fastft.training.objectives.grpo import GRPOConfig

        return GRPOConfig(**kwargs)

    return TrainConfig(**kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fastft.studio.worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("run_dir", help="the run's folder, written by the studio")
    parser.add_argument("--resume-from", default=None, help="a checkpoint folder (relative: in RUN_DIR)")
    args = parser.parse_args(argv)
    folder = Path(args.run_dir).resolve()
    status = _Status(
        folder, pid=os.getpid(), status="starting", started=time.time(), step=0, resumed_from=args.resume_from
    )
    stop_asked = []

    def on_signal(signum, _frame) -> None:
        stop_asked.append(signum)

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    run = None
    trackers: list = []
    try:
        spec = files.read_json(folder / files.SPEC)
        if spec is None or spec.get("format") != files.SPEC_FORMAT:
            raise ValueError(
                f"{folder / files.SPEC} is missing or not a studio run: start runs from the studio."
            )
        model, tokenizer = _load(spec, folder)
        train_data, eval_data = _data(spec, folder)
        config = _config(spec, folder, args.resume_from)
        if stop_asked or "stop" in files.requests(folder):
            status.update(status="stopped")
            return 0
        from fastft.studio.run_control import Run
        from fastft.training.events import EventLog
        from fastft.training.tracking import make_trackers

        rewards = None
        if spec.get("rewards"):
            from fastft.studio.grpo import reward_functions

            rewards = reward_functions(spec["rewards"])
        run = Run(
            model, tokenizer, train_data, eval_data, config, rewards=rewards, threads=spec.get("threads")
        )
        run.subscribe(EventLog(folder / files.EVENTS))
        trackers = make_trackers(spec.get("trackers") or (), folder, spec["config"], name=folder.name)
        for tracker in trackers:
            run.subscribe(tracker)
        run.start()
        _follow(run, folder, status, stop_asked)
        if run.error is None and run.trainer is not None:
            from fastft.models.hf_save import save_adapter

            save_adapter(model, folder / files.TRAINED, overwrite=True)
        status.update(
            status=run.status,
            step=run.step,
            threads=run.threads_note,
            error=run.error_message if run.error is not None else "",
            traceback=run.traceback,
        )
        if run.traceback:
            print(run.traceback, file=sys.stderr, flush=True)
        return 1 if run.error is not None else 0
    except BaseException as error:  # noqa: BLE001 - written down for the studio, then the process ends
        text = traceback.format_exc()
        print(text, file=sys.stderr, flush=True)
        status.update(status="failed", error=f"{type(error).__name__}: {error}", traceback=text)
        return 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        for tracker in trackers:
            try:
                tracker.close()
            except Exception:  # noqa: BLE001 - the run's end is written already
                traceback.print_exc()


def _follow(run, folder: Path, status: _Status, stop_asked: list) -> None:
    """Until the run ends: act on the control folder's requests and keep status.json current."""
    saves: dict[str, dict] = {}
    taken: set[str] = set()
    shown = [None]  # GRPO: the rollout last written to rollout.json

    def write_rollout() -> None:
        rollout = getattr(run.trainer, "last_rollout", None)
        if rollout is not None and rollout is not shown[0]:
            shown[0] = rollout
            files.write_json(folder / files.ROLLOUT, _rollout_fields(rollout))

    while not run.done:
        write_rollout()
        asked = files.requests(folder)
        if (stop_asked or "stop" in asked) and run.status not in ("stopping", *files.ENDED):
            run.stop()
        elif "pause" in asked and run.status in ("starting", "running"):
            run.pause()
        elif "pause" not in asked and run.status in ("pausing", "paused"):
            run.resume()
        for name in sorted(asked - taken):
            if name.startswith("save-"):
                taken.add(name)
                files.withdraw(folder, name)
                future = run.save_checkpoint()
                future.add_done_callback(lambda done, key=name[5:]: saves.update({key: _saved(done)}))
        now = run.status  # an ended status is written once the trained adapter is saved (main)
        status.update(
            status=now if now in files.ACTIVE else status.fields["status"],
            step=run.step,
            threads=run.threads_note,
            elapsed=run.elapsed_seconds,
            saves=dict(saves),
            checkpoints=run.checkpoints,
        )
        time.sleep(POLL_S)
    write_rollout()  # the last step's
    status.update(saves=dict(saves), elapsed=run.elapsed_seconds, checkpoints=run.checkpoints)


def _rollout_fields(rollout) -> dict:
    """What the Run tab shows of a GRPO rollout (`fastft.studio.grpo.rollout_html`), as JSON."""
    return {
        "prompts": rollout.prompts,
        "completions": list(rollout.completions),
        "truncated": rollout.truncated.tolist(),
        "rewards": rollout.rewards.tolist(),
        "total": rollout.total.tolist(),
        "advantages": rollout.advantages.tolist(),
        "step": rollout.step,
    }


def _saved(future) -> dict:
    error = future.exception()
    return {"error": str(error)} if error is not None else {"path": str(future.result())}


if __name__ == "__main__":
    sys.exit(main())

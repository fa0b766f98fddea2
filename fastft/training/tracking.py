"""Experiment tracking a user opts into: event subscribers that hand every `StepEvent` / `EvalEvent` to
TensorBoard (event files in the run's folder) or Weights & Biases.

Nothing here is imported, let alone started, unless asked for: `wandb.init` (the only call that may reach
the network) runs only when a run names "wandb" in its trackers. A tracker that is not installed is refused
before the run starts (`tracking_problems`), with the command that installs it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable

from fastft.training.events import EvalEvent, Event, StepEvent

# Function-local imports: wandb is optional (report_to='wandb'); torch and transformers submodules load where their
# feature is used (not every supported version has each, and each costs its import).


__all__ = ["TRACKERS", "TensorBoardLog", "TrackingError", "WandbLog", "make_trackers", "tracking_problems"]

# name → (the module it needs, the package that installs it, what it is called)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard", "TensorBoard"),
    "wandb": ("wandb", "wandb", "Weights & Biases"),
}


class TrackingError(RuntimeError):
    """A tracker was asked for that cannot run here (not installed, or an unknown name)."""


def tracking_problems(names: Iterable[str]) -> list[str]:
    """Why each of the tracker `names` cannot run here (empty: all can), each with its fix."""
    problems = []
    for name in names:
        if name not in TRACKERS:
            problems.append(f"Unknown tracker {name!r}: pick from {sorted(TRACKERS)}.")
            continue
        module, package, label = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            problems.append(
                f"{label} is not installed, so this run cannot log to it. Fix: `pip install {package}` "
                f"(then restart the kernel), or untick {label}."
            )
    return problems


def _scalars(event: Event) -> dict[str, float]:
    if isinstance(event, EvalEvent):
        values = {"eval/loss": event.eval_loss}
        values.update({f"eval/{k}": v for k, v in (event.preference or {}).items() if k != "pairs"})
        return values
    values = {
        "train/loss": event.loss,
        "train/learning_rate": event.learning_rate,
        "train/grad_norm": event.grad_norm,
        "train/trained_tokens_per_second": event.trained_tokens_per_second,
        "train/peak_memory_gib": event.peak_memory_bytes / 2**30,
        "train/step_seconds": event.step_seconds,
    }
    values.update({f"preference/{k}": v for k, v in (event.preference or {}).items() if k != "pairs"})
    values.update({f"grpo/{k}": v for k, v in (event.grpo or {}).items()})
    return values


class TensorBoardLog:
    """Writes each event's numbers as TensorBoard scalars into `folder` (``tensorboard --logdir folder``),
    flushed after every step so a TensorBoard open beside the run follows it."""

    def __init__(self, folder: str | os.PathLike):
        problems = tracking_problems(["tensorboard"])
        if problems:
            raise TrackingError(problems[0])
        from torch.utils.tensorboard import SummaryWriter

        self.folder = os.fspath(folder)
        self.writer = SummaryWriter(self.folder)

    def __call__(self, event: Event) -> None:
        for tag, value in _scalars(event).items():
            self.writer.add_scalar(tag, value, event.step)
        if isinstance(event, StepEvent):
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLog:
    """Logs each event's numbers to a Weights & Biases run (`wandb.init(project=…, dir=folder, config=…)`,
    made here: only a run that asked for W&B ever calls it)."""

    def __init__(
        self, folder: str | os.PathLike, config: dict, project: str = "fastft", name: str | None = None
    ):
        problems = tracking_problems(["wandb"])
        if problems:
            raise TrackingError(problems[0])
        import wandb

        self.run = wandb.init(project=project, dir=os.fspath(folder), config=config, name=name)

    def __call__(self, event: Event) -> None:
        self.run.log(_scalars(event), step=event.step)

    def close(self) -> None:
        self.run.finish()


def make_trackers(
    names: Iterable[str], folder: str | os.PathLike, config: dict, name: str | None = None
) -> list:
    """The subscribers for the tracker `names` ("tensorboard": event files in ``folder/tensorboard``;
    "wandb"); `TrackingError` names the fix for one that cannot run here, before any is made."""
    names = list(dict.fromkeys(names))
    problems = tracking_problems(names)
    if problems:
        raise TrackingError(" ".join(problems))
    trackers = []
    for tracker in names:
        if tracker == "tensorboard":
            trackers.append(TensorBoardLog(os.path.join(os.fspath(folder), "tensorboard")))
        else:
            trackers.append(WandbLog(folder, config, name=name))
    return trackers

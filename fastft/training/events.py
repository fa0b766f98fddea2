"""What the trainer tells the world: one `StepEvent` per optimizer step, one `EvalEvent` per evaluation.

A run returns them all as a `TrainResult`. The trainer only emits; faces (progress bar, studio plots, report) subscribe.
Events are plain frozen dataclasses of host numbers, safe to keep, plot or serialise.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastft.training.timing import StepProfile

# Function-local imports: torch.distributed's checkpoint and FSDP modules load only in a distributed run.


@dataclass(frozen=True)
class StepEvent:
    """One optimizer step (all micro-batches of it).

    `trained_tokens` counts tokens that carry a label (the ones the loss is averaged over);
    `tokens` counts every token fed to the model. Memory is the peak since the run started:
    CUDA allocator peak on a GPU, the process's peak resident set on a CPU (`memory_kind`).

    `phases` is the step's timing breakdown in milliseconds (`fastft.profile`: ``step``, ``data``,
    ``forward``, ``loss``, ``backward``, ``optimizer`` and nested phases such as ``layers.attention``,
    summed over layers and micro-batches); empty when profiling is off. On a GPU it is read from
    CUDA events once they completed, like the loss: the event of step s (with its phases) is
    emitted during step s+1.

    `tokens` are real tokens; `padding_tokens` the pad slots a static-shape step added on top
    (`TrainConfig.static_shapes`). `graph_replays` counts the step's `micro_batches` that replayed a CUDA
    graph (`fastft.training.graph`). A preference run (`TrainConfig.method`) sets `preference`: the step's
    ``pairs`` and their mean ``rewards_chosen``, ``rewards_rejected``, ``margin`` and ``accuracy`` (the share
    of pairs whose chosen answer has the higher reward; `fastft.training.objectives.preference`). A GRPO run
    (`fastft.training.objectives.grpo`) sets `grpo`: the step's mean ``reward`` and ``reward_std``, ``reward/<function>``
    per reward function, ``kl``, ``clip_ratio``, ``completion_length``, ``truncated`` and ``accuracy``.
    """

    step: int
    max_steps: int
    epoch: float
    loss: float
    learning_rate: float
    grad_norm: float
    trained_tokens: int
    tokens: int
    step_seconds: float
    trained_tokens_per_second: float
    peak_memory_bytes: int
    memory_kind: str
    phases: dict[str, float] = field(default_factory=dict, hash=False)
    padding_tokens: int = 0
    graph_replays: int = 0
    micro_batches: int = 1
    preference: dict[str, float] | None = field(default=None, hash=False)
    grpo: dict[str, float] | None = field(default=None, hash=False)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EvalEvent:
    """Loss on the held-out set, token-weighted over all its trained tokens; for a preference run the mean pair
    loss, with `preference` holding the held-out pairs' mean rewards, margin and accuracy (as `StepEvent`)."""

    step: int
    eval_loss: float
    eval_trained_tokens: int
    preference: dict[str, float] | None = field(default=None, hash=False)

    def as_dict(self) -> dict:
        return asdict(self)


Event = StepEvent | EvalEvent
Subscriber = Callable[[Event], None]


@dataclass
class TrainResult:
    """Every event of a run; `profile` is the run's step profiler (``fastft.step_profile_figure(result.profile)``), None when off;
    `cuda_graph` counts how its micro-batches ran (``captures``, ``replays``, ``eager``, ``drops``);
    `attention` names the packed-attention backend the run resolved to and its kernels (None: the model's own
    attention ran)."""

    steps: list[StepEvent] = field(default_factory=list)
    evals: list[EvalEvent] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)
    stopped_early: bool = False
    seconds: float = 0.0
    profile: StepProfile | None = field(default=None, repr=False, compare=False)
    cuda_graph: dict[str, int] = field(default_factory=dict)
    attention: str | None = None

    @property
    def final_loss(self) -> float | None:
        return self.steps[-1].loss if self.steps else None


class EventLog:
    """A subscriber that appends every event to `path` as one JSON line, written and flushed at once, so
    another process can follow the run (`read_events`: the studio plotting a run it started under
    torchrun). Under torchrun only rank 0 writes: every rank sees the same global figures."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def __call__(self, event: Event) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        line = json.dumps({"kind": type(event).__name__, **event.as_dict()})
        with open(self.path, "a", encoding="utf-8") as log:
            log.write(line + "\n")
            log.flush()


def read_events(path: str | os.PathLike, offset: int = 0) -> tuple[list[Event], int]:
    """The events an `EventLog` wrote to `path` after byte `offset`, and the offset to read on from. Only
    whole lines count: one being written is read the next time."""
    try:
        with open(path, "rb") as log:
            log.seek(offset)
            chunk = log.read()
    except FileNotFoundError:
        return [], offset
    complete = chunk.rfind(b"\n") + 1
    events: list[Event] = []
    for line in chunk[:complete].splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        kind = record.pop("kind")
        events.append(StepEvent(**record) if kind == "StepEvent" else EvalEvent(**record))
    return events, offset + complete

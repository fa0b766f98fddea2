"""Always-on phase timing of training steps: where the time of each step went, at almost no cost.

A step is cut into top-level phases that follow each other without gaps (`TOP_LEVEL`): ``data``
(building the micro-batches), ``forward`` (embedding and decoder layers), ``loss`` (final norm's
output to the loss: output head and cross-entropy), ``backward`` and ``optimizer`` (clipping,
step, zero_grad, schedule). With gradient accumulation each micro-batch adds its own forward,
loss and backward spans; a step's value is their sum. Inside them, module hooks
(`fastft.training.timing_hooks`) add nested spans: ``embed``, ``layers.N.norm`` / ``.attention`` /
``.mlp`` (``.moe`` for a mixture-of-experts block), ``final_norm``; in backward,
``loss_backward`` (loss, head and final norm), ``layers.N.backward`` (from the gradient reaching
the layer's output to the gradient of its input, recompute included) and ``layers.N.recompute``
(the layer's modules run again by activation checkpointing, counted here and never as forward).
A micro-batch replayed from a CUDA graph (`fastft.training.graph`) is one top-level phase, ``graph``
(its forward, loss and backward in one launch); no hook fires inside it. Under torchrun the step's
gradient all-reduce (`fastft.training.distributed`) is its own top-level phase, ``communication``,
between the last backward and ``optimizer``.

Clocks: perf_counter on a CPU; on a GPU one CUDA event per boundary, recorded without waiting and
read once the step's last event has completed (`StepProfile.collect`), like the trainer's loss
readout. GPU phases are therefore spans of the GPU timeline between boundaries, idle gaps included.

`StepTiming.summary` folds layers together (``layers.N.attention`` → ``layers.attention``) and adds
``step`` (the profiled wall time of the whole step, data included); that is what `StepEvent.phases`
carries. Every value is in milliseconds.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re
import statistics
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from html import escape

import torch

from fastft.training.nvtx import NvtxRanges, RecordFunctionRanges, nvtx_available, nvtx_tool_attached
from fastft.training.timing_hooks import BACKWARD, FORWARD, IDLE, instrument, release

TOP_LEVEL = ("data", "forward", "loss", "backward", "graph", "communication", "optimizer")
# Known nesting of the summary's phases: child → parent (inclusive times; a parent contains its children).
PARENTS = {
    "embed": "forward",
    "layers.norm": "forward",
    "layers.attention": "forward",
    "layers.mlp": "forward",
    "layers.moe": "forward",
    "final_norm": "forward",
    "loss_backward": "backward",
    "layers.backward": "backward",
    "layers.recompute": "layers.backward",
    "offload_wait": "layers.backward",
}
ORDER = (
    "step",
    "data",
    "forward",
    "embed",
    "layers.norm",
    "layers.attention",
    "layers.mlp",
    "layers.moe",
    "final_norm",
    "loss",
    "backward",
    "loss_backward",
    "layers.backward",
    "layers.recompute",
    "offload_wait",
    "graph",
    "communication",
    "optimizer",
)
_LAYER = re.compile(r"^layers\.\d+\.")


_GROUPS: dict[str, str] = {}


def group_of(name: str) -> str:
    """The summary name of a span: ``layers.12.attention`` → ``layers.attention``; others unchanged."""
    group = _GROUPS.get(name)
    if group is None:
        group = _GROUPS[name] = _LAYER.sub("layers.", name)
    return group


@dataclass(frozen=True)
class PhaseSpan:
    """One timed interval of a step, in ms from the step's start; depth 0 = top level, 1 = nested, 2 = inside those."""

    name: str
    start_ms: float
    end_ms: float
    depth: int

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class StepTiming:
    """Every span of one optimizer step (`step` is 1-based, as in `StepEvent`).

    `phases` sums the spans per name (ms); `intervals` holds them as plain
    ``(name, start_ms, end_ms, depth)`` tuples in recording order, `spans` as sorted `PhaseSpan`s.
    """

    step: int
    total_ms: float
    phases: dict[str, float] = field(default_factory=dict, hash=False)
    intervals: tuple[tuple[str, float, float, int], ...] = field(default=(), repr=False)

    @functools.cached_property
    def spans(self) -> tuple[PhaseSpan, ...]:
        """The spans by start time (built on first use: most steps are never drawn)."""
        return tuple(sorted((PhaseSpan(*i) for i in self.intervals), key=lambda s: (s.start_ms, s.depth)))

    def summary(self) -> dict[str, float]:
        """Milliseconds per phase with layers folded together, plus ``step`` (see the module docstring)."""
        out: dict[str, float] = {"step": self.total_ms}
        for name, ms in self.phases.items():
            key = group_of(name)
            out[key] = out.get(key, 0.0) + ms
        return out


def exclusive_phases(phases: Mapping[str, float]) -> dict[str, float]:
    """Split a summary into parts that add up to its ``step``: each known phase minus its known children.

    Keys: the summary's keys that `PARENTS` or `TOP_LEVEL` place, a parent's remainder under its own
    name, and ``other`` (step time outside every top-level phase). Phases of unknown nesting are left out.
    """
    children: dict[str, float] = collections.defaultdict(float)
    for name, parent in PARENTS.items():
        if name in phases:
            children[parent] += phases[name]
    out = {}
    for name in ORDER[1:]:
        if name in phases:
            out[name] = max(0.0, phases[name] - children.get(name, 0.0))
    if "step" in phases:
        out["other"] = max(0.0, phases["step"] - sum(phases.get(name, 0.0) for name in TOP_LEVEL))
    return out


class _CpuClock:
    mark = staticmethod(time.perf_counter)

    def ready(self, marks: list) -> bool:
        return True

    def offsets_ms(self, marks: list, wait: bool) -> list[float]:
        first = marks[0]
        return [(m - first) * 1000.0 for m in marks]

    def release(self, marks: list) -> None:
        pass


class _CudaClock:
    """CUDA events from a free list; read only after they completed, so reading never stalls a step."""

    def __init__(self) -> None:
        self._free: list[torch.cuda.Event] = []
        self.stream: torch.cuda.Stream | None = None  # the step's stream, set by `StepProfile.step_begin`

    def mark(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(self.stream)  # a given stream spares a current_stream() lookup per mark
        return event

    def ready(self, marks: list) -> bool:
        return marks[-1].query()

    def offsets_ms(self, marks: list, wait: bool) -> list[float]:
        if wait:
            marks[-1].synchronize()
        first, out = marks[0], []
        for event in marks:
            try:
                out.append(first.elapsed_time(event))
            except RuntimeError:  # recorded on another stream and not done yet: wait for this one only
                event.synchronize()
                out.append(first.elapsed_time(event))
        return out

    def release(self, marks: list) -> None:
        self._free.extend(marks)


class PendingTiming:
    """A finished step's raw marks, waiting to be read (`StepProfile.collect`)."""

    __slots__ = ("marks", "spans", "step")

    def __init__(self, step: int, marks: list, spans: list):
        self.step, self.marks, self.spans = step, marks, spans


class _Scope:
    """Context manager for a nested span opened by `phase` (see there)."""

    __slots__ = ("name", "profile", "start")

    def __init__(self, profile: StepProfile, name: str):
        self.profile, self.name, self.start = profile, name, -1

    def __enter__(self) -> _Scope:
        profile = self.profile
        if profile._state:
            self.start = profile._now()
            profile._push(self.name)
        return self

    def __exit__(self, *exc) -> None:
        profile = self.profile
        if self.start >= 0 and profile._state:
            profile._spans.append(
                (self.name, self.start, profile._now(), 2 if profile._state == BACKWARD else 1)
            )
            profile._pop()


class _NullScope:
    def __enter__(self) -> _NullScope:
        return self

    def __exit__(self, *exc) -> None:
        pass


_NULL_SCOPE = _NullScope()


class StepProfile:
    """Phase timings of every step of a run (`TrainConfig(profile=True)`; the trainer's `.profile`).

    `phases` has one summary per collected step (ms per phase, layers folded; oldest first) and
    `steps` their 1-based step numbers; `timings` keeps every span of the last `keep` steps.
    `table()` gives the median of each phase; `fastft.report.step_profile_figure(profile)` draws the
    phases across steps and `fastft.report.step_timeline_figure(profile)` one step as a Gantt chart. `attach(model)` hooks the model's modules (idempotent: a model carries
    the hooks of one profile at a time), `detach()` removes them.

    On a CUDA device the phases are also NVTX ranges (``nsys profile`` shows them by name): by default
    when an NVTX tool is attached to the process (`nvtx_tool_attached`: ``nsys profile python ...``),
    always with `nvtx=True`, never with `nvtx=False` or on a CPU device.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        device: torch.device | str | None = None,
        *,
        nvtx: bool | None = None,
        keep: int = 64,
    ):
        if device is None and model is not None:
            device = next(model.parameters()).device
        self.device = torch.device(device or "cpu")
        self._clock = _CudaClock() if self.device.type == "cuda" else _CpuClock()
        self._mark = self._clock.mark
        wanted = nvtx_tool_attached() if nvtx is None else nvtx
        use_nvtx = self.device.type == "cuda" and wanted and nvtx_available()
        self._nvtx = (NvtxRanges(),) if use_nvtx else ()
        self._ranges: tuple = self._nvtx
        self.phases: list[dict[str, float]] = []
        self.steps: list[int] = []
        self.timings: collections.deque[StepTiming] = collections.deque(maxlen=keep)
        self.instrumented: list[str] = []  # names of the hooked modules' phases
        self._handles: list = []
        # weak: the model's state holds this profile while it is attached (`fastft.training.timing_hooks`), and
        # a profile holding its model strongly would keep a model the user dropped alive through the profile
        self._model: weakref.ref[torch.nn.Module] | None = None
        self._reset()
        self._state = IDLE
        if model is not None:
            self.attach(model)

    # -- instrumentation ---------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> StepProfile:
        """Hook `model`'s modules (instance hooks; any other profile's hooks on it are removed first)."""
        self.detach()
        self._handles, self.instrumented = instrument(model, self)
        self._model = weakref.ref(model)
        return self

    def detach(self) -> None:
        """Remove every hook this profile registered (timing of top-level phases keeps working)."""
        for handle in self._handles:
            handle.remove()
        model = self._model() if self._model is not None else None
        if model is not None:
            release(model, self)
        self._handles, self._model, self.instrumented = [], None, []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def span(self, name: str):
        """Time a nested span of the running step under `name` (a no-op between steps).

        For code below the trainer that knows of a cost the hooks cannot see: the offloaded checkpointing's
        wait for its host→device copy is ``profile.span("offload_wait")``, handed to the model's offloader
        while this profile is attached (`fastft.training.timing_hooks`)."""
        return _Scope(self, name) if self._state else _NULL_SCOPE

    # -- recording (called by the trainer and the hooks) ------------------------------------------------
    def _reset(self) -> None:
        self._marks: list = []
        self._spans: list[tuple[str, int, int, int]] = []
        self._top: tuple[str, int] | None = None
        self._open: tuple[str, int, tuple] | None = None  # the backward span running now
        self._boundaries = 0  # gradient boundaries seen in this backward pass

    def _now(self) -> int:
        marks = self._marks
        marks.append(self._mark())
        return len(marks) - 1

    def _push(self, name: str) -> None:
        for ranges in self._ranges:
            ranges.push(name)

    def _pop(self) -> None:
        for ranges in self._ranges:
            ranges.pop()

    def step_begin(self) -> None:
        """Start a step; its first phase is ``data``."""
        self._reset()
        self._state = FORWARD
        if isinstance(self._clock, _CudaClock):
            self._clock.stream = torch.cuda.current_stream(self.device)
        self._top = ("data", self._now())
        self._push("data")

    def begin(self, name: str) -> None:
        """End the running top-level phase and start `name` at the same instant."""
        if not self._state:
            return
        mark = self._now()
        self._close(mark)
        self._top = (name, mark)
        self._push(name)
        if name == "backward":
            self._state, self._boundaries = BACKWARD, 0
            self._open = ("loss_backward", mark, self._range_start("loss_backward"))
        else:
            self._state = FORWARD

    @contextlib.contextmanager
    def opaque(self, name: str):
        """A top-level phase whose inside is not instrumented (a CUDA graph replay): the module hooks stay
        silent until it ends (the next `begin` or `step_end` closes it)."""
        self.begin(name)
        state, self._state = self._state, IDLE
        try:
            yield
        finally:
            self._state = state

    def _close(self, mark: int) -> None:
        if self._state == BACKWARD:
            self._end_backward(mark)
        if self._top is not None:
            name, start = self._top
            self._spans.append((name, start, mark, 0))
            self._pop()
            self._top = None

    def _handoff(self, old: str, new: str) -> None:
        """The final norm's post-hook: the rest of the forward pass is the loss."""
        if self._top is not None and self._top[0] == old:
            self.begin(new)

    def _range_start(self, name: str) -> tuple:
        return tuple(ranges.start(name) for ranges in self._ranges) if self._ranges else ()

    def _boundary(self, following: str | None) -> None:
        """The gradient of a layer's input is complete: the span running ends, `following` starts."""
        if self._state != BACKWARD:
            return
        mark = self._now()
        self._boundaries += 1
        self._finish(mark)
        if following is not None:
            self._open = (following, mark, self._range_start(following))

    def _finish(self, mark: int, keep: bool = True) -> None:
        if self._open is None:
            return
        name, start, handles = self._open
        if keep:
            self._spans.append((name, start, mark, 1))
        for ranges, handle in zip(self._ranges, handles, strict=False):
            ranges.end(handle)
        self._open = None

    def _end_backward(self, mark: int) -> None:
        # Layer 0's input needs no gradient under a frozen embedding, so no boundary ends its backward:
        # it lasts until the end of the backward pass. Without any boundary (no hooked layers) there
        # is no telling where the loss's backward ended: that span is dropped.
        self._finish(mark, keep=self._boundaries > 0)

    def step_end(self, step: int) -> PendingTiming:
        """End the step (1-based number `step`); read it later with `collect`."""
        if self._state:
            self._close(self._now())
        self._state = IDLE
        pending = PendingTiming(step, self._marks, self._spans)
        self._reset()
        return pending

    def cancel(self) -> None:
        """Drop a step that did not finish (an exception inside it); a no-op between steps."""
        if self._state and self._top is not None:
            self._pop()
        self._finish(-1, keep=False)
        self._state = IDLE
        self._reset()

    def ready(self, pending: PendingTiming) -> bool:
        """True when `collect` will not wait (always on a CPU)."""
        return not pending.marks or self._clock.ready(pending.marks)

    def collect(self, pending: PendingTiming, wait: bool = True) -> dict[str, float]:
        """Read a finished step: store its `StepTiming` and return its summary (ms per phase)."""
        if not pending.marks:
            return {}
        offsets = self._clock.offsets_ms(pending.marks, wait)
        self._clock.release(pending.marks)
        intervals = tuple((name, offsets[a], offsets[b], depth) for name, a, b, depth in pending.spans)
        phases: dict[str, float] = {}
        for name, start, end, _ in intervals:
            phases[name] = phases.get(name, 0.0) + (end - start)
        timing = StepTiming(pending.step, offsets[-1], phases, intervals)
        summary = timing.summary()
        self.timings.append(timing)
        self.phases.append(summary)
        self.steps.append(pending.step)
        return summary

    # -- torch.profiler annotations ---------------------------------------------------------------------
    def _annotate(self, on: bool) -> RecordFunctionRanges | None:
        """Also emit the phases as torch.profiler ranges (while a profiling window records)."""
        if on:
            annotations = RecordFunctionRanges()
            self._ranges = (*self._nvtx, annotations)
            return annotations
        for ranges in self._ranges:
            if isinstance(ranges, RecordFunctionRanges):
                ranges.close()
        self._ranges = self._nvtx
        return None

    # -- reading ----------------------------------------------------------------------------------------
    def timing(self, step: int | None = None) -> StepTiming | None:
        """The kept `StepTiming` of `step` (default: the latest), or None."""
        if not self.timings:
            return None
        if step is None:
            return self.timings[-1]
        return next((t for t in self.timings if t.step == step), None)

    def table(self, skip: int = 1) -> Table:
        """Median and mean ms of each phase and its share of the median step (the first `skip` steps left out)."""
        return phase_table(self.phases[skip:] if len(self.phases) > skip else self.phases)


class NullProfile:
    """What the trainer calls when profiling is off: every method does nothing."""

    def step_begin(self) -> None:
        pass

    def begin(self, name: str) -> None:
        pass

    @contextlib.contextmanager
    def opaque(self, name: str):
        yield

    def step_end(self, step: int) -> None:
        return None

    def cancel(self) -> None:
        pass


NULL_PROFILE = NullProfile()


# -- tables ---------------------------------------------------------------------------------------------------
class Table:
    """Rows of plain values with a text form (`str`) and an HTML form (shown by Jupyter).

    `formats` maps a column to a format string for its numbers (default ``{:,.3f}`` for floats).
    """

    def __init__(
        self, columns: Sequence[str], rows: Iterable[Sequence], formats: Mapping[str, str] | None = None
    ):
        self.columns = list(columns)
        self.rows = [list(row) for row in rows]
        self.formats = dict(formats or {})

    def to_dicts(self) -> list[dict]:
        return [dict(zip(self.columns, row, strict=True)) for row in self.rows]

    def cells(self) -> list[list[str]]:
        """Every row as formatted text."""
        out = []
        for row in self.rows:
            line = []
            for column, value in zip(self.columns, row, strict=True):
                if value is None:
                    line.append("")
                elif isinstance(value, float):
                    line.append(self.formats.get(column, "{:,.3f}").format(value))
                else:
                    line.append(str(value))
            out.append(line)
        return out

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        cells = [self.columns, *self.cells()]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        return "\n".join(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in cells
        )

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in self.cells()
        )
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def phase_table(phases: Sequence[Mapping[str, float]]) -> Table:
    """Per phase over steps: median ms, mean ms, and the median's share of the median step.

    Phases come in `ORDER`, then any others (spans of `phase`) by name; ``inside`` names the parent.
    """
    names = [n for n in ORDER if any(n in p for p in phases)]
    names += sorted({n for p in phases for n in p} - set(names))
    steps = [p["step"] for p in phases if "step" in p]
    step_median = statistics.median(steps) if steps else 0.0
    rows = []
    for name in names:
        values = [p[name] for p in phases if name in p]
        median = statistics.median(values)
        parent = PARENTS.get(name) or ("step" if name in TOP_LEVEL else None)
        share = median / step_median if step_median > 0 else None
        rows.append([name, parent, median, statistics.fmean(values), share])
    return Table(
        ["phase", "inside", "median ms", "mean ms", "share of step"],
        rows,
        formats={"share of step": "{:.1%}"},
    )

"""The Run tab's live read-out of a run: progress bar and status line, the curves (loss, learning rate,
tokens/s, memory; preference rewards; GRPO rewards), the latest GRPO rollout and the step timing.

`RunReadout` owns those widgets and the bounded series behind the curves (`SeriesBuffer`); the panel's ticker
calls `take` and `tick` a few times a second, never from inside a training step.
"""

from __future__ import annotations

import html
import math
import time

import ipywidgets as widgets

from fastft.data.rewards import reward_name
from fastft.report.figures import phases_figure, run_dashboard_figure
from fastft.studio.grpo import grpo_figure, rollout_html
from fastft.studio.launched import LaunchedRun
from fastft.studio.live import Ema, LiveFigure, SeriesBuffer
from fastft.studio.notices import status_html
from fastft.studio.preference import preference_figure
from fastft.studio.process_run import ProcessRun
from fastft.studio.run_control import Run
from fastft.studio.run_settings import PREFERENCE_METHODS
from fastft.training.events import EvalEvent, StepEvent
from fastft.training.timing import phase_table

__all__ = ["RunReadout", "duration", "ending", "status_line", "where_html"]

_BAR_STYLES = {"failed": "danger", "finished": "success", "stopped": "warning"}


def duration(seconds: float) -> str:
    """`seconds` as m:ss, or h:mm:ss from an hour on."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _shown(visible: bool) -> str | None:
    """A layout's ``display``: None shows the widget, "none" hides it."""
    return None if visible else "none"


class RunReadout:
    """The widgets that show a run as it trains (`mode`: how plots update, as `LiveFigure` takes it), each
    curve's series bounded to `max_points`. `timing` is the step-timing section (figure and table)."""

    TIMING_EVERY = 5.0  # seconds between redraws of the step-timing figure and table
    TIMING_STEPS = 120  # steps shown in the step-timing bars (the latest ones)
    TEXT_EVERY = 10.0  # seconds between status lines printed without a notebook

    def __init__(self, mode: str, max_points: int = 2000):
        self.mode = mode
        self.max_points = max_points
        self._seen = 0  # run.events taken into the series so far
        self._last_timing = 0.0
        self._last_text = 0.0
        self.series = SeriesBuffer(
            ("loss", "smoothed", "learning_rate", "tokens_per_second", "memory_gib"), max_points
        )
        self.eval_series = SeriesBuffer(("eval_loss",), max_points)
        self.preference_series = SeriesBuffer(
            ("rewards_chosen", "rewards_rejected", "margin", "accuracy"), max_points
        )
        self.grpo_series = SeriesBuffer(("reward", "kl", "completion_length", "accuracy"), max_points)
        self._grpo_rewards: list[str] = []  # the running GRPO run's reward names, as its series hold them
        self._shown_rollout = None
        self._ema = Ema(0.9)
        # no side margins: at 100 % width they would push the bar past the tab's edge
        self.progress = widgets.IntProgress(
            value=0, min=0, max=1, layout=widgets.Layout(width="100%", margin="2px 0")
        )
        self.progress_text = widgets.HTML("")
        self.plots = LiveFigure(run_dashboard_figure(), mode)
        self.preference_plots = LiveFigure(preference_figure(), mode)
        self.grpo_plots = LiveFigure(grpo_figure(), mode)
        self.rollouts = widgets.HTML("")  # the latest rollout: prompts, completions, rewards, advantages
        self.timing_figure = LiveFigure(phases_figure([], []), mode)
        self.timing_table = widgets.HTML("")
        self.timing = widgets.VBox(
            [
                widgets.HTML("<b>Step timing</b> (ms per phase, latest steps)"),
                self.timing_figure.widget,
                self.timing_table,
            ]
        )

    def show_method(self, method: str) -> None:
        """Show the preference curves for a preference method, the GRPO curves and rollouts for GRPO."""
        self.preference_plots.widget.layout.display = _shown(method in PREFERENCE_METHODS)
        self.grpo_plots.widget.layout.display = _shown(method == "grpo")
        self.rollouts.layout.display = _shown(method == "grpo")

    def reset(self, run, cuda: bool) -> None:
        """Empty curves, progress and timing for `run` (its x axes to its last step; memory of a CUDA run
        read as CUDA memory, else as the process's resident memory)."""
        max_steps = run.max_steps
        self.series.clear()
        self.eval_series.clear()
        self.preference_series.clear()
        self._shown_rollout = None
        self.rollouts.value = ""
        self._ema = Ema(0.9)
        self._seen = 0
        self._last_timing = 0.0
        self.progress.max = max(1, int(max_steps or 1))
        self.progress.value = 0
        self.progress.bar_style = ""
        self.progress_text.value = ""
        self.timing_figure.replace(phases_figure([], []))  # the last run's bars, labels and axis go
        self.timing_table.value = ""
        self.plots.replace(
            run_dashboard_figure(max_steps=max_steps, memory_kind="cuda" if cuda else "cpu-rss")
        )
        method = getattr(run.config, "method", "sft")
        self.show_method(method)
        if method in PREFERENCE_METHODS:
            self.preference_plots.replace(preference_figure(max_steps=max_steps))
        if method == "grpo":
            self._grpo_rewards = [reward_name(r) for r in run.rewards or ()]
            self.grpo_series = SeriesBuffer(self._grpo_columns(), self.max_points)
            self.grpo_plots.replace(grpo_figure(self._grpo_rewards, max_steps=max_steps))

    def take(self, run, final: bool = False) -> None:
        """Move `run`'s new events into the series and curves, then show its progress and status line."""
        n = len(run.events)
        new = run.events[self._seen : n]
        self._seen = n
        for event in new:
            if isinstance(event, StepEvent):
                self._take_step(event)
            elif isinstance(event, EvalEvent):
                self.eval_series.append(event.step, eval_loss=event.eval_loss)
        if new or final:
            self._draw()
            self._show_rollout(run)
        self.progress.max = max(1, int(run.max_steps or 1))
        self.progress.value = min(run.step, self.progress.max)
        self.progress.bar_style = _BAR_STYLES.get(run.status, "")
        self.progress_text.value = html.escape(status_line(run))

    def tick(self, run, final: bool = False) -> None:
        """What is redrawn less often: the step timing every `TIMING_EVERY` seconds, a status line printed
        every `TEXT_EVERY` seconds without a notebook; at the end (`final`) everything, flushed."""
        now = time.monotonic()
        if final or now - self._last_timing >= self.TIMING_EVERY:
            self._last_timing = now
            self._draw_timing(run)
        if self.mode == "text" and (final or now - self._last_text >= self.TEXT_EVERY) and run.events:
            self._last_text = now
            print(status_line(run), flush=True)
        if final:
            self.plots.flush()
            self.preference_plots.flush()
            self.grpo_plots.flush()
            self.timing_figure.flush()

    def _take_step(self, event: StepEvent) -> None:
        self.series.append(
            event.step,
            loss=event.loss,
            smoothed=self._ema(event.loss),
            learning_rate=event.learning_rate,
            tokens_per_second=event.trained_tokens_per_second,
            memory_gib=event.peak_memory_bytes / 2**30,
        )
        if event.preference:
            self.preference_series.append(
                event.step, **{k: v for k, v in event.preference.items() if k != "pairs"}
            )
        if event.grpo:
            self.grpo_series.append(event.step, **event.grpo)

    def _draw(self) -> None:
        s = self.series
        x = s.column("x")
        self.plots.set_data(
            {
                0: (x, s.column("loss")),
                1: (x, s.column("smoothed")),
                2: (self.eval_series.column("x"), self.eval_series.column("eval_loss")),
                3: (x, s.column("learning_rate")),
                4: (x, s.column("tokens_per_second")),
                5: (x, s.column("memory_gib")),
            }
        )
        g = self.grpo_series
        if len(g) and g.columns[1:] == self._grpo_columns():
            gx = g.column("x")
            self.grpo_plots.set_data({i: (gx, g.column(name)) for i, name in enumerate(self._grpo_columns())})
        p = self.preference_series
        if len(p):
            px = p.column("x")
            self.preference_plots.set_data(
                {
                    0: (px, p.column("rewards_chosen")),
                    1: (px, p.column("rewards_rejected")),
                    2: (px, p.column("margin")),
                    3: (px, p.column("accuracy")),
                }
            )

    def _grpo_columns(self) -> tuple[str, ...]:
        """The GRPO series' columns in `fastft.studio.grpo.grpo_figure`'s trace order."""
        per_function = (f"reward/{name}" for name in self._grpo_rewards)
        return ("reward", *per_function, "kl", "completion_length", "accuracy")

    def _show_rollout(self, run) -> None:
        """The rollouts inspector: redrawn when the trainer has a new rollout."""
        owner = run.trainer if run.trainer is not None else run  # a `ProcessRun` reads its worker's
        rollout = getattr(owner, "last_rollout", None)
        if rollout is None or rollout is self._shown_rollout:
            return

        self._shown_rollout = rollout
        group = run.config.num_generations
        # its own step: the trainer keeps a step's rollout before that step's event arrives
        self.rollouts.value = rollout_html(rollout, self._grpo_rewards, group, step=rollout.step or None)

    def _draw_timing(self, run) -> None:
        profile = getattr(getattr(run, "trainer", None), "profile", None)
        if profile is not None:
            n = len(profile.steps)  # phases are appended before steps: both hold at least n entries
            all_steps, all_phases = profile.steps[:n], profile.phases[:n]
        else:  # a run in another process: the phases its events carry
            timed = [e for e in run.events if isinstance(e, StepEvent) and e.phases]
            all_steps, all_phases = [e.step for e in timed], [e.phases for e in timed]
        n = len(all_steps)
        if not n:
            return
        first = max(0, n - self.TIMING_STEPS)
        self.timing_figure.update_from(phases_figure(list(all_steps[first:]), list(all_phases[first:])))
        table = phase_table(all_phases[1:] if n > 1 else all_phases)
        self.timing_table.value = table._repr_html_()


def status_line(run) -> str:
    """One line on `run`: its status, step, time elapsed and left, loss, speed, memory and its method's
    numbers (preference accuracy and margin, GRPO reward), and the last eval loss."""
    step, total = run.step, run.max_steps or 0
    elapsed = run.elapsed_seconds
    parts = [f"{run.status}", f"step {step}/{total}", f"{duration(elapsed)} elapsed"]
    if run.active and step and total > step:
        parts.append(f"ETA {duration(elapsed / step * (total - step))}")
    recent = [e for e in run.events[-50:] if isinstance(e, StepEvent)][-20:]
    if recent:
        parts += _speed_parts(recent)
    if recent and recent[-1].preference:
        metrics = recent[-1].preference
        parts.append(f"accuracy {metrics['accuracy']:.0%} · margin {metrics['margin']:+.3f}")
    if recent and recent[-1].grpo:
        metrics = recent[-1].grpo
        parts.append(f"reward {metrics['reward']:+.3f}")
        if "accuracy" in metrics:
            parts.append(f"accuracy {metrics['accuracy']:.0%}")
    evals = [e for e in run.events[-50:] if isinstance(e, EvalEvent)]
    if evals:
        parts.append(f"eval loss {evals[-1].eval_loss:.4f}")
    return " · ".join(parts)


def _speed_parts(recent: list[StepEvent]) -> list[str]:
    """The last loss, tokens/s and memory of the `recent` steps, and how many micro-batches a CUDA graph
    replayed."""
    last = recent[-1]
    # tokens/s over the last steps, not the last one alone: one step slowed by the notebook's own
    # work (a plot redraw holding the GIL) would otherwise read as the run's speed
    seconds = sum(e.step_seconds for e in recent)
    speed = sum(e.trained_tokens for e in recent) / seconds if seconds > 0 else 0.0
    parts = [
        f"loss {last.loss:.4f}",
        f"{speed:,.0f} trained tok/s",
        f"{last.peak_memory_bytes / 2**30:.2f} GiB",
    ]
    replayed = sum(e.graph_replays for e in recent)
    if replayed:  # chat data replays too: its micro-batches are padded to one shape
        parts.append(f"CUDA graph: {replayed}/{sum(e.micro_batches for e in recent)} micro-batches replayed")
    return parts


def ending(run) -> tuple[str, str, str | None]:
    """How `run` ended, as the panel says it: its text, kind ("error", "warn", "ok") and title."""
    if run.error is not None:
        return run.error_message, "error", "The run stopped"
    if run.status == "stopped":
        where = f" Last checkpoint: {run.checkpoints[-1]}." if run.checkpoints else ""
        return f"Stopped at step {run.step}.{where}", "warn", None
    final = run.result.final_loss
    where = f" Checkpoint: {run.checkpoints[-1]}." if run.checkpoints else ""
    loss = f" with loss {final:.4f}" if final is not None and math.isfinite(final) else ""
    attention = f" Attention: {run.result.attention}." if run.result.attention else ""
    return (
        f"Finished {run.step} steps in {duration(run.elapsed_seconds)}{loss}.{where}{attention}",
        "ok",
        None,
    )


def where_html(run, in_process: bool, processes: int) -> str:
    """Where `run` trains (a child process: its pid, folder, log and any traceback; this kernel; torchrun),
    or with none going, where Start would train it (`in_process`, on `processes` processes)."""
    if isinstance(run, ProcessRun):
        alive = "running" if run.active else "ended"
        parts = [
            f"In a child process: pid {run.pid} ({alive})",
            f"folder {run.folder}",
            f"log {run.log_path}",
        ]
        if run.threads_note:
            parts.append(f"CPU threads {run.threads_note}")
        text = html.escape(" · ".join(parts))
        if run.traceback:
            text += (
                "<details><summary>the worker's traceback</summary><pre style='white-space:pre-wrap'>"
                f"{html.escape(run.traceback)}</pre></details>"
            )
        return status_html(text, "info", raw=True)
    if isinstance(run, Run) and run.active:
        threads = f" · CPU threads {run.threads_note}" if run.threads_note else ""
        return status_html(f"In this kernel: the model object is trained{threads}.", "info")
    if isinstance(run, LaunchedRun) and run.active:
        return status_html(f"On {run.processes} processes (torchrun) · log {run.log_path}", "info")
    if in_process:
        text = "Start trains in a child process: the run goes on if the kernel restarts."
    elif processes > 1:
        text = f"Start trains on {processes} processes (torchrun)."
    else:
        text = "Start trains in this kernel: the model object holds the trained weights afterwards."
    return status_html(text, "info")

"""The Run tab's Runs view: the runs in the runs folder (the folder above the output dir), each with its state
(running, paused, finished, failed, stopped: from its files and whether its pid lives), step, loss, pid and
checkpoints; Show follows the chosen run in the plots above, Resume trains it on from one of its checkpoints
in a new child process (`fastft.studio.process_run.ProcessRun.from_checkpoint`)."""

from __future__ import annotations

import html
import math
from pathlib import Path

import ipywidgets as widgets

from fastft.studio.notices import button, error_html, field, row, status_html
from fastft.studio.process_run import ProcessRun
from fastft.studio.run_folder import RunInfo, list_runs

__all__ = ["RunsView"]


class RunsView:
    """The runs of `panel`'s runs folder (`panel`: the `RunPanel` whose plots show a chosen run).

    ``refresh()`` reads the folder again (and returns its runs, newest first); ``show(folder)`` follows a run;
    ``resume(folder, checkpoint)`` starts a run again from its checkpoint and returns the new `ProcessRun`.
    Widgets: ``table``, ``run_choice``, ``checkpoint_choice``, ``refresh_button``, ``show_button``,
    ``resume_button``, ``message``.
    """

    def __init__(self, panel):
        self.panel = panel
        self.infos: list[RunInfo] = []
        style = {"description_width": "6em"}
        self.title = widgets.HTML("")
        self.table = widgets.HTML("")
        self.run_choice = widgets.Dropdown(options=[], description="run", style=style, layout=field("16em"))
        self.checkpoint_choice = widgets.Dropdown(
            options=[], description="checkpoint", style=style, layout=field("16em")
        )
        self.refresh_button = button(description="Refresh", icon="refresh")
        self.show_button = button(description="Show", icon="line-chart")
        self.resume_button = button(description="Resume from checkpoint", icon="play")
        self.message = widgets.HTML("")
        self.run_choice.observe(self._on_choice, names="value")
        self.refresh_button.on_click(lambda _b: self.refresh())
        self.show_button.on_click(lambda _b: self._act(self.show))
        self.resume_button.on_click(lambda _b: self._act(self.resume))
        self.widget = widgets.VBox(
            [
                self.title,
                self.table,
                row([self.run_choice, self.checkpoint_choice]),
                row([self.refresh_button, self.show_button, self.resume_button]),
                self.message,
            ]
        )

    @property
    def folder(self) -> Path:
        """The runs folder: the one above the run the Run tab follows, else above its output dir (``runs``
        for ``runs/studio``)."""
        followed = getattr(self.panel.run, "folder", None)
        if followed is not None:
            return Path(followed).parent
        output = self.panel.output_dir.value.strip() or "runs/studio"
        return Path(output).expanduser().parent

    def refresh(self) -> list[RunInfo]:
        """Read the runs folder again: the table and the choices follow."""
        self.infos = list_runs(self.folder)
        self.title.value = f"<b>Runs</b> in {html.escape(str(self.folder))}/ (started by the studio)"
        if not self.infos:
            self.table.value = status_html("None yet: Start writes one here.", "info")
        else:
            self.table.value = _table(self.infos)
        chosen = self.run_choice.value
        self.run_choice.options = [(info.name, str(info.folder)) for info in self.infos]
        if any(chosen == value for _, value in self.run_choice.options):
            self.run_choice.value = chosen
        self._on_choice()
        return self.infos

    def _info(self, folder: str | None) -> RunInfo | None:
        return next((info for info in self.infos if str(info.folder) == folder), None)

    def _on_choice(self, _change=None) -> None:
        info = self._info(self.run_choice.value)
        checkpoints = info.checkpoints if info is not None else []
        self.checkpoint_choice.options = [(Path(path).name, path) for path in reversed(checkpoints)]
        self.resume_button.disabled = info is None or info.active or not checkpoints
        self.show_button.disabled = info is None

    def _act(self, action) -> None:
        try:
            action()
        except Exception as error:  # noqa: BLE001 - shown here, never raised into the notebook
            self.message.value = error_html(str(error), "Not done")

    def _check_idle(self) -> None:
        run = self.panel.run
        if run is not None and run.active and not _same_folder(run, self.run_choice.value):
            raise RuntimeError(
                "The Run tab is following a run that is still going: stop it, or wait for it to end, first."
            )

    def show(self, folder: str | None = None):
        """Follow the run in `folder` (default: the chosen one) in the Run tab's plots."""

        folder = folder or self.run_choice.value
        if not folder:
            raise ValueError("No run is chosen: pick one in 'run' (Refresh reads the folder again).")
        self._check_idle()
        current = self.panel.run
        if _same_folder(current, folder):
            return current
        run = ProcessRun.attach(folder)
        self.panel.follow(run)
        self.message.value = status_html(f"Showing {folder} ({run.status}).", "info")
        return run

    def resume(self, folder: str | None = None, checkpoint: str | None = None):
        """Train the run in `folder` on from `checkpoint` (defaults: the chosen ones) in a new child process."""

        folder = folder or self.run_choice.value
        checkpoint = checkpoint or self.checkpoint_choice.value
        if not folder or not checkpoint:
            raise ValueError("Pick a run and one of its checkpoints first.")
        self._check_idle()
        run = ProcessRun.from_checkpoint(folder, checkpoint)
        self.panel.follow(run)
        self.message.value = status_html(
            f"Resumed {folder} from {Path(checkpoint).name} (pid {run.pid}).", "ok"
        )
        self.refresh()
        return run


def _same_folder(run, folder: str | None) -> bool:
    here = getattr(run, "folder", None)
    return here is not None and folder is not None and Path(here).resolve() == Path(folder).resolve()


def _table(infos: list[RunInfo]) -> str:
    head = "".join(
        f"<th style='text-align:left;padding:2px 8px'>{name}</th>"
        for name in ("run", "state", "step", "loss", "pid", "checkpoints", "model · method")
    )
    rows = []
    for info in infos:
        loss = f"{info.loss:.4f}" if info.loss is not None and math.isfinite(info.loss) else "–"
        steps = f"{info.step}/{info.max_steps}" if info.max_steps else str(info.step)
        checkpoints = (
            ", ".join(Path(path).name.removeprefix("checkpoint-") for path in info.checkpoints) or "–"
        )
        cells = [
            info.name,
            info.status,
            steps,
            loss,
            str(info.pid) if info.active and info.pid else "–",
            checkpoints,
            f"{info.model} · {info.method}",
        ]
        title = f" title='{html.escape(info.error)}'" if info.error else ""
        rows.append(
            f"<tr{title}>"
            + "".join(f"<td style='padding:2px 8px'>{html.escape(c)}</td>" for c in cells)
            + "</tr>"
        )
    return (
        "<div style='overflow-x:auto'><table style='border-collapse:collapse;font-size:13px'>"
        f"<tr>{head}</tr>{''.join(rows)}</table></div>"
    )

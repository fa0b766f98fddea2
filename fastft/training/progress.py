"""A tqdm progress bar that subscribes to the trainer's events (a notebook bar in Jupyter)."""

from __future__ import annotations

from tqdm.auto import tqdm

from fastft.training.events import EvalEvent, Event, StepEvent


class ProgressBar:
    """Shows step / max_steps, ETA, loss, trained tokens/s and peak memory."""

    def __init__(self, total: int, initial: int = 0, description: str = "training"):
        self.bar = tqdm(total=total, initial=initial, desc=description, unit="step", dynamic_ncols=True)
        self.eval_loss: float | None = None

    def __call__(self, event: Event) -> None:
        if isinstance(event, EvalEvent):
            self.eval_loss = event.eval_loss
            return
        if not isinstance(event, StepEvent):
            return
        self.bar.n = event.step
        postfix = {
            "loss": f"{event.loss:.4f}",
            "tok/s": f"{event.trained_tokens_per_second:,.0f}",
            "mem": f"{event.peak_memory_bytes / 2**30:.2f}GiB",
        }
        if self.eval_loss is not None:
            postfix["eval"] = f"{self.eval_loss:.4f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

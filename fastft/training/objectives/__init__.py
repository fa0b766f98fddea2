"""Training objectives: what one step of a run computes, on the `Trainer`'s loop.

The `Trainer` (`fastft.training.trainer`) owns the loop and what every objective shares: the data order (bins or
prompts per step, a pure function of seed and epoch), the optimizer and its schedule, gradient clipping and fp16
loss scaling (`Trainer.update`), distributed start, pause / stop, events read one step later, evaluation,
checkpoints and exact resume. An objective is an `Objective` subclass that provides:

* ``prepare(trainer, train_data, eval_data)``: the data as it trains on it (packed bins, packed pairs, prompt
  rows; anything with a length, the units the loop orders), and its own checks of the data and settings;
* ``units_per_step(trainer)``: how many of those units one optimizer step reads (default: the packed trainer's
  ``micro_batch_bins * grad_accum_steps * world_size``), and ``updates_per_step`` (optimizer updates per step,
  which the schedule counts);
* ``train_step(trainer)``: one step. It reads its units with ``trainer.units_for_step(trainer.step)`` (or,
  packed, ``trainer.bins_for_step``), runs the forward and backward passes under ``trainer.autocast()``, calls
  ``trainer.update()`` (clip, optimizer and schedule; returns the gradient norm) and ends with
  ``trainer.queue_readout(values, info)``: the device values ``[loss, grad_norm, *metrics]`` and the step's
  host facts (`Trainer.queue_readout` lists them), read back without a host sync inside the step;
* ``event_fields(metrics, info)``: the `StepEvent` fields its metrics fill (``preference``, ``grpo``), and
  optionally ``start(trainer)`` (work before the first step: DPO's precomputed reference),
  ``check_world(trainer, world_size)`` (distributed settings it cannot run) and ``captures_graphs(config)``.

Objectives on packed batches subclass `PackedObjective` (`fastft.training.objectives.packed`) instead: it
provides the packed step (micro-batches, token-weighted accumulation, CUDA graphs, static shapes, DDP/FSDP) and
evaluation, and asks for ``loss_sum(model, batch, extra)`` (the micro-batch's summed loss and its metric sums)
with ``unit`` ("token" or "pair", what the loss is averaged over) and ``metrics`` (the names of its metric sums).
Here: `SFTObjective` (`sft`), `PreferenceObjective` (`preference`: DPO, IPO, ORPO, SimPO) and `GRPOObjective`
(`grpo`, with its rollout, static decoder and loss beside it). A new objective (KTO, a reward model) is one new
module here, passed as ``Trainer(..., objective=MyObjective())``.
"""

from __future__ import annotations


class Objective:
    """The interface between the `Trainer`'s loop and what one step computes (module docstring).

    An instance serves one trainer: it may keep that run's state (a precomputed reference, a static batch
    shape, the latest rollout)."""

    name = "objective"
    metrics: tuple[str, ...] = ()  # the names of the device metric sums its step reads back after the loss
    updates_per_step = 1  # optimizer updates per step: the schedule counts them
    batch_shape = None  # the static shape a packed objective pads its micro-batches to (None: it does not)

    def prepare(self, trainer, train_data, eval_data) -> tuple:
        """The train and eval data as this objective trains on them (checked)."""
        return train_data, eval_data

    def check_world(self, trainer, world_size: int) -> None:
        """Refuse a distributed setting this objective cannot run (before the model is sharded)."""

    def units_per_step(self, trainer) -> int:
        """The data units (bins, prompts) one optimizer step reads, over every rank."""
        config = trainer.config
        return config.micro_batch_bins * config.grad_accum_steps * trainer.world_size

    def captures_graphs(self, config) -> bool:
        """Whether a step's micro-batches may replay from CUDA graphs (`fastft.training.graph`)."""
        return True

    def start(self, trainer) -> None:
        """Called at the start of every `Trainer.train()`, before its first step."""

    def train_step(self, trainer) -> None:
        """One optimizer step, ending with ``trainer.queue_readout(values, info)``."""
        raise NotImplementedError(f"{type(self).__name__} does not define train_step(trainer).")

    def event_fields(self, metrics: list[float], info: dict) -> dict:
        """The `StepEvent` fields of this objective, from the read-back values after loss and gradient norm."""
        return {}

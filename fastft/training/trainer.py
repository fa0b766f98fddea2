"""The trainer: an explicit loop that runs an objective's steps and emits one `StepEvent` per step.

The loop owns what every objective shares (`fastft.training.objectives` says what an objective provides):
the data order, the optimizer and its schedule (`update`: clipping, fp16 loss scaling), distributed start,
pause / stop between steps, events, evaluation, checkpoints and exact resume. `TrainConfig` picks the objective
(``method``: SFT, DPO, ORPO, SimPO); ``Trainer(..., objective=...)`` runs any other, GRPO's included
(`fastft.training.objectives.grpo.GRPOTrainer`).

Host–device syncs: none inside a step. On CUDA the step's loss and gradient norm are copied to
pinned memory without blocking and read one step later, when their event has completed; the
`StepEvent` of step s is emitted during step s+1 (and all are flushed at the end, before each
checkpoint and on stop). A non-finite loss stops the run with `NonFiniteLossError`; checkpoints
are written only after every earlier step was read back finite and when every trained weight is finite
(one device reduction and one sync per save, none per step), so the last one is always good.

Data order is a pure function of (seed, epoch): bins (or an objective's other units, GRPO's prompts) are
shuffled per epoch with a seeded generator, and step s always reads the same ones. Data larger than memory
comes as a `PackedStream` (shards packed as they are read; order a pure function of seed, epoch and shard;
needs `max_steps`). Resume restores adapters, optimizer, scheduler and RNG, so a resumed run's losses equal
the uninterrupted run's.
"""

from __future__ import annotations

import math
import os
import random
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from fastft.atomic import DiskFullError, expand
from fastft.checks import SettingError
from fastft.data.batch import BatchShape, PackedBatch
from fastft.data.stream import PackedStream, StreamCursor, batch_of
from fastft.runtime.attention import describe_backend, patch_packed_attention, unpatch_packed_attention
from fastft.training.checkpoint import (
    CheckpointError,
    ResumeMismatchError,
    apply_checkpoint,
    check_adapter_matches,
    clean_output_dir,
    list_checkpoints,
    read_checkpoint,
    save_checkpoint,
)
from fastft.training.config import TrainConfig, warn_long_warmup
from fastft.training.control import StepControl
from fastft.training.distributed import check_resume, full_tensor, start_distributed
from fastft.training.events import EvalEvent, Event, StepEvent, Subscriber, TrainResult
from fastft.training.graph import StepGraph
from fastft.training.loss_scale import LossScaler
from fastft.training.objectives import Objective
from fastft.training.objectives.preference import METHODS, PreferenceObjective
from fastft.training.objectives.sft import SFTObjective
from fastft.training.optimizer import adamw, advance_schedule, cosine_with_warmup
from fastft.training.progress import ProgressBar
from fastft.training.readout import PendingReadout, peak_memory
from fastft.training.resume_check import (
    accepted_message,
    check_compatible,
    compare,
    data_fingerprint,
    lora_settings,
    optimizer_message,
    weight_format,
)
from fastft.training.run_folder import (
    RunLock,
    check_writable,
    claim_folder,
    new_run_id,
    prune_own_checkpoints,
    resumed_run,
)
from fastft.training.timing import StepProfile
from fastft.training.timing_hooks import detach_profile

__all__ = [
    "NonFiniteLossError",
    "ResumeWarning",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "check_writable",
    "cosine_with_warmup",
    "objective_for",
    "train",
    "train_with_progress",
]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; training stopped and the last good checkpoint is kept."""


class Trainer:
    """Training of a (PEFT) model on the loop of this module, with the config's objective or `objective`.

    `train_data` is what the objective trains on: for SFT a `PackedDataset`, a `PackedStream` or anything `pack`
    accepts (then packed to the tokenizer's `model_max_length`); for a preference method pairs (rows or
    `PackedPairs`). Subscribers receive every `StepEvent` / `EvalEvent`; `stop()` and
    `pause()` / `unpause()` are honoured between steps (safe to call from another thread): a paused
    trainer holds its training thread at the step boundary until `unpause()` or `stop()`, and
    `call_between_steps(fn)` has that thread run `fn` there (at once while it holds).
    `profile` is the run's `StepProfile` (phase timings per step; None with `TrainConfig(profile=False)`).
    `run_id` is the id every checkpoint of the run records (a resumed run's is its checkpoint's).
    """

    run_id: str | None = None
    _run_lock: RunLock | None = None  # held (on the main rank) while a run trains into output_dir
    _folder_open = False  # every rank: output_dir was opened for this run (`_open_output_dir`)
    _signature: dict | None = None
    _resume_differences: list = []

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        train_data,
        eval_data=None,
        config: TrainConfig | None = None,
        subscribers: Iterable[Subscriber] = (),
        objective: Objective | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or TrainConfig()
        self.objective = objective if objective is not None else objective_for(self.config)
        self.train_data, self.eval_data = self.objective.prepare(self, train_data, eval_data)
        self._cursor = None
        if isinstance(self.train_data, PackedStream):
            if not self.config.max_steps:
                raise ValueError(
                    "A PackedStream has no length until it has been read: pass max_steps=... "
                    "(optimizer steps) to train on it."
                )
            self._cursor = StreamCursor(self.train_data, self.config.seed)
        self.subscribers: list[Subscriber] = list(subscribers)
        self.device = next(model.parameters()).device
        if self.config.attention is not None:
            patch_packed_attention(model, self.config.attention)
        else:  # the model's own attention, also where add_lora switched it to packed attention for the HF path
            unpatch_packed_attention(model)
        self.objective.check_world(self, int(os.environ.get("WORLD_SIZE", "1")))
        self.parallel = start_distributed(model, self.device, self.config)
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        if self.parallel is not None and self.parallel.sharding == "ddp":
            self.parallel.broadcast_parameters(self.parameters)
        if not self.parameters:
            raise ValueError("The model has no trainable parameters: call fastft.add_lora(model, ...) first.")
        _check_has_adapters(model)
        if self.config.output_dir:
            check_writable(self.config.output_dir)
        self.profile: StepProfile | None = None
        if self.config.profile:
            self.profile = StepProfile(model, self.device)
        else:
            detach_profile(model)
        self._set_up_steps()
        self._set_up_optimizer()
        self.step = 0
        self.result = TrainResult(profile=self.profile)
        self.control = StepControl()  # stop, pause and calls between steps, from any thread
        self._pending: list[PendingReadout] = []
        self._epoch_orders: dict[int, np.ndarray] = {}

    def _set_up_steps(self) -> None:
        """The run's length in steps and its warmup (`max_steps` wins over `epochs`)."""
        self.bins_per_step = self.objective.units_per_step(self)
        self.updates_per_step = self.objective.updates_per_step
        self.max_steps = self.config.max_steps or max(
            1, math.ceil(self.config.epochs * len(self.train_data) / self.bins_per_step)
        )
        warmup = self.config.warmup
        self.warmup_steps = int(warmup * self.max_steps) if isinstance(warmup, float) else int(warmup)
        if self.config.max_steps is None and self.warmup_steps >= self.max_steps and self.warmup_steps > 0:
            warn_long_warmup(self.warmup_steps, self.max_steps)

    def _set_up_optimizer(self) -> None:
        """Autocast, the fp16 loss scaler, AdamW, the schedule and the step's CUDA graph."""
        self.autocast_dtype = self._autocast_dtype()
        # fp16: loss scaling on the device (a graph reads the scale tensor at each replay); the fused AdamW
        # skips an overflowing step on the device
        self.loss_scaler = LossScaler(self.device) if self.autocast_dtype == torch.float16 else None
        self.optimizer = adamw(
            self.parameters,
            lr=self.config.learning_rate,
            betas=self.config.adam_betas,
            eps=self.config.adam_eps,
            weight_decay=self.config.weight_decay,
            fused=self.device.type == "cuda" or self.loss_scaler is not None,
        )
        self.scheduler = self._schedule()
        graphs = self.config.cuda_graph and self.objective.captures_graphs(self.config)
        graphs = graphs and not (self.parallel and self.parallel.sharding == "fsdp")  # FSDP_LIMITS
        # the objective's metric sums: one tensor for the run (a replay adds into the captured one)
        self.metric_sums = torch.zeros(len(self.objective.metrics), device=self.device)
        self.step_graph = StepGraph(
            self.parameters,
            enabled=graphs,
            accumulators=[self.metric_sums] if len(self.objective.metrics) else [],
            loss_scale=None if self.loss_scaler is None else self.loss_scaler.scale,
        )

    # -- control -----------------------------------------------------------------------------
    def subscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.append(subscriber)

    def stop(self) -> None:
        """Finish the current step, then stop (a checkpoint is written if `output_dir` is set); a paused
        run stops where it holds."""
        self.control.stop()

    def pause(self) -> None:
        """Hold the training thread at the next step boundary until `unpause()` (or `stop()`)."""
        self.control.pause()

    def unpause(self) -> None:
        self.control.unpause()

    @property
    def holding(self) -> bool:
        """True while the training thread waits between two steps because the trainer is paused."""
        return self.control.holding

    def call_between_steps(self, fn: Callable[[], object]) -> None:
        """Have the training thread call `fn()` before its next step, at once while it holds paused, so
        `fn` sees no half-done step (a checkpoint asked for from another thread). An exception from `fn`
        ends `train()`; calls still queued when `train()` returns run at the next `train()`."""
        self.control.call_between_steps(fn)

    # -- data order ----------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_orders:
            generator = np.random.default_rng([self.config.seed, epoch])
            self._epoch_orders = {epoch: generator.permutation(len(self.train_data))}
        return self._epoch_orders[epoch]

    def units_for_step(self, step: int) -> list[int]:
        """The data units (indices into the train data: bins, or GRPO's prompt rows) of optimizer step `step`
        (0-based), every rank's, in order; a pure function of the seed and the step."""
        n = len(self.train_data)
        positions = range(step * self.bins_per_step, (step + 1) * self.bins_per_step)
        return [int(self._epoch_order(p // n)[p % n]) for p in positions]

    def bins_for_step(self, step: int) -> list[list]:
        """The bins of each micro-batch of optimizer step `step` (0-based); a pure function.

        Bin indices of the `PackedDataset`; for a `PackedStream`, ``(shard, bin index)`` pairs."""
        if self._cursor is not None:
            bins = self._cursor.bins(step * self.bins_per_step, self.bins_per_step)
        else:
            bins = self.units_for_step(step)
        size = self.config.micro_batch_bins
        return [bins[i : i + size] for i in range(0, len(bins), size)]

    def batches(self, bins: list[list]) -> list[PackedBatch]:
        """The CPU `PackedBatch` of each micro-batch's bins (as `bins_for_step` gives them)."""
        make = batch_of if self._cursor is not None else self.train_data.batch
        return [make(micro_batch) for micro_batch in bins]

    def epoch_progress(self) -> float:
        """Epochs read once the current step's data is read (a stream's cursor knows its own)."""
        if self._cursor is not None:
            return self._cursor.epoch_progress
        return (self.step + 1) * self.bins_per_step / len(self.train_data)

    # -- the loop ------------------------------------------------------------------------------
    def train(self, steps: int | None = None) -> TrainResult:
        """Run until `max_steps` (or `stop()`); returns every event of the run.

        With `steps`, run at most that many more steps and return (events flushed; the final
        evaluation and checkpoint wait for the run's end); a later `train()` continues the run.
        """
        config = self.config
        target = self.max_steps if steps is None else min(self.max_steps, self.step + steps)
        if self.step == 0:  # seed dropout & co. like any trainer; a resume restores the RNG instead
            torch.manual_seed(config.seed)
            np.random.seed(config.seed % 2**32)
            random.seed(config.seed)
        if config.output_dir and not self._folder_open:
            self._open_output_dir()
        started, paused = time.perf_counter(), False
        try:
            if self.step == 0:
                self.run_id = new_run_id()
                if config.resume_from:
                    self._resume(config.resume_from)  # the run id becomes the checkpoint's
            self.objective.start(self)
            started = time.perf_counter()
            self.model.train()
            if self.device.type == "cuda":  # the events' peak memory is this run's, not the process's so far
                torch.cuda.reset_peak_memory_stats(self.device)
            while self.step < target:
                self.control.between_steps()
                if self.control.stopped:
                    self.result.stopped_early = True
                    break
                self._train_step()
                self.step += 1
                self._emit_ready()
                if config.eval_every and self.step % config.eval_every == 0 and self.step < self.max_steps:
                    self.evaluate()
                if config.save_every and self.step % config.save_every == 0:
                    self.save_checkpoint()
            self._flush()
            if self.step < self.max_steps and not self.result.stopped_early:
                paused = True  # the run keeps its output_dir locked
                return self.result  # paused after `steps`: the run is not over (a captured graph stays)
            self.step_graph.release()  # the run is over: the graph's memory pool goes back
            if self.eval_data is not None and (
                not self.result.evals or self.result.evals[-1].step != self.step
            ):
                self.evaluate()
            last_saved = self.result.checkpoints[-1] if self.result.checkpoints else ""
            wants_final = config.output_dir and (config.save_every or self.result.stopped_early)
            if wants_final and not last_saved.endswith(f"checkpoint-{self.step}"):
                self.save_checkpoint()
        except BaseException:
            self.step_graph.release()
            raise
        finally:
            if not paused:  # the run is over, or an exception ended this train()
                self._close_output_dir()
            if self.profile is not None:
                self.profile.cancel()  # a step cut short by an exception leaves no timing half-open
            self.result.seconds += time.perf_counter() - started
            self.result.cuda_graph = self.step_graph.stats
            self.result.attention = describe_backend(self.model)
        return self.result

    def _autocast_dtype(self) -> torch.dtype | None:
        if self.device.type != "cuda":
            return None
        dtype = getattr(getattr(self.model, "fastft_info", None), "dtype", None)
        return dtype if dtype in (torch.bfloat16, torch.float16) else None

    @property
    def world_size(self) -> int:
        """Ranks training this run (1 outside torchrun)."""
        return self.parallel.world_size if self.parallel is not None else 1

    @property
    def batch_shape(self) -> BatchShape | None:
        """The static shape this run pads its micro-batches to; None when it does not (or before its first
        step)."""
        return self.objective.batch_shape or None

    def autocast(self) -> torch.autocast:
        """The run's autocast context (bf16 / fp16 on CUDA per the model's dtype; off on the CPU)."""
        return torch.autocast(
            self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        )

    def _train_step(self) -> None:
        self.objective.train_step(self)

    def update(self) -> torch.Tensor:
        """One optimizer update from the accumulated gradients: unscale (fp16), clip to `max_grad_norm`, step the
        optimizer and the schedule, zero the gradients. Returns the gradient norm before clipping (a float32
        device scalar, no host sync)."""
        if self.loss_scaler:  # before clipping: the norm is the unscaled gradients'
            self.loss_scaler.unscale_(self.parameters, self._found_inf_reduction())
        if self.config.max_grad_norm is not None or self.parallel is not None:  # FSDP: a norm over shards
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.parameters, self.config.max_grad_norm or math.inf, foreach=True
            )
            grad_norm = full_tensor(grad_norm)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters]))
        if self.loss_scaler:  # skipped on the device when a gradient overflowed
            self.loss_scaler.step(self.optimizer)
            self.loss_scaler.update()
        else:
            self.optimizer.step()
        # a captured backward accumulates into the gradients' own memory: keep it, zeroed
        self.optimizer.zero_grad(set_to_none=not self.step_graph.holds_gradients)
        self.scheduler.step()
        return grad_norm.detach().float().to(self.device)

    def queue_readout(self, values: torch.Tensor, info: dict) -> None:
        """Hand a step's device `values` (``[loss, grad_norm, *metrics]``, then under torchrun the global counts
        of trained tokens, tokens, padding and pairs) and its host `info` to the events, read when ready. `info`
        holds ``step`` (1-based), ``lr``, ``trained``, ``tokens``, ``padding``, ``pairs``, ``micro_batches``,
        ``replays``, ``epoch``, the stopped `StepTimer` ``timer`` and the profiler's ``timing`` (or None)."""
        self._pending.append(PendingReadout(values, info))

    def _found_inf_reduction(self):
        """How a sharded run agrees on skipping a step: the max of every rank's overflow flag (FSDP2 ranks
        unscale their own shards; DDP's gradients are already summed, so every rank's flag is the same)."""
        if self.parallel is None or self.parallel.sharding != "fsdp":
            return None
        return lambda flag: torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)

    def _emit_ready(self, wait: bool = False) -> None:
        while self._pending and (wait or self._pending[0].ready()):
            readout = self._pending.pop(0)
            loss, grad_norm, *metrics = readout.read()
            info = readout.info
            if self.parallel is not None:
                *metrics, trained, tokens, padding, pairs = metrics
                info = dict(
                    info, trained=int(trained), tokens=int(tokens), padding=int(padding), pairs=int(pairs)
                )
            seconds = info["timer"].seconds()
            timing = info["timing"]  # recorded before the readout: complete once it is
            phases = self.profile.collect(timing) if timing is not None and self.profile else {}
            event = StepEvent(
                step=info["step"],
                max_steps=self.max_steps,
                epoch=info["epoch"],
                loss=loss,
                learning_rate=info["lr"],
                grad_norm=grad_norm,
                trained_tokens=info["trained"],
                tokens=info["tokens"],
                step_seconds=seconds,
                trained_tokens_per_second=info["trained"] / seconds if seconds > 0 else 0.0,
                # a replay's activations are the capture's, invisible to the allocator's counters
                peak_memory_bytes=max(peak_memory(self.device), self.step_graph.peak_bytes),
                memory_kind="cuda" if self.device.type == "cuda" else "cpu-rss",
                phases=phases,
                padding_tokens=info["padding"],
                graph_replays=info["replays"],
                micro_batches=info["micro_batches"],
                **self.objective.event_fields(metrics, info),
            )
            self.result.steps.append(event)
            self._publish(event)
            # a non-finite gradient norm has already been applied (clipping scales by it): stop at this
            # step, not at the next one whose loss it ruins. fp16's loss scaler is the exception: it skips
            # that step's update itself and lowers its scale
            scaled = self.loss_scaler is not None
            if not (math.isfinite(loss) and (math.isfinite(grad_norm) or scaled)):
                self._pending.clear()
                what = (
                    f"loss became {loss}" if not math.isfinite(loss) else f"gradient norm became {grad_norm}"
                )
                raise NonFiniteLossError(
                    f"The {what} at step {event.step} (loss {loss:.4g}, learning rate "
                    f"{event.learning_rate:.3g}, gradient norm {grad_norm:.3g}). Training stopped. "
                    f"{self._newest_good_checkpoint_text()}"
                )

    def _flush(self) -> None:
        self._emit_ready(wait=True)

    def _publish(self, event: Event) -> None:
        for subscriber in self.subscribers:
            subscriber(event)

    # -- evaluation and checkpoints ----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> EvalEvent:
        """The objective's loss over the whole eval set (a sync point; not part of a step): token-weighted for
        SFT; for a preference run the mean pair loss, with the pairs' mean rewards, margin and accuracy."""
        if self.eval_data is None:
            raise ValueError("No eval data: pass eval_data=... to the Trainer.")
        self._flush()
        self.model.eval()
        objective = self.objective
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        metric_sums = torch.zeros(len(objective.metrics), device=self.device, dtype=torch.float64)
        trained = pairs = 0
        size = self.config.micro_batch_bins
        starts = list(range(0, len(self.eval_data), size))
        if self.parallel is not None and self.parallel.sharding == "ddp":  # FSDP: every rank runs every batch
            starts = self.parallel.shard(starts)
        try:
            for start in starts:
                bins = list(range(start, min(start + size, len(self.eval_data))))
                batch = self.eval_data.batch(bins).to(self.device)
                with self.autocast():
                    loss, metrics = objective.loss_sum(
                        self.model, batch, objective.extra_input(self, "eval", bins)
                    )
                total += loss.double()
                if metrics is not None:
                    metric_sums += metrics.double()
                pairs += batch.num_sequences // 2
                trained += batch.num_trained_tokens
        finally:
            self.model.train()
        if self.parallel is not None and self.parallel.sharding == "ddp":
            total, metric_sums, trained, pairs = self.parallel.sum_eval(total, metric_sums, trained, pairs)
        units = pairs if objective.unit == "pair" else trained
        fields = objective.eval_fields((metric_sums / units).tolist(), pairs) if objective.metrics else {}
        event = EvalEvent(
            step=self.step, eval_loss=float(total / units), eval_trained_tokens=trained, **fields
        )
        self.result.evals.append(event)
        self._publish(event)
        return event

    def save_checkpoint(self) -> Path:
        """Write ``output_dir/checkpoint-<step>`` (then prune to `save_total_limit`), only if every weight
        is finite: `NonFiniteLossError` otherwise, naming the newest good checkpoint."""
        if not self.config.output_dir:
            raise ValueError("Set TrainConfig(output_dir=...) to save checkpoints.")
        self._flush()  # raises before writing if any step so far was not finite
        if not self._weights_are_finite():
            raise NonFiniteLossError(
                f"The trained weights hold NaN or infinite values at step {self.step}, so no checkpoint was "
                f"written. {self._newest_good_checkpoint_text()}"
            )
        state = {
            "step": self.step,
            "max_steps": self.max_steps,
            "config": asdict(self.config),
            "run": {"id": self.run_id, **self._run_signature()},
            "steps": [event.as_dict() for event in self.result.steps],
            "evals": [event.as_dict() for event in self.result.evals],
        }
        if self.loss_scaler is not None:  # fp16: the scale and its growth count, so a resume is exact
            state["loss_scale"] = self.loss_scaler.state_dict()
        folder = expand(self.config.output_dir) / f"checkpoint-{self.step}"
        try:
            if self.parallel is None:
                save_checkpoint(folder, self.model, self.optimizer, self.scheduler, state)
            else:  # rank 0 writes, with every rank's RNG; the others wait for it
                self.parallel.save_once(folder, self.model, self.optimizer, self.scheduler, state)
        except DiskFullError as error:
            previous = self._newest_checkpoint()
            intact = (
                f"the previous checkpoint {previous} is intact"
                if previous
                else "no checkpoint was written yet"
            )
            raise DiskFullError(
                error.errno,
                f"no space left on device while writing {folder}; {intact}. Free some space (or set "
                "output_dir to a disk with room, save_total_limit lower) and resume with resume_from='latest'.",
            ) from error
        self.result.checkpoints.append(str(folder))
        if self.parallel is None or self.parallel.is_main:  # this run's own checkpoints only
            prune_own_checkpoints(self.config.output_dir, self.run_id, self.config.save_total_limit)
        if self.parallel is not None:
            self.parallel.barrier()
        return folder

    def _open_output_dir(self) -> None:
        """Lock output_dir for this run (`fastft.training.run_folder`); at the run's start also finish what a
        killed run left half-written there and refuse a folder holding another run's checkpoints. Under
        torchrun rank 0 does it and every rank raises if it failed there."""
        config = self.config

        def open_folder() -> None:
            self._run_lock = RunLock.acquire(config.output_dir)
            if self.step == 0:
                try:
                    clean_output_dir(config.output_dir)  # what a killed run left half-written
                    resumed, run_id = resumed_run(config.output_dir, config.resume_from)
                    claim_folder(config.output_dir, run_id, resumed, config.overwrite_output_dir)
                except BaseException:
                    self._close_output_dir()
                    raise

        if self.parallel is None:
            open_folder()
        else:
            failure = None
            if self.parallel.is_main:
                try:
                    open_folder()
                except Exception as error:  # handed to the other ranks, then raised here as it was
                    failure = error
            shared = self.parallel.gather_objects(
                None if failure is None else f"{type(failure).__name__}: {failure}"
            )
            if failure is not None:
                raise failure
            if shared[0] is not None:
                raise RuntimeError(f"Rank 0 could not open output_dir={config.output_dir!r} ({shared[0]}).")
        self._folder_open = True

    def close(self) -> None:
        """Free output_dir's lock held by a run paused after ``train(steps=...)``, so another run may use the
        folder (a run that ends frees it by itself); a later `train()` takes the lock again and goes on."""
        self._close_output_dir()

    def _close_output_dir(self) -> None:
        """Unlock output_dir: the run is over (or this `train()` ended in an exception)."""
        if self._run_lock is not None:
            self._run_lock.release()
        self._run_lock = None
        self._folder_open = False

    def _weights_are_finite(self) -> bool:
        """One device-side reduction over the trained weights and one sync (at save time, never per step)."""
        with torch.no_grad():
            local = [p.to_local() if hasattr(p, "to_local") else p for p in self.parameters]  # FSDP2 shards
            flags = [torch.isfinite(p).all() for p in local]
            finite = (
                torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=self.device)
            )
            if self.parallel is not None and self.parallel.sharding == "fsdp":  # every rank's shards
                finite = finite.to(torch.int32)
                torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
            return bool(finite)

    def _newest_checkpoint(self) -> Path | None:
        """The newest checkpoint this run wrote or resumed from that is still on disk."""
        for name in reversed(self.result.checkpoints):
            if Path(name).is_dir():
                return Path(name)
        return None

    def _newest_good_checkpoint_text(self) -> str:
        newest = self._newest_checkpoint()
        where = (
            f"The newest good checkpoint is {newest} (its weights were checked finite when it was written)."
            if newest
            else "No checkpoint was written yet."
        )
        resume = (
            f"resume_from={str(newest)!r}, reset_optimizer=True and a lower learning_rate"
            if newest
            else "a lower learning_rate"
        )
        return (
            f"{where} Fix: lower the learning rate, keep max_grad_norm on, or check the data of this step; "
            f"then train again with {resume}."
        )

    def _resume(self, source: str) -> None:
        """Restore the run from `source` (a checkpoint folder, or "latest": the newest loadable one)."""
        if source == "latest":
            loaded = self._resume_latest()
            if loaded is None:
                return  # nothing to resume from yet: start fresh
            folder, state = loaded
        else:
            folder = Path(source)
            state = self._load(folder)
        self.step = state["step"]
        self.result.steps = [StepEvent(**event) for event in state["steps"]]
        self.result.evals = [EvalEvent(**event) for event in state["evals"]]
        self.result.checkpoints.append(str(folder))
        self.run_id = (state.get("run") or {}).get("id")  # None: a checkpoint from before runs had ids
        self._report_resumed_settings(folder)

    def _resume_latest(self) -> tuple[Path, dict] | None:
        """Try the checkpoints newest first; warn about each damaged one skipped."""
        checkpoints = list_checkpoints(self.config.output_dir)
        for folder in reversed(checkpoints):
            try:
                return folder, self._load(folder)
            except ResumeMismatchError:  # whole, but another run's: not skipped as damaged
                raise
            except CheckpointError as error:
                warnings.warn(
                    f"Skipped a damaged checkpoint while resuming: {error}", ResumeWarning, stacklevel=4
                )
        if checkpoints:
            raise CheckpointError(
                f"No checkpoint in {self.config.output_dir} can be loaded (each is damaged, see the warnings): "
                "start a new run in another output_dir, or resume_from=<a folder you trust>."
            )
        return None

    def _load(self, folder: Path) -> dict:
        contents = read_checkpoint(folder, self.device)  # every file checked before the model changes
        if self.parallel is not None or "distributed" in contents["state"]:
            check_resume(folder, contents["state"], self.parallel)
        # one check of everything that defines the run, before anything changes (`resume_check`)
        now = {**asdict(self.config), **self._run_signature(), "max_steps": self.max_steps}
        differences = compare(contents["state"], contents["adapter_config"], now | lora_settings(self.model))
        check_compatible(folder, differences, self.config, contents["state"]["step"])
        check_adapter_matches(folder, self.model, contents["adapter"])
        restore = not self.config.reset_optimizer
        kept = {d.name: d.saved for d in differences if d.group == "optimizer"} if restore else {}
        if kept:
            self._keep_saved_settings(kept)
        self._resume_differences = differences
        sharded = self.parallel is not None and self.parallel.sharding == "fsdp"
        state = apply_checkpoint(
            folder, contents, self.model, self.optimizer, self.scheduler, restore, sharded=sharded
        )
        if self.parallel is not None:
            self.parallel.restore_rng(state)
        if self.loss_scaler is not None and "loss_scale" in state:  # else (a bf16 checkpoint) a fresh scale
            self.loss_scaler.load_state_dict(state["loss_scale"])
        if self.config.reset_optimizer:  # a fresh optimizer; the schedule of this config, at the resumed step
            self.scheduler = self._schedule()
            advance_schedule(self.scheduler, state["step"] * self.updates_per_step)
        return state

    def _keep_saved_settings(self, saved: dict) -> None:
        """Train on with the checkpoint's optimizer and schedule settings (`saved`): the trainer's copy of the
        config takes them, and the schedule is rebuilt with its warmup and floor (a scheduler's state holds
        neither; the optimizer's learning rate, decay and Adam constants come with its state)."""
        values = {name: tuple(value) if isinstance(value, list) else value for name, value in saved.items()}
        self.config = replace(self.config, **values)
        warmup = self.config.warmup
        self.warmup_steps = int(warmup * self.max_steps) if isinstance(warmup, float) else int(warmup)
        self.scheduler = self._schedule()
        if self._cursor is not None and "seed" in saved:  # a stream's order follows the kept seed too
            self._cursor = StreamCursor(self.train_data, self.config.seed)

    def _schedule(self) -> torch.optim.lr_scheduler.LambdaLR:
        """Cosine with warmup over the run's optimizer updates (`Objective.updates_per_step` per step)."""
        updates = self.updates_per_step
        return torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            cosine_with_warmup(
                self.warmup_steps * updates, self.max_steps * updates, self.config.min_learning_rate_ratio
            ),
        )

    def _run_signature(self) -> dict:
        """What defines this run besides its config (`fastft.training.resume_check`): its data's fingerprint,
        packing length and base weights' format, computed once."""
        if self._signature is None:
            self._signature = {
                "data": data_fingerprint(self.train_data),
                "max_seq_length": getattr(self.train_data, "max_seq_length", None),
                "weights": weight_format(self.model),
            }
        return self._signature

    def _report_resumed_settings(self, folder: Path) -> None:
        """Say which hyperparameters the resumed run trains with: the checkpoint's (kept, by default) or
        this config's (``reset_optimizer=True``), naming every one that differs; and which data and objective
        changes a reset option accepted."""
        accepted = accepted_message(folder, self._resume_differences, self.step)
        if accepted:
            warnings.warn(accepted, ResumeWarning, stacklevel=4)
        learning_rate = self.scheduler.get_last_lr()[0]
        message = optimizer_message(
            folder, self._resume_differences, self.step, self.config.reset_optimizer, learning_rate
        )
        if message:
            warnings.warn(message, ResumeWarning, stacklevel=4)


class ResumeWarning(UserWarning):
    """What a resume did with settings that differ from the checkpoint's, or a damaged checkpoint skipped."""


def _check_has_adapters(model: torch.nn.Module) -> None:
    """Refuse a model without LoRA adapters: training it would silently update every base weight."""
    if not any(isinstance(module, BaseTunerLayer) for module in model.modules()):
        raise ValueError(
            "This model has no LoRA adapters, so training it would update every base weight (full "
            "fine-tuning, which fastft does not support yet; it is planned). Call "
            "model = fastft.add_lora(model, ...) first."
        )


def train(
    model: torch.nn.Module,
    tokenizer,
    dataset,
    eval_dataset=None,
    *,
    progress: bool = True,
    subscribers: Iterable[Subscriber] = (),
    **config,
) -> TrainResult:
    """Fine-tune `model` on `dataset` (a `PackedDataset`, a `PackedStream` for data larger than memory
    (with ``max_steps``), or rows/`datasets.Dataset` to pack).

    Keyword arguments are `TrainConfig` fields (max_steps, learning_rate, …). With `progress`, a
    tqdm bar shows loss, tokens/s and memory. Returns every `StepEvent` and `EvalEvent`.
    """
    trainer = Trainer(model, tokenizer, dataset, eval_dataset, TrainConfig(**config), subscribers)
    return train_with_progress(trainer, progress)


def train_with_progress(trainer: Trainer, progress: bool = True) -> TrainResult:
    """`trainer.train()` with a tqdm bar of loss, tokens/s and memory (under torchrun, on rank 0 only)."""
    main = trainer.parallel is None or trainer.parallel.is_main
    bar = ProgressBar(trainer.max_steps, initial=0) if progress and main else None
    if bar is not None:
        trainer.subscribe(bar)
    try:
        return trainer.train()
    finally:
        if bar is not None:
            bar.close()


def objective_for(config: TrainConfig) -> Objective:
    """The objective `config.method` names: SFT, or a preference method (DPO, ORPO, SimPO)."""
    if config.method == "sft":
        return SFTObjective()
    if config.method in METHODS:
        return PreferenceObjective.from_config(config)
    raise SettingError(
        f"method={config.method!r} has no objective the Trainer builds from a config: pass "
        "Trainer(..., objective=...), or use its own trainer (GRPO: fastft.grpo / GRPOTrainer)."
    )

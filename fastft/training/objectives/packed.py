"""`PackedObjective`: objectives on packed bins, one padding-free row per micro-batch.

One step = `grad_accum_steps` micro-batches, each `micro_batch_bins` packed bins concatenated into one
padding-free row. The loss is summed per micro-batch and divided by the step's count of the objective's `unit`
(trained tokens, or pairs), known on the host when the batch is built, so accumulation is weighted by it. A
micro-batch replays from a CUDA graph when its batches repeat one shape (`fastft.training.graph`); with
`TrainConfig.static_shapes` the micro-batches are padded to one `BatchShape` for that. Under torchrun each rank
runs its share of the step's micro-batches, and the counts, loss and metric sums are summed on the device.

A subclass gives ``loss_sum(model, batch, extra)``: the micro-batch's summed loss and its metric sums (None
without `metrics`); ``extra`` is what ``extra_input`` hands it (DPO's precomputed reference log-probs).
"""

from __future__ import annotations

import functools

import torch

from fastft.data.batch import BatchShape, PackedBatch
from fastft.data.packing import PackedDataset, pack
from fastft.data.stream import PackedStream
from fastft.runtime.attention import SHAPE_ONLY_BACKENDS, choose_backend, is_patched
from fastft.training.distributed import set_gradient_sync
from fastft.training.graph import EAGER, REPLAY
from fastft.training.loss import router_aux_loss_coefficient
from fastft.training.objectives import Objective
from fastft.training.readout import StepTimer, device_scalar
from fastft.training.timing import NULL_PROFILE


class PackedObjective(Objective):
    """An objective on packed bins (module docstring): the packed step, static shapes and evaluation."""

    unit = "token"  # what the loss is averaged over: "token" (trained tokens) or "pair"

    def __init__(self):
        self.batch_shape: BatchShape | None | bool = None  # decided on the first step (`shaped`)

    def loss_sum(self, model: torch.nn.Module, batch: PackedBatch, extra=None):
        """The micro-batch's summed loss and its metric sums (a device tensor of `metrics`, or None)."""
        raise NotImplementedError(f"{type(self).__name__} does not define loss_sum(model, batch, extra).")

    def extra_input(self, trainer, split: str, bins: list) -> torch.Tensor | None:
        """What `loss_sum` gets beside the batch for these bins of "train" or "eval" (None: nothing)."""
        return None

    def eval_fields(self, means: list[float], pairs: int) -> dict:
        """The `EvalEvent` fields of this objective from its metric sums' means over the eval set."""
        return {}

    def prepare(self, trainer, train_data, eval_data) -> tuple:
        """Rows are packed to the tokenizer's `model_max_length`, eval rows to the train data's length."""
        if not isinstance(train_data, (PackedDataset, PackedStream)):
            train_data = pack(train_data, trainer.tokenizer)
        if isinstance(eval_data, PackedStream):
            raise ValueError(
                "eval_data must be a PackedDataset or rows to pack: evaluation reads every bin each time, "
                "so pack a held-out set with fastft.pack(rows, tokenizer) instead of streaming it."
            )
        if eval_data is not None and not isinstance(eval_data, PackedDataset):
            eval_data = pack(eval_data, trainer.tokenizer, train_data.max_seq_length)
        return train_data, eval_data

    def micro_batch_loss(
        self, trainer, batch: PackedBatch, divisor: torch.Tensor, extra: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A micro-batch's summed loss over the step's unit count (`divisor`, a device tensor: a CUDA graph
        replays every step's count), under autocast; its metric sums are added to ``trainer.metric_sums``."""
        with trainer.autocast():
            loss, metrics = self.loss_sum(trainer.model, batch, extra)
            if metrics is not None:
                trainer.metric_sums += metrics
            return loss / divisor

    def train_step(self, trainer) -> None:
        parallel = trainer.parallel
        phases = trainer.profile or NULL_PROFILE  # top-level phases follow each other: data → forward → …
        phases.step_begin()
        step_bins = trainer.bins_for_step(trainer.step)
        if parallel is not None:  # this rank's micro-batches of the global step
            step_bins = parallel.shard(step_bins)
        micro_batches = self.shaped(trainer, trainer.batches(step_bins))
        extras = [self.extra_input(trainer, "train", bins) for bins in step_bins]
        trained = sum(b.num_trained_tokens for b in micro_batches)
        tokens = sum(b.real_tokens for b in micro_batches)
        padding = sum(b.padding for b in micro_batches)
        pairs = sum(b.real_sequences for b in micro_batches) // 2
        per_pair = self.unit == "pair"
        counts = None
        if parallel is not None:  # the global counts: one device all-reduce, no host sync
            counts = parallel.global_counts([trained, tokens, padding, pairs])
            divisor = counts[3 if per_pair else 0].float()
        else:
            divisor = device_scalar(pairs if per_pair else trained, trainer.device)
        trainer.metric_sums.zero_()
        micro_batches = [batch.to(trainer.device) for batch in micro_batches]
        timer = StepTimer(trainer.device)
        loss_fn = functools.partial(self.micro_batch_loss, trainer)
        loss_total = torch.zeros((), device=trainer.device)
        replays = 0
        for index, batch in enumerate(micro_batches):
            if parallel is not None and parallel.sharding == "fsdp":
                set_gradient_sync(trainer.model, index == len(micro_batches) - 1)
            if (mode := trainer.step_graph.mode(batch, first_micro_batch=index == 0)) != EAGER:
                replays += mode == REPLAY
                with phases.opaque("graph"):
                    loss_total += trainer.step_graph.forward_backward(batch, divisor, loss_fn)
                continue
            phases.begin("forward")  # the final norm's hook hands over to "loss"
            loss = loss_fn(batch, divisor, extras[index])
            phases.begin("backward")
            (trainer.loss_scaler.scaled(loss) if trainer.loss_scaler else loss).backward()
            loss_total += loss.detach()
        if parallel is not None:
            phases.begin("communication")
            loss_total = parallel.reduce_step(trainer.parameters, loss_total, trainer.metric_sums)
        phases.begin("optimizer")
        learning_rate = trainer.scheduler.get_last_lr()[0]
        grad_norm = trainer.update()
        timing = phases.step_end(trainer.step + 1)
        timer.stop()
        values = torch.stack([loss_total.float(), grad_norm])
        if self.metrics:  # per unit of the loss (pair)
            units = (pairs if per_pair else trained) if counts is None else counts[3 if per_pair else 0]
            values = torch.cat([values, trainer.metric_sums / units])
        if counts is not None:  # the event's counts are the run's, read back with the loss
            values = torch.cat([values.double(), counts.double()])
        info = dict(
            step=trainer.step + 1,
            lr=learning_rate,
            trained=trained,
            tokens=tokens,
            timer=timer,
            timing=timing,
        )
        info.update(padding=padding, replays=replays, micro_batches=len(micro_batches), pairs=pairs)
        info["epoch"] = trainer.epoch_progress()
        trainer.queue_readout(values, info)

    # -- static shapes -------------------------------------------------------------------------
    def pads_batches(self, trainer, first: PackedBatch) -> bool:
        """Whether this run pads its micro-batches to one `BatchShape` (`TrainConfig.static_shapes`); decided
        on the run's first micro-batch (the attention backend is resolved on it)."""
        asked = trainer.config.static_shapes
        if asked is False:
            return False
        if router_aux_loss_coefficient(trainer.model) is not None:
            if asked:
                raise ValueError(
                    "static_shapes=True cannot keep the router's load-balancing loss exact (pad tokens would "
                    "be routed): leave static_shapes=None, or turn off output_router_logits."
                )
            return False
        if asked:
            return True
        if not trainer.step_graph.policy.enabled or not is_patched(trainer.model):
            return False
        data = trainer.train_data
        if isinstance(data, PackedDataset) and data.batches_repeat_one_shape():
            return False  # fixed-length rows replay as they are (and keep the uniform bins' cuDNN attention)
        return choose_backend(trainer.model, first.to(trainer.device)) in SHAPE_ONLY_BACKENDS

    def shaped(self, trainer, batches: list[PackedBatch]) -> list[PackedBatch]:
        """The step's CPU micro-batches, padded to the run's `BatchShape` when it pads (widened, once, for a
        stream's batch that does not fit)."""
        if self.batch_shape is None:
            if not self.pads_batches(trainer, batches[0]):
                self.batch_shape = False
                return batches
            self.batch_shape = self.covering_shape(trainer)
        if self.batch_shape is False:
            return batches
        for batch in batches:
            if not self.batch_shape.holds(batch):
                self.batch_shape = self.batch_shape.grown_to(batch)
        return [batch.padded(self.batch_shape) for batch in batches]

    def covering_shape(self, trainer) -> BatchShape:
        """The largest micro-batch this run can draw, rounded up: a `PackedDataset` knows its bins; a
        stream's bins are bounded by `max_seq_length` (sequences and targets grow as they come)."""
        size, data = trainer.config.micro_batch_bins, trainer.train_data
        if isinstance(data, PackedDataset):
            return BatchShape.covering(*data.largest_batch(size), attended=data.attended_length())
        tokens = size * data.max_seq_length
        return BatchShape.covering(tokens, 8, tokens // 2)

"""The SFT trainer: an explicit loop over packed batches that emits one `StepEvent` per step.

One step = `grad_accum_steps` micro-batches, each `micro_batch_bins` packed bins concatenated
into one padding-free row. The loss is summed per micro-batch and divided by the step's trained
token count, known on the host when the batch is built, so accumulation is token-weighted.

Host–device syncs: none inside a step. On CUDA the step's loss and gradient norm are copied to
pinned memory without blocking and read one step later, when their event has completed; the
`StepEvent` of step s is emitted during step s+1 (and all are flushed at the end, before each
checkpoint and on stop). A non-finite loss stops the run with `NonFiniteLossError`; checkpoints
are written only after every earlier step was read back finite and when every trained weight is finite
(one device reduction and one sync per save, none per step), so the last one is always good.

Data order is a pure function of (seed, epoch): bins are shuffled per epoch with a seeded
generator, and step s always reads the same bins. Data larger than memory comes as a `PackedStream`
(shards packed as they are read; order a pure function of seed, epoch and shard; needs `max_steps`). Resume restores adapters, optimizer, scheduler
and RNG, so a resumed run's losses equal the uninterrupted run's.
"""

from __future__ import annotations

import difflib
import math
import os
import random
import resource
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from fastft.atomic import DiskFullError, expand
from fastft.checks import SettingError, real_number, whole_number
from fastft.data.batch import BatchShape, PackedBatch
from fastft.data.packing import PackedDataset, pack
from fastft.data.stream import PackedStream, StreamCursor, batch_of
from fastft.runtime.attention import (
    BACKENDS,
    SHAPE_ONLY_BACKENDS,
    choose_backend,
    describe_backend,
    is_patched,
    patch_packed_attention,
    unpatch_packed_attention,
)
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
from fastft.training.distributed import full_tensor, set_gradient_sync, start_distributed
from fastft.training.events import EvalEvent, Event, StepEvent, Subscriber
from fastft.training.graph import EAGER, REPLAY, StepGraph
from fastft.training.loss import causal_lm_loss_sum, router_aux_loss_coefficient
from fastft.training.loss_scale import LossScaler
from fastft.training.optimizer import adamw
from fastft.training.resume_check import (
    accepted_message,
    check_compatible,
    compare,
    data_fingerprint,
    lora_settings,
    weight_format,
)
from fastft.training.run_folder import RunLock, claim_folder, new_run_id, prune_own_checkpoints, resumed_run
from fastft.training.timing import NULL_PROFILE, StepProfile
from fastft.training.timing_hooks import detach_profile


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; training stopped and the last good checkpoint is kept."""


@dataclass
class TrainConfig:
    """Hyperparameters of a supervised fine-tuning run (defaults suit LoRA on a small dataset).

    `attention` is the packed-attention backend (`fastft.runtime.attention.BACKENDS`), "auto" to
    measure and pick, or None to leave the model's own attention (transformers' packed-sequence
    detection). `max_steps` wins over `epochs` when set. `warmup` is a step count (int) or a fraction of
    `max_steps` (float below 1). `eval_every` / `save_every` are in optimizer steps (None: only
    at the end / never). A run locks `output_dir` while it trains (a second run there is refused, naming the
    first) and refuses a folder holding another run's checkpoints; ``overwrite_output_dir=True`` deletes them
    first (`fastft.training.run_folder`). `resume_from` is a checkpoint folder or "latest" (in `output_dir`: the
    newest one that loads, skipping damaged ones with a warning). A resume keeps the checkpoint's optimizer and
    schedule, and warns about each hyperparameter of this config it therefore ignores; ``reset_optimizer=True``
    resumes the weights, RNG and step with a fresh optimizer and this config's schedule (a new learning rate,
    warmup, weight decay…), and says so. Other changes (data, packing length, batching, step count, the loss's
    settings, the method, LoRA's alpha or dropout) are refused, listing each, unless ``reset_data=True`` or
    ``reset_objective=True`` accepts them (`fastft.training.resume_check`). Every setting is checked here: a
    wrong one raises `SettingError` naming it.
    `profile` times the phases of every step (`fastft.profile.StepProfile`, ``Trainer.profile``;
    under 2 % of a step) and fills `StepEvent.phases`; False removes the profiler's hooks from the model.
    `cuda_graph` replays a micro-batch's forward and backward from a CUDA graph when its batches repeat one
    shape (fixed-length rows; `fastft.training.graph`): on a GPU the step stops waiting for the host. Packed
    bins are padded to one shape for that (`static_shapes`). Every checkpointing mode is captured,
    offloaded ones included (their copies become graph nodes on the copy stream); False never captures.
    `static_shapes` pads every packed micro-batch to one `fastft.data.batch.BatchShape` (the run's largest
    micro-batch, rounded up: a pad tail segment that trains nothing), so chat data, whose bins never
    repeat their lengths, replays a CUDA graph from the third step on. None (the default) pads where a
    graph can replay: on CUDA with `cuda_graph`, a packed-attention backend that reads only the batch's
    shape, and no router load-balancing loss (pad tokens would be routed); True pads everywhere (the CPU
    too: the same losses and gradients, slower); False never pads.

    `method` is "sft" (next-token cross-entropy on the trained tokens) or a preference objective on packed
    pairs (`fastft.data.pairs.pack_pairs`; `fastft.training.preference`): "dpo" (with `dpo_loss` "sigmoid",
    "ipo" or "robust"; the reference is the model with its adapters disabled), "orpo" or "simpo" (no
    reference). `beta` defaults to 0.1 (2.0 for SimPO); `label_smoothing` is DPO's and SimPO's ε,
    `simpo_gamma` SimPO's margin γ. Preference steps replay CUDA graphs as SFT steps do, except with
    `precompute_reference` (eager); ragged pairs pad to a static shape as SFT's packs do (pad pairs
    take no loss).

    `distributed` applies under torchrun (`fastft.training.distributed`): "ddp" replicates the model and sums
    the LoRA gradients once per step; "fsdp" shards the base and the adapters with FSDP2 (``fully_shard``).
    `precompute_reference` (DPO) runs the adapter-disabled pass once over the train and eval pairs before
    training, keeps each sequence's reference log-prob with the data, and skips the reference forward in
    every step (`fastft.training.preference.cached_reference_log_probs`).
    """

    max_steps: int | None = None
    epochs: float = 1.0
    learning_rate: float = 2e-4
    min_learning_rate_ratio: float = 0.1
    warmup: int | float = 0.05
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    micro_batch_bins: int = 1
    grad_accum_steps: int = 1
    seed: int = 3407
    eval_every: int | None = None
    save_every: int | None = None
    save_total_limit: int = 2
    output_dir: str | None = None
    resume_from: str | None = None
    attention: str | None = "auto"
    profile: bool = True
    cuda_graph: bool = True
    static_shapes: bool | None = None
    method: str = "sft"
    beta: float | None = None
    dpo_loss: str = "sigmoid"
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    distributed: str = "ddp"
    precompute_reference: bool = False

    reset_optimizer: bool = False
    reset_data: bool = False
    reset_objective: bool = False
    overwrite_output_dir: bool = False

    def __post_init__(self) -> None:
        check_train_config(self)


def check_train_config(config: TrainConfig) -> None:
    """Every setting's type and range, with the value and the fix; warnings for legal but doubtful values."""
    for name in ("micro_batch_bins", "grad_accum_steps", "save_total_limit"):
        whole_number(name, getattr(config, name), minimum=1)
    if config.max_steps is not None:
        whole_number("max_steps", config.max_steps, minimum=1, fix="Or leave max_steps=None to train epochs.")
    real_number(
        "epochs", config.epochs, low=0, low_open=True, fix="Pass epochs > 0, or max_steps=N for a step count."
    )
    real_number(
        "learning_rate", config.learning_rate, low=0, low_open=True, fix="LoRA usually takes 1e-4 to 3e-3."
    )
    if config.learning_rate >= 1:
        warnings.warn(
            f"learning_rate={config.learning_rate:g} is far above what fine-tuning takes (LoRA: 1e-4 to 3e-3): "
            "the weights will most likely blow up.",
            stacklevel=4,
        )
    real_number("min_learning_rate_ratio", config.min_learning_rate_ratio, low=0, high=1)
    if isinstance(config.warmup, float):
        real_number(
            "warmup",
            config.warmup,
            low=0,
            high=1,
            high_open=True,
            fix="A float is a share of the run (0.05).",
        )
    else:
        whole_number(
            "warmup", config.warmup, minimum=0, fix="Pass a step count (int) or a share below 1 (float)."
        )
    if (
        config.max_steps is not None
        and not isinstance(config.warmup, float)
        and config.warmup >= config.max_steps
    ):
        _warn_long_warmup(config.warmup, config.max_steps)
    real_number("weight_decay", config.weight_decay, low=0)
    if len(config.adam_betas) != 2:
        raise SettingError(f"adam_betas must be two numbers, got {config.adam_betas!r}.")
    for beta in config.adam_betas:
        real_number("adam_betas", beta, low=0, high=1, high_open=True, fix="The defaults are (0.9, 0.999).")
    real_number("adam_eps", config.adam_eps, low=0, low_open=True)
    if config.max_grad_norm is not None:
        real_number(
            "max_grad_norm",
            config.max_grad_norm,
            low=0,
            low_open=True,
            fix="It caps the gradient's norm (1.0 is usual): a value <= 0 would reverse or zero every update. "
            "Use None to turn clipping off.",
        )
    whole_number("seed", config.seed)
    for name in ("eval_every", "save_every"):
        if getattr(config, name) is not None:
            whole_number(name, getattr(config, name), minimum=1, fix=f"Use {name}=None to turn it off.")
    for name in ("output_dir", "resume_from"):
        value = getattr(config, name)
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise SettingError(f"{name} must be a path (str), got {value!r}.")
        if value is not None and value != "latest":
            setattr(config, name, str(expand(value)))
    if (
        config.resume_from is not None
        and config.resume_from != "latest"
        and not Path(config.resume_from).exists()
    ):
        hint = (
            " Did you mean resume_from='latest' (the newest checkpoint in output_dir)?"
            if difflib.get_close_matches(Path(config.resume_from).name, ["latest"], cutoff=0.6)
            else " Give a checkpoint folder (output_dir/checkpoint-N) or 'latest'."
        )
        raise SettingError(f"resume_from={config.resume_from!r} does not exist.{hint}")
    for name in (
        "reset_optimizer",
        "reset_data",
        "reset_objective",
        "overwrite_output_dir",
        "profile",
        "cuda_graph",
    ):
        if not isinstance(getattr(config, name), bool):
            raise SettingError(f"{name} must be True or False, got {getattr(config, name)!r}.")
    if (
        config.attention is not None
        and not callable(config.attention)
        and config.attention not in ("auto", *BACKENDS)
    ):
        close = difflib.get_close_matches(str(config.attention), ["auto", *BACKENDS], n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise SettingError(
            f"attention={config.attention!r} is not a packed-attention backend.{hint} Use 'auto', one of "
            f"{', '.join(BACKENDS)}, or None for the model's own attention."
        )
    if config.static_shapes not in (None, True, False):
        raise SettingError(
            f"static_shapes must be None (pad where a CUDA graph replays), True or False, got {config.static_shapes!r}."
        )
    _check_method(config)
    from fastft.training.distributed import SHARDINGS

    if config.distributed not in SHARDINGS:
        raise SettingError(
            f"distributed={config.distributed!r} is not one of {', '.join(SHARDINGS)} (used under torchrun only)."
        )
    if (config.save_every or config.resume_from == "latest") and not config.output_dir:
        raise SettingError(
            "save_every and resume_from='latest' need output_dir=... (where checkpoints live)."
        )


def _check_method(config: TrainConfig) -> None:
    from fastft.training.preference import DPO_LOSSES, METHODS

    for name, value, valid in (("method", config.method, METHODS), ("dpo_loss", config.dpo_loss, DPO_LOSSES)):
        if value not in valid:
            close = difflib.get_close_matches(str(value), valid, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise SettingError(f"{name}={value!r} is not one of {', '.join(valid)}.{hint}")
    if config.beta is not None:
        real_number("beta", config.beta, low=0, low_open=True, fix="DPO usually takes 0.1, SimPO 2.0.")
    real_number(
        "label_smoothing",
        config.label_smoothing,
        low=0,
        high=0.5,
        high_open=True,
        fix="It is ε, a share below 0.5.",
    )
    real_number("simpo_gamma", config.simpo_gamma, low=0)
    if not isinstance(config.precompute_reference, bool):
        raise SettingError(
            f"precompute_reference must be True or False, got {config.precompute_reference!r}."
        )
    if config.precompute_reference and config.method != "dpo":
        raise SettingError(
            f"precompute_reference=True applies to method='dpo' only: {config.method!r} has no reference model. "
            "Leave it False."
        )


def preference_settings(config: TrainConfig):
    """The run's `PreferenceLoss`, None for SFT."""
    from fastft.training.preference import DEFAULT_BETA, PreferenceLoss

    if config.method == "sft":
        return None
    beta = config.beta if config.beta is not None else DEFAULT_BETA[config.method]
    return PreferenceLoss(
        config.method, config.dpo_loss, float(beta), config.label_smoothing, config.simpo_gamma
    )


def _warn_long_warmup(warmup_steps: int, max_steps: int) -> None:
    warnings.warn(
        f"warmup={warmup_steps} steps is not shorter than the run ({max_steps} steps): the learning rate never "
        "reaches its peak. Use a shorter warmup, e.g. warmup=0.05 (5 % of the run).",
        stacklevel=5,
    )


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


def cosine_with_warmup(warmup_steps: int, total_steps: int, min_ratio: float) -> Callable[[int], float]:
    """LR multiplier: linear warmup from 0 to 1, then cosine decay from 1 to `min_ratio`."""

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


class _PendingReadout:
    """A step's device scalars on their way to the host, read once their copy has completed."""

    def __init__(self, values: torch.Tensor, info: dict):
        self.info = info
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host, self.done = values, None

    def ready(self) -> bool:
        return self.done is None or self.done.query()

    def read(self) -> list[float]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class Trainer:
    """Supervised fine-tuning of a (PEFT) model on packed data.

    `train_data` is a `PackedDataset` or anything `pack` accepts (then packed to the tokenizer's
    `model_max_length`). Subscribers receive every `StepEvent` / `EvalEvent`; `stop()` and
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
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or TrainConfig()
        self.preference = preference_settings(self.config)
        if self.preference is not None:
            train_data, eval_data = _as_pairs(train_data, tokenizer), _as_pairs(eval_data, tokenizer)
        if isinstance(train_data, (PackedDataset, PackedStream)):
            self.train_data = train_data
        else:
            self.train_data = pack(train_data, tokenizer)
        self._cursor = None
        if isinstance(self.train_data, PackedStream):
            if not self.config.max_steps:
                raise ValueError(
                    "A PackedStream has no length until it has been read: pass max_steps=... "
                    "(optimizer steps) to train on it."
                )
            self._cursor = StreamCursor(self.train_data, self.config.seed)
        if isinstance(eval_data, PackedStream):
            raise ValueError(
                "eval_data must be a PackedDataset or rows to pack: evaluation reads every bin each time, "
                "so pack a held-out set with fastft.pack(rows, tokenizer) instead of streaming it."
            )
        self.eval_data = (
            None
            if eval_data is None
            else eval_data
            if isinstance(eval_data, PackedDataset)
            else pack(eval_data, tokenizer, self.train_data.max_seq_length)
        )
        self.subscribers: list[Subscriber] = list(subscribers)
        self.device = next(model.parameters()).device
        if self.config.attention is not None:
            patch_packed_attention(model, self.config.attention)
        else:  # the model's own attention, also where add_lora switched it to packed attention for the HF path
            unpatch_packed_attention(model)
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
        self.bins_per_step = self.config.micro_batch_bins * self.config.grad_accum_steps * self.world_size
        self.max_steps = self.config.max_steps or max(
            1, math.ceil(self.config.epochs * len(self.train_data) / self.bins_per_step)
        )
        warmup = self.config.warmup
        self.warmup_steps = int(warmup * self.max_steps) if isinstance(warmup, float) else int(warmup)
        if self.config.max_steps is None and self.warmup_steps >= self.max_steps and self.warmup_steps > 0:
            _warn_long_warmup(self.warmup_steps, self.max_steps)
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
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            cosine_with_warmup(self.warmup_steps, self.max_steps, self.config.min_learning_rate_ratio),
        )
        # a precomputed reference is a per-step input the graph does not copy in: those DPO runs stay eager
        graphs = self.config.cuda_graph and not self.config.precompute_reference
        graphs = graphs and not (self.parallel and self.parallel.sharding == "fsdp")  # FSDP_LIMITS
        # a preference step's metric sums: one tensor for the run (a replay adds into the captured one)
        self._metric_sums = torch.zeros(4, device=self.device)
        self.step_graph = StepGraph(
            self.parameters,
            enabled=graphs,
            accumulators=[self._metric_sums],
            loss_scale=None if self.loss_scaler is None else self.loss_scaler.scale,
        )
        self._batch_shape: BatchShape | None | bool = None  # decided on the first step (`_shaped`)
        self.step = 0
        self.result = TrainResult(profile=self.profile)
        self._stop = threading.Event()
        self._control = threading.Condition()  # guards the pause state and the queued calls below
        self._paused = False
        self._holding = False
        self._calls: list[Callable[[], object]] = []
        self._pending: list[_PendingReadout] = []
        self._epoch_orders: dict[int, np.ndarray] = {}
        self._references: dict | None = None  # "train" / "eval" → per-sequence reference log-probs

    # -- control -----------------------------------------------------------------------------
    def subscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.append(subscriber)

    def stop(self) -> None:
        """Finish the current step, then stop (a checkpoint is written if `output_dir` is set); a paused
        run stops where it holds."""
        with self._control:
            self._stop.set()
            self._control.notify_all()

    def pause(self) -> None:
        """Hold the training thread at the next step boundary until `unpause()` (or `stop()`)."""
        with self._control:
            self._paused = True

    def unpause(self) -> None:
        with self._control:
            self._paused = False
            self._control.notify_all()

    @property
    def holding(self) -> bool:
        """True while the training thread waits between two steps because the trainer is paused."""
        return self._holding

    def call_between_steps(self, fn: Callable[[], object]) -> None:
        """Have the training thread call `fn()` before its next step, at once while it holds paused, so
        `fn` sees no half-done step (a checkpoint asked for from another thread). An exception from `fn`
        ends `train()`; calls still queued when `train()` returns run at the next `train()`."""
        with self._control:
            self._calls.append(fn)
            self._control.notify_all()

    def _between_steps(self) -> None:
        """On the training thread at a step boundary: run the queued calls, and hold while paused."""
        while True:
            with self._control:
                calls, self._calls = self._calls, []
                if not calls:
                    if not self._paused or self._stop.is_set():
                        return
                    self._holding = True
                    try:
                        self._control.wait()
                    finally:
                        self._holding = False
                    continue
            for call in calls:
                call()

    # -- data order ----------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epoch_orders:
            generator = np.random.default_rng([self.config.seed, epoch])
            self._epoch_orders = {epoch: generator.permutation(len(self.train_data))}
        return self._epoch_orders[epoch]

    def bins_for_step(self, step: int) -> list[list]:
        """The bins of each micro-batch of optimizer step `step` (0-based); a pure function.

        Bin indices of the `PackedDataset`; for a `PackedStream`, ``(shard, bin index)`` pairs."""
        if self._cursor is not None:
            bins = self._cursor.bins(step * self.bins_per_step, self.bins_per_step)
            size = self.config.micro_batch_bins
            return [bins[i : i + size] for i in range(0, len(bins), size)]
        n = len(self.train_data)
        positions = range(step * self.bins_per_step, (step + 1) * self.bins_per_step)
        bins = [int(self._epoch_order(p // n)[p % n]) for p in positions]
        size = self.config.micro_batch_bins
        return [bins[i : i + size] for i in range(0, len(bins), size)]

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
            if config.precompute_reference and self._references is None:
                self._references = self._precompute_references()
            started = time.perf_counter()
            self.model.train()
            if self.device.type == "cuda":  # the events' peak memory is this run's, not the process's so far
                torch.cuda.reset_peak_memory_stats(self.device)
            while self.step < target:
                self._between_steps()
                if self._stop.is_set():
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

    def _precompute_references(self) -> dict:
        from fastft.training.preference import cached_reference_log_probs

        references = {"train": cached_reference_log_probs(self.model, self.train_data)}
        if self.eval_data is not None:
            references["eval"] = cached_reference_log_probs(self.model, self.eval_data)
        return references

    def _reference_of(self, split: str, bins: list[int]) -> torch.Tensor | None:
        """The precomputed reference log-probs of these bins' sequences, in batch order (None without)."""
        if self._references is None or split not in self._references:
            return None
        data = self.train_data if split == "train" else self.eval_data
        members = torch.as_tensor([row for b in bins for row in data.bins[b]])
        return self._references[split][members.to(self.device, non_blocking=True)]

    def _micro_batch_loss(
        self, batch: PackedBatch, divisor: torch.Tensor, reference: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A micro-batch's summed loss over the step's trained tokens (`divisor`, a device tensor: a CUDA
        graph replays every step's count), under autocast. A preference run divides its pair losses by the
        step's pairs instead and adds the batch's metric sums to `_metric_sums`."""
        with torch.autocast(
            self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        ):
            if self.preference is None:
                return causal_lm_loss_sum(self.model, batch) / divisor
            from fastft.training.preference import pair_loss_sum

            loss, metrics = pair_loss_sum(self.model, batch, self.preference, reference)
            self._metric_sums += metrics
            return loss / divisor

    # -- static shapes -------------------------------------------------------------------------
    def _pads_batches(self, first: PackedBatch) -> bool:
        """Whether this run pads its micro-batches to one `BatchShape` (`TrainConfig.static_shapes`); decided
        on the run's first micro-batch (the attention backend is resolved on it)."""
        asked = self.config.static_shapes
        if asked is False:
            return False
        if router_aux_loss_coefficient(self.model) is not None:
            if asked:
                raise ValueError(
                    "static_shapes=True cannot keep the router's load-balancing loss exact (pad tokens would "
                    "be routed): leave static_shapes=None, or turn off output_router_logits."
                )
            return False
        if asked:
            return True
        if not self.step_graph.policy.enabled or not is_patched(self.model):
            return False
        if isinstance(self.train_data, PackedDataset) and self.train_data.batches_repeat_one_shape():
            return False  # fixed-length rows replay as they are (and keep the uniform bins' cuDNN attention)
        return choose_backend(self.model, first.to(self.device)) in SHAPE_ONLY_BACKENDS

    def _shaped(self, batches: list[PackedBatch]) -> list[PackedBatch]:
        """The step's CPU micro-batches, padded to the run's `BatchShape` when it pads (widened, once, for a
        stream's batch that does not fit)."""
        if self._batch_shape is None:
            if not self._pads_batches(batches[0]):
                self._batch_shape = False
                return batches
            self._batch_shape = self._covering_shape()
        if self._batch_shape is False:
            return batches
        for batch in batches:
            if not self._batch_shape.holds(batch):
                self._batch_shape = self._batch_shape.grown_to(batch)
        return [batch.padded(self._batch_shape) for batch in batches]

    def _covering_shape(self) -> BatchShape:
        """The largest micro-batch this run can draw, rounded up: a `PackedDataset` knows its bins; a
        stream's bins are bounded by `max_seq_length` (sequences and targets grow as they come)."""
        size = self.config.micro_batch_bins
        if isinstance(self.train_data, PackedDataset):
            return BatchShape.covering(
                *self.train_data.largest_batch(size), attended=self.train_data.attended_length()
            )
        tokens = size * self.train_data.max_seq_length
        return BatchShape.covering(tokens, 8, tokens // 2)

    @property
    def world_size(self) -> int:
        """Ranks training this run (1 outside torchrun)."""
        return self.parallel.world_size if self.parallel is not None else 1

    @property
    def batch_shape(self) -> BatchShape | None:
        """The static shape this run pads its micro-batches to; None when it does not (or before its first
        step)."""
        return self._batch_shape or None

    def _train_step(self) -> None:
        phases = self.profile or NULL_PROFILE  # top-level phases follow each other: data → forward → …
        phases.step_begin()
        make = batch_of if self._cursor is not None else self.train_data.batch
        step_bins = self.bins_for_step(self.step)
        if self.parallel is not None:  # this rank's micro-batches of the global step
            step_bins = self.parallel.shard(step_bins)
        micro_batches = self._shaped([make(bins) for bins in step_bins])
        references = [self._reference_of("train", bins) for bins in step_bins]
        trained = sum(b.num_trained_tokens for b in micro_batches)
        tokens = sum(b.real_tokens for b in micro_batches)
        padding = sum(b.padding for b in micro_batches)
        pairs = sum(b.real_sequences for b in micro_batches) // 2
        counts = None
        if self.parallel is not None:  # the global counts: one device all-reduce, no host sync
            counts = self.parallel.global_counts([trained, tokens, padding, pairs])
            divisor = counts[0 if self.preference is None else 3].float()
        else:
            divisor = _device_scalar(trained if self.preference is None else pairs, self.device)
        self._metric_sums.zero_()
        micro_batches = [batch.to(self.device) for batch in micro_batches]
        timer = _StepTimer(self.device)
        loss_total = torch.zeros((), device=self.device)
        replays = 0
        for index, batch in enumerate(micro_batches):
            if self.parallel is not None and self.parallel.sharding == "fsdp":
                set_gradient_sync(self.model, index == len(micro_batches) - 1)
            if (mode := self.step_graph.mode(batch, first_micro_batch=index == 0)) != EAGER:
                replays += mode == REPLAY
                with phases.opaque("graph"):
                    loss_total += self.step_graph.forward_backward(batch, divisor, self._micro_batch_loss)
                continue
            phases.begin("forward")  # the final norm's hook hands over to "loss"
            loss = self._micro_batch_loss(batch, divisor, references[index])
            phases.begin("backward")
            (self.loss_scaler.scaled(loss) if self.loss_scaler else loss).backward()
            loss_total += loss.detach()
        if self.parallel is not None:
            phases.begin("communication")
            loss_total = self.parallel.reduce_step(self.parameters, loss_total, self._metric_sums)
        phases.begin("optimizer")
        if self.loss_scaler:  # before clipping: the norm is the unscaled gradients'
            self.loss_scaler.unscale_(self.parameters, self._found_inf_reduction())
        if self.config.max_grad_norm is not None or self.parallel is not None:  # FSDP: a norm over shards
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.parameters, self.config.max_grad_norm or math.inf, foreach=True
            )
            grad_norm = full_tensor(grad_norm)
        else:
            grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters]))
        learning_rate = self.scheduler.get_last_lr()[0]
        if self.loss_scaler:  # skipped on the device when a gradient overflowed
            self.loss_scaler.step(self.optimizer)
            self.loss_scaler.update()
        else:
            self.optimizer.step()
        # a captured backward accumulates into the gradients' own memory: keep it, zeroed
        self.optimizer.zero_grad(set_to_none=not self.step_graph.holds_gradients)
        self.scheduler.step()
        timing = phases.step_end(self.step + 1)
        timer.stop()
        values = torch.stack([loss_total.float(), grad_norm.detach().float().to(self.device)])
        if self.preference is not None:
            values = torch.cat([values, self._metric_sums / (pairs if counts is None else counts[3])])
        if counts is not None:  # the event's counts are the run's, read back with the loss
            values = torch.cat([values.double(), counts.double()])
        epoch = (
            self._cursor.epoch_progress
            if self._cursor is not None
            else (self.step + 1) * self.bins_per_step / len(self.train_data)
        )
        info = dict(
            step=self.step + 1, lr=learning_rate, trained=trained, tokens=tokens, timer=timer, timing=timing
        )
        info.update(padding=padding, replays=replays, micro_batches=len(micro_batches), pairs=pairs)
        info["epoch"] = epoch
        self._pending.append(_PendingReadout(values, info))

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
                peak_memory_bytes=max(_peak_memory(self.device), self.step_graph.peak_bytes),
                memory_kind="cuda" if self.device.type == "cuda" else "cpu-rss",
                phases=phases,
                padding_tokens=info["padding"],
                graph_replays=info["replays"],
                micro_batches=info["micro_batches"],
                **self._event_metrics(metrics, info),
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

    def _event_metrics(self, metrics: list[float], info: dict) -> dict:
        """The method's fields of a `StepEvent` from the readout's values after loss and gradient norm."""
        return {"preference": _preference_metrics(metrics, info["pairs"])}

    def _flush(self) -> None:
        self._emit_ready(wait=True)

    def _publish(self, event: Event) -> None:
        for subscriber in self.subscribers:
            subscriber(event)

    # -- evaluation and checkpoints ----------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> EvalEvent:
        """Token-weighted loss over the whole eval set (a sync point; not part of a step); for a preference
        run the mean pair loss, with the pairs' mean rewards, margin and accuracy."""
        if self.eval_data is None:
            raise ValueError("No eval data: pass eval_data=... to the Trainer.")
        self._flush()
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        metric_sums = torch.zeros(4, device=self.device, dtype=torch.float64)
        trained = pairs = 0
        size = self.config.micro_batch_bins
        starts = list(range(0, len(self.eval_data), size))
        if self.parallel is not None and self.parallel.sharding == "ddp":  # FSDP: every rank runs every batch
            starts = self.parallel.shard(starts)
        try:
            for start in starts:
                bins = list(range(start, min(start + size, len(self.eval_data))))
                batch = self.eval_data.batch(bins).to(self.device)
                with torch.autocast(
                    self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
                ):
                    if self.preference is None:
                        total += causal_lm_loss_sum(self.model, batch).double()
                    else:
                        from fastft.training.preference import pair_loss_sum

                        reference = self._reference_of("eval", bins)
                        loss, metrics = pair_loss_sum(self.model, batch, self.preference, reference)
                        total += loss.double()
                        metric_sums += metrics.double()
                        pairs += batch.num_sequences // 2
                trained += batch.num_trained_tokens
        finally:
            self.model.train()
        if self.parallel is not None and self.parallel.sharding == "ddp":
            total, metric_sums, trained, pairs = self.parallel.sum_eval(total, metric_sums, trained, pairs)
        preference = None
        if self.preference is not None:
            preference = _preference_metrics((metric_sums / pairs).tolist(), pairs)
        event = EvalEvent(
            step=self.step,
            eval_loss=float(total / (trained if self.preference is None else pairs)),
            eval_trained_tokens=trained,
            preference=preference,
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
            from fastft.training.distributed import check_resume

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
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer,
                cosine_with_warmup(self.warmup_steps, self.max_steps, self.config.min_learning_rate_ratio),
            )
            _advance_schedule(self.scheduler, state["step"])
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
        return torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            cosine_with_warmup(self.warmup_steps, self.max_steps, self.config.min_learning_rate_ratio),
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
        differing = {d.name: (d.saved, d.now) for d in self._resume_differences if d.group == "optimizer"}
        if not differing:
            return
        listed = ", ".join(f"{name} {old!r} → {new!r}" for name, (old, new) in differing.items())
        if self.config.reset_optimizer:
            lr = self.scheduler.get_last_lr()[0]
            message = (
                f"Resumed from {folder} at step {self.step} with a fresh optimizer and this config's values: "
                f"{listed} (learning rate now {lr:.3g}). The Adam moments start again from zero."
            )
        else:
            message = (
                f"Resumed from {folder} at step {self.step} keeping the checkpoint's optimizer and schedule, so "
                f"these new values are NOT used: {listed}. Pass reset_optimizer=True to train on with them."
            )
        if "seed" in differing and self.config.reset_optimizer:
            message += " The data order follows this config's seed from here on; the resume is not exact."
        warnings.warn(message, ResumeWarning, stacklevel=4)


class ResumeWarning(UserWarning):
    """What a resume did with settings that differ from the checkpoint's, or a damaged checkpoint skipped."""


def _advance_schedule(scheduler, steps: int) -> None:
    """Move a fresh LR schedule to `steps` optimizer steps without stepping the optimizer."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*", category=UserWarning)
        for _ in range(steps):
            scheduler.step()


def _as_pairs(data, tokenizer):
    """Preference data as `PackedPairs` (rows are packed with `pack_pairs`); None stays None."""
    from fastft.data.pairs import PackedPairs, pack_pairs

    if data is None or isinstance(data, PackedPairs):
        return data
    if isinstance(data, (PackedDataset, PackedStream)):
        raise ValueError(
            "A preference method trains on pairs: pass the preference rows, or fastft.pack_pairs(rows, tokenizer), "
            "not a dataset packed for SFT."
        )
    return pack_pairs(data, tokenizer)


def _preference_metrics(values: list[float], pairs: int) -> dict[str, float] | None:
    from fastft.training.preference import METRICS

    if not values:
        return None
    return {"pairs": pairs, **dict(zip(METRICS, values, strict=True))}


def _device_scalar(value: float, device: torch.device) -> torch.Tensor:
    """`value` as a 0-d float32 tensor on `device`, copied from pinned memory without a host sync."""
    scalar = torch.tensor(float(value), dtype=torch.float32)
    return scalar.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else scalar


class _StepTimer:
    """Step wall time: CUDA events on a GPU (read later, never stalling), perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.begin, self.finish = time.perf_counter(), None

    def stop(self) -> None:
        if self.cuda:
            self.end.record()
        else:
            self.finish = time.perf_counter()

    def seconds(self) -> float:
        if self.cuda:
            return self.start.elapsed_time(self.end) / 1000.0
        return self.finish - self.begin


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _check_has_adapters(model: torch.nn.Module) -> None:
    """Refuse a model without LoRA adapters: training it would silently update every base weight."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if not any(isinstance(module, BaseTunerLayer) for module in model.modules()):
        raise ValueError(
            "This model has no LoRA adapters, so training it would update every base weight (full "
            "fine-tuning, which fastft does not support yet; it is planned). Call "
            "model = fastft.add_lora(model, ...) first."
        )


def check_writable(output_dir: str | os.PathLike) -> Path:
    """Create `output_dir` and prove a file can be written there, before any step runs."""
    folder = expand(output_dir)
    if folder.exists() and not folder.is_dir():
        raise SettingError(
            f"output_dir={str(folder)!r} is a file, not a folder: pick a folder path for checkpoints."
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".fastft-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise SettingError(
            f"output_dir={str(folder)!r} cannot be written ({error.strerror or error}): pick a folder you can "
            "write to."
        ) from None
    return folder


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
    from fastft.training.progress import ProgressBar

    trainer = Trainer(model, tokenizer, dataset, eval_dataset, TrainConfig(**config), subscribers)
    main = trainer.parallel is None or trainer.parallel.is_main  # under torchrun, rank 0 shows the bar
    bar = ProgressBar(trainer.max_steps, initial=0) if progress and main else None
    if bar is not None:
        trainer.subscribe(bar)
    try:
        return trainer.train()
    finally:
        if bar is not None:
            bar.close()

"""GRPO with verifiable rewards on the SFT engine: `grpo`, `GRPOConfig`, `GRPOTrainer`.

One step (`GRPOTrainer._train_step`):

1. **rollout**: the step's `prompts_per_step` prompts (order a pure function of seed and epoch, as the SFT
   trainer's bins), `num_generations` completions each, sampled with the step's own seed
   (`fastft.training.rollout`);
2. **rewards**: every reward function scores every completion (`fastft.data.rewards`); their weighted sum is
   normalised per group into advantages (`fastft.training.grpo_loss.group_advantages`);
3. **learn**: the completions, packed padding-free into micro-batches, run `num_iterations` updates of the
   clipped objective (`fastft.training.grpo_loss`). The per-token log-probs come from the model's fused head
   (`fastft.training.loss.target_losses`: no ``[tokens, vocab]`` logits, forward or backward). With one
   update the old policy's log-probs are the policy's own, detached (ratio exactly 1, nothing recomputed);
   with more they are the ones the static decoder drew the tokens with (`GRPOConfig.old_log_probs`; under
   ``generate``, or "recompute", one no-grad pass computes them before the first update). With ``kl_coef > 0`` the reference's come
   from the same model with its adapters disabled (`fastft.training.preference.adapters_disabled`), once.

The trainer is the SFT `Trainer` with this step: the same optimizer, schedule (one scheduler step per update),
gradient clipping, events read one step later, checkpoints, pause / stop and exact resume. `StepEvent.grpo`
carries the step's rewards, KL, clip ratio, completion length and accuracy; the profiler's phases split the
step into ``rollout``, ``reference`` (old / reference log-probs), ``forward``, ``backward`` and ``optimizer``.
"""

from __future__ import annotations

import difflib
import math
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fastft.checks import SettingError, real_number, whole_number
from fastft.data.rewards import Reward, check_columns, resolve_rewards, reward_name, score_completions
from fastft.runtime.attention import patch_packed_attention, unpatch_packed_attention
from fastft.training.distributed import start_distributed
from fastft.training.events import Subscriber
from fastft.training.graph import StepGraph
from fastft.training.grpo_loss import (
    IMPORTANCE_SAMPLING,
    LOSS_TYPES,
    GRPOLoss,
    group_advantages,
    token_loss_sum,
)
from fastft.training.loss import target_losses
from fastft.training.loss_scale import LossScaler
from fastft.training.optimizer import adamw
from fastft.training.preference import adapters_disabled
from fastft.training.rollout import (
    Sampling,
    pack_completions,
    prompt_of,
    prompt_rows,
    sample,
    tokenize_prompt,
)
from fastft.training.timing import NULL_PROFILE, StepProfile
from fastft.training.timing_hooks import detach_profile
from fastft.training.trainer import (
    TrainConfig,
    Trainer,
    TrainResult,
    _advance_schedule,
    _check_has_adapters,
    _device_scalar,
    _PendingReadout,
    _StepTimer,
    check_train_config,
    check_writable,
    cosine_with_warmup,
)


@dataclass
class GRPOConfig(TrainConfig):
    """A GRPO run: `TrainConfig`'s optimizer, schedule, checkpoint and resume settings, and

        `prompts_per_step` prompts per step, `num_generations` (G) completions each, sampled at `temperature`
        and nucleus `top_p` up to `max_new_tokens` (stopping at EOS), `generation_batch_size` prompts per
        ``generate`` call (None: all of the step's); `static_decode` samples through the static-cache decoder,
    each decode step one CUDA graph replay on a GPU (None: where the architecture allows, else ``generate``;
    `fastft.training.decode`). `num_iterations` updates per rollout; clip range
        ``[1 - epsilon, 1 + epsilon_high]`` (`epsilon_high` None: `epsilon`); `kl_coef` β of the KL to the
        reference (0: no reference pass); `loss_type` "grpo", "dr_grpo" or "dapo" and `importance_sampling`
        "token" or "sequence" (GSPO), see `fastft.training.grpo_loss`; `scale_rewards` divides advantages by the
        group's standard deviation; `reward_weights` weighs the reward functions (None: 1 each);
        `micro_batch_tokens` caps a training micro-batch (None: the step's completions in one); with
        `num_iterations` > 1, `old_log_probs` "sampling" keeps the old policy's log-probs from the static
        decoder that drew the tokens (``generate`` has none: then, or with "recompute", one no-grad pass
        computes them before the first update). `max_steps` counts rollouts (None: `epochs` over the prompts);
        `warmup` counts them too.
    """

    method: str = "grpo"
    learning_rate: float = 5e-5
    prompts_per_step: int = 4
    num_generations: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    generation_batch_size: int | None = None
    static_decode: bool | None = None
    num_iterations: int = 1
    epsilon: float = 0.2
    epsilon_high: float | None = None
    kl_coef: float = 0.0
    loss_type: str = "grpo"
    importance_sampling: str = "token"
    scale_rewards: bool = True
    reward_weights: tuple[float, ...] | None = None
    micro_batch_tokens: int | None = None
    old_log_probs: str = "sampling"

    def __post_init__(self) -> None:
        if self.method != "grpo":
            raise SettingError(
                f"GRPOConfig(method={self.method!r}): a GRPOConfig trains GRPO only; leave method."
            )
        self.method = "sft"  # TrainConfig's checks know the SFT methods; every shared setting is checked
        try:
            check_train_config(self)
        finally:
            self.method = "grpo"
        check_grpo_config(self)

    @property
    def loss(self) -> GRPOLoss:
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        return GRPOLoss(
            self.loss_type, self.importance_sampling, self.epsilon, high, self.kl_coef, self.max_new_tokens
        )

    @property
    def sampling(self) -> Sampling:
        return Sampling(
            self.num_generations,
            self.max_new_tokens,
            self.temperature,
            self.top_p,
            self.generation_batch_size,
            self.static_decode,
        )


def _sampled_log_probs(rollout: Rollout, micro_batch) -> torch.Tensor:
    """The micro-batch's completion tokens' log-probs as the sampler drew them, in its targets' order
    (completion by completion, token by token)."""
    width = rollout.log_probs.shape[1]
    index = np.concatenate(
        [m * width + np.arange(len(rollout.completion_ids[m])) for m in micro_batch.members]
    )
    return rollout.log_probs.view(-1)[torch.from_numpy(index).to(rollout.log_probs.device, non_blocking=True)]


def check_grpo_config(config: GRPOConfig) -> None:
    """GRPO's own settings, each with its value and fix."""
    whole_number("prompts_per_step", config.prompts_per_step, minimum=1)
    whole_number(
        "num_generations",
        config.num_generations,
        minimum=2,
        fix="A group needs at least 2 completions to compare (8 is usual).",
    )
    whole_number("max_new_tokens", config.max_new_tokens, minimum=1)
    whole_number("num_iterations", config.num_iterations, minimum=1)
    for name in ("generation_batch_size", "micro_batch_tokens"):
        if getattr(config, name) is not None:
            whole_number(name, getattr(config, name), minimum=1, fix=f"Or leave {name}=None.")
    real_number(
        "temperature",
        config.temperature,
        low=0,
        low_open=True,
        fix="Sampling needs some randomness: 0.7 to 1.0.",
    )
    real_number("top_p", config.top_p, low=0, low_open=True, high=1, fix="1.0 keeps every token.")
    real_number("epsilon", config.epsilon, low=0, low_open=True, high=1, high_open=True, fix="0.2 is usual.")
    if config.epsilon_high is not None:
        real_number("epsilon_high", config.epsilon_high, low=0, low_open=True, fix="DAPO takes 0.28.")
    real_number(
        "kl_coef", config.kl_coef, low=0, fix="0 drops the KL term (and the reference pass); 0.04 is TRL's."
    )
    for name, valid in (
        ("loss_type", LOSS_TYPES),
        ("importance_sampling", IMPORTANCE_SAMPLING),
        ("old_log_probs", OLD_LOG_PROBS),
    ):
        value = getattr(config, name)
        if value not in valid:
            close = difflib.get_close_matches(str(value), valid, n=1, cutoff=0.6)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise SettingError(f"{name}={value!r} is not one of {', '.join(valid)}.{hint}")
    if not isinstance(config.scale_rewards, bool):
        raise SettingError(f"scale_rewards must be True or False, got {config.scale_rewards!r}.")
    if config.reward_weights is not None:
        config.reward_weights = tuple(float(w) for w in config.reward_weights)


OLD_LOG_PROBS = ("sampling", "recompute")


@dataclass(frozen=True)
class Rollout:
    """One step's sampled completions with their rewards (host values), prompt-major."""

    prompts: list
    completions: list[str]
    prompt_ids: list[np.ndarray]
    completion_ids: list[np.ndarray]
    truncated: np.ndarray
    rewards: np.ndarray  # [completions, reward functions]
    total: np.ndarray  # [completions], the weighted sum
    advantages: np.ndarray  # [completions]
    step: int = 0  # the training step (1-based) it was sampled for
    # [completions, max_new_tokens] on the device: each drawn token's log-prob when the sampler kept them
    log_probs: torch.Tensor | None = None


class GRPOTrainer(Trainer):
    """GRPO on a (PEFT) model: `Trainer`'s loop, control and checkpoints with the GRPO step (module docstring).

    `prompts` are rows (a list of dicts or a `datasets.Dataset`) with a ``prompt`` or ``messages`` column and
    whatever columns the `rewards` read, or bare prompts (strings used as they are, conversations through the
    chat template: `fastft.training.rollout.prompt_rows`); each reward is ``(prompts, completions, **row) ->
    list[float]`` or the name of a bundled one (``"exact_match"``: `fastft.data.rewards.NAMED`).
    `last_rollout` is the latest step's `Rollout` (for inspecting completions and advantages);
    `decode_stats` counts the rollouts' decode steps run eagerly and replayed from a CUDA graph.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        prompts,
        rewards: Sequence[Reward] | Reward,
        config: GRPOConfig | None = None,
        subscribers: Iterable[Subscriber] = (),
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or GRPOConfig()
        if not isinstance(self.config, GRPOConfig):
            raise SettingError(f"GRPOTrainer needs a GRPOConfig, got {type(self.config).__name__}.")
        self.rewards = resolve_rewards(rewards)
        if not self.rewards:
            raise SettingError("GRPO needs at least one reward function, e.g. fastft.rewards.exact_match.")
        weights = self.config.reward_weights
        if weights is not None and len(weights) != len(self.rewards):
            raise SettingError(
                f"reward_weights has {len(weights)} values for {len(self.rewards)} reward functions: give one each."
            )
        self.weights = np.asarray(weights if weights is not None else [1.0] * len(self.rewards))
        self.rows = prompt_rows(prompts)
        if not self.rows:
            raise ValueError("GRPO got no prompt rows: pass rows with a 'prompt' or 'messages' column.")
        check_columns(self.rewards, sorted(set.intersection(*(set(self._columns(row)) for row in self.rows))))
        self.prompts = [prompt_of(row) for row in self.rows]
        self.prompt_ids = [tokenize_prompt(tokenizer, prompt) for prompt in self.prompts]
        self.train_data = self.rows  # `_epoch_order` shuffles prompts as the SFT trainer shuffles bins
        self.eval_data = None
        self.preference = None
        self.settings = self.config.loss
        self.subscribers: list[Subscriber] = list(subscribers)
        self.device = next(model.parameters()).device
        if self.config.attention is not None:
            patch_packed_attention(model, self.config.attention)
        else:
            unpatch_packed_attention(model)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and self.config.distributed != "ddp":
            raise SettingError(
                f"GRPO runs on several processes as DDP only (distributed={self.config.distributed!r}): each rank "
                "samples its share of the step's prompts. Fix: distributed='ddp'."
            )
        self.parallel = start_distributed(model, self.device, self.config)  # None outside torchrun
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        if self.parallel is not None:
            if self.config.prompts_per_step < self.parallel.world_size:
                raise SettingError(
                    f"prompts_per_step={self.config.prompts_per_step} on {self.parallel.world_size} ranks leaves a "
                    f"rank without prompts: each rank samples whole groups. Fix: prompts_per_step of at least "
                    f"{self.parallel.world_size}."
                )
            self.parallel.broadcast_parameters(self.parameters)
        if not self.parameters:
            raise ValueError("The model has no trainable parameters: call fastft.add_lora(model, ...) first.")
        _check_has_adapters(model)
        if self.config.output_dir:
            check_writable(self.config.output_dir)
        self.profile: StepProfile | None = StepProfile(model, self.device) if self.config.profile else None
        if self.profile is None:
            detach_profile(model)
        self.bins_per_step = self.config.prompts_per_step
        self.max_steps = self.config.max_steps or max(
            1, math.ceil(self.config.epochs * len(self.rows) / self.bins_per_step)
        )
        self.updates_per_step = self.config.num_iterations
        warmup = self.config.warmup
        self.warmup_steps = int(warmup * self.max_steps) if isinstance(warmup, float) else int(warmup)
        self.autocast_dtype = self._autocast_dtype()
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
        self.step_graph = StepGraph(self.parameters, enabled=False)  # rollouts change every shape
        self._batch_shape = False
        self._cursor = None
        self.step = 0
        self.result = TrainResult(profile=self.profile)
        self._stop = threading.Event()
        self._control = threading.Condition()
        self._paused = False
        self._holding = False
        self._calls: list[Callable[[], object]] = []
        self._pending: list[_PendingReadout] = []
        self._epoch_orders: dict[int, np.ndarray] = {}
        self.last_rollout: Rollout | None = None
        self.decode_stats = {"eager_steps": 0, "replays": 0}  # the static decoder's, over the run's rollouts

    def _schedule(self) -> torch.optim.lr_scheduler.LambdaLR:
        """Cosine with warmup over the run's optimizer updates (`num_iterations` per step)."""
        updates = self.updates_per_step
        return torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            cosine_with_warmup(
                self.warmup_steps * updates, self.max_steps * updates, self.config.min_learning_rate_ratio
            ),
        )

    def _load(self, folder) -> dict:
        state = super()._load(folder)
        if self.config.reset_optimizer:  # the SFT trainer's fresh schedule counts steps, this one updates
            self.scheduler = self._schedule()
            _advance_schedule(self.scheduler, state["step"] * self.updates_per_step)
        return state

    @staticmethod
    def _columns(row: dict) -> list[str]:
        return [name for name in row if name != "prompt"]

    def prompts_for_step(self, step: int) -> list[int]:
        """The prompt rows of step `step` (0-based); a pure function of the seed and the step."""
        n = len(self.rows)
        positions = range(step * self.bins_per_step, (step + 1) * self.bins_per_step)
        return [int(self._epoch_order(p // n)[p % n]) for p in positions]

    def evaluate(self):
        raise ValueError(
            "A GRPO run has no eval loss: measure held-out accuracy with fastft.evaluate_accuracy(model, "
            "tokenizer, rows)."
        )

    # -- one step ------------------------------------------------------------------------------
    def rollout(self, step: int) -> Rollout:
        """Sample and score step `step`'s completions (no update). Under torchrun each rank samples its share
        of the step's prompts (every ``world_size``-th, whole groups), from a seed of its own."""
        config = self.config
        chosen = self.prompts_for_step(step)
        seed = (config.seed, step)
        if self.parallel is not None:
            chosen = self.parallel.shard(chosen)
            seed = (config.seed, step, self.parallel.rank)
        group = config.num_generations
        completion_ids, truncated, log_probs = sample(
            self.model,
            self.tokenizer,
            [self.prompt_ids[i] for i in chosen],
            config.sampling,
            seed,
            self.decode_stats,
            keep_log_probs=self.updates_per_step > 1 and config.old_log_probs == "sampling",
        )
        completions = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        owners = [i for i in chosen for _ in range(group)]
        prompts = [self.prompts[i] for i in owners]
        columns = {
            name: [self.rows[i].get(name) for i in owners] for name in self._columns(self.rows[chosen[0]])
        }
        rewards = np.asarray(
            score_completions(self.rewards, prompts, completions, columns, step=step + 1, rows=owners),
            dtype=np.float64,
        ).T
        if not np.isfinite(rewards).all():
            bad = [
                reward_name(r)
                for r, ok in zip(self.rewards, np.isfinite(rewards).all(0), strict=True)
                if not ok
            ]
            raise ValueError(
                f"The reward {bad[0]!r} returned NaN or infinity at step {step + 1}: return finite numbers."
            )
        total = rewards @ self.weights
        advantages = group_advantages(total, group, config.scale_rewards)
        return Rollout(
            prompts,
            completions,
            [self.prompt_ids[i] for i in owners],
            completion_ids,
            truncated,
            rewards,
            total,
            advantages,
            step + 1,
            log_probs,
        )

    def _log_probs(self, batch) -> torch.Tensor:
        with torch.autocast(
            self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None
        ):
            return -target_losses(self.model, batch)

    def _train_step(self) -> None:
        config, settings = self.config, self.settings
        phases = self.profile or NULL_PROFILE
        phases.step_begin()
        timer = _StepTimer(self.device)
        with phases.opaque("rollout"):
            rollout = self.rollout(self.step)
        self.last_rollout = rollout
        phases.begin("data")
        micro_batches = [
            mb.to(self.device)
            for mb in pack_completions(rollout.prompt_ids, rollout.completion_ids, config.micro_batch_tokens)
        ]
        advantages = [
            torch.from_numpy(rollout.advantages[mb.members].astype(np.float32)).to(
                self.device, non_blocking=True
            )
            for mb in micro_batches
        ]
        completion_tokens = sum(len(ids) for ids in rollout.completion_ids)
        completions = len(rollout.completions)
        tokens = sum(mb.batch.num_tokens for mb in micro_batches)
        counts = None
        if (
            self.parallel is not None
        ):  # the step's counts over every rank (a host read: rollouts are host-side)
            counts = self.parallel.global_counts([completion_tokens, tokens, 0, 0, completions])
            completion_tokens, tokens, _, _, completions = (int(n) for n in counts.tolist())
            counts = counts[:4]
        divisor = _device_scalar(settings.divisor(completions, completion_tokens), self.device)
        old = [None] * len(micro_batches)
        reference = [None] * len(micro_batches)
        recompute = self.updates_per_step > 1 and rollout.log_probs is None
        if self.updates_per_step > 1 and not recompute:
            old = [_sampled_log_probs(rollout, mb) for mb in micro_batches]
        if recompute or settings.kl_coef > 0:
            phases.begin("reference")
            with torch.no_grad():
                for index, mb in enumerate(micro_batches):
                    if recompute:
                        old[index] = self._log_probs(mb.batch).detach()
                    if settings.kl_coef > 0:
                        with adapters_disabled(self.model):
                            reference[index] = self._log_probs(mb.batch)
        loss_total = torch.zeros((), device=self.device)
        norm_total = torch.zeros((), device=self.device)
        metric_total = torch.zeros(2, device=self.device)
        learning_rate = self.scheduler.get_last_lr()[0]
        for _ in range(self.updates_per_step):
            for index, mb in enumerate(micro_batches):
                phases.begin("forward")
                log_probs = self._log_probs(mb.batch)
                loss, metrics = token_loss_sum(
                    settings,
                    log_probs,
                    old[index],
                    advantages[index],
                    mb.sequence,
                    mb.counts,
                    reference[index],
                )
                loss = loss / divisor
                phases.begin("backward")
                (self.loss_scaler.scaled(loss) if self.loss_scaler else loss).backward()
                loss_total += loss.detach()
                metric_total += metrics
            if self.parallel is not None:
                phases.begin("communication")
                self.parallel.reduce_gradients(self.parameters)
            phases.begin("optimizer")
            norm_total += self._update()
        if self.parallel is not None:  # the loss and the metric sums of every rank's completions
            summed = torch.cat([loss_total.reshape(1), metric_total])
            self.parallel.sum_(summed)
            loss_total, metric_total = summed[0], summed[1:]
        timing = phases.step_end(self.step + 1)
        timer.stop()
        updates = self.updates_per_step
        values = torch.cat(
            [
                torch.stack([loss_total / updates, norm_total / updates]),
                metric_total / (completion_tokens * updates),
            ]
        )
        if counts is not None:  # read back with the loss, as the SFT trainer's global counts are
            values = torch.cat([values.double(), counts.double()])
        info = dict(
            step=self.step + 1, lr=learning_rate, trained=completion_tokens, tokens=tokens, timer=timer
        )
        info.update(timing=timing, padding=0, replays=0, micro_batches=len(micro_batches), pairs=0)
        info["epoch"] = (self.step + 1) * self.bins_per_step / len(self.rows)
        info["grpo"] = self._host_metrics(rollout)
        self._pending.append(_PendingReadout(values, info))

    def _update(self) -> torch.Tensor:
        """Clip, step the optimizer and the schedule, zero the gradients; the gradient norm (device)."""
        if self.loss_scaler:  # before clipping: the norm is the unscaled gradients'
            self.loss_scaler.unscale_(self.parameters, self._found_inf_reduction())
        if self.config.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters, self.config.max_grad_norm, foreach=True)
        else:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters]))
        if self.loss_scaler:  # skipped on the device when a gradient overflowed
            self.loss_scaler.step(self.optimizer)
            self.loss_scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return norm.detach().float().to(self.device)

    def _host_metrics(self, rollout: Rollout) -> dict[str, float]:
        total, rewards, truncated = rollout.total, rollout.rewards, np.asarray(rollout.truncated)
        lengths = np.asarray([len(ids) for ids in rollout.completion_ids], dtype=np.float64)
        if self.parallel is not None:  # every rank's completions: one host gather of small arrays
            parts = self.parallel.gather_objects((total, rewards, truncated, lengths))
            total, rewards, truncated, lengths = (
                np.concatenate(column) for column in zip(*parts, strict=True)
            )
        metrics = {
            "reward": float(total.mean()),
            "reward_std": float(total.reshape(-1, self.config.num_generations).std(axis=1, ddof=1).mean()),
        }
        for column, reward in enumerate(self.rewards):
            metrics[f"reward/{reward_name(reward)}"] = float(rewards[:, column].mean())
        accuracy = [c for c, reward in enumerate(self.rewards) if getattr(reward, "is_accuracy", False)]
        if accuracy:
            metrics["accuracy"] = float((rewards[:, accuracy[0]] >= 1).mean())
        metrics["completion_length"] = float(lengths.mean())
        metrics["truncated"] = float(truncated.mean())
        metrics["completions"] = len(total)
        return metrics

    def _event_metrics(self, metrics: list[float], info: dict) -> dict:
        kl, clipped = metrics
        values = dict(info["grpo"])
        values["clip_ratio"] = clipped
        if self.settings.kl_coef > 0:
            values["kl"] = kl
        return {"grpo": values}


def grpo(
    model: torch.nn.Module,
    tokenizer,
    prompts,
    rewards: Sequence[Reward] | Reward,
    config: GRPOConfig | None = None,
    *,
    progress: bool = True,
    subscribers: Iterable[Subscriber] = (),
    **settings,
) -> TrainResult:
    """Train `model` with GRPO on `prompts` (rows, a `datasets.Dataset` or a `fastft.load_dataset` name)
    scored by `rewards` (callables ``(prompts, completions, **row) -> list[float]``; `fastft.rewards` bundles
    some). `config` is a `GRPOConfig`, or its fields as keyword arguments. Returns every `StepEvent`
    (``event.grpo`` holds the rewards, KL and accuracy)."""
    from fastft.training.progress import ProgressBar

    if config is not None and settings:
        raise SettingError("Pass either config=GRPOConfig(...) or its fields as keywords, not both.")
    config = config or GRPOConfig(**settings)
    if isinstance(prompts, str):
        from fastft.data.loading import load_dataset

        prompts = load_dataset(prompts)
    trainer = GRPOTrainer(model, tokenizer, prompts, rewards, config, subscribers)
    bar = ProgressBar(trainer.max_steps, initial=0) if progress else None
    if bar is not None:
        trainer.subscribe(bar)
    try:
        return trainer.train()
    finally:
        if bar is not None:
            bar.close()

"""GRPO with verifiable rewards on the SFT engine: `grpo`, `GRPOConfig`, `GRPOTrainer`.

One step (`GRPOObjective.train_step`):

1. **rollout**: the step's `prompts_per_step` prompts (order a pure function of seed and epoch, as the SFT
   trainer's bins), `num_generations` completions each, sampled with the step's own seed
   (`fastft.training.objectives.rollout`);
2. **rewards**: every reward function scores every completion (`fastft.data.rewards`); their weighted sum is
   normalised per group into advantages (`fastft.training.objectives.grpo_loss.group_advantages`);
3. **learn**: the completions, packed padding-free into micro-batches, run `num_iterations` updates of the
   clipped objective (`fastft.training.objectives.grpo_loss`). The per-token log-probs come from the model's fused head
   (`fastft.training.loss.target_losses`: no ``[tokens, vocab]`` logits, forward or backward). With one
   update the old policy's log-probs are the policy's own, detached (ratio exactly 1, nothing recomputed);
   with more they are the ones the static decoder drew the tokens with (`GRPOConfig.old_log_probs`; under
   ``generate``, or "recompute", one no-grad pass computes them before the first update). With ``kl_coef > 0`` the reference's come
   from the same model with its adapters disabled (`fastft.training.objectives.preference.adapters_disabled`), once.

`GRPOObjective` is this step as an objective on the `Trainer`'s loop (`GRPOTrainer` runs it): the same optimizer,
schedule (one scheduler step per update), gradient clipping, events read one step later, checkpoints, pause /
stop and exact resume. The rollout (`rollout`), the static-cache decoder (`decode`) and the loss (`grpo_loss`)
live beside it. `StepEvent.grpo`
carries the step's rewards, KL, clip ratio, completion length and accuracy; the profiler's phases split the
step into ``rollout``, ``reference`` (old / reference log-probs), ``forward``, ``backward`` and ``optimizer``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fastft.checks import SettingError, real_number, whole_number
from fastft.data.rewards import Reward, check_columns, resolve_rewards, reward_name, score_completions
from fastft.training.config import TrainConfig, check_train_config
from fastft.training.events import Subscriber
from fastft.training.loss import target_losses
from fastft.training.objectives import Objective
from fastft.training.objectives.grpo_loss import (
    IMPORTANCE_SAMPLING,
    LOSS_TYPES,
    GRPOLoss,
    group_advantages,
    token_loss_sum,
)
from fastft.training.objectives.preference import adapters_disabled
from fastft.training.objectives.rollout import (
    Sampling,
    pack_completions,
    prompt_of,
    prompt_rows,
    sample,
    tokenize_prompt,
)
from fastft.training.readout import StepTimer, device_scalar
from fastft.training.timing import NULL_PROFILE
from fastft.training.trainer import Trainer, TrainResult, train_with_progress


@dataclass
class GRPOConfig(TrainConfig):
    """A GRPO run: `TrainConfig`'s optimizer, schedule, checkpoint and resume settings, and

        `prompts_per_step` prompts per step, `num_generations` (G) completions each, sampled at `temperature`
        and nucleus `top_p` up to `max_new_tokens` (stopping at EOS), `generation_batch_size` prompts per
        ``generate`` call (None: all of the step's); `static_decode` samples through the static-cache decoder,
    each decode step one CUDA graph replay on a GPU (None: where the architecture allows, else ``generate``;
    `fastft.training.objectives.decode`). `num_iterations` updates per rollout; clip range
        ``[1 - epsilon, 1 + epsilon_high]`` (`epsilon_high` None: `epsilon`); `kl_coef` β of the KL to the
        reference (0: no reference pass); `loss_type` "grpo", "dr_grpo" or "dapo" and `importance_sampling`
        "token" or "sequence" (GSPO), see `fastft.training.objectives.grpo_loss`; `scale_rewards` divides advantages by the
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


def sampled_log_probs(rollout: Rollout, micro_batch) -> torch.Tensor:
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


class GRPOObjective(Objective):
    """GRPO's step (module docstring) on the `Trainer`'s loop; its data are prompt rows (`prepare`), a step reads
    `prompts_per_step` of them. Keeps the run's rows, rewards, `last_rollout` and `decode_stats`."""

    name = "grpo"

    def __init__(self, rewards: Sequence[Reward] | Reward):
        self.reward_functions = rewards
        self.last_rollout: Rollout | None = None
        self.decode_stats = {"eager_steps": 0, "replays": 0}  # the static decoder's, over the run's rollouts

    def prepare(self, trainer, prompts, eval_data) -> tuple:
        """The prompt rows, checked against the config and the rewards; GRPO has no eval data."""
        config = trainer.config
        if not isinstance(config, GRPOConfig):
            raise SettingError(f"GRPOTrainer needs a GRPOConfig, got {type(config).__name__}.")
        self.rewards = resolve_rewards(self.reward_functions)
        if not self.rewards:
            raise SettingError("GRPO needs at least one reward function, e.g. fastft.rewards.exact_match.")
        weights = config.reward_weights
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
        self.prompt_ids = [tokenize_prompt(trainer.tokenizer, prompt) for prompt in self.prompts]
        self.settings = config.loss
        self.updates_per_step = config.num_iterations
        return self.rows, None  # the loop shuffles prompts as it shuffles bins

    def check_world(self, trainer, world_size: int) -> None:
        config = trainer.config
        if world_size > 1 and config.distributed != "ddp":
            raise SettingError(
                f"GRPO runs on several processes as DDP only (distributed={config.distributed!r}): each rank "
                "samples its share of the step's prompts. Fix: distributed='ddp'."
            )
        if world_size > 1 and config.prompts_per_step < world_size:
            raise SettingError(
                f"prompts_per_step={config.prompts_per_step} on {world_size} ranks leaves a "
                f"rank without prompts: each rank samples whole groups. Fix: prompts_per_step of at least "
                f"{world_size}."
            )

    def units_per_step(self, trainer) -> int:
        return trainer.config.prompts_per_step

    def captures_graphs(self, config) -> bool:
        return False  # rollouts change every shape

    @staticmethod
    def _columns(row: dict) -> list[str]:
        return [name for name in row if name != "prompt"]

    def rollout(self, trainer, step: int) -> Rollout:
        """Sample and score step `step`'s completions (no update). Under torchrun each rank samples its share
        of the step's prompts (every ``world_size``-th, whole groups), from a seed of its own."""
        config = trainer.config
        chosen = trainer.units_for_step(step)
        seed = (config.seed, step)
        if trainer.parallel is not None:
            chosen = trainer.parallel.shard(chosen)
            seed = (config.seed, step, trainer.parallel.rank)
        group = config.num_generations
        completion_ids, truncated, log_probs = sample(
            trainer.model,
            trainer.tokenizer,
            [self.prompt_ids[i] for i in chosen],
            config.sampling,
            seed,
            self.decode_stats,
            keep_log_probs=self.updates_per_step > 1 and config.old_log_probs == "sampling",
        )
        completions = trainer.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
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

    def log_probs(self, trainer, batch) -> torch.Tensor:
        """Per-target log-probs of a packed completions batch under the trained model, under autocast."""
        with trainer.autocast():
            return -target_losses(trainer.model, batch)

    def _old_and_reference(self, trainer, rollout: Rollout, micro_batches, phases) -> tuple[list, list]:
        """Each micro-batch's old-policy log-probs (kept from sampling, or recomputed) and reference
        log-probs (``kl_coef > 0``: the model with its adapters disabled); None where not needed."""
        old = [None] * len(micro_batches)
        reference = [None] * len(micro_batches)
        recompute = self.updates_per_step > 1 and rollout.log_probs is None
        if self.updates_per_step > 1 and not recompute:
            old = [sampled_log_probs(rollout, mb) for mb in micro_batches]
        if recompute or self.settings.kl_coef > 0:
            phases.begin("reference")
            with torch.no_grad():
                for index, mb in enumerate(micro_batches):
                    if recompute:
                        old[index] = self.log_probs(trainer, mb.batch).detach()
                    if self.settings.kl_coef > 0:
                        with adapters_disabled(trainer.model):
                            reference[index] = self.log_probs(trainer, mb.batch)
        return old, reference

    def train_step(self, trainer) -> None:
        config, settings, device, parallel = trainer.config, self.settings, trainer.device, trainer.parallel
        phases = trainer.profile or NULL_PROFILE
        phases.step_begin()
        timer = StepTimer(device)
        with phases.opaque("rollout"):
            rollout = self.rollout(trainer, trainer.step)
        self.last_rollout = rollout
        phases.begin("data")
        micro_batches = [
            mb.to(device)
            for mb in pack_completions(rollout.prompt_ids, rollout.completion_ids, config.micro_batch_tokens)
        ]
        advantages = [
            torch.from_numpy(rollout.advantages[mb.members].astype(np.float32)).to(device, non_blocking=True)
            for mb in micro_batches
        ]
        completion_tokens = sum(len(ids) for ids in rollout.completion_ids)
        completions = len(rollout.completions)
        tokens = sum(mb.batch.num_tokens for mb in micro_batches)
        counts = None
        if parallel is not None:  # the step's counts over every rank (a host read: rollouts are host-side)
            counts = parallel.global_counts([completion_tokens, tokens, 0, 0, completions])
            completion_tokens, tokens, _, _, completions = (int(n) for n in counts.tolist())
            counts = counts[:4]
        divisor = device_scalar(settings.divisor(completions, completion_tokens), device)
        old, reference = self._old_and_reference(trainer, rollout, micro_batches, phases)
        loss_total = torch.zeros((), device=device)
        norm_total = torch.zeros((), device=device)
        metric_total = torch.zeros(2, device=device)
        learning_rate = trainer.scheduler.get_last_lr()[0]
        for _ in range(self.updates_per_step):
            for index, mb in enumerate(micro_batches):
                phases.begin("forward")
                log_probs = self.log_probs(trainer, mb.batch)
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
                (trainer.loss_scaler.scaled(loss) if trainer.loss_scaler else loss).backward()
                loss_total += loss.detach()
                metric_total += metrics
            if parallel is not None:
                phases.begin("communication")
                parallel.reduce_gradients(trainer.parameters)
            phases.begin("optimizer")
            norm_total += trainer.update()
        if parallel is not None:  # the loss and the metric sums of every rank's completions
            summed = torch.cat([loss_total.reshape(1), metric_total])
            parallel.sum_(summed)
            loss_total, metric_total = summed[0], summed[1:]
        timing = phases.step_end(trainer.step + 1)
        timer.stop()
        updates = self.updates_per_step
        values = torch.cat(
            [
                torch.stack([loss_total / updates, norm_total / updates]),
                metric_total / (completion_tokens * updates),
            ]
        )
        if counts is not None:  # read back with the loss, as the packed step's global counts are
            values = torch.cat([values.double(), counts.double()])
        info = dict(
            step=trainer.step + 1, lr=learning_rate, trained=completion_tokens, tokens=tokens, timer=timer
        )
        info.update(timing=timing, padding=0, replays=0, micro_batches=len(micro_batches), pairs=0)
        info["epoch"] = trainer.epoch_progress()
        info["grpo"] = self._host_metrics(trainer, rollout)
        trainer.queue_readout(values, info)

    def _host_metrics(self, trainer, rollout: Rollout) -> dict[str, float]:
        total, rewards, truncated = rollout.total, rollout.rewards, np.asarray(rollout.truncated)
        lengths = np.asarray([len(ids) for ids in rollout.completion_ids], dtype=np.float64)
        if trainer.parallel is not None:  # every rank's completions: one host gather of small arrays
            parts = trainer.parallel.gather_objects((total, rewards, truncated, lengths))
            total, rewards, truncated, lengths = (
                np.concatenate(column) for column in zip(*parts, strict=True)
            )
        metrics = {
            "reward": float(total.mean()),
            "reward_std": float(total.reshape(-1, trainer.config.num_generations).std(axis=1, ddof=1).mean()),
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

    def event_fields(self, metrics: list[float], info: dict) -> dict:
        kl, clipped = metrics
        values = dict(info["grpo"])
        values["clip_ratio"] = clipped
        if self.settings.kl_coef > 0:
            values["kl"] = kl
        return {"grpo": values}


class GRPOTrainer(Trainer):
    """GRPO on a (PEFT) model: the `Trainer` with a `GRPOObjective` (module docstring).

    `prompts` are rows (a list of dicts or a `datasets.Dataset`) with a ``prompt`` or ``messages`` column and
    whatever columns the `rewards` read, or bare prompts (strings used as they are, conversations through the
    chat template: `fastft.training.objectives.rollout.prompt_rows`); each reward is ``(prompts, completions,
    **row) -> list[float]`` or the name of a bundled one (``"exact_match"``: `fastft.data.rewards.NAMED`).
    `last_rollout` is the latest step's `Rollout` (for inspecting completions and advantages);
    `decode_stats` counts the rollouts' decode steps run eagerly and replayed from a CUDA graph.
    """

    objective: GRPOObjective

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        prompts,
        rewards: Sequence[Reward] | Reward,
        config: GRPOConfig | None = None,
        subscribers: Iterable[Subscriber] = (),
    ):
        objective = GRPOObjective(rewards)
        super().__init__(model, tokenizer, prompts, None, config or GRPOConfig(), subscribers, objective)

    @property
    def rewards(self) -> list:
        return self.objective.rewards

    @property
    def prompt_ids(self) -> list[np.ndarray]:
        return self.objective.prompt_ids

    @property
    def last_rollout(self) -> Rollout | None:
        return self.objective.last_rollout

    @property
    def decode_stats(self) -> dict[str, int]:
        return self.objective.decode_stats

    def prompts_for_step(self, step: int) -> list[int]:
        """The prompt rows of step `step` (0-based); a pure function of the seed and the step."""
        return self.units_for_step(step)

    def rollout(self, step: int) -> Rollout:
        """Sample and score step `step`'s completions (no update): `GRPOObjective.rollout`."""
        return self.objective.rollout(self, step)

    def log_probs(self, batch) -> torch.Tensor:
        """Per-target log-probs of a packed completions batch under the trained model."""
        return self.objective.log_probs(self, batch)

    def evaluate(self):
        raise ValueError(
            "A GRPO run has no eval loss: measure held-out accuracy with fastft.evaluate_accuracy(model, "
            "tokenizer, rows)."
        )


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
    if config is not None and settings:
        raise SettingError("Pass either config=GRPOConfig(...) or its fields as keywords, not both.")
    config = config or GRPOConfig(**settings)
    if isinstance(prompts, str):
        from fastft.data.loading import load_dataset  # imports `datasets`: only for a dataset's name

        prompts = load_dataset(prompts)
    trainer = GRPOTrainer(model, tokenizer, prompts, rewards, config, subscribers)
    return train_with_progress(trainer, progress)

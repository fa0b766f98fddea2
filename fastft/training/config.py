"""`TrainConfig`: the settings of a training run, each checked when the config is made.

A wrong setting raises `SettingError` naming it, its value and the fix; a legal but doubtful one warns. The checks
are small functions by theme (`check_train_config` runs them all); `GRPOConfig` reuses them for the settings it
shares.
"""

from __future__ import annotations

import difflib
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from fastft.atomic import expand
from fastft.checks import SettingError, real_number, whole_number
from fastft.runtime.attention import BACKENDS
from fastft.training.distributed import SHARDINGS
from fastft.training.objectives.preference import DPO_LOSSES, METHODS


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
    pairs (`fastft.data.pairs.pack_pairs`; `fastft.training.objectives.preference`): "dpo" (with `dpo_loss` "sigmoid",
    "ipo" or "robust"; the reference is the model with its adapters disabled), "orpo" or "simpo" (no
    reference). `beta` defaults to 0.1 (2.0 for SimPO); `label_smoothing` is DPO's and SimPO's ε,
    `simpo_gamma` SimPO's margin γ. Preference steps replay CUDA graphs as SFT steps do, except with
    `precompute_reference` (eager); ragged pairs pad to a static shape as SFT's packs do (pad pairs
    take no loss).

    `distributed` applies under torchrun (`fastft.training.distributed`): "ddp" replicates the model and sums
    the LoRA gradients once per step; "fsdp" shards the base and the adapters with FSDP2 (``fully_shard``).
    `precompute_reference` (DPO) runs the adapter-disabled pass once over the train and eval pairs before
    training, keeps each sequence's reference log-prob with the data, and skips the reference forward in
    every step (`fastft.training.objectives.preference.cached_reference_log_probs`).
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
    _check_steps(config)
    _check_optimizer(config)
    _check_paths(config)
    _check_switches(config)
    _check_attention(config)
    check_method(config)
    if config.distributed not in SHARDINGS:
        raise SettingError(
            f"distributed={config.distributed!r} is not one of {', '.join(SHARDINGS)} (used under torchrun only)."
        )
    if (config.save_every or config.resume_from == "latest") and not config.output_dir:
        raise SettingError(
            "save_every and resume_from='latest' need output_dir=... (where checkpoints live)."
        )


def _check_steps(config: TrainConfig) -> None:
    """The run's length, batching, warmup and the step intervals."""
    for name in ("micro_batch_bins", "grad_accum_steps", "save_total_limit"):
        whole_number(name, getattr(config, name), minimum=1)
    if config.max_steps is not None:
        whole_number("max_steps", config.max_steps, minimum=1, fix="Or leave max_steps=None to train epochs.")
    real_number(
        "epochs", config.epochs, low=0, low_open=True, fix="Pass epochs > 0, or max_steps=N for a step count."
    )
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
        warn_long_warmup(config.warmup, config.max_steps)
    whole_number("seed", config.seed)
    for name in ("eval_every", "save_every"):
        if getattr(config, name) is not None:
            whole_number(name, getattr(config, name), minimum=1, fix=f"Use {name}=None to turn it off.")


def _check_optimizer(config: TrainConfig) -> None:
    """The learning rate and its schedule's floor, weight decay, Adam's constants and gradient clipping."""
    real_number(
        "learning_rate", config.learning_rate, low=0, low_open=True, fix="LoRA usually takes 1e-4 to 3e-3."
    )
    if config.learning_rate >= 1:
        warnings.warn(
            f"learning_rate={config.learning_rate:g} is far above what fine-tuning takes (LoRA: 1e-4 to 3e-3): "
            "the weights will most likely blow up.",
            stacklevel=5,
        )
    real_number("min_learning_rate_ratio", config.min_learning_rate_ratio, low=0, high=1)
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


def _check_paths(config: TrainConfig) -> None:
    """`output_dir` and `resume_from`: paths (expanded in place), a resume source that exists."""
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


def _check_switches(config: TrainConfig) -> None:
    """The True/False settings, and `static_shapes` (None, True or False)."""
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
    if config.static_shapes not in (None, True, False):
        raise SettingError(
            f"static_shapes must be None (pad where a CUDA graph replays), True or False, got {config.static_shapes!r}."
        )


def _check_attention(config: TrainConfig) -> None:
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


def check_method(config: TrainConfig) -> None:
    """The objective's settings: `method` and the preference losses' constants."""
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


def warn_long_warmup(warmup_steps: int, max_steps: int, stacklevel: int = 6) -> None:
    """Warn that a warmup of `warmup_steps` never ends in a run of `max_steps`."""
    warnings.warn(
        f"warmup={warmup_steps} steps is not shorter than the run ({max_steps} steps): the learning rate never "
        "reaches its peak. Use a shorter warmup, e.g. warmup=0.05 (5 % of the run).",
        stacklevel=stacklevel,
    )

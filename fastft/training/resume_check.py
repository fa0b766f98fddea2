"""Whether a checkpoint may resume this run: one check of everything that defines a run's trajectory.

A checkpoint records its run's settings (``trainer_state.json``: ``config`` and ``max_steps``), its signature
(``run``: the run id, the training data's fingerprint, the packing length) and its adapter's
``adapter_config.json``. `compare` sets each against this run's, and every difference falls in one group:

- ``optimizer`` (`OPTIMIZER_SETTINGS`: the learning rate and its schedule, weight decay, Adam's constants, the
  seed): the checkpoint's values are kept (and a warning names the new ones not used), or
  ``reset_optimizer=True`` trains on with this config's and a fresh optimizer;
- ``data`` (the data, packing length, batching, step count; GRPO's rollout sizes): refused, or
  ``reset_data=True`` goes on from the resumed step with this run's data and batches, with a warning;
- ``objective`` (the loss's settings, gradient clipping): refused, or ``reset_objective=True`` goes on with
  this run's, with a warning;
- ``fixed`` (the method, LoRA's alpha, dropout and variants, the base weights' format: `weight_format`; rank
  and targets are checked by
  `fastft.training.checkpoint.check_adapter_matches`): refused; a new run starts from the checkpoint's
  adapter instead (`fastft.load_adapter`).

A refusal (`ResumeMismatchError`) lists every difference, saved → now, and how to accept it, before any
weight is loaded. A resumed run that accepted nothing is the uninterrupted run, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fastft.data.packing import PackedDataset
from fastft.training.checkpoint import ResumeMismatchError

OPTIMIZER_SETTINGS = (
    "learning_rate",
    "min_learning_rate_ratio",
    "warmup",
    "weight_decay",
    "adam_betas",
    "adam_eps",
    "seed",
)
DATA_SETTINGS = (
    "data",
    "max_seq_length",
    "micro_batch_bins",
    "grad_accum_steps",
    "max_steps",
    # GRPO's rollouts
    "prompts_per_step",
    "num_generations",
    "max_new_tokens",
    "temperature",
    "top_p",
    "micro_batch_tokens",
)
OBJECTIVE_SETTINGS = (
    "max_grad_norm",
    "beta",
    "dpo_loss",
    "label_smoothing",
    "simpo_gamma",
    # GRPO's loss
    "num_iterations",
    "epsilon",
    "epsilon_high",
    "kl_coef",
    "loss_type",
    "importance_sampling",
    "scale_rewards",
    "reward_weights",
    "old_log_probs",
)
FIXED_SETTINGS = ("method", "lora_alpha", "lora_dropout", "use_rslora", "use_dora", "bias", "weights")
# each group's option that accepts its changes (the fixed group has none)
GROUPS = {
    "optimizer": ("reset_optimizer", OPTIMIZER_SETTINGS),
    "data": ("reset_data", DATA_SETTINGS),
    "objective": ("reset_objective", OBJECTIVE_SETTINGS),
    "fixed": (None, FIXED_SETTINGS),
}
LORA_SETTINGS = ("lora_alpha", "lora_dropout", "use_rslora", "use_dora", "bias")


@dataclass(frozen=True)
class Difference:
    """One setting that differs between the checkpoint's run (`saved`) and this one (`now`)."""

    name: str
    saved: object
    now: object
    group: str

    def __str__(self) -> str:
        if self.name == "data":
            return f"data (fingerprint {str(self.saved)[:12]} → {str(self.now)[:12]}: other rows or another order)"
        return f"{self.name} {self.saved!r} → {self.now!r}"


def data_fingerprint(data) -> str | None:
    """A SHA-256 of what a run trains on: a `PackedDataset`'s (or `PackedPairs`') tokens, labels and bins, or
    GRPO's prompt rows; None for a `PackedStream` (not read ahead)."""

    digest = hashlib.sha256()
    if isinstance(data, PackedDataset):
        tokenized = data.data
        digest.update(np.asarray([data.max_seq_length, len(tokenized)], dtype=np.int64).tobytes())
        digest.update(tokenized.lengths.tobytes())
        for arrays in (tokenized.input_ids, tokenized.labels):
            if arrays:
                digest.update(np.concatenate(arrays).astype(np.int64).tobytes())
        digest.update(np.asarray([len(b) for b in data.bins], dtype=np.int64).tobytes())
        digest.update(np.asarray([i for b in data.bins for i in b], dtype=np.int64).tobytes())
        return digest.hexdigest()
    if isinstance(data, list):  # GRPO's prompt rows
        digest.update(json.dumps(data, sort_keys=True, default=str).encode("utf-8"))
        return digest.hexdigest()
    return None


def weight_format(model) -> str:
    """The format of `model`'s frozen base weights: "fp8" (`fastft.models.fp8`), "nf4" or "int8"
    (bitsandbytes), else "16-bit" (bf16, fp16 and fp32 alike: a resume may change the compute dtype)."""
    from fastft.models.fp8 import is_fp8
    from fastft.runtime.model_state import base_model

    base = base_model(model)
    if getattr(base, "is_loaded_in_4bit", False):
        return "nf4"
    if getattr(base, "is_loaded_in_8bit", False):
        return "int8"
    return "fp8" if is_fp8(base) else "16-bit"


def lora_settings(model) -> dict:
    """The LoRA settings of `model`'s active adapter, as its ``adapter_config.json`` names them."""
    configs = getattr(model, "peft_config", None) or {}
    config = configs.get(getattr(model, "active_adapter", "default"))
    return {} if config is None else {name: getattr(config, name, None) for name in LORA_SETTINGS}


def compare(saved_state: dict, saved_adapter: dict, now: dict) -> list[Difference]:
    """Every run-defining setting that differs: `saved_state` is the checkpoint's trainer state, `saved_adapter`
    its adapter_config.json, `now` this run's values by name (`GROUPS`). A value the checkpoint did not record
    (older checkpoints have no data fingerprint) or this run cannot know (a stream's) is not compared."""
    saved = dict(saved_state.get("config") or {})
    saved.update({key: value for key, value in (saved_state.get("run") or {}).items() if key != "id"})
    if "max_steps" in saved_state:
        saved["max_steps"] = saved_state["max_steps"]
    saved.update({name: saved_adapter[name] for name in LORA_SETTINGS if name in saved_adapter})
    differences = []
    for group, (_, names) in GROUPS.items():
        for name in names:
            if name not in saved or name not in now:
                continue
            old, new = saved[name], now[name]
            if name == "data" and (old is None or new is None):
                continue
            if _plain(old) != _plain(new):
                differences.append(Difference(name, old, new, group))
    return differences


def check_compatible(folder: Path, differences: list[Difference], config, step: int) -> None:
    """Raise `ResumeMismatchError` for each difference no option of `config` accepts, listing them all with
    how to accept each; the optimizer group is never refused (its values are kept or reset)."""
    refused = [d for d in differences if d.group != "optimizer" and not _accepted_by(config, d.group)]
    if not refused:
        return
    listed = "; ".join(str(d) for d in refused)
    fixes = []
    for group in ("data", "objective"):
        names = [d.name for d in refused if d.group == group]
        if names:
            option = GROUPS[group][0]
            fixes.append(
                f"pass {option}=True to go on from step {step} with this run's {', '.join(names)} (the run is then "
                "no longer the uninterrupted one)"
            )
    fixed = [d.name for d in refused if d.group == "fixed"]
    if fixed:
        fixes.append(
            f"{', '.join(fixed)} cannot change within a run: start a new run from its weights, "
            f"model = fastft.load_adapter(base_model, {str(folder)!r}), without resume_from and into another "
            "output_dir"
        )
    raise ResumeMismatchError(
        f"Cannot resume from {folder}: this run differs from the one that wrote it ({listed}), so the resumed "
        f"run would equal no uninterrupted run. Resume with the saved values, or {'; or '.join(fixes)}."
    )


def accepted_message(folder: Path, differences: list[Difference], step: int) -> str | None:
    """The warning for the data and objective changes a reset option accepted (None when there are none)."""
    accepted = [d for d in differences if d.group in ("data", "objective")]
    if not accepted:
        return None
    listed = ", ".join(f"{d} ({GROUPS[d.group][0]}=True)" for d in accepted)
    return (
        f"Resumed from {folder} at step {step} with changes you accepted: {listed}. From here the run is no longer "
        "the uninterrupted one."
    )


def optimizer_message(
    folder: Path, differences: list[Difference], step: int, reset_optimizer: bool, learning_rate: float
) -> str | None:
    """The warning naming every optimizer or schedule setting that differs from the checkpoint's: which values
    the resumed run trains with (the checkpoint's, or this config's with ``reset_optimizer``). None: none."""
    differing = {d.name: (d.saved, d.now) for d in differences if d.group == "optimizer"}
    if not differing:
        return None
    listed = ", ".join(f"{name} {old!r} → {new!r}" for name, (old, new) in differing.items())
    if reset_optimizer:
        message = (
            f"Resumed from {folder} at step {step} with a fresh optimizer and this config's values: "
            f"{listed} (learning rate now {learning_rate:.3g}). The Adam moments start again from zero."
        )
    else:
        message = (
            f"Resumed from {folder} at step {step} keeping the checkpoint's optimizer and schedule, so "
            f"these new values are NOT used: {listed}. Pass reset_optimizer=True to train on with them."
        )
    if "seed" in differing and reset_optimizer:
        message += " The data order follows this config's seed from here on; the resume is not exact."
    return message


def _accepted_by(config, group: str) -> bool:
    option = GROUPS[group][0]
    return option is not None and bool(getattr(config, option, False))


def _plain(value):
    """Comparable form: tuples as lists, numbers as floats (JSON's 8 is peft's 8.0)."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value

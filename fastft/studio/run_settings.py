"""The Run tab's settings: the choices its controls offer, and what cannot work with them, checked before Start.

`run_problems` reads a `TrainConfig` (or `GRPOConfig`) built from the controls, the shared `StudioState` and
where the run would train; each problem is ("error", text) (Start refuses) or ("warn", text), its text
naming the setting and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastft.data.pairs import PackedPairs
from fastft.data.rewards import RewardError, check_columns
from fastft.studio.grpo import reward_functions
from fastft.training.tracking import tracking_problems
from fastft.vram import fits

__all__ = [
    "DPO_LOSSES",
    "METHODS",
    "PREFERENCE_METHODS",
    "TRAIN_IN",
    "RunTarget",
    "fit_warning",
    "missing_for_start",
    "run_problems",
]

# The Run tab's method choice: value → label. The preference methods train on pairs (the Data tab packs them
# with `fastft.pack_pairs`); GRPO on the loaded rows' prompts, scored by the chosen rewards
# (`fastft.studio.grpo`).
METHODS = {"sft": "SFT", "dpo": "DPO", "orpo": "ORPO", "simpo": "SimPO", "grpo": "GRPO"}
PREFERENCE_METHODS = ("dpo", "orpo", "simpo")
DPO_LOSSES = {"sigmoid": "sigmoid", "ipo": "IPO", "robust": "robust"}
# Where Start trains: value → label.
TRAIN_IN = {"process": "a child process", "kernel": "this kernel"}

Problems = list[tuple[str, str]]


@dataclass(frozen=True)
class RunTarget:
    """Where and how Start would train: in a child process (`in_process`) or not, on how many `processes`,
    the ticked `trackers`, the GRPO `reward_keys` and the model's loadable name (None: it has none)."""

    in_process: bool
    processes: int
    trackers: list[str]
    reward_keys: list[str]
    model_name: str | None


def missing_for_start(state, method: str) -> str | None:
    """What Start needs and `state` lacks (a model, packed data unless GRPO, LoRA adapters), with the fix."""
    if state.model is None or state.tokenizer is None:
        return "No model yet. Fix: load one in the Model tab (or fastft.load_model + add_lora)."
    if state.packed is None and method != "grpo":
        return "No packed data yet. Fix: load and pack a dataset in the Data tab (fastft.pack)."
    if not any(p.requires_grad for p in state.model.parameters()):
        return "The model has no LoRA adapters to train. Fix: apply LoRA in the Model tab (fastft.add_lora)."
    return None


def fit_warning(state, config) -> list[str]:
    """On a GPU: the estimator's verdict for this run of `state`'s model, when it says the run will not fit."""
    try:
        device = next(state.model.parameters()).device
        if device.type != "cuda" or not torch.cuda.is_available():
            return []
        seq = state.packed.max_seq_length
        verdict = fits(state.model, seq, gpu="auto", batch_tokens=seq * config.micro_batch_bins)
        return [] if verdict.fits else [verdict.message]
    except Exception:  # noqa: BLE001 - the estimate is advice; never block a run on it
        return []


def run_problems(config, state, target: RunTarget) -> Problems:
    """What cannot work with `config` on `state`'s model and data ("error": Start refuses) or looks like a
    mistake ("warn"), each with its fix."""
    found: Problems = []
    steps = config.max_steps
    warmup = config.warmup if isinstance(config.warmup, int) else round(config.warmup * steps)
    if warmup >= steps:
        found.append(
            (
                "error",
                f"warmup is {warmup} steps, as long as the whole run ({steps} steps): the learning rate never "
                f"reaches its peak. Fix: fewer warmup steps than {steps}, or a share below 1 (0.05).",
            )
        )
    found += _data_problems(config.method, state, target.reward_keys)
    packed = state.packed
    bins = len(packed) if packed is not None and hasattr(packed, "__len__") else None
    per_step = config.micro_batch_bins * config.grad_accum_steps
    if config.method != "grpo" and bins is not None and per_step > bins:
        found.append(
            (
                "error",
                f"one step takes {config.micro_batch_bins} micro-batch bins × {config.grad_accum_steps} "
                f"accumulation = {per_step} bins, but the packed data has only {bins}: a step would train "
                f"the same bins twice. Fix: at most {bins} bins per step, or a shorter max length in the "
                "Data tab (more, smaller bins).",
            )
        )
    found += _schedule_problems(config, state)
    found += _launch_problems(config, state, target.processes)
    found += _where_problems(config, state, target)
    return found


def _schedule_problems(config, state) -> Problems:
    """Checkpoints need a folder; saving or evaluating less often than once a run happens at its end only."""
    found: Problems = []
    steps = config.max_steps
    if config.save_every and not config.output_dir:
        found.append(("error", "save every is set but output dir is empty. Fix: name an output dir."))
    if config.save_every and config.save_every > steps:
        found.append(
            (
                "warn",
                f"save every {config.save_every} is longer than the run ({steps} steps): one checkpoint, at the end.",
            )
        )
    if config.eval_every and config.eval_every > steps:
        found.append(
            (
                "warn",
                f"eval every {config.eval_every} is longer than the run ({steps} steps): evaluation runs at the end only.",
            )
        )
    if config.eval_every and getattr(state, "eval_packed", None) is None:
        found.append(("warn", "eval every is set but there is no eval set: no evaluation will run."))
    return found


def _where_problems(config, state, target: RunTarget) -> Problems:
    """A run in a child process needs its folder and a model it can load by name; a tracker must be
    installed, and TensorBoard writes into the output dir."""

    found = [("error", text) for text in tracking_problems(target.trackers)]
    if target.trackers and not config.output_dir:
        found.append(("error", "experiment tracking writes into the run's folder. Fix: name an output dir."))
    if not target.in_process:
        return found
    if not config.output_dir:
        found.append(
            (
                "error",
                "a run in a child process writes its events and checkpoints to its folder. Fix: name an "
                "output dir, or train in 'this kernel'.",
            )
        )
    if state.model is not None and target.model_name is None:
        found.append(
            (
                "error",
                "the child process loads the model by name, and this model has none. Fix: load it in the "
                "Model tab, or train in 'this kernel'.",
            )
        )
    return found


def _launch_problems(config, state, processes: int) -> Problems:
    """A run on several processes: SFT on packed data, with an output dir to bring the adapter back from."""
    if processes < 2:
        return []
    found = []
    if config.method != "sft":
        found.append(
            (
                "error",
                f"the studio runs only SFT on {processes} processes so far ({config.method} here). Fix: "
                "processes 'this kernel', or run the Python section's script with `fastft launch --gpus "
                f"{processes} train.py`.",
            )
        )
    if not config.output_dir:
        found.append(
            (
                "error",
                "a run on several processes brings its adapter back from its checkpoints. Fix: name an "
                "output dir.",
            )
        )
    if getattr(state, "eval_packed", None) is not None:
        found.append(("warn", "a run on several processes leaves out the eval set."))
    return found


def _data_problems(method: str, state, reward_keys: list[str]) -> Problems:
    """A preference method on data without pairs, or SFT on pairs: the method and the data disagree."""

    if method == "grpo":
        return _grpo_problems(state.rows, reward_keys)
    if state.packed is not None:
        pairs = isinstance(state.packed, PackedPairs)
    elif state.rows is not None and hasattr(state.rows, "column_names"):
        pairs = "pair" in state.rows.column_names
    else:
        return []
    name = METHODS.get(method, method)
    if method != "sft" and not pairs:
        return [
            (
                "error",
                f"{name} trains on preference pairs (a prompt with a chosen and a rejected answer), but the "
                "loaded data has none. Fix: load rows with 'prompt', 'chosen' and 'rejected' in the Data tab "
                "(format auto or preference) and Pack them, or pick SFT.",
            )
        ]
    if method == "sft" and pairs:
        return [
            (
                "error",
                "SFT trains on chats or text, but the loaded data is preference pairs. Fix: pick DPO, ORPO "
                "or SimPO as the method, or load chat data in the Data tab.",
            )
        ]
    return []


def _grpo_problems(rows, reward_keys: list[str]) -> Problems:
    """GRPO needs prompt rows (a 'prompt' or 'messages' column, not pairs), at least one reward, and the
    columns the chosen rewards read."""

    if not reward_keys:
        return [("error", "GRPO needs a reward to score completions. Fix: pick at least one in rewards.")]
    if rows is None:
        return [
            (
                "error",
                "GRPO samples from the loaded rows' prompts, but no rows are loaded. Fix: load a dataset "
                "in the Data tab (bundled:skills has prompts and answers).",
            )
        ]
    columns = list(getattr(rows, "column_names", None) or (rows[0] if len(rows) else {}))
    if "pair" in columns or not ({"prompt", "messages", "prompt_ids"} & set(columns)):
        return [
            (
                "error",
                "GRPO samples completions of prompts, but the loaded rows have no 'prompt' or 'messages' "
                "column. Fix: load chat rows or rows with a 'prompt' in the Data tab.",
            )
        ]
    try:
        check_columns(reward_functions(reward_keys), columns)
    except RewardError as error:
        return [("error", f"{error} Or pick rewards these rows can feed (format, length penalty).")]
    return []

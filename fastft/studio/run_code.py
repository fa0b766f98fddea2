"""The Run tab's Python section: the same run in plain Python, from loading the model to training."""

from __future__ import annotations

from fastft.studio.grpo import REWARDS
from fastft.studio.notices import call_code, py_repr
from fastft.studio.run_settings import PREFERENCE_METHODS, RunTarget

__all__ = ["run_code", "train_kwargs"]

# `fastft.train`'s defaults: left out of the call
_TRAIN_DEFAULTS = {"grad_accum_steps": 1, "micro_batch_bins": 1, "eval_every": None, "save_every": None}
# `GRPOConfig`'s defaults: left out of the call
_GRPO_DEFAULTS = {"temperature": 1.0, "kl_coef": 0.0}


def train_kwargs(config: dict) -> dict:
    """`fastft.train`'s keyword arguments for the Run tab's `config` keywords, its defaults left out (the
    Python section's call, and the script of a run on several processes)."""
    defaults = _TRAIN_DEFAULTS
    return {k: v for k, v in config.items() if not (k in defaults and defaults[k] == v)}


def run_code(state, method: str, config: dict, target: RunTarget) -> str:
    """The plain-Python equivalent of a run of `method` with `config` (the Run tab's `TrainConfig` keywords)
    on `state`'s model and data, trained where `target` says (runs as is)."""

    pack = state.pack_settings
    seq = getattr(state.packed, "max_seq_length", None) or pack.max_seq_length
    lines = [
        "import fastft",
        "",
        call_code(
            "model, tokenizer",
            "fastft.load_model",
            [py_repr(target.model_name or "<model name>")],
            state.load_settings.load_kwargs,
        ),
        call_code("model", "fastft.add_lora", ["model"], state.lora_settings.add_lora_kwargs),
        call_code(
            "rows",
            "fastft.load_dataset",
            [py_repr(state.dataset_name or "bundled:skills")],
            {"format": pack.format} if pack.format != "auto" else {},
        ),
    ]
    if pack.chat_template != "tokenizer":
        lines.append(f"# chat template: {pack.chat_template} (as chosen in the Data tab)")
    if method == "grpo":
        return "\n".join(lines + _grpo_lines(config, target.reward_keys)) + "\n"
    preference = method in PREFERENCE_METHODS
    if preference:
        lines.append(
            call_code("data", "fastft.pack_pairs", ["rows", "tokenizer"], {"max_seq_length": int(seq)})
        )
    else:
        train_on = {"train_on": pack.train_on} if pack.train_on != "responses" else {}
        lines.append(
            call_code("data", "fastft.pack", ["rows", "tokenizer"], {"max_seq_length": int(seq), **train_on})
        )
    lines.append(call_code("result", "fastft.train", ["model", "tokenizer", "data"], train_kwargs(config)))
    lines.append('print(f"final loss {result.final_loss:.4f}")')
    if target.in_process:
        lines.insert(
            0,
            "# the studio runs this in a child process (python -m fastft.studio.worker <output dir>): the "
            "run goes on if the kernel restarts",
        )
    if target.processes > 1:
        lines.insert(
            0,
            f"# on {target.processes} processes: save as train.py and run "
            f"`fastft launch --gpus {target.processes} train.py` (the studio writes and runs its own)",
        )
    if preference:
        lines.append("print(result.steps[-1].preference)  # rewards chosen/rejected, margin, accuracy")
    return "\n".join(lines) + "\n"


def _grpo_lines(config: dict, reward_keys: list[str]) -> list[str]:
    """The rewards and the `fastft.grpo` call of a GRPO run."""
    made = ", ".join(REWARDS[key][1] for key in reward_keys)
    shown = _GRPO_DEFAULTS
    call = call_code(
        "result",
        "fastft.grpo",
        ["model", "tokenizer", "rows", "rewards"],
        {k: v for k, v in config.items() if v is not None and not (k in shown and shown[k] == v)},
    )
    return [
        f"rewards = [{made}]",
        call,
        "print(result.steps[-1].grpo)  # reward (per function), KL, completion length, accuracy",
    ]

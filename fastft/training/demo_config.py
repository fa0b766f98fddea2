"""The settings of `fastft demo`, the embedded default job (the demo itself is `fastft.demo`; the convergence
bench trains the same job)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from fastft.checks import SettingError, real_number, run_name, whole_number
from fastft.runtime.activation_checkpointing import Checkpointing

# Function-local imports: the CLI's parser and light commands read this module without torch or transformers
# (tests/faces/test_cli.py).

SFT_STEPS = 150
# GRPO's demo starts from a short SFT run: from the full one (SFT_STEPS) GRPO of the demo's size left held-out
# accuracy within the seeds' spread in every setting tried; from this point it raises it (fastft.grpo_demo)
GRPO_SFT_STEPS = 20


@dataclass
class DemoConfig:
    """Everything `fastft demo` can change (each field is a CLI flag)."""

    model: str = "tiny-llama"
    dataset: str = "bundled:skills"
    eval_dataset: str = "bundled:skills-eval"
    max_seq_length: int = 256
    # SFT's optimizer steps; None: SFT_STEPS, or with method "grpo" GRPO_SFT_STEPS
    steps: int | None = None
    learning_rate: float = 4e-3
    lora_r: int = 16
    lora_alpha: float = 32.0
    # the tiny preset's activations take a few MiB: recomputing them would only cost time
    gradient_checkpointing: str = "none"
    micro_batch_bins: int = 4
    eval_every: int = 50
    eval_samples: int = 128
    seed: int = 3407
    output_dir: str = "runs"
    name: str = field(default_factory=lambda: datetime.now().strftime("demo-%Y%m%d-%H%M%S"))
    device: str | None = None
    progress: bool = True
    # "dpo": preference pairs made from the skills data instead of SFT (`fastft.demo.run_preference_demo`);
    # "grpo": after SFT, GRPO with the exact-match reward (`fastft.grpo_demo`)
    method: str = "sft"
    dpo_steps: int = 40  # DPO's optimizer steps (more overshoots on the tiny preset: fastft.demo)
    grpo_steps: int = 80
    grpo_learning_rate: float = 5e-4
    grpo_prompts_per_step: int = 8
    grpo_generations: int = 16
    grpo_max_new_tokens: int = 16
    grpo_temperature: float = 1.0

    def __post_init__(self) -> None:
        """Check every setting before anything is loaded (the demo fails in its first second, not after
        loading, packing and an accuracy pass)."""
        if self.steps is None:
            self.steps = GRPO_SFT_STEPS if self.method == "grpo" else SFT_STEPS
        for name, minimum in (
            ("max_seq_length", 2),
            ("steps", 1),
            ("lora_r", 1),
            ("micro_batch_bins", 1),
            ("eval_every", 1),
            ("eval_samples", 1),
            ("dpo_steps", 1),
            ("grpo_steps", 1),
            ("grpo_prompts_per_step", 1),
            ("grpo_generations", 2),
            ("grpo_max_new_tokens", 1),
        ):
            whole_number(name.replace("_", "-"), getattr(self, name), minimum=minimum)
        whole_number("seed", self.seed)
        real_number(
            "learning-rate", self.learning_rate, low=0, low_open=True, fix="The demo's default is 4e-3."
        )
        real_number("lora-alpha", self.lora_alpha, low=0, low_open=True, fix="The scale is alpha / r.")
        if self.method not in ("sft", "dpo", "grpo"):
            raise SettingError(
                f"method={self.method!r}: use sft, dpo (pairs from the skills data) or grpo (SFT, then GRPO "
                "from its result)."
            )
        real_number("grpo-learning-rate", self.grpo_learning_rate, low=0, low_open=True)
        real_number(
            "grpo-temperature", self.grpo_temperature, low=0, low_open=True, fix="1.0 is the default."
        )
        run_name("name", self.name)  # the run's folder inside output_dir, never a path of its own
        for name in ("model", "dataset", "eval_dataset", "output_dir"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise SettingError(
                    f"{name.replace('_', '-')} must be a non-empty text, got {getattr(self, name)!r}."
                )

        Checkpointing.parse(self.gradient_checkpointing)  # raises naming the modes
        if self.device is not None:
            from fastft.models.loading import resolve_device

            resolve_device(self.device)

    @property
    def run_dir(self) -> Path:
        """``output_dir/name``: the name is checked again here, where it becomes a path (the config can change)."""
        return Path(self.output_dir).expanduser() / run_name("name", self.name)

    def check_paths(self) -> None:
        """The run folder can be written and its adapter folder saved, before any model is loaded."""
        from fastft.atomic import check_destination
        from fastft.training.run_folder import check_writable

        check_writable(self.run_dir)
        check_destination(self.run_dir / "adapter")
        from fastft.training.checkpoint import list_checkpoints

        for folder in ("checkpoints", "grpo-checkpoints"):  # a run never overwrites another run's checkpoints
            found = list_checkpoints(self.run_dir / folder)
            if found:
                raise SettingError(
                    f"{self.run_dir} already holds a demo run (its {folder}/{found[-1].name}): pick another "
                    f"--name, or delete {self.run_dir} to run this one again."
                )

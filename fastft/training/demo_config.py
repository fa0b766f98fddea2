"""The settings of `fastft demo`, the embedded default job (the demo itself is `fastft.demo`; the convergence
bench trains the same job)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass
class DemoConfig:
    """Everything `fastft demo` can change (each field is a CLI flag)."""

    model: str = "tiny-llama"
    dataset: str = "bundled:skills"
    eval_dataset: str = "bundled:skills-eval"
    max_seq_length: int = 256
    steps: int = 600
    learning_rate: float = 4e-3
    lora_r: int = 16
    lora_alpha: float = 32
    # the tiny preset's activations take a few MiB: recomputing them would only cost time
    gradient_checkpointing: str = "none"
    micro_batch_bins: int = 4
    eval_every: int = 100
    eval_samples: int = 128
    seed: int = 3407
    output_dir: str = "runs"
    name: str = field(default_factory=lambda: datetime.now().strftime("demo-%Y%m%d-%H%M%S"))
    device: str | None = None
    progress: bool = True

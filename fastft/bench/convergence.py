"""`fastft bench convergence`: the demo's training with and without fastft's fused kernels, beside the bf16
noise floor measured in the same run.

Three runs of the demo's training (same seed, data order and LoRA init): fused, unfused, and unfused with
another exact attention kernel (the *floor*: a change of rounding only). Per step, the relative loss
difference of fused vs unfused is printed beside floor vs unfused, so a bias in the fused path shows as a
gap above the floor, while bf16 chaos at a high learning rate shows in both.

    fastft bench convergence --steps 100 --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

from fastft.data.packing import pack
from fastft.models.lora import add_lora
from fastft.models.patch import UnfusedWarning
from fastft.training.demo_config import DemoConfig
from fastft.training.trainer import TrainConfig, Trainer

# Function-local imports: tests replace these names on their modules, so they are looked up when called.


def demo_curves(device: str, steps: int, runs, dtype=None, learning_rate: float | None = None) -> dict:
    """Loss curves of the demo's training for each ``(label, fused, attention)`` in `runs`."""

    from fastft.data.loading import load_dataset
    from fastft.models.loading import load_model

    demo = DemoConfig()
    dtype = dtype or torch.bfloat16
    curves = {}
    for label, fused, attention in runs:
        model, tokenizer = load_model(
            demo.model, max_seq_length=demo.max_seq_length, device=device, dtype=dtype
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnfusedWarning)
            model = add_lora(model, r=demo.lora_r, alpha=demo.lora_alpha, seed=demo.seed, fused=fused)
        data = pack(load_dataset(demo.dataset), tokenizer, demo.max_seq_length)
        config = TrainConfig(
            max_steps=steps,
            learning_rate=learning_rate or demo.learning_rate,
            micro_batch_bins=demo.micro_batch_bins,
            seed=demo.seed,
            attention=attention,
            profile=False,
        )
        curves[label] = [step.loss for step in Trainer(model, tokenizer, data, None, config).train().steps]
    return curves


def deviation(a: list[float], b: list[float]) -> list[float]:
    """Per-step relative difference ``|a - b| / |b|``."""
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "median": ordered[len(ordered) // 2],
        "p90": ordered[len(ordered) * 9 // 10],
        "worst": max(values),
        "worst_step": values.index(max(values)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastft bench convergence", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--learning-rate", type=float, default=None, help="default: the demo's")
    parser.add_argument("--out", default="benchmarks/convergence.json")
    args = parser.parse_args(argv)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    attention, floor = ("varlen", "sdpa_segments") if device == "cuda" else ("sdpa_masked", "sdpa_segments")
    runs = [("fused", True, attention), ("unfused", False, attention), ("floor", False, floor)]
    curves = demo_curves(device, args.steps, runs, learning_rate=args.learning_rate)
    result = {
        "device": device,
        "steps": args.steps,
        "fused_vs_unfused": summary(deviation(curves["fused"], curves["unfused"])),
        "floor_vs_unfused": summary(deviation(curves["floor"], curves["unfused"])),
        "curves": curves,
    }
    for key in ("fused_vs_unfused", "floor_vs_unfused"):
        s = result[key]
        print(
            f"{key:>17}: median {100 * s['median']:.2f} %, 90th percentile {100 * s['p90']:.2f} %, "
            f"worst {100 * s['worst']:.2f} % at step {s['worst_step']}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

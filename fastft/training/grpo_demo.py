"""The GRPO stage of ``fastft demo --method grpo``: from the demo's SFT point, GRPO on skills prompts with the
exact-match reward, held-out accuracy measured before and after (`fastft.demo` calls `run_grpo_stage`).

The prompts are the SFT rows' questions (the answers are only the reward's ``answer`` column). Measured on
the CPU (seed 3407, 128 held-out questions, exact match after SFT 66.4 %; 2026-12-02), GRPO of this size moved
held-out accuracy by -6.2 to +2.3 points across the settings tried (30-60 steps, 8-16 prompts of 8-16
completions, learning rates 3e-4 to 1e-3, fresh or SFT prompts, temperature 0.5-1.0), within the SFT seeds'
spread (standard deviation 3.0 points, README); a learning rate of 4e-3 fell to 42 %. The defaults are the
best setting measured (50 steps, 8 prompts x 16 completions, 5e-4: 66.4 % -> 68.8 %), not a shown gain:
``fastft demo --method grpo --seed 1`` went 67.2 % -> 65.6 % (sampled reward 0.78 -> 0.95; 222 s in all).
Prompts from 76 words outside ``skills.WORDS`` in the same templates (so a held-out word prompt's template
skill, not a memorised answer, is what GRPO trains; 2026-12-03, seed 3407): the sampled reward on them rose
0.25 -> 0.48 while held-out accuracy went 66.4 % -> 64.1 %.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastft.data.rewards import exact_match
from fastft.training.evaluate import AccuracyResult, evaluate_accuracy
from fastft.training.grpo import GRPOConfig, GRPOTrainer
from fastft.training.trainer import TrainResult


@dataclass
class GRPOStage:
    """What the GRPO stage did: its run, its settings, and held-out accuracy at its start and end."""

    config: GRPOConfig
    result: TrainResult
    accuracy_before: AccuracyResult
    accuracy_after: AccuracyResult


def demo_grpo_config(demo, output_dir: str | None = None) -> GRPOConfig:
    """The stage's `GRPOConfig` from the demo's settings (`DemoConfig`'s ``grpo_*`` fields)."""
    return GRPOConfig(
        max_steps=demo.grpo_steps,
        learning_rate=demo.grpo_learning_rate,
        prompts_per_step=demo.grpo_prompts_per_step,
        num_generations=demo.grpo_generations,
        max_new_tokens=demo.grpo_max_new_tokens,
        temperature=demo.grpo_temperature,
        warmup=0,
        seed=demo.seed,
        save_every=max(1, demo.grpo_steps // 2) if output_dir else None,
        output_dir=output_dir,
    )


def run_grpo_stage(
    model,
    tokenizer,
    sft_rows,
    questions,
    demo,
    before: AccuracyResult | None = None,
    output_dir: str | None = None,
    subscribers=(),
) -> GRPOStage:
    """GRPO from the model as it is (the demo's SFT point) on the SFT rows' questions, then held-out accuracy."""
    config = demo_grpo_config(demo, output_dir)
    before = before or evaluate_accuracy(model, tokenizer, questions)
    trainer = GRPOTrainer(model, tokenizer, sft_rows, [exact_match], config, subscribers)
    result = trainer.train()
    after = evaluate_accuracy(model, tokenizer, questions)
    return GRPOStage(config, result, before, after)

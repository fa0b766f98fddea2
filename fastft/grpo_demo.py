"""The GRPO stage of ``fastft demo --method grpo``: from a short SFT run (`GRPO_SFT_STEPS`, 20 steps), GRPO on
the SFT rows' questions with the exact-match reward (the answers are only the reward's ``answer`` column),
held-out accuracy measured before and after (`fastft.demo` calls `run_grpo_stage`).

Measured on the CPU (2026-12-03, all 256 held-out questions, five seeds): 80 GRPO steps of 8 prompts x 16
completions at 5e-4 raise held-out exact match from 50.5 % (seed standard deviation 2.2) to 56.6 % (0.9), by
3.1 to 9.0 points per seed; the same rises in content accuracy (the right answer in any wording), so the gain
is answers, not a format (`tests/training/test_grpo.py` asserts it). 50 steps gained 3.1 to 5.8.

From the full SFT run (150 steps, 66.4 % on 128 questions) GRPO of this size did not move held-out accuracy
beyond the seeds' spread in any setting tried (2026-12-02/03: -7.8 to +2.3 points over 30-60 steps, 8-16
prompts of 8-16 completions, learning rates 3e-4 to 2e-3, SFT prompts, fresh prompts, arithmetic only, or
words outside ``skills.WORDS``; 4e-3 fell to 42 %). There the sampled reward rises on the SFT rows' questions
(0.78 -> 0.95: their answers are memorised) but not on fresh arithmetic ones (0.31 -> 0.26 in 50 steps),
although 16 samples hold the right answer for 87 % of held-out questions against 66 % greedy; a reward the
model can reach without new skill (an answer ending in an even digit) rose 0.5 -> 1.0 in 30 steps, so the
updates work. From the short start GRPO sharpens what pretraining and 20 SFT steps half learned.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastft.data.rewards import exact_match
from fastft.training.evaluate import AccuracyResult, evaluate_accuracy
from fastft.training.objectives.grpo import GRPOConfig, GRPOTrainer
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

"""The GRPO stage of ``fastft demo --method grpo``: from the demo's SFT point, GRPO on skills prompts with the
exact-match reward, held-out accuracy measured before and after (`fastft.demo` calls `run_grpo_stage`; the
learning-bar test runs the same function).

The prompts are fresh skills rows (`fastft.data.skills.generate` with the demo's seed), none of them a
held-out question or an SFT row: on the rows SFT trained on, the model already answers most of its samples
right, so most groups would agree and teach nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastft.data.rewards import exact_match
from fastft.data.skills import generate, held_out_prompts
from fastft.training.evaluate import AccuracyResult, evaluate_accuracy
from fastft.training.grpo import GRPOConfig, GRPOTrainer
from fastft.training.trainer import TrainResult

PROMPT_ROWS = 2000


@dataclass
class GRPOStage:
    """What the GRPO stage did: its run, its settings, and held-out accuracy at its start and end."""

    config: GRPOConfig
    result: TrainResult
    accuracy_before: AccuracyResult
    accuracy_after: AccuracyResult


def grpo_prompt_rows(sft_rows, seed: int, count: int = PROMPT_ROWS) -> list[dict]:
    """`count` skills rows whose prompts are neither held out nor in `sft_rows`."""
    seen = held_out_prompts() | {
        m["content"] for row in sft_rows for m in row["messages"] if m["role"] == "user"
    }
    return list(generate(count, seed + 1, exclude=seen))


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
    """GRPO from the model as it is (the demo's SFT point) on fresh skills prompts, then held-out accuracy."""
    config = demo_grpo_config(demo, output_dir)
    before = before or evaluate_accuracy(model, tokenizer, questions)
    trainer = GRPOTrainer(
        model, tokenizer, grpo_prompt_rows(sft_rows, demo.seed), [exact_match], config, subscribers
    )
    result = trainer.train()
    after = evaluate_accuracy(model, tokenizer, questions)
    return GRPOStage(config, result, before, after)

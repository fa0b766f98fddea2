"""`fastft demo`: the whole path on the embedded default, offline (about 40 s of training CPU time: README).

Loads `tiny-llama`, adds LoRA, packs the bundled skills data, measures on the held-out rows both content
accuracy (the right answer in any wording) and format compliance (the bare answer the system prompt asks
for), trains (with eval loss and checkpoints), measures both again, saves the adapter and writes
``runs/<name>/report.html``. Uses the GPU when there is one; on a CPU it first times a training
micro-batch at one thread and at torch's default and keeps the faster count.
"""

from __future__ import annotations

import json
import random
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fastft.data.loading import load_dataset
from fastft.data.packing import pack
from fastft.data.pairs import pack_pairs
from fastft.data.skills import VERBOSE_ANSWER
from fastft.grpo_demo import GRPOStage, run_grpo_stage
from fastft.models.hf_save import save_adapter
from fastft.models.loading import load_model
from fastft.models.lora import add_lora, trainable_parameter_count
from fastft.report import RunReport, write_report
from fastft.training.cpu_threads import choose_training_threads
from fastft.training.demo_config import DemoConfig
from fastft.training.evaluate import AccuracyResult, evaluate_accuracy
from fastft.training.objectives.preference import sequence_log_probs
from fastft.training.progress import ProgressBar
from fastft.training.trainer import TrainConfig, Trainer, TrainResult


@dataclass
class DemoResult:
    run_dir: Path
    report_path: Path | None  # None for `--method dpo` (no HTML report yet)
    adapter_path: Path
    train: TrainResult
    accuracy_before: AccuracyResult
    accuracy_after: AccuracyResult
    summary: dict
    grpo: GRPOStage | None = None

    def text(self) -> str:
        """The plain-text summary printed at the end of `fastft demo`."""
        if self.summary.get("method") == "dpo":
            return _preference_text(self)
        s = self.summary
        lines = [
            f"fastft demo — {s['model']} on {s['device']}",
            f"  trainable parameters  {s['trainable_parameters']:,} of {s['total_parameters']:,}",
            f"  data                  {s['packing']}",
            f"  loss                  {s['first_loss']:.4f} → {s['final_loss']:.4f} "
            f"(eval {s['first_eval_loss']:.4f} → {s['final_eval_loss']:.4f})",
            f"  throughput            {s['median_trained_tokens_per_second']:,.0f} trained tokens/s (median), "
            f"peak memory {s['peak_memory_gib']:.2f} GiB ({s['memory_kind']})",
            f"  attention             {s['attention'] or 'the model’s own'}",
            f"  CPU threads           {s['cpu_threads']}",
            f"  content accuracy      {s['content_accuracy_before']:.1%} → {s['content_accuracy_after']:.1%} "
            f"on {s['eval_samples']} held-out questions (right answer, any wording)",
            f"  format compliance     {s['accuracy_before']:.1%} → {s['accuracy_after']:.1%} "
            "(the bare answer the system prompt asks for)",
            f"      {'task':<14} {'content':>16}   {'format':>16}",
        ]
        before, after = self.accuracy_before, self.accuracy_after
        for task in after.per_task:
            if task != "all":
                content = (
                    f"{before.content_per_task.get(task, 0.0):6.1%} → {after.content_per_task[task]:6.1%}"
                )
                formatted = f"{before.per_task.get(task, 0.0):6.1%} → {after.per_task[task]:6.1%}"
                lines.append(f"      {task:<14} {content:>16}   {formatted:>16}")
        if self.grpo is not None:
            g = self.grpo
            lines.append(
                f"  GRPO                  {s['grpo_steps']} steps from the SFT result: format compliance "
                f"{g.accuracy_before.overall:.1%} → {g.accuracy_after.overall:.1%}, content accuracy "
                f"{g.accuracy_before.content:.1%} → {g.accuracy_after.content:.1%} "
                f"(sampled reward {s['grpo_first_reward']:.2f} → {s['grpo_last_reward']:.2f})"
            )
        lines += [
            f"  time                  {s['duration_s']:.1f} s {s['duration_covers']} "
            f"(training {s['training_s']:.1f} s, {s['training_cpu_s']:.1f} s of CPU)",
            f"  adapter               {self.adapter_path}",
            f"  report                {self.report_path}",
        ]
        return "\n".join(lines)


def run_demo(config: DemoConfig | None = None, log=print, started_at: float | None = None) -> DemoResult:
    """Run the demo end to end and return its results (see `DemoConfig` for the knobs).

    `started_at` is the `time.time()` the whole command began (`fastft demo` passes its process's start), so
    the reported time covers imports too; without it the time counts from this call.
    """
    config = config or DemoConfig()
    if config.method == "dpo":
        return run_preference_demo(config, log)
    fresh = not config.run_dir.exists()
    config.check_paths()  # settings were checked when the config was built; paths before loading
    try:
        return _run(config, log, started_at)
    except BaseException:
        if fresh and config.run_dir.is_dir() and not any(config.run_dir.iterdir()):
            config.run_dir.rmdir()  # a run that failed before writing anything leaves no empty folder behind
        raise


def _run(config: DemoConfig, log, started_at: float | None) -> DemoResult:
    covers = "for the whole command" if started_at is not None else "for run_demo"
    started_at = time.time() if started_at is None else started_at
    run_dir = config.run_dir
    model, tokenizer = _load_with_lora(config, log)
    trainable, total = trainable_parameter_count(model)

    train_rows, eval_rows, questions = _rows(config)
    train_data = pack(train_rows, tokenizer, config.max_seq_length)
    eval_data = pack(eval_rows, tokenizer, config.max_seq_length)
    log(f"packed {config.dataset}: {train_data.stats.summary()}")
    threads = choose_training_threads(model, train_data, config.micro_batch_bins)
    if threads is not None:
        log(f"CPU threads: {threads.describe('micro-batch')}")

    log(f"accuracy before training on {len(questions)} held-out questions …")
    before = evaluate_accuracy(model, tokenizer, questions)

    train_config = TrainConfig(
        max_steps=config.steps,
        learning_rate=config.learning_rate,
        micro_batch_bins=config.micro_batch_bins,
        eval_every=config.eval_every,
        save_every=max(1, config.steps // 2),
        output_dir=str(run_dir / "checkpoints"),
        seed=config.seed,
    )
    trainer = Trainer(model, tokenizer, train_data, eval_data, train_config)
    with _progress_bar(trainer, config.progress):
        first_eval = trainer.evaluate()
        result, training_s, training_cpu_s = _timed_train(trainer)

    log("accuracy after training …")
    after = evaluate_accuracy(model, tokenizer, questions)
    stage = (
        _grpo(model, tokenizer, train_rows, questions, config, after, log)
        if config.method == "grpo"
        else None
    )
    adapter_path = save_adapter(model, run_dir / "adapter", tokenizer)

    steps = result.steps
    speeds = sorted(s.trained_tokens_per_second for s in steps)
    device = next(model.parameters()).device
    summary = {
        "model": config.model,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "trainable_parameters": trainable,
        "total_parameters": total,
        "packing": train_data.stats.summary(),
        "steps": len(steps),
        "first_loss": steps[0].loss,
        "final_loss": steps[-1].loss,
        "first_eval_loss": first_eval.eval_loss,
        "final_eval_loss": result.evals[-1].eval_loss,
        "median_trained_tokens_per_second": speeds[len(speeds) // 2],
        "peak_memory_gib": max(s.peak_memory_bytes for s in steps) / 2**30,
        "memory_kind": steps[-1].memory_kind,
        "attention": result.attention,
        "cpu_threads": threads.describe("micro-batch") if threads is not None else "not probed (GPU run)",
        **_accuracy_summary(before, after, len(questions)),
        "training_s": training_s,
        "training_cpu_s": training_cpu_s,
        "duration_covers": covers,
    }
    report = RunReport(
        title=f"fastft demo — {config.model}",
        config=asdict(config) | {"train": asdict(train_config)},
        steps=steps,
        evals=[first_eval, *result.evals],
        summary={},
        accuracy_before=before.content_per_task,
        accuracy_after=after.content_per_task,
        format_before=before.per_task,
        format_after=after.per_task,
        samples=_samples(before, after),
        timeline=_timeline(trainer),
    )
    if stage is not None:
        rewards = [event.grpo["reward"] for event in stage.result.steps]
        summary |= {
            "grpo_steps": len(stage.result.steps),
            "grpo_accuracy_after": stage.accuracy_after.overall,
            "grpo_content_accuracy_after": stage.accuracy_after.content,
            "grpo_first_reward": rewards[0],
            "grpo_last_reward": rewards[-1],
        }
    # the time is taken last, so that it covers writing the adapter and the report too
    summary["duration_s"] = time.time() - started_at
    report.summary = _readable(summary)
    report_path = write_report(report, run_dir / "report.html")
    with open(run_dir / "summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return DemoResult(run_dir, report_path, adapter_path, result, before, after, summary, stage)


def _load_with_lora(config: DemoConfig, log):
    """``(model, tokenizer)``: the configured model with LoRA added, after seeding torch with the demo's seed."""
    torch.manual_seed(config.seed)
    log(f"loading {config.model} …")
    model, tokenizer = load_model(config.model, max_seq_length=config.max_seq_length, device=config.device)
    model = add_lora(
        model,
        r=config.lora_r,
        alpha=config.lora_alpha,
        gradient_checkpointing=config.gradient_checkpointing,
        seed=config.seed,
    )
    return model, tokenizer


def _rows(config: DemoConfig):
    """``(train rows, eval rows, held-out questions)``: the first ``eval_samples`` eval rows are the questions."""
    train_rows = load_dataset(config.dataset)
    eval_rows = load_dataset(config.eval_dataset)
    questions = [row for row in eval_rows.select(range(min(config.eval_samples, len(eval_rows))))]
    return train_rows, eval_rows, questions


@contextmanager
def _progress_bar(trainer: Trainer, enabled: bool):
    """A progress bar subscribed to ``trainer`` while the block runs (none when not ``enabled``)."""
    bar = ProgressBar(trainer.max_steps) if enabled else None
    if bar is not None:
        trainer.subscribe(bar)
    try:
        yield
    finally:
        if bar is not None:
            bar.close()


def _timed_train(trainer: Trainer) -> tuple[TrainResult, float, float]:
    """``trainer.train()`` and the seconds it took: ``(result, wall seconds, CPU seconds of all threads)``."""
    started, cpu_started = time.perf_counter(), time.process_time()
    result = trainer.train()
    return result, time.perf_counter() - started, time.process_time() - cpu_started


def _accuracy_summary(before: AccuracyResult, after: AccuracyResult, eval_samples: int) -> dict:
    """The summary's accuracy entries: format compliance and content accuracy before and after training on
    ``eval_samples`` held-out questions."""
    return {
        "accuracy_before": before.overall,
        "accuracy_after": after.overall,
        "content_accuracy_before": before.content,
        "content_accuracy_after": after.content,
        "eval_samples": eval_samples,
    }


def _samples(before: AccuracyResult, after: AccuracyResult) -> list[dict]:
    """The report's sample table: the first 16 held-out questions' completions before and after training."""
    return [
        {
            "prompt": b["prompt"],
            "expected": b["expected"],
            "before": b["completion"],
            "after": a["completion"],
            "right before": _mark(b["content_correct"]),
            "right after": _mark(a["content_correct"]),
        }
        for b, a in zip(before.completions[:16], after.completions[:16], strict=True)
    ]


def _grpo(
    model, tokenizer, train_rows, questions, config: DemoConfig, after: AccuracyResult, log
) -> GRPOStage:
    """``--method grpo``: GRPO from the SFT result (`fastft.grpo_demo`), with its own progress bar."""
    log(
        f"GRPO from the SFT result: {config.grpo_steps} steps of {config.grpo_prompts_per_step} prompts × "
        f"{config.grpo_generations} completions …"
    )
    bar = ProgressBar(config.grpo_steps) if config.progress else None
    try:
        return run_grpo_stage(
            model,
            tokenizer,
            train_rows,
            questions,
            config,
            before=after,
            output_dir=str(config.run_dir / "grpo-checkpoints"),
            subscribers=[bar] if bar is not None else [],
        )
    finally:
        if bar is not None:
            bar.close()


def _mark(right: bool) -> str:
    return "✓" if right else "✗"


def _timeline(trainer: Trainer) -> list[dict]:
    """The spans of the run's last profiled step, for the report's step timeline (none when profiling is off)."""
    timing = trainer.profile.timing() if trainer.profile is not None else None
    return [asdict(span) for span in timing.spans] if timing is not None else []


def _readable(summary: dict) -> dict:
    """The summary as a person reads it in the report: percentages, GiB, seconds, rounded losses."""
    s = summary
    return {
        "model": s["model"],
        "device": s["device"],
        "trainable parameters": f"{s['trainable_parameters']:,} of {s['total_parameters']:,}",
        "data": s["packing"],
        "steps": s["steps"],
        "training loss": f"{s['first_loss']:.4f} → {s['final_loss']:.4f}",
        "eval loss": f"{s['first_eval_loss']:.4f} → {s['final_eval_loss']:.4f}",
        "held-out content accuracy": f"{s['content_accuracy_before']:.1%} → {s['content_accuracy_after']:.1%} "
        f"({s['eval_samples']} questions; the right answer in any wording)",
        "held-out format compliance": f"{s['accuracy_before']:.1%} → {s['accuracy_after']:.1%} "
        "(the bare answer the system prompt asks for)",
        "trained tokens/s (median)": f"{s['median_trained_tokens_per_second']:,.0f}",
        "peak memory": f"{s['peak_memory_gib']:.2f} GiB ({'GPU' if s['memory_kind'] == 'cuda' else 'CPU RSS'})",
        "attention": s["attention"] or "the model’s own",
        "CPU threads": s["cpu_threads"],
        "training time": f"{s['training_s']:.1f} s ({s['training_cpu_s']:.1f} s of CPU time, all threads)",
        "duration": f"{s['duration_s']:.1f} s {s['duration_covers']}",
    }


# -- preference tuning: `fastft demo --method dpo` -------------------------------------------------------------


def skills_pairs(rows, seed: int) -> list[dict]:
    """Preference pairs from skills rows: the prompt (system prompt and question), chosen = the bare right
    answer, rejected = the right answer in the preset's wordy pretraining style (even rows) or another
    row's answer (odd rows; wordy when it happens to be the same)."""

    rows = list(rows)
    rng = random.Random(seed)
    pairs = []
    for index, row in enumerate(rows):
        answer, wordy = row["answer"], VERBOSE_ANSWER.format(answer=row["answer"])
        rejected = wordy
        if index % 2 and len(rows) > 1:
            other = rows[(index + 1 + rng.randrange(len(rows) - 1)) % len(rows)]["answer"]
            rejected = other if other != answer else wordy
        pairs.append(
            {
                "prompt": row["messages"][:-1],
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return pairs


def chosen_over_rejected(model, pairs) -> float:
    """The share of `pairs` (`PackedPairs`) whose chosen answer the model finds likelier than the rejected
    one (summed log-probs; the reference plays no part, so the untrained model has its own score)."""

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    right = 0
    try:
        with torch.no_grad():
            for index in range(len(pairs)):
                sums, _ = sequence_log_probs(model, pairs.batch([index]).to(device))
                right += int((sums[0::2] > sums[1::2]).sum())
    finally:
        model.train(was_training)
    return right / pairs.pairs


PAIR_ROWS = 400  # training pairs drawn from the bundled skills rows


def run_preference_demo(config: DemoConfig | None = None, log=print) -> DemoResult:
    """`fastft demo --method dpo`: DPO on pairs from the skills data (`skills_pairs`), starting from the
    preset itself (which answers wordily, as it was pretrained). Measures the held-out chosen-over-rejected
    accuracy (`chosen_over_rejected`) and the skills accuracies (exact bare answer, and content) before and
    after `dpo_steps` steps; the reference log-probs are precomputed. Saves the adapter and summary.json."""

    config = config or DemoConfig(method="dpo")
    config.check_paths()
    started = time.time()
    model, tokenizer = _load_with_lora(config, log)
    train_rows, _, questions = _rows(config)
    train_pairs = pack_pairs(
        skills_pairs(train_rows.select(range(min(PAIR_ROWS, len(train_rows)))), config.seed),
        tokenizer,
        config.max_seq_length,
    )
    held_out = pack_pairs(skills_pairs(questions, 1), tokenizer, config.max_seq_length)
    log(f"pairs from {config.dataset}: {train_pairs.pair_stats}; held out: {held_out.pair_stats}")
    log(f"before: chosen-over-rejected and accuracy on {len(questions)} held-out questions …")
    pairs_before = chosen_over_rejected(model, held_out)
    before = evaluate_accuracy(model, tokenizer, questions)
    train_config = TrainConfig(
        method="dpo",
        beta=0.1,
        max_steps=config.dpo_steps,
        learning_rate=config.learning_rate,
        micro_batch_bins=config.micro_batch_bins,
        seed=config.seed,
        precompute_reference=True,
    )
    trainer = Trainer(model, tokenizer, train_pairs, held_out, train_config)
    with _progress_bar(trainer, config.progress):
        result, training_s, _ = _timed_train(trainer)
    log("after …")
    pairs_after = chosen_over_rejected(model, held_out)
    after = evaluate_accuracy(model, tokenizer, questions)
    adapter_path = save_adapter(model, config.run_dir / "adapter", tokenizer)
    summary = {
        "method": "dpo",
        "model": config.model,
        "pairs": train_pairs.pairs,
        "held_out_pairs": held_out.pairs,
        "steps": len(result.steps),
        "first_loss": result.steps[0].loss,
        "final_loss": result.steps[-1].loss,
        "final_eval": result.evals[-1].preference,
        "chosen_over_rejected_before": pairs_before,
        "chosen_over_rejected_after": pairs_after,
        **_accuracy_summary(before, after, len(questions)),
        "training_s": training_s,
        "duration_s": time.time() - started,
    }
    with open(config.run_dir / "summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return DemoResult(config.run_dir, None, adapter_path, result, before, after, summary)


def _preference_text(result: DemoResult) -> str:
    s = result.summary
    return "\n".join(
        [
            f"fastft demo --method dpo — {s['model']}, {s['pairs']} pairs, {s['steps']} steps",
            f"  loss                  {s['first_loss']:.4f} → {s['final_loss']:.4f}",
            f"  chosen over rejected  {s['chosen_over_rejected_before']:.1%} → "
            f"{s['chosen_over_rejected_after']:.1%} on {s['held_out_pairs']} held-out pairs",
            f"  exact answer          {s['accuracy_before']:.1%} → {s['accuracy_after']:.1%} "
            f"on {s['eval_samples']} held-out questions (the bare answer the system prompt asks for)",
            f"  content accuracy      {s['content_accuracy_before']:.1%} → {s['content_accuracy_after']:.1%} "
            "(right answer, any wording)",
            f"  time                  {s['duration_s']:.1f} s (training {s['training_s']:.1f} s)",
            f"  adapter               {result.adapter_path}",
        ]
    )

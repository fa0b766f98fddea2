"""`fastft demo`: the whole path on the embedded default, offline, in about a minute on a CPU.

Loads `tiny-llama`, adds LoRA, packs the bundled skills data, measures answer accuracy on the
held-out rows, trains (with eval loss and checkpoints), measures accuracy again, saves the adapter
and writes ``runs/<name>/report.html``. Uses the GPU when there is one.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fastft.data.loading import load_dataset
from fastft.data.packing import pack
from fastft.models.export import save_adapter
from fastft.models.loading import load_model
from fastft.models.lora import add_lora, trainable_parameter_count
from fastft.report import RunReport, write_report
from fastft.training.demo_config import DemoConfig
from fastft.training.evaluate import AccuracyResult, evaluate_accuracy
from fastft.training.progress import ProgressBar
from fastft.training.trainer import TrainConfig, Trainer, TrainResult


@dataclass
class DemoResult:
    run_dir: Path
    report_path: Path
    adapter_path: Path
    train: TrainResult
    accuracy_before: AccuracyResult
    accuracy_after: AccuracyResult
    summary: dict

    def text(self) -> str:
        """The plain-text summary printed at the end of `fastft demo`."""
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
            f"  accuracy              {s['accuracy_before']:.1%} → {s['accuracy_after']:.1%} "
            f"on {s['eval_samples']} held-out questions",
        ]
        before, after = self.accuracy_before.per_task, self.accuracy_after.per_task
        for task in after:
            if task != "all":
                lines.append(f"      {task:<14} {before.get(task, 0.0):6.1%} → {after[task]:6.1%}")
        lines += [
            f"  time                  {s['duration_s']:.1f} s",
            f"  adapter               {self.adapter_path}",
            f"  report                {self.report_path}",
        ]
        return "\n".join(lines)


def run_demo(config: DemoConfig | None = None, log=print) -> DemoResult:
    """Run the demo end to end and return its results (see `DemoConfig` for the knobs)."""
    config = config or DemoConfig()
    config.check_paths()  # settings were checked when the config was built; paths before loading
    started = time.perf_counter()
    run_dir = config.run_dir
    torch.manual_seed(config.seed)

    log(f"loading {config.model} …")
    model, tokenizer = load_model(config.model, max_seq_length=config.max_seq_length, device=config.device)
    model = add_lora(model, r=config.lora_r, alpha=config.lora_alpha, seed=config.seed)
    trainable, total = trainable_parameter_count(model)

    train_rows = load_dataset(config.dataset)
    eval_rows = load_dataset(config.eval_dataset)
    train_data = pack(train_rows, tokenizer, config.max_seq_length)
    eval_data = pack(eval_rows, tokenizer, config.max_seq_length)
    log(f"packed {config.dataset}: {train_data.stats.summary()}")
    questions = [row for row in eval_rows.select(range(min(config.eval_samples, len(eval_rows))))]

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
    bar = ProgressBar(trainer.max_steps) if config.progress else None
    if bar is not None:
        trainer.subscribe(bar)
    try:
        first_eval = trainer.evaluate()
        result = trainer.train()
    finally:
        if bar is not None:
            bar.close()

    log("accuracy after training …")
    after = evaluate_accuracy(model, tokenizer, questions)
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
        "accuracy_before": before.overall,
        "accuracy_after": after.overall,
        "eval_samples": len(questions),
        "duration_s": time.perf_counter() - started,
    }
    samples = [
        {
            "prompt": b["prompt"],
            "expected": b["expected"],
            "before": b["completion"],
            "after": a["completion"],
        }
        for b, a in zip(before.completions[:16], after.completions[:16], strict=True)
    ]
    report = RunReport(
        title=f"fastft demo — {config.model}",
        config=asdict(config) | {"train": asdict(train_config)},
        steps=steps,
        evals=[first_eval, *result.evals],
        summary=_readable(summary),
        accuracy_before=before.per_task,
        accuracy_after=after.per_task,
        samples=samples,
        timeline=_timeline(trainer),
    )
    report_path = write_report(report, run_dir / "report.html")
    with open(run_dir / "summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return DemoResult(run_dir, report_path, adapter_path, result, before, after, summary)


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
        "held-out accuracy": f"{s['accuracy_before']:.1%} → {s['accuracy_after']:.1%} ({s['eval_samples']} questions)",
        "trained tokens/s (median)": f"{s['median_trained_tokens_per_second']:,.0f}",
        "peak memory": f"{s['peak_memory_gib']:.2f} GiB ({'GPU' if s['memory_kind'] == 'cuda' else 'CPU RSS'})",
        "attention": s["attention"] or "the model’s own",
        "duration": f"{s['duration_s']:.1f} s",
    }

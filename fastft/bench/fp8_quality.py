"""`fastft bench fp8-quality`: the demo's training with FP8 base weights against 16-bit, beside the 16-bit
run-to-run spread measured in the same command.

Every run is the demo's job (`fastft.training.demo_config.DemoConfig`: a tiny preset, LoRA r=16 from one
seed, the bundled skills data packed into 256-token bins, four per step, its learning rate) for ``--steps``
steps; a run differs from another only in its base weights (16-bit or ``load_in_fp8=True``) and the trainer's
seed (data order and dropout, `TrainConfig.seed`), the model and the LoRA initialisation staying the same.
For each of ``--seeds`` seeds one 16-bit and one FP8 run; then, per logged step:

- *spread*: the 16-bit runs' range ``max - min`` over the seeds (what changing only the data order does);
- *paired*: ``|FP8 - 16-bit|`` of the runs with the same seed (same batches at every step);
- *inside*: whether each FP8 run's loss lies inside the 16-bit runs' range ``[min, max]``.

The same for the curves smoothed over ``--window`` steps, the final held-out eval loss, and the held-out
skills accuracy (content and format, `fastft.training.evaluate.evaluate_accuracy` on the demo's
``--eval-samples`` questions) after the demo's own training length (`DemoConfig.steps`: each run pauses there
for it, then goes on; the learning-rate schedule is the ``--steps`` run's).

On the CPU the 16-bit runs compute in fp32 (the CPU's default dtype for a preset) and the FP8 ones by
``--fp8-gemm``: ``reference`` (the CPU path of an FP8 model: weights e4m3 with per-channel scales,
dequantised, activations unquantised) or ``emulated`` (the GPU's FP8 GEMMs' numbers: activations and output
gradients also quantised per row, products in fp32; `fastft.kernels.fp8.EMULATE_ON_CPU`). On a GPU both run in
bf16 and FP8 projections take ``_scaled_mm`` where their widths allow (`fastft.kernels.fp8.fp8_gemm_runs`).

    fastft bench fp8-quality --model tiny-llama --device cpu --fp8-gemm emulated
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from fastft.bench.common import environment, markdown_table
from fastft.kernels import fp8
from fastft.training.demo_config import DemoConfig

# Function-local imports: peft imports bitsandbytes, which asks the hub for a kernel: models load through
# `fastft.models.loading` first.


def train_run(
    model_name: str,
    load_in_fp8: bool,
    seed: int,
    steps: int,
    device: str,
    accuracy_at: int | None,
    eval_samples: int,
    fp8_gemm: str = "reference",
) -> dict:
    """One run of the demo's job: ``{"losses": [...], "eval_loss", "accuracy": {...} | None, "seconds"}``."""
    from fastft.data.loading import load_dataset
    from fastft.data.packing import pack
    from fastft.kernels.capability import KernelFallbackWarning
    from fastft.models.loading import load_model
    from fastft.models.lora import add_lora
    from fastft.training.evaluate import evaluate_accuracy
    from fastft.training.trainer import TrainConfig, Trainer

    demo = DemoConfig()
    started = time.perf_counter()
    model, tokenizer = load_model(
        model_name, max_seq_length=demo.max_seq_length, device=device, load_in_fp8=load_in_fp8
    )
    model = add_lora(model, r=demo.lora_r, alpha=demo.lora_alpha, seed=demo.seed)
    eval_rows = load_dataset(demo.eval_dataset)
    data = pack(load_dataset(demo.dataset), tokenizer, demo.max_seq_length)
    eval_data = pack(eval_rows, tokenizer, demo.max_seq_length)
    questions = [row for row in eval_rows.select(range(min(eval_samples, len(eval_rows))))]
    config = TrainConfig(
        max_steps=steps,
        learning_rate=demo.learning_rate,
        micro_batch_bins=demo.micro_batch_bins,
        seed=seed,
        profile=False,
    )
    emulate = fp8.emulated_gemms() if load_in_fp8 and fp8_gemm == "emulated" else contextlib.nullcontext()
    accuracy = None
    with emulate, warnings.catch_warnings():
        warnings.simplefilter("ignore", KernelFallbackWarning)
        trainer = Trainer(model, tokenizer, data, eval_data, config)
        if accuracy_at is not None and accuracy_at < steps:
            trainer.train(steps=accuracy_at)  # paused there; the next call goes on to `steps`
            accuracy = evaluate_accuracy(model, tokenizer, questions)
        events = trainer.train().steps  # every event of the run, from step 1
        if accuracy is None and accuracy_at is not None:
            accuracy = evaluate_accuracy(model, tokenizer, questions)
        eval_loss = trainer.evaluate().eval_loss
    return {
        "losses": [event.loss for event in events],
        "eval_loss": eval_loss,
        "accuracy": None
        if accuracy is None
        else {"step": min(accuracy_at, steps), "content": accuracy.content, "format": accuracy.overall},
        "seconds": time.perf_counter() - started,
    }


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing means over `window` steps (the first steps over as many as there are)."""
    out = []
    for index in range(len(values)):
        part = values[max(0, index + 1 - window) : index + 1]
        out.append(sum(part) / len(part))
    return out


def compare(bf16: list[list[float]], fp8_runs: list[list[float]]) -> dict:
    """Per step: the 16-bit runs' spread, each FP8 run's distance to the 16-bit run of its seed (the first
    ``len(fp8_runs)`` of `bf16`), and whether each FP8 run lies inside the 16-bit range; summarised (module
    docstring)."""
    steps = len(bf16[0])
    low = [min(run[t] for run in bf16) for t in range(steps)]
    high = [max(run[t] for run in bf16) for t in range(steps)]
    spread = [h - lo for h, lo in zip(high, low, strict=True)]
    paired = [[abs(f[t] - b[t]) for t in range(steps)] for f, b in zip(fp8_runs, bf16, strict=False)]
    inside = [sum(low[t] <= run[t] <= high[t] for t in range(steps)) for run in fp8_runs]
    worst_paired = [max(p[t] for p in paired) for t in range(steps)]
    return {
        "spread_median": sorted(spread)[steps // 2],
        "spread_min": min(spread),
        "paired_median": sorted(worst_paired)[steps // 2],
        "paired_max": max(worst_paired),
        "steps_paired_above_spread": sum(p > s for p, s in zip(worst_paired, spread, strict=True)),
        "steps_inside_range": inside,
        "steps": steps,
    }


def run_order(seeds: list[int], fp8_seeds: int) -> list[tuple[str, int]]:
    """The runs in the order they go: the first seed's 16-bit and FP8 runs, the other 16-bit runs (the spread
    is then complete), then the other seeds' FP8 runs (the first `fp8_seeds` seeds get one)."""
    first, rest = seeds[0], seeds[1:]
    return (
        [("16bit", first), ("fp8", first)]
        + [("16bit", seed) for seed in rest]
        + [("fp8", seed) for seed in rest[: max(0, fp8_seeds - 1)]]
    )


def run(
    model_name: str,
    seeds: list[int],
    steps: int,
    device: str,
    fp8_gemm: str,
    window: int,
    eval_samples: int,
    accuracy_at: int | None,
    fp8_seeds: int | None = None,
    log=print,
    after_each=None,
) -> dict:
    """Every run of `run_order`, then their comparison (`summarise`); ``after_each(runs)`` after each run
    (partial saves)."""
    runs: dict[str, list[dict]] = {"16bit": [], "fp8": []}
    for label, seed in run_order(seeds, len(seeds) if fp8_seeds is None else fp8_seeds):
        result = train_run(
            model_name, label == "fp8", seed, steps, device, accuracy_at, eval_samples, fp8_gemm
        )
        result["seed"] = seed
        runs[label].append(result)
        accuracy = result["accuracy"] or {}
        log(
            f"{label:>5} seed {seed}: loss {result['losses'][0]:.4f} → {result['losses'][-1]:.4f}, eval "
            f"{result['eval_loss']:.4f}, content {accuracy.get('content', float('nan')):.1%}, format "
            f"{accuracy.get('format', float('nan')):.1%} ({result['seconds']:.0f} s)"
        )
        if after_each is not None:
            after_each(runs)
    return summarise(runs, window)


def summarise(runs: dict[str, list[dict]], window: int) -> dict:
    """`compare` of the runs' curves, raw and smoothed over `window` steps, with the runs."""
    bf16 = [r["losses"] for r in runs["16bit"]]
    fp8_losses = [r["losses"] for r in runs["fp8"]]
    return {
        "raw": compare(bf16, fp8_losses),
        "smoothed": compare([smooth(c, window) for c in bf16], [smooth(c, window) for c in fp8_losses]),
        "runs": runs,
    }


def table(result: dict) -> str:
    rows = []
    for label in ("16bit", "fp8"):
        for item in result["runs"][label]:
            accuracy = item["accuracy"] or {}
            rows.append(
                {
                    "weights": "FP8" if label == "fp8" else "16-bit",
                    "seed": item["seed"],
                    "first": f"{item['losses'][0]:.4f}",
                    "last": f"{item['losses'][-1]:.4f}",
                    "eval": f"{item['eval_loss']:.4f}",
                    "content": f"{100 * accuracy['content']:.1f} %" if accuracy else None,
                    "format": f"{100 * accuracy['format']:.1f} %" if accuracy else None,
                }
            )
    text = markdown_table(
        rows,
        [
            ("weights", "base"),
            ("seed", "trainer seed"),
            ("first", "loss, step 1"),
            ("last", "loss, last step"),
            ("eval", "held-out eval loss"),
            ("content", "skills content acc."),
            ("format", "skills format acc."),
        ],
    )
    lines = [text, ""]
    for kind in ("raw", "smoothed"):
        c = result[kind]
        lines.append(
            f"{kind:>8}: 16-bit spread median {c['spread_median']:.4f} (min {c['spread_min']:.4f}); same-seed "
            f"|FP8 - 16-bit| median {c['paired_median']:.4f}, worst {c['paired_max']:.4f}; steps where it "
            f"exceeds the spread {c['steps_paired_above_spread']}/{c['steps']}; FP8 inside the 16-bit range "
            f"{c['steps_inside_range']} of {c['steps']} steps"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastft bench fp8-quality", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama", help="an embedded preset (or a local checkpoint)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", default="3407,3408,3409", help="the trainer seeds, comma-separated")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--fp8-gemm",
        choices=("reference", "emulated"),
        default="emulated",
        help="on the CPU: the FP8 model's dequantised reference, or the GPU's FP8 GEMMs emulated",
    )
    parser.add_argument(
        "--fp8-seeds", type=int, default=None, help="how many of the seeds get an FP8 run (default: all)"
    )
    parser.add_argument("--window", type=int, default=10, help="steps of the smoothed curves")
    parser.add_argument("--eval-samples", type=int, default=DemoConfig().eval_samples)
    parser.add_argument(
        "--accuracy-at",
        type=int,
        default=DemoConfig().steps,
        help="the step after which the skills accuracy is measured (0: not measured; default: the demo's)",
    )
    parser.add_argument("--out", default="benchmarks/fp8-quality.json")
    parser.add_argument(
        "--from-json",
        default=None,
        help="summarise the runs a record (partial or whole) already holds instead of training; each run's "
        "curve is its last `steps` losses",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        return _from_json(Path(args.from_json), Path(args.out))

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    seeds = [int(seed) for seed in args.seeds.split(",")]
    if len(seeds) < 2:
        raise SystemExit("--seeds: give at least two, so the 16-bit runs have a spread")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {
        "bench": "fp8-quality",
        "model": args.model,
        "steps": args.steps,
        "seeds": seeds,
        "device": device,
        "compute": "bf16" if device.startswith("cuda") else "fp32",
        "fp8_gemm": "scaled_mm where the widths allow" if device.startswith("cuda") else args.fp8_gemm,
        "window": args.window,
    }

    def partial(runs):
        out.write_text(json.dumps(settings | {"partial": True, "runs": runs}, indent=2) + "\n")

    result = run(
        args.model,
        seeds,
        args.steps,
        device,
        args.fp8_gemm,
        args.window,
        args.eval_samples,
        args.accuracy_at or None,
        args.fp8_seeds,
        after_each=partial,
    )
    result = settings | {"environment": environment()} | result
    text = table(result)
    print(text)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(text + "\n")
    print(f"wrote {out}")
    return 0


def _from_json(source: Path, out: Path) -> int:
    record = json.loads(source.read_text())
    runs = record["runs"]
    for run_list in runs.values():
        for item in run_list:
            item["losses"] = item["losses"][-record["steps"] :]
    if not runs["16bit"] or not runs["fp8"]:
        raise SystemExit(f"{source}: needs at least one 16-bit and one FP8 run, has {len(runs['16bit'])} and "
                         f"{len(runs['fp8'])}")  # fmt: skip
    record.pop("partial", None)
    result = record | summarise(runs, record["window"]) | {"summarised_from": str(source)}
    text = table(result)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(text + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

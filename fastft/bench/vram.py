"""`fastft bench vram`: the VRAM estimate against real training steps, and the longest context that fits.

Part 1, peak memory: for each configuration (catalog architectures from 0.5B to 32B with random weights,
16-bit / NF4 / 8-bit, checkpointing none / recompute / offload, short and long sequences, MoE, the fused
kernels and the transformers + peft path), two training steps as fastft's trainer runs them
(`fastft.vram.measure`), and ``torch.cuda.max_memory_allocated`` beside `estimate_vram`'s allocated peak.
Also recorded per run: the reserved peak (calibrates the allocator slack), the forward / backward /
optimizer phase peaks (calibrate the loss and backward phases) and the CUDA context.

Part 2, longest context: under a per-process cap (``torch.cuda.set_per_process_memory_fraction``, 24 GiB
by default, standing in for an RTX 4090), `max_context`'s prediction against the longest sequence that
really trains, found by trying lengths (bisection around the prediction; one step per trial). Each trial
that trains records its allocated and reserved peaks: the allocator's slack near a cap, which the estimate's
`SLACK_FRACTION` stands for.

Configurations run cheapest first and stop starting new ones once `--budget-s` is spent (the rest are
listed as skipped), so one call fits a 10-minute device slot. Memory is freed between configurations.
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass

import torch

from fastft.bench.common import environment, environment_line, markdown_table
from fastft.bench.harness import report_parser
from fastft.models.catalog import CATALOG
from fastft.vram import capped_gpu, max_context
from fastft.vram.measure import TrainingProbe, is_out_of_memory, measure

GiB = 2**30


@dataclass(frozen=True)
class Config:
    model: str
    precision: str = "bf16"
    checkpointing: str = "recompute"
    seq_len: int = 4096
    fused: bool = True
    lora_r: int = 16

    @property
    def label(self) -> str:
        length = f"{self.seq_len // 1024}k" if self.seq_len >= 1024 else str(self.seq_len)
        return f"{self.name} {length}{self.path}"

    @property
    def name(self) -> str:
        return f"{self.model.rsplit('/', 1)[-1]} {self.precision} {self.checkpointing}"

    @property
    def path(self) -> str:
        return "" if self.fused else ", transformers+peft"


# Cheapest first (the planner runs those under 20 s, then the longest-context searches, then the rest).
PEAK_CONFIGS = (
    Config("Qwen/Qwen2.5-0.5B-Instruct", checkpointing="none", seq_len=2048),
    Config("Qwen/Qwen2.5-0.5B-Instruct", checkpointing="recompute", seq_len=16384),
    Config("Qwen/Qwen2.5-0.5B-Instruct", checkpointing="offload", seq_len=16384),
    Config("meta-llama/Llama-3.2-1B-Instruct", checkpointing="none", seq_len=4096),
    Config("Qwen/Qwen3-1.7B", checkpointing="recompute", seq_len=8192),
    Config("Qwen/Qwen3-1.7B", checkpointing="recompute", seq_len=8192, fused=False),
    Config("google/gemma-3-1b-it", checkpointing="recompute", seq_len=4096),
    Config("Qwen/Qwen3-4B", checkpointing="offload", seq_len=16384),
    Config("Qwen/Qwen3-8B", checkpointing="recompute", seq_len=8192),
    Config("Qwen/Qwen3-8B", precision="nf4", checkpointing="recompute", seq_len=8192),
    Config("meta-llama/Llama-3.1-8B-Instruct", precision="nf4", checkpointing="none", seq_len=2048),
    Config("mistralai/Mistral-7B-Instruct-v0.3", precision="int8", checkpointing="recompute", seq_len=2048),
    Config("Qwen/Qwen2.5-14B-Instruct", checkpointing="recompute", seq_len=4096),
    Config("Qwen/Qwen3-30B-A3B", checkpointing="recompute", seq_len=4096),
    Config("Qwen/Qwen3-32B", precision="nf4", checkpointing="recompute", seq_len=4096),
    Config("Qwen/Qwen3-32B", checkpointing="offload", seq_len=8192),
    # held out: added after the estimator was revised against the rows above, to check it on new ground
    Config("mistralai/Mistral-7B-Instruct-v0.3", precision="int8", checkpointing="recompute", seq_len=4096),
    Config("meta-llama/Llama-3.1-8B-Instruct", checkpointing="recompute", seq_len=16384),
    Config("Qwen/Qwen3-14B", precision="nf4", checkpointing="offload", seq_len=16384),
)

CONTEXT_CONFIGS = (
    Config("Qwen/Qwen2.5-0.5B-Instruct", checkpointing="recompute", fused=False),  # eager loss dominates
    Config("Qwen/Qwen3-8B", precision="nf4", checkpointing="none"),
    Config("Qwen/Qwen3-8B", precision="nf4", checkpointing="recompute", fused=False),
    Config("Qwen/Qwen3-8B", checkpointing="recompute"),
)
# Run last, when the budget still allows (predicted ~40k tokens: its trials are the slowest).
LATE_CONTEXT_CONFIGS = (Config("Qwen/Qwen3-8B", precision="nf4", checkpointing="recompute"),)


class _NothingFits(Exception):
    pass


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _seconds_guess(config: Config, tokens: int, steps: int) -> float:
    """A rough wall-time guess (build + steps at ~250 TFLOP/s) to skip what the budget cannot hold."""

    spec = CATALOG.get(config.model)
    params = spec.active_parameter_count() if spec else 1e8
    total = spec.parameter_count() if spec else 1e8
    layers = spec.num_layers if spec else 4
    width = spec.hidden_size if spec else 128
    flops = steps * (8 * params * tokens + 12 * layers * width * tokens**2)
    return 5 + total / 4e9 + flops / 250e12


def _context_guess(config: Config, cap_gib: float, trials: int = 5) -> float:
    predicted = max_context(
        config.model,
        capped_gpu(int(cap_gib * GiB)),
        precision=config.precision,
        checkpointing=config.checkpointing,
        fused=config.fused,
    )
    return _seconds_guess(config, 1024, 1) + trials * (_seconds_guess(config, max(predicted, 1024), 1) - 5)


def measure_peak(config: Config, steps: int = 2) -> dict:
    """One configuration: estimated vs measured peak (and the phase peaks), or the error it raised."""

    # Memory still allocated by an earlier configuration would count in this one's peak: recorded, and
    # shown in the table, so a leak is seen rather than mistaken for an estimation error.
    row = {"config": config.label, **asdict(config), "leftover_gib": torch.cuda.memory_allocated() / GiB}
    started = time.perf_counter()
    try:
        result = measure(
            config.model,
            config.seq_len,
            precision=config.precision,
            lora_r=config.lora_r,
            checkpointing=config.checkpointing,
            fused=config.fused,
            steps=steps,
        )
        estimate = result.estimate
        loss_phase = estimate.phase_bytes("loss")
        backward_phase = estimate.phase_bytes("backward")
        row.update(
            status="ok",
            estimated_gib=estimate.allocated_bytes / GiB,
            measured_gib=result.peak_allocated / GiB,
            error_pct=100 * result.error,
            estimated_total_gib=estimate.total_bytes / GiB,
            reserved_gib=result.peak_reserved / GiB,
            slack_estimated_gib=estimate["slack"] / GiB,
            slack_measured_gib=(result.peak_reserved - result.peak_allocated) / GiB,
            estimated_loss_phase_gib=loss_phase / GiB,
            estimated_backward_phase_gib=backward_phase / GiB,
            measured_forward_gib=result.steps[-1].forward / GiB,
            measured_backward_gib=result.steps[-1].backward / GiB,
            measured_optimizer_gib=result.steps[-1].optimizer / GiB,
            setup_gib=result.setup_allocated / GiB,
            context_gib=result.context_bytes / GiB,
            step_s=result.steps[-1].seconds,
            kernels=estimate.settings.kernels,
            components={c.key: c.own_bytes for c in estimate.components},
        )
    except Exception as error:  # a configuration that fails is reported, the others still run
        row.update(status=f"error: {type(error).__name__}: {error}"[:400])
    finally:
        _free()
    row["seconds"] = time.perf_counter() - started
    return row


def measure_context(config: Config, cap_bytes: int, budget_s: float, granularity: int = 512) -> dict:
    """`max_context`'s prediction under a `cap_bytes` allocator cap, and the longest length that trains."""

    gpu = capped_gpu(cap_bytes)
    predicted = max_context(
        config.model,
        gpu,
        precision=config.precision,
        lora_r=config.lora_r,
        checkpointing=config.checkpointing,
        fused=config.fused,
        multiple_of=granularity,
    )
    row = {
        "config": config.name + config.path,
        **asdict(config),
        "cap_gib": cap_bytes / GiB,
        "predicted": predicted,
        "leftover_gib": torch.cuda.memory_allocated() / GiB,
    }
    started = time.perf_counter()
    probe = None
    # (length, trained, allocated peak GiB, reserved peak GiB)
    trials: list[tuple[int, bool, float | None, float | None]] = []
    try:
        probe = TrainingProbe(
            config.model,
            config.precision,
            config.lora_r,
            "all-linear",
            config.checkpointing,
            fused=config.fused,
        )
        total = torch.cuda.get_device_properties(probe.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), probe.device)

        def trains(length: int) -> bool:
            _free()
            try:
                memory = probe.step(length)
            except RuntimeError as error:
                if not is_out_of_memory(error):
                    raise
                trials.append((length, False, None, None))
                return False
            # allocated and reserved peaks near the cap: what the allocator's slack really is there
            trials.append((length, True, memory.peak / GiB, memory.reserved / GiB))
            return True

        # the first step creates the optimizer states, as in a real run; nothing fits if it does not
        if not trains(granularity):
            raise _NothingFits

        def round_down(length: int) -> int:
            return max(granularity, length // granularity * granularity)

        def in_budget() -> bool:
            return time.perf_counter() - started < budget_s

        # probe 5 % either side of the prediction (doubling the step until the answer flips), then bisect
        step = max(granularity, round_down(predicted // 20))
        low, high = 0, None
        guess = max(predicted, granularity)
        if trains(guess):
            low = guess
            while high is None and in_budget():
                longer = low + step
                if trains(longer):
                    low, step = longer, step * 2
                else:
                    high = longer
        else:
            high = guess
            while low == 0 and in_budget():
                shorter = round_down(high - step)
                if shorter >= high or high <= granularity:
                    break
                if trains(shorter):
                    low = shorter
                else:
                    high, step = shorter, step * 2
        while high is not None and low and high - low > granularity and in_budget():
            middle = round_down((low + high) // 2)
            if middle <= low:
                break
            if trains(middle):
                low = middle
            else:
                high = middle
        row.update(
            status="ok",
            measured=low,
            first_failing=high,
            error_pct=100 * (predicted - low) / low if low else None,
            trials=trials,
        )
    except _NothingFits:
        row.update(status="ok", measured=0, first_failing=granularity, error_pct=None, trials=trials)
    except Exception as error:
        row.update(status=f"error: {type(error).__name__}: {error}"[:400], trials=trials)
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(1.0)
        if probe is not None:
            probe.close()
        _free()
    row["seconds"] = time.perf_counter() - started
    return row


def run(
    budget_s: float = 480.0,
    steps: int = 2,
    cap_gib: float = 24.0,
    only: list[str] | None = None,
    skip_context: bool = False,
    json_path: str | None = None,
) -> dict:
    """Every configuration the budget allows; returns the environment and both tables' rows.

    With `json_path`, the result so far is rewritten there after every configuration, so a run cut
    short by its caller keeps what it measured."""
    if not torch.cuda.is_available():
        raise RuntimeError("fastft bench vram measures real training steps and needs a CUDA GPU.")
    started = time.perf_counter()

    def selected(configs):
        return [c for c in configs if not only or any(key.lower() in c.label.lower() for key in only)]

    def left() -> float:
        return budget_s - (time.perf_counter() - started)

    peaks, contexts = [], []

    def result() -> dict:
        return {
            "benchmark": "vram",
            "environment": environment(),
            "settings": {"steps": steps, "cap_gib": cap_gib, "budget_s": budget_s},
            "peaks": peaks,
            "contexts": contexts,
            "seconds": time.perf_counter() - started,
        }

    small, large = [], []
    for config in selected(PEAK_CONFIGS):
        (small if _seconds_guess(config, config.seq_len, steps) < 20 else large).append(config)
    plan = [("peak", c) for c in small]
    if not skip_context:
        plan += [("context", c) for c in selected(CONTEXT_CONFIGS)]
    plan += [("peak", c) for c in large]
    if not skip_context:
        plan += [("context", c) for c in selected(LATE_CONTEXT_CONFIGS)]
    for kind, config in plan:
        guess = (
            _seconds_guess(config, config.seq_len, steps)
            if kind == "peak"
            else _context_guess(config, cap_gib)
        )
        if left() < guess:
            row = {
                "config": config.label,
                **asdict(config),
                "status": f"skipped: budget ({left():.0f} s left)",
            }
            (peaks if kind == "peak" else contexts).append(row)
            continue
        if kind == "peak":
            row = measure_peak(config, steps)
            peaks.append(row)
            shown = f"{row.get('error_pct', float('nan')):+.1f}%" if row["status"] == "ok" else row["status"]
        else:
            row = measure_context(config, int(cap_gib * GiB), budget_s=min(120.0, left()))
            contexts.append(row)
            shown = (
                f"predicted {row['predicted']}, measured {row.get('measured')}"
                if row["status"] == "ok"
                else row["status"]
            )
        print(f"  {row['config']:<52} {row['seconds']:6.1f} s  {shown}", flush=True)
        if json_path:
            _write_json(json_path, result())
    return result()


def _write_json(path: str, result: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


PEAK_COLUMNS = [
    ("config", "configuration"),
    ("kernels", "kernels"),
    ("estimated_gib", "estimated GiB"),
    ("measured_gib", "measured GiB"),
    ("error_pct", "error %"),
    ("estimated_loss_phase_gib", "est. loss phase"),
    ("measured_forward_gib", "meas. forward"),
    ("estimated_backward_phase_gib", "est. backward phase"),
    ("measured_backward_gib", "meas. backward"),
    ("slack_estimated_gib", "est. slack"),
    ("slack_measured_gib", "meas. slack"),
    ("context_gib", "CUDA context"),
    ("leftover_gib", "left over GiB"),
    ("step_s", "step s"),
    ("status", "status"),
]
CONTEXT_COLUMNS = [
    ("config", "configuration"),
    ("cap_gib", "cap GiB"),
    ("predicted", "predicted tokens"),
    ("measured", "longest that trained"),
    ("first_failing", "first OOM"),
    ("error_pct", "error %"),
    ("leftover_gib", "left over GiB"),
    ("status", "status"),
]


def report(result: dict) -> str:
    env, settings = result["environment"], result["settings"]
    head = (
        f"vram — estimated vs measured peak (torch.cuda.max_memory_allocated, {settings['steps']} steps), "
        f"and the longest context under a {settings['cap_gib']:.0f} GiB cap\n"
        f"{environment_line(env, 'torch', 'transformers', 'peft')}; {result['seconds']:.0f} s"
    )
    return (
        head
        + "\n\n"
        + markdown_table(result["peaks"], PEAK_COLUMNS)
        + "\n\n"
        + markdown_table(result["contexts"], CONTEXT_COLUMNS)
    )


def main(argv: list[str] | None = None) -> int:
    parser = report_parser("vram", __doc__)
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="stop starting configurations after this"
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps per configuration")
    parser.add_argument(
        "--cap-gib", type=float, default=24.0, help="allocator cap for the longest-context search"
    )
    parser.add_argument(
        "--only", nargs="*", default=None, help="run configurations whose label contains these"
    )
    parser.add_argument("--skip-context", action="store_true", help="skip the longest-context search")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument("--json", default=None, help="write the full result (with every component) here")
    parser.add_argument("--markdown", default=None, help="write the tables as markdown here")
    args = parser.parse_args(argv)
    if args.list:
        for config in PEAK_CONFIGS:
            print(f"peak     {config.label}")
        for config in CONTEXT_CONFIGS + LATE_CONTEXT_CONFIGS:
            print(f"context  {config.name}{config.path}")
        return 0
    result = run(args.budget_s, args.steps, args.cap_gib, args.only, args.skip_context, args.json)
    text = report(result)
    print(text)
    if args.json:
        _write_json(args.json, result)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0

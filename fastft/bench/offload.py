"""`fastft bench offload`: what keeping checkpointed layer inputs in host memory saves and costs.

Workload: a catalog architecture with random weights (bf16), LoRA r=16 on every linear layer, AdamW on
the adapters, fastft's packed attention; each step is one long packed bin (`--tokens`, a few documents
of 1/8 to 1/2 of the bin each, the last 60 % of every document trained).

Modes, on the same model and batches, in one process:
- ``recompute`` (``gradient_checkpointing=True``): plain recompute; every layer's input stays on the GPU.
- ``offload-single``: inputs in pinned host memory, copied back into one buffer when each layer's
  backward starts (the compute stream waits for every copy): the ablation.
- ``offload``: two device buffers; layer i-1's input is copied while layer i runs its backward.
- ``none`` (``False``): no checkpointing (at these lengths it usually runs out of memory; reported as OOM).

Per mode: median step time over `--steps` timed steps after `--warmup` (CUDA events; the step includes
the optimizer), tokens/s (all tokens of the bin), peak allocated memory and the part of it added by the
step (peak minus what was allocated before), GiB offloaded per step, copy-stream times of the
device→host and host→device copies, how long the compute stream stood waiting for host→device copies,
and the share of host→device copy time hidden behind compute (``1 - wait / copy``).

`--time-budget` (seconds, from start, builds included) keeps the run inside one device call: a model or
mode whose estimated time (FLOP count at an assumed 350 TFLOP/s, then the measured step time) would not
finish in time is reported as skipped. Defaults: Llama-3.1-8B and Qwen3-14B at 32k tokens, Qwen3-32B at 16k.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

import numpy as np
import torch

from fastft.bench.common import environment, environment_line, markdown_table, time_steps
from fastft.bench.harness import report_parser, save_record
from fastft.data.batch import PackedBatch
from fastft.models.catalog import CATALOG
from fastft.models.lora import add_lora, set_gradient_checkpointing
from fastft.models.random_model import random_model
from fastft.runtime import attention
from fastft.runtime.offload import enable_offload, offload_stats
from fastft.training.loss import causal_lm_loss_sum

DEFAULT_TOKENS = {
    "meta-llama/Llama-3.1-8B-Instruct": 32768,
    "Qwen/Qwen3-14B": 32768,
    "Qwen/Qwen3-32B": 16384,
}
# bench mode → (checkpointing, double-buffered); "offload-single" is the ablation: one device buffer, no prefetch
MODES = {
    "recompute": ("recompute", True),
    "offload-single": ("offload", False),
    "offload": ("offload", True),
    "none": ("none", True),
}
ASSUMED_FLOPS = 350e12  # bf16 FLOP/s for the first estimate of a model's step (about 45 % of the H200's)
MODE_COST = {"offload-single": 1.3, "none": 0.8}  # relative to recompute, for the time estimate


def long_documents(tokens: int, vocab: int, rng: np.random.Generator) -> PackedBatch:
    """One bin of exactly `tokens` tokens: documents of 1/8 to 1/2 of the bin, the last 60 % of each trained."""
    lengths, left = [], tokens
    while left > 0:
        n = int(rng.integers(tokens // 8, tokens // 2 + 1))
        n = left if left - n < tokens // 8 else n
        lengths.append(n)
        left -= n
    ids = [rng.integers(3, vocab, size=n).astype(np.int64) for n in lengths]
    labels = []
    for doc in ids:
        lab = doc.copy()
        lab[: int(len(doc) * 0.4)] = -100
        labels.append(lab)
    return PackedBatch.from_sequences(ids, labels)


def estimated_step_seconds(model_name: str, batch: PackedBatch) -> float | None:
    """LoRA with recompute: 6·N FLOPs per token (forward, recompute, activation gradients) plus causal
    attention in four passes; None for presets (no budget needed)."""

    spec = CATALOG.get(model_name)
    if spec is None:
        return None
    dense = 6 * spec.active_parameter_count(include_embedding=False) * batch.num_tokens
    width = int(spec.config["num_attention_heads"]) * spec.head_dim
    causal = sum(n * n / 2 for n in batch.sequence_lengths)
    attention_flops = 4 * (4 * width * causal) * spec.num_layers
    return (dense + attention_flops) / ASSUMED_FLOPS


def _gib(value: float | None) -> float | None:
    return None if value is None else value / 2**30


def _measure_model(
    model_name: str,
    tokens: int,
    modes: list[str],
    warmup: int,
    steps: int,
    lora_r: int,
    fused: bool | None,
    deadline: float,
    seed: int,
) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cuda = device.type == "cuda"
    rng = np.random.default_rng(seed)
    base_row = {"model": model_name, "tokens": tokens}

    def skipped(reason: str, names=modes) -> list[dict]:
        return [dict(base_row, mode=name, status=reason) for name in names]

    probe = long_documents(tokens, 1000, np.random.default_rng(seed))
    estimate = estimated_step_seconds(model_name, probe)
    if estimate is not None:
        needed = 20 + sum(estimate * MODE_COST.get(m, 1.0) * (warmup + steps) for m in modes)
        if time.perf_counter() + needed > deadline:
            print(f"  {model_name}: skipped (needs ~{needed:.0f} s, time budget left)", flush=True)
            return skipped("skipped (time budget)")

    model, optimizer = _lora_model(model_name, device, dtype, lora_r, fused, seed)
    vocab = model.config.vocab_size
    batches = [long_documents(tokens, vocab, rng).to(device) for _ in range(warmup + steps)]
    autocast = dict(device_type=device.type, dtype=dtype, enabled=cuda)

    def forward(i: int) -> torch.Tensor:
        batch = batches[i]
        with torch.autocast(**autocast):
            return causal_lm_loss_sum(model, batch) / batch.num_trained_tokens

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    rows, measured = [], None
    for name in modes:
        mode, double_buffer = MODES[name]
        row = dict(base_row, mode=name)
        rows.append(row)
        guess = measured if measured is not None else estimate
        cost = None if guess is None else guess * MODE_COST.get(name, 1.0) * (warmup + steps) * 1.2
        if cost is not None and time.perf_counter() + cost > deadline:
            row["status"] = "skipped (time budget)"
            print(f"  {name:<18} skipped (time budget)", flush=True)
            continue
        set_gradient_checkpointing(model, mode)
        if mode == "offload":
            enable_offload(model, double_buffer=double_buffer, timing=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        oom = False
        try:
            for i in range(warmup):
                forward(i).backward()
                optimizer_step()
            offload_stats(model, reset=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if cuda else 0
            times = time_steps(lambda i: forward(warmup + i), optimizer_step, device, 0, steps)
        except torch.OutOfMemoryError:
            oom = True
        if oom:  # outside the except block, so the failed step's tensors are really gone
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            row["status"] = "OOM"
            print(f"  {name:<18} OOM", flush=True)
            continue
        median = times.median()
        step_s = median["total"] / 1000.0
        if mode is not False:
            measured = step_s / MODE_COST.get(name, 1.0)
        stats = offload_stats(model)
        row.update(
            status="ok",
            forward_ms=median["forward"],
            backward_ms=median["backward"],
            step_ms=median["total"],
            tokens_per_s=sum(b.num_tokens for b in batches[warmup:]) / steps / step_s,
            peak_gib=_gib(torch.cuda.max_memory_allocated()) if cuda else None,
            step_gib=_gib(torch.cuda.max_memory_allocated() - before) if cuda else None,
        )
        if stats is not None:
            row.update(_offload_figures(stats, steps))
        print(
            f"  {name:<18} step {row['step_ms']:9.1f} ms  {row['tokens_per_s']:9.0f} tok/s  "
            f"peak {row['peak_gib'] or 0:6.1f} GiB",
            flush=True,
        )
    _against_recompute(rows)
    return rows


def _lora_model(model_name: str, device, dtype, lora_r: int, fused: bool | None, seed: int):
    """The random-weight `model_name` with LoRA r=`lora_r` (checkpointed, packed attention), in training mode,
    and its AdamW with its states allocated, so every mode starts from the same memory."""
    started = time.perf_counter()
    model = random_model(model_name, device, dtype)
    model.config.use_cache = False
    extra = {} if fused is None else {"fused": fused}
    model = add_lora(model, r=lora_r, alpha=lora_r, gradient_checkpointing=True, seed=seed, **extra)
    attention.patch_packed_attention(model, "auto")
    model.train()
    lora = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=1e-5, weight_decay=0.0, fused=device.type == "cuda")
    for p in lora:  # allocate the optimizer state now, so every mode starts from the same memory
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"  {model_name}: built in {time.perf_counter() - started:.0f} s", flush=True)
    return model, optimizer


def _offload_figures(stats, steps: int) -> dict:
    """The offloader's figures (`offload_stats`) over `steps` timed steps, per step."""
    return dict(
        offloaded_gib=_gib(stats.bytes_offloaded / steps),
        d2h_ms=None if stats.d2h_ms is None else stats.d2h_ms / steps,
        h2d_ms=None if stats.h2d_ms is None else stats.h2d_ms / steps,
        wait_ms=None if stats.wait_ms is None else stats.wait_ms / steps,
        hidden_pct=None if stats.hidden_fraction is None else 100 * stats.hidden_fraction,
        pinned_gib=_gib(stats.pinned_bytes),
        buffers_gib=_gib(stats.device_buffer_bytes),
        fallback_calls=stats.fallback_calls,
        offload_disabled=stats.disabled,
    )


def _against_recompute(rows: list[dict]) -> None:
    """Each measured row's speed over plain recompute's and the memory it saves against it, where recompute ran."""
    recompute = next((r for r in rows if r["mode"] == "recompute" and r.get("status") == "ok"), None)
    for row in rows:
        if recompute and row.get("status") == "ok":
            row["speed_vs_recompute"] = row["tokens_per_s"] / recompute["tokens_per_s"]
            if row.get("peak_gib") is not None:
                row["saved_gib"] = recompute["peak_gib"] - row["peak_gib"]


def run(
    models: list[str] | None = None,
    tokens: int | None = None,
    modes: list[str] | None = None,
    warmup: int = 1,
    steps: int = 2,
    lora_r: int = 16,
    fused: bool | None = None,
    time_budget: float = 450.0,
    seed: int = 0,
) -> dict:
    """Every mode on every model that fits the time budget; one row per (model, mode)."""
    started = time.perf_counter()
    deadline = started + time_budget
    models = models or list(DEFAULT_TOKENS)
    modes = modes or list(MODES)
    rows = []
    for name in models:
        count = tokens or DEFAULT_TOKENS.get(name, 32768)
        print(f"{name}, {count} tokens per step", flush=True)
        rows += _measure_model(name, count, modes, warmup, steps, lora_r, fused, deadline, seed)
        gc.collect()  # the model is gone with `_measure_model`'s frame
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            host_empty_cache = getattr(torch.accelerator, "empty_host_cache", None) or getattr(
                torch._C, "_host_emptyCache", None
            )  # give the cached pinned slabs of this model back to the OS
            if host_empty_cache is not None:
                host_empty_cache()
    return {
        "benchmark": "offload",
        "environment": environment(),
        "workload": {
            "models": models,
            "tokens": {name: tokens or DEFAULT_TOKENS.get(name, 32768) for name in models},
            "lora_r": lora_r,
            "warmup": warmup,
            "steps": steps,
            "fused": fused,
            "dtype": "bf16" if torch.cuda.is_available() else "fp32 (CPU)",
            "time_budget_s": time_budget,
            "seconds": time.perf_counter() - started,
        },
        "rows": rows,
    }


COLUMNS = [
    ("model", "model"),
    ("tokens", "tokens/step"),
    ("mode", "mode"),
    ("status", "status"),
    ("step_ms", "step ms"),
    ("tokens_per_s", "tokens/s"),
    ("speed_vs_recompute", "× recompute"),
    ("peak_gib", "peak GiB"),
    ("saved_gib", "GiB saved vs recompute"),
    ("step_gib", "step GiB above weights"),
    ("offloaded_gib", "GiB offloaded/step"),
    ("d2h_ms", "D→H copy ms/step"),
    ("h2d_ms", "H→D copy ms/step"),
    ("wait_ms", "compute wait ms/step"),
    ("hidden_pct", "H→D hidden %"),
]


def report(result: dict) -> str:
    env, work = result["environment"], result["workload"]
    head = (
        f"offload — random weights, {work['dtype']}, LoRA r={work['lora_r']}, one packed bin per step "
        f"(documents of 1/8–1/2 of the bin), {work['steps']} timed steps after {work['warmup']} warm-up, "
        f"median; fused kernels: {'default' if work['fused'] is None else work['fused']}\n"
        f"{environment_line(env, 'torch', 'transformers', 'peft')}; {work['seconds']:.0f} s"
    )
    return head + "\n\n" + markdown_table(result["rows"], COLUMNS)


def main(argv: list[str] | None = None) -> int:
    parser = report_parser("offload", __doc__)
    parser.add_argument(
        "--models",
        nargs="+",
        default=None,
        help="catalog hub ids (random weights) or presets (default: 8B, 14B, 32B)",
    )
    parser.add_argument(
        "--tokens", type=int, default=None, help="tokens per step (default: per model, 16k–32k)"
    )
    parser.add_argument(
        "--modes", nargs="+", choices=list(MODES), default=None, help="modes to run (default: all)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    parser.add_argument("--unfused", action="store_true", help="add_lora(fused=False): transformers' modules")
    parser.add_argument(
        "--time-budget", type=float, default=450.0, help="seconds for the whole run; later work is skipped"
    )
    parser.add_argument("--out", default=None, help="folder for offload.json and offload.md")
    args = parser.parse_args(argv)
    result = run(
        args.models,
        args.tokens,
        args.modes,
        args.warmup,
        args.steps,
        args.lora_r,
        False if args.unfused else None,
        args.time_budget,
    )
    text = report(result)
    print(text)
    if args.out:
        save_record(Path(args.out) / "offload.json", result, text)
    return 0

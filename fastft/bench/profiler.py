"""`fastft bench profiler`: what the always-on step profiler costs, and the breakdown it shows.

Two trainers on two copies of one model (same random weights, same LoRA init, same bins), one with
``TrainConfig(profile=True)`` and one with ``profile=False``, take turns: a block of steps each, timed
wall-clock between device synchronisations, many blocks. The overhead is the median ratio of the
paired blocks' times minus one (pairing cancels the drift of clocks and of the machine). The profiled
trainer's median phases are printed too: the breakdown the studio and the report show.

    fastft bench profiler --model meta-llama/Llama-3.1-8B-Instruct --layers 8 --seq-len 2048 --bins 2
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from fastft.bench.common import environment, environment_line, markdown_table
from fastft.bench.harness import report_parser
from fastft.data.packing import PackedDataset
from fastft.data.tokenize import TokenizedData
from fastft.models.lora import add_lora
from fastft.models.presets import load_preset_tokenizer
from fastft.models.random_model import random_model
from fastft.training.trainer import TrainConfig, Trainer


def random_packed_dataset(vocab: int, seq_len: int, sequences: int, seed: int = 0):
    """`sequences` random token rows of `seq_len`, every token trained, one row per bin."""

    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, vocab, seq_len, dtype=np.int64).astype(np.int32) for _ in range(sequences)]
    data = TokenizedData(
        input_ids=ids, labels=[row.copy() for row in ids], source_rows=list(range(sequences))
    )
    return PackedDataset(data, [[i] for i in range(sequences)], seq_len)


def _model(name: str, layers: int | None, device: torch.device, dtype: torch.dtype, lora_r: int):
    torch.manual_seed(0)
    cut = {"num_hidden_layers": layers} if layers is not None and not name.startswith("tiny-") else {}
    model = random_model(name, device, dtype, **cut)
    return add_lora(model, r=lora_r, alpha=lora_r, seed=1)


def run(
    name: str,
    layers: int | None,
    seq_len: int,
    bins: int,
    blocks: int,
    steps_per_block: int,
    lora_r: int = 16,
    nvtx: bool | None = None,
) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = load_preset_tokenizer()
    trainers = {}
    for profiled in (True, False):
        model = _model(name, layers, device, dtype, lora_r)
        vocab = model.config.vocab_size
        data = random_packed_dataset(vocab, seq_len, bins * (blocks + 2) * steps_per_block * 2)
        # eager steps: the hooks' overhead is what is measured (a CUDA graph replay has no hooks inside)
        config = TrainConfig(
            max_steps=10**6, micro_batch_bins=bins, learning_rate=1e-5, profile=profiled, cuda_graph=False
        )
        trainers[profiled] = Trainer(model, tokenizer, data, config=config)
    if nvtx is not None:  # what `nsys profile` would turn on (the default follows an attached NVTX tool)
        from fastft.profile import StepProfile

        trainers[True].profile = StepProfile(trainers[True].model, nvtx=nvtx)

    def block(trainer) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        trainer.train(steps=steps_per_block)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - started) / steps_per_block

    for trainer in trainers.values():
        block(trainer)  # warm-up: compilation, allocator, autotuning
    seconds = {True: [], False: []}
    for index in range(blocks):
        order = (True, False) if index % 2 == 0 else (False, True)
        for profiled in order:
            seconds[profiled].append(block(trainers[profiled]))
    ratios = [on / off for on, off in zip(seconds[True], seconds[False], strict=True)]
    steps = trainers[True].result.steps
    phases = {}
    for event in steps[len(steps) // 2 :]:
        for key, value in (event.phases or {}).items():
            phases.setdefault(key, []).append(value)
    profile = trainers[True].profile
    return {
        "benchmark": "profiler",
        "environment": environment(),
        "workload": {
            "model": name,
            "layers": layers,
            "tokens_per_step": seq_len * bins,
            "blocks": blocks,
            "steps_per_block": steps_per_block,
            "dtype": str(dtype).removeprefix("torch."),
            "lora_r": lora_r,
        },
        "step_ms_profiled": 1000 * statistics.median(seconds[True]),
        "step_ms_unprofiled": 1000 * statistics.median(seconds[False]),
        "overhead_pct": 100 * (statistics.median(ratios) - 1),
        "overhead_pct_blocks": [100 * (r - 1) for r in ratios],
        "nvtx": bool(getattr(profile, "_nvtx", False)),
        "phases_ms": {key: statistics.median(values) for key, values in sorted(phases.items())},
    }


def report(result: dict) -> str:
    work, env = result["workload"], result["environment"]
    head = (
        f"Step profiler overhead — {work['model']} ({work['layers'] or 'all'} layers), "
        f"{work['tokens_per_step']} tokens/step, {work['dtype']}, LoRA r={work['lora_r']}; "
        f"{environment_line(env, 'torch')}\n\n"
        f"step {result['step_ms_unprofiled']:.1f} ms without the profiler, "
        f"{result['step_ms_profiled']:.1f} ms with it: overhead {result['overhead_pct']:+.2f} % "
        f"(median of {work['blocks']} paired blocks of {work['steps_per_block']} steps); "
        f"NVTX ranges {'on' if result['nvtx'] else 'off'}\n\n"
    )
    rows = [{"phase": key, "ms": value} for key, value in result["phases_ms"].items()]
    return head + markdown_table(rows, [("phase", "phase"), ("ms", "median ms per step")])


def main(argv: list[str] | None = None) -> int:
    parser = report_parser("profiler", __doc__)
    parser.add_argument(
        "--model", default="meta-llama/Llama-3.1-8B-Instruct", help="catalog hub id or preset"
    )
    parser.add_argument("--layers", type=int, default=8, help="decoder layers kept (default 8; 0: all)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--bins", type=int, default=2, help="sequences per step")
    parser.add_argument("--blocks", type=int, default=8, help="paired blocks")
    parser.add_argument("--steps-per-block", type=int, default=5)
    parser.add_argument(
        "--nvtx", choices=("auto", "on", "off"), default="auto", help="NVTX ranges (auto: when nsys listens)"
    )
    parser.add_argument("--out", default=None, help="write the result here as JSON")
    args = parser.parse_args(argv)
    nvtx = {"auto": None, "on": True, "off": False}[args.nvtx]
    result = run(
        args.model, args.layers or None, args.seq_len, args.bins, args.blocks, args.steps_per_block, nvtx=nvtx
    )
    print(report(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0

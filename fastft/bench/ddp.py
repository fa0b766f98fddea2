"""`fastft bench ddp`: LoRA training throughput on N GPUs against 1, through torchrun (`fastft.training.distributed`).

The workload of `fastft bench sft` (random weights of a catalog architecture, packed chats trained on the
assistant tokens, LoRA r=16 on the seven projections, `fastft.train`'s Trainer) run twice: on one rank and on
`--gpus` ranks, each rank with the same micro-batches per step (weak scaling: the global batch grows with the
ranks). Each run is its own ``torchrun --standalone`` launch; rank 0 writes the run's trained and real tokens
per second (counted over every rank by the trainer's events) after `--warmup` steps. The report gives both and
their ratio (the goal on 2 H200s: at least 1.9x). ``--gpus 1`` is the one-rank NCCL smoke run.

    fastft bench ddp --model meta-llama/Llama-3.1-8B-Instruct --gpus 2
    fastft bench ddp --model tiny-llama --gpus 2 --device cpu --steps 3 --warmup 1   # gloo, the CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from fastft.bench.common import environment
from fastft.bench.harness import ensure_checkpoint, fastft_model, packed
from fastft.bench.sft import chat_rows
from fastft.models.patch import is_fused, patch_report
from fastft.runtime.offload import offload_stats
from fastft.training.trainer import TrainConfig, Trainer

# Function-local imports: imported after the environment they read is set (environment variables, offline mode).


def run_worker(args) -> dict:
    """One rank of one launch: train, time the steps after the warmup, rank 0 returns the figures."""

    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    model = fastft_model(args.checkpoint, args.precision, args.max_seq_length, "auto", device)
    vocab = model.get_input_embeddings().weight.shape[0]
    rows = chat_rows(
        args.chats, vocab, args.user_median, args.assistant_median, args.sigma, args.max_seq_length, args.seed
    )
    config = TrainConfig(max_steps=args.warmup + args.steps, warmup=0, learning_rate=1e-5)
    trainer = Trainer(model, None, packed(rows, args.max_seq_length), config=config)
    trainer.train(steps=args.warmup)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    result = trainer.train(steps=args.steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    timed = result.steps[args.warmup :]
    phases = [e.phases.get("communication", 0.0) for e in timed]
    offloaded = offload_stats(model)
    fused = patch_report(model)
    return dict(
        precision=args.precision,
        # what ran under the process group: graph replays, offloaded layers, fused modules, attention
        cuda_graph=dict(result.cuda_graph),
        timed_graph_replays=sum(e.graph_replays for e in timed),
        timed_micro_batches=sum(e.micro_batches for e in timed),
        offload=None
        if offloaded is None
        else dict(
            layers_offloaded=offloaded.layers_offloaded,
            fallback_calls=offloaded.fallback_calls,
            bytes_kept=offloaded.bytes_kept,
            disabled=offloaded.disabled,
        ),
        fused=is_fused(model),
        patch_report=str(fused) if fused is not None else None,
        attention=result.attention,
        world_size=trainer.world_size,
        backend=trainer.parallel.backend if trainer.parallel is not None else None,
        seconds=seconds,
        trained_tokens_per_second=sum(e.trained_tokens for e in timed) / seconds,
        tokens_per_second=sum(e.tokens for e in timed) / seconds,
        communication_ms=sorted(phases)[len(phases) // 2] if phases else 0.0,
        peak_memory_bytes=max(e.peak_memory_bytes for e in timed),
    )


def _launch(args, gpus: int, result_path: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={gpus}",
        "-m",
        "fastft.bench.ddp",
        "--worker",
        "--result",
        str(result_path),
        *args.passed,
    ]
    done = subprocess.run(command, check=False, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the {gpus}-rank run failed (exit {done.returncode}): {' '.join(command)}")
    return json.loads(result_path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastft bench ddp", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="meta-llama/Llama-3.1-8B-Instruct", help="catalog hub id or preset"
    )
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    parser.add_argument("--gpus", type=int, default=2, help="ranks of the run compared with one rank")
    parser.add_argument("--chats", type=int, default=3000)
    parser.add_argument("--user-median", type=float, default=120.0)
    parser.add_argument("--assistant-median", type=float, default=220.0)
    parser.add_argument("--sigma", type=float, default=0.7)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "nf4"))
    parser.add_argument("--max-seq-length", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--folder", default="/dev/shm/fastft-bench-step", help="the random checkpoints")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--timeout", type=float, default=900, help="seconds per launch")
    parser.add_argument("--out", default="benchmarks/ddp.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        import torch.distributed as dist

        figures = run_worker(args)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(args.result).write_text(json.dumps(figures))
        if dist.is_initialized():
            dist.destroy_process_group()
        return 0

    checkpoint = ensure_checkpoint(args)
    skip = {"--out", "--gpus", "--timeout", "--folder", "--layers", "--model"}
    args.passed = [f"--checkpoint={checkpoint}"]
    for name, value in vars(args).items():
        flag = "--" + name.replace("_", "-")
        if (
            flag not in skip
            and name not in ("worker", "result", "checkpoint", "passed")
            and value is not None
        ):
            args.passed.append(f"{flag}={value}")
    scratch = Path(args.out).with_suffix("")
    scratch.parent.mkdir(parents=True, exist_ok=True)
    runs = [_launch(args, n, Path(f"{scratch}.rank{n}.json")) for n in sorted({1, args.gpus})]
    single, wide = runs[0], runs[-1]
    report = dict(
        model=args.model,
        layers=args.layers,
        gpus=args.gpus,
        runs=runs,
        speedup=wide["trained_tokens_per_second"] / single["trained_tokens_per_second"],
        environment=environment(),
    )
    Path(args.out).write_text(json.dumps(report, indent=2))
    for run in runs:
        print(
            f"{run['world_size']} rank(s) ({run['backend'] or 'no process group'}): "
            f"{run['trained_tokens_per_second']:,.0f} trained tokens/s, {run['tokens_per_second']:,.0f} tokens/s, "
            f"communication {run['communication_ms']:.2f} ms/step, peak {run['peak_memory_bytes'] / 2**30:.2f} GiB; "
            f"graph replays {run['timed_graph_replays']} of {run['timed_micro_batches']} timed micro-batches, "
            f"offload {run['offload']}, fused: {run['patch_report']}"
        )
    print(f"speed-up on {args.gpus} rank(s): {report['speedup']:.2f}x  ->  {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

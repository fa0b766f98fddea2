"""`fastft bench sft`: supervised fine-tuning on realistic packed chat data, every system side by side.

The user's workload, not a microbenchmark: chats of 1 to 3 turns whose user and assistant turns have
log-normal token lengths (median `--user-median` and `--assistant-median`, sigma `--sigma`, plus 5 template
tokens per turn), trained on the assistant tokens only, packed best-fit into micro-batches of
`--max-seq-length` tokens. Random weights of a catalog architecture (`fastft bench step`'s checkpoints),
LoRA r=16 on the seven projections (and the experts of an MoE model). Systems, each in its own process:

* ``fastft``      -- `load_model` + `add_lora` + fastft's `Trainer` (what `fastft.train` runs): packed
  micro-batches padded to one shape and replayed as a CUDA graph, offloaded checkpointing.
* ``fastft-trl``  -- the same model under TRL's ``SFTTrainer(packing=True)`` with TRL's defaults: the
  one-import switch from Unsloth (TRL's ``gradient_checkpointing=True`` keeps fastft's offloaded
  checkpointing: `fastft.models.lora.set_gradient_checkpointing` routes the model's switches).
* ``unsloth``     -- ``FastLanguageModel`` + ``get_peft_model(use_gradient_checkpointing="unsloth")`` under
  the same ``SFTTrainer(packing=True)`` (TRL's ``gradient_checkpointing`` off: Unsloth's own is on).
* ``hf``          -- transformers + PEFT (SDPA, gradient checkpointing) under the same trainer.

The baselines run with torch's cuDNN attention off unless ``--baseline-cudnn-attention on``: on packed
rows Unsloth (on torch < 2.12, without flash-attn or xformers) calls SDPA once per packed segment, and
cuDNN builds a plan for every new segment length; measured on an H200 (torch 2.11), Unsloth + TRL ran
2,996 tokens/s with cuDNN and 4,670 without, so the baselines get their faster setting. fastft's own
attention backend is its own choice (``attention`` in the result).

Every system trains with the same optimizer: AdamW with fp32 states (fastft's `Trainer` runs torch's fused
AdamW; the TRL systems get ``optim="adamw_torch_fused"``, ``"adamw_torch"`` on a CPU). Unsloth's patched
``SFTConfig`` would otherwise default to bitsandbytes' 8-bit AdamW, whose states take a quarter of the bytes:
on Llama-3.1-8B r=16, 81 MiB against 320, which until 2026-12-06 made Unsloth's recorded peaks 0.23 GiB lower
than its run with fastft's optimizer (`fastft.vram.measure.resident_memory`, the bench's ``--snapshot``).

Every system sees the same chats in its own packing. After `--warmup` steps, `--steps` steps are timed
(wall clock between ``torch.cuda.synchronize()`` calls); the report gives real tokens per second (padding
slots not counted), trained tokens per second, the median and the slowest step, and the peak of
``torch.cuda.max_memory_allocated``. A step's time is the wall clock: for TRL's trainers between
synchronised step ends, for fastft's between the arrivals of consecutive steps' events on the host (each
after its CUDA events completed), so a host stall counts; fastft's device-side step times are kept beside
(``device_step_seconds``).

    fastft bench sft --systems fastft,fastft-trl,unsloth,hf --workloads bf16,nf4 --unsloth-path /tmp/site_unsloth
    fastft bench sft --model Qwen/Qwen3-30B-A3B --layers 12 --workloads bf16
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

from fastft.bench.baselines import hf_model, step_clock, trl_run_settings, unsloth_model
from fastft.bench.harness import (
    bench_parser,
    ensure_checkpoint,
    fastft_model,
    packed,
    parse_or_work,
    run_system,
    systems_of,
    worker_options,
    workloads_of,
)
from fastft.kernels import tiling

# Function-local imports: torch, transformers and the engine load where used: a bench's Unsloth worker imports this
# module and must import unsloth before transformers; TRL is an optional dependency (the baselines and the facade's
# trainers); tests replace these names on their modules, so they are looked up when called.

SYSTEMS = ("fastft", "fastft-trl", "unsloth", "hf")
TEMPLATE_TOKENS = 5  # a turn's header and end tokens (role, separators), trained only on assistant turns' end

# Every system's optimizer (module docstring): TRL's name for it, and what the record says.
TRL_OPTIMIZER = "adamw_torch_fused"
OPTIMIZER = "AdamW, fp32 states (torch fused) for every system; Unsloth's default 8-bit AdamW overridden"


# --------------------------------------------------------------------------------------------------- data


def chat_rows(
    count: int,
    vocab: int,
    user_median: float,
    assistant_median: float,
    sigma: float,
    max_length: int,
    seed: int,
):
    """`count` chats as (input_ids, labels) int64 arrays: 1 to 3 turns, log-normal turn lengths, labels on the
    assistant turns only (-100 elsewhere), cut to `max_length` tokens (a chat cut mid-turn keeps its turns so
    far). Token ids are random in ``[3, vocab)``; the same seed gives every system the same chats."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        ids, trained = [], []
        for _ in range(int(rng.integers(1, 4))):
            for median, labelled in ((user_median, False), (assistant_median, True)):
                length = TEMPLATE_TOKENS + max(1, int(rng.lognormal(math.log(median), sigma)))
                ids.append(rng.integers(3, vocab, length))
                trained.append(np.full(length, labelled))
        tokens, mask = np.concatenate(ids)[:max_length], np.concatenate(trained)[:max_length]
        if not mask.any():
            continue  # a chat cut before its first answer trains nothing
        rows.append((tokens.astype(np.int64), np.where(mask, tokens, -100).astype(np.int64)))
    return rows


# ------------------------------------------------------------------------------------------------ workers


def _model(args, device):
    import torch

    precision, seq = args.workload.removesuffix("-fp16"), args.max_seq_length
    if args.workload.endswith(
        "fp16"
    ):  # what a T4 computes in: fastft's trainer with its device-side loss scale
        if args.system != "fastft":
            raise SystemExit(
                f"--workloads {args.workload}: fp16 compute is measured for the fastft system only"
            )
        return fastft_model(
            args.folder,
            "bf16" if precision == "fp16" else precision,
            seq,
            "auto",
            device,
            dtype=torch.float16,
        )
    if args.system in ("fastft", "fastft-trl"):
        return fastft_model(args.folder, precision, seq, "auto", device)
    if args.system == "hf":
        return hf_model(args.folder, precision, False, device)
    return unsloth_model(args.folder, precision, seq)


def _run_fastft(model, rows, args, device):
    import torch

    from fastft.bench.long_context import StepRecording
    from fastft.training.trainer import TrainConfig, Trainer

    snapshot = StepRecording(device) if args.snapshot else None
    trainer = Trainer(
        model,
        None,
        packed(rows, args.max_seq_length),
        config=TrainConfig(
            max_steps=args.warmup + args.steps,
            warmup=0,
            learning_rate=1e-5,
            # a replay allocates in the graph's pool, outside the recorded history: the snapshot's run is eager
            cuda_graph=snapshot is None,
        ),
    )
    if snapshot is None:
        trainer.train(steps=args.warmup)
    else:  # the last warm-up step, recorded
        trainer.train(steps=args.warmup - 1)
        snapshot.start(trainer.model, trainer.optimizer)
        trainer.train(steps=1)
        snapshot.stop()
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    # when each step's event reaches the host (on a GPU during the next step, once its CUDA events completed):
    # the intervals are the steps as the wall clock sees them, host stalls included, without a sync per step
    arrivals: dict[int, float] = {}
    trainer.subscribe(lambda event: arrivals.setdefault(event.step, time.perf_counter()))
    started = time.perf_counter()
    result = trainer.train(steps=args.steps)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    seconds = time.perf_counter() - started
    timed = result.steps[args.warmup :]
    marks = [started] + [arrivals[e.step] for e in timed if e.step in arrivals]
    wall = [b - a for a, b in zip(marks, marks[1:], strict=False)][1:]  # the first holds the pipeline's start
    return dict(
        seconds=seconds,
        tokens=sum(e.tokens for e in timed),
        trained=sum(e.trained_tokens for e in timed),
        padding=sum(e.padding_tokens for e in timed),
        step_seconds=wall if len(wall) >= 2 else [e.step_seconds for e in timed],
        device_step_seconds=[e.step_seconds for e in timed],
        graph=result.cuda_graph,
        attention=result.attention,
        # every step's, the warm-up's included (each `train` call restarts the allocator's peak; a replay's
        # activations live in the graph's pool, which the trainer's events count from the capture)
        peak_bytes=max(e.peak_memory_bytes for e in result.steps),
        **({"live_at_peak": snapshot.live} if snapshot else {}),
    )


def _run_trl(model, rows, args, device):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    dataset = Dataset.from_dict(
        {"input_ids": [ids.tolist() for ids, _ in rows], "labels": [labels.tolist() for _, labels in rows]}
    )
    cuda = device.type == "cuda"
    config = SFTConfig(
        output_dir=args.scratch,
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=1,
        packing=True,
        max_length=args.max_seq_length,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        **trl_run_settings(cuda),
        # TRL's default (on) unless --trl-gradient-checkpointing off; Unsloth checkpoints its own way
        gradient_checkpointing=args.system != "unsloth" and args.trl_gradient_checkpointing == "on",
        gradient_checkpointing_kwargs={"use_reentrant": False},
        optim=TRL_OPTIMIZER if cuda else "adamw_torch",  # every system's optimizer (module docstring)
        seed=3407,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset)
    counts = []
    collate = trainer.data_collator

    def counting(features):
        batch = collate(features)
        counts.append((int(batch["input_ids"].numel()), int((batch["labels"][..., 1:] != -100).sum())))
        return batch

    trainer.data_collator = counting
    from fastft.bench.long_context import StepRecording

    snapshot = StepRecording(device) if args.snapshot else None

    class Snapshot(TrainerCallback):  # the last warm-up step, recorded (before the clock marks its end)
        def on_step_begin(self, train_args, state, control, **kwargs):
            if state.global_step == args.warmup - 1:
                snapshot.start(kwargs.get("model"), kwargs.get("optimizer"))

        def on_step_end(self, train_args, state, control, **kwargs):
            if state.global_step == args.warmup:
                snapshot.stop()

    if snapshot is not None:
        trainer.add_callback(Snapshot())
    clock = step_clock(device)
    trainer.add_callback(clock)
    trainer.train()
    marks = clock.marks
    first, last = args.warmup - 1, args.warmup + args.steps - 1
    timed = counts[args.warmup : args.warmup + args.steps]
    return dict(
        seconds=marks[last] - marks[first],
        tokens=sum(tokens for tokens, _ in timed),
        trained=sum(trained for _, trained in timed),
        padding=0,
        step_seconds=[b - a for a, b in zip(marks[first:last], marks[first + 1 : last + 1], strict=True)],
        **({"live_at_peak": snapshot.live} if snapshot else {}),
    )


def _tile_every_mlp(rows: int, intermediate: int) -> None:
    """This worker's fused MLPs (16-bit compute, `intermediate` columns) run in tiles of at most `rows` rows at
    every length: the tiling rule's two constants, set in this process only (`fastft.kernels.tiling` reads
    them at each call)."""

    tiling.TILE_FROM_BYTES = 0
    tiling.TILE_BYTES = rows * intermediate * 2


def run_worker(args) -> dict:
    import torch

    if args.system == "unsloth":
        import unsloth  # noqa: F401 - first, so it patches transformers and TRL before they load
    torch.manual_seed(0)
    device = torch.device(args.device)
    baseline = args.system in ("unsloth", "hf")
    if baseline and args.baseline_cudnn_attention == "off":
        torch.backends.cuda.enable_cudnn_sdp(False)
    if not baseline:  # this worker's models (read when they are patched and at each call)
        from fastft.bench.common import set_memory_trades

        set_memory_trades(args.adapter_copies, args.dh_slice_mib)
    model = _model(args, device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if args.mlp_tile_rows and not baseline:
        _tile_every_mlp(args.mlp_tile_rows, base.config.intermediate_size)
    rows = chat_rows(
        args.chats,
        base.config.vocab_size,
        args.user_median,
        args.assistant_median,
        args.sigma,
        args.max_seq_length,
        args.seed,
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    run = _run_fastft if args.system == "fastft" else _run_trl
    measured = run(model, rows, args, device)
    steps = measured.pop("step_seconds")
    seconds = measured.pop("seconds")
    peak = measured.pop("peak_bytes", 0)
    if device.type == "cuda":
        peak = max(peak, torch.cuda.max_memory_allocated(device))
    median = statistics.median(steps)
    result = dict(
        system=args.system,
        workload=args.workload,
        tokens_per_s=measured["tokens"] / seconds,
        trained_tokens_per_s=measured["trained"] / seconds,
        step_ms=1000 * median,
        slowest_step_ms=1000 * max(steps),
        slowest_over_median=max(steps) / median,
        peak_gib=peak / 2**30 if device.type == "cuda" else None,
        padding_share=measured["padding"] / (measured["tokens"] + measured["padding"]),
        cudnn_attention=args.baseline_cudnn_attention if baseline else "fastft's choice",
        **{key: value for key, value in measured.items() if key not in ("tokens", "trained", "padding")},
    )
    return result


# ------------------------------------------------------------------------------------------------ driver


def _table(results: list[dict]) -> str:
    from fastft.bench.common import markdown_table

    by_workload = {}
    for result in results:
        by_workload.setdefault(result["workload"], {})[result["system"]] = result
    rows = []
    for workload, systems in by_workload.items():
        for system, result in systems.items():
            if "error" in result:
                rows.append(dict(workload=workload, system=system, note=result["error"][:160]))
                continue
            row = dict(result)
            for baseline in ("unsloth", "hf"):
                other = systems.get(baseline)
                if other and "error" not in other and baseline != system:
                    row[f"vs_{baseline}"] = f"{result['tokens_per_s'] / other['tokens_per_s']:.2f}x"
            graph = result.get("graph")
            row["note"] = f"graph {graph['replays']} replays" if graph else ""
            rows.append(row)
    columns = [
        ("workload", "workload"),
        ("system", "system"),
        ("tokens_per_s", "tokens/s"),
        ("trained_tokens_per_s", "trained tokens/s"),
        ("step_ms", "median step ms"),
        ("slowest_over_median", "slowest / median"),
        ("peak_gib", "peak GiB"),
        ("padding_share", "padding share"),
        ("vs_unsloth", "vs Unsloth"),
        ("vs_hf", "vs HF+PEFT"),
        ("note", "note"),
    ]
    return markdown_table(rows, columns)


def _write(path: str, args, results: list[dict]) -> str:
    from fastft.bench.common import environment

    table = _table(results)
    keys = _DATA_SETTINGS + (
        "model",
        "layers",
        "warmup",
        "steps",
        "baseline_cudnn_attention",
        "trl_gradient_checkpointing",
        "mlp_tile_rows",
        "adapter_copies",
        "dh_slice_mib",
        "snapshot",
    )
    settings = {key: getattr(args, key) for key in keys}
    settings["optimizer"] = OPTIMIZER
    output = {"benchmark": "sft", "settings": settings, "environment": environment(), "results": results}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(output, indent=2) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    return table


_DATA_SETTINGS = ("chats", "user_median", "assistant_median", "sigma", "max_seq_length", "seed")


def main(argv: list[str] | None = None) -> int:
    from fastft.bench.common import add_memory_trade_options, memory_trade_argv

    parser = bench_parser("sft", __doc__, SYSTEMS, "fastft,fastft-trl,hf")
    parser.add_argument(
        "--workloads",
        default="bf16,nf4",
        help="bf16, nf4 (the base's precision; bf16 compute), fp16, nf4-fp16 (fp16 compute: the fastft system only)",
    )
    parser.add_argument("--chats", type=int, default=3000)
    parser.add_argument("--user-median", type=float, default=120.0, help="median tokens of a user turn")
    parser.add_argument("--assistant-median", type=float, default=220.0, help="median tokens of an answer")
    parser.add_argument("--sigma", type=float, default=0.7, help="log-normal sigma of the turn lengths")
    parser.add_argument("--max-seq-length", type=int, default=4096, help="tokens per packed micro-batch")
    parser.add_argument("--seed", type=int, default=0, help="the chats' seed")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--folder", default="/dev/shm/fastft-bench-step", help="the random checkpoints")
    parser.add_argument(
        "--unsloth-path", default=None, help="site folder put first on PYTHONPATH for Unsloth"
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per system and workload")
    parser.add_argument(
        "--baseline-cudnn-attention",
        choices=("on", "off"),
        default="off",
        help="torch's cuDNN attention for unsloth and hf (off: their faster setting on packed rows)",
    )
    parser.add_argument(
        "--trl-gradient-checkpointing",
        choices=("on", "off"),
        default="on",
        help="SFTConfig(gradient_checkpointing=...) for fastft-trl and hf (on: TRL's default)",
    )
    add_memory_trade_options(parser)
    parser.add_argument(
        "--mlp-tile-rows",
        type=int,
        default=0,
        help="experiment: fastft's fused MLP in tiles of this many rows at every length (0: its own rule, "
        "fastft.kernels.tiling: tiles from 256 MiB per [rows, intermediate] tensor)",
    )
    parser.add_argument(
        "--snapshot",
        action="store_true",
        help="record the allocator over the last warm-up step of each system and report the tensors alive at "
        "its peak (CUDA; fastft's trainer then runs eagerly; the timed steps are unaffected)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="benchmarks/sft.json")
    worker_options(parser, "sft")
    args = parse_or_work(parser, argv, run_worker)
    if args is None:
        return 0

    systems = systems_of(parser, args.systems, SYSTEMS)
    workloads = workloads_of(parser, args.workloads, ("bf16", "nf4", "fp16", "nf4-fp16"))
    if args.snapshot and (args.device != "cuda" or args.warmup < 2):
        parser.error("--snapshot records a CUDA allocator: --device cuda and --warmup 2 or more")
    folder = ensure_checkpoint(args)
    results = []
    for workload in workloads:
        for system in systems:
            argv_worker = ["--worker", "--system", system, "--workload", workload, "--folder", str(folder)]
            for key in _DATA_SETTINGS + (
                "warmup",
                "steps",
                "device",
                "baseline_cudnn_attention",
                "trl_gradient_checkpointing",
                "mlp_tile_rows",
            ):
                argv_worker += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
            argv_worker += memory_trade_argv(args)
            argv_worker += ["--snapshot"] if args.snapshot else []
            result = run_system(system, argv_worker, "fastft.bench.sft", args.timeout, args.unsloth_path)
            result.setdefault("workload", workload)
            results.append(result)
            _write(args.out, args, results)  # a later timeout keeps what was measured
            summary = result.get("error") or (
                f"{result['tokens_per_s']:,.0f} tok/s, slowest step {result['slowest_over_median']:.2f}x the "
                f"median, {result['peak_gib'] or 0:.1f} GiB"
            )
            print(f"{workload:>5} {system:>10}: {summary}", file=sys.stderr, flush=True)
            for site in result.get("live_at_peak", {}).get("sites", [])[:10]:
                print(
                    f"      {site['bytes'] / 2**20:9.1f} MiB  {site['tensors']:4d}  {site['site']}",
                    file=sys.stderr,
                )
            for owner, nbytes in result.get("live_at_peak", {}).get("resident_before", {}).items():
                print(f"      {nbytes / 2**20:9.1f} MiB  before the step: {owner}", file=sys.stderr)
    print(_write(args.out, args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`fastft bench sft`: supervised fine-tuning on realistic packed chat data, every system side by side.

The user's workload, not a microbenchmark, on one or more data shapes (`--shapes`, `fastft.bench.chat_shapes`):
``short`` (1 to 3 turns, user turns median 120 tokens, answers 220), ``multi-turn`` (rows of median about 570
tokens, p90 about 1,480) and ``documents`` (2,048 to 4,000 tokens, every token trained): real text from
fastft's docstrings in Llama-3.1's chat template, tokenised with the ``tiny-llama3`` preset's tokenizer,
trained on the answers only, packed best-fit into micro-batches of `--max-seq-length` tokens. Every system
gets the same rows. Random weights of a catalog architecture (`fastft bench step`'s checkpoints), LoRA r=16
on the seven projections (and the experts of an MoE model). Systems:

* ``fastft``      -- `load_model` + `add_lora` + fastft's `Trainer` (what `fastft.train` runs): packed
  micro-batches padded to one shape and replayed as a CUDA graph, offloaded checkpointing.
* ``fastft-trl``  -- the same model under TRL's ``SFTTrainer(packing=True)`` with TRL's defaults: the
  one-import switch from Unsloth (TRL's ``gradient_checkpointing=True`` keeps fastft's offloaded
  checkpointing: `fastft.models.lora.set_gradient_checkpointing` routes the model's switches).
* ``unsloth``     -- ``FastLanguageModel`` + ``get_peft_model(use_gradient_checkpointing="unsloth")`` under
  the same ``SFTTrainer(packing=True)`` (TRL's ``gradient_checkpointing`` off: Unsloth's own is on), at
  matched settings (below).
* ``hf``          -- transformers + PEFT (SDPA, gradient checkpointing) under the same trainer, matched.
* ``unsloth-defaults``, ``hf-defaults`` -- the same two with their own defaults: what a user of the library
  gets. ``SFTConfig`` is given only the workload (steps, one pack of `--max-seq-length` tokens a micro-batch,
  ``packing=True``, bf16, a constant learning rate) and the library picks the rest: the optimizer (Unsloth's
  patched config: bitsandbytes' 8-bit AdamW; TRL's: transformers' default), TRL's gradient checkpointing
  switch, and torch's attention backends as they come (cuDNN attention on). Each result records the optimizer
  and checkpointing its trainer ran with.

Matched settings (``unsloth``, ``hf``; ``settings: "matched"`` in the result): the same optimizer as fastft
and the same packing, pack length and micro-batch, and torch's cuDNN attention off unless
``--baseline-cudnn-attention on``, so SDPA runs FlashAttention-2, the kernel of fastft's varlen attention
(transformers' SDPA path on packed rows takes a mask, so HF + PEFT runs torch's memory-efficient kernel;
without the flash-attn package transformers has no varlen path). On packed rows Unsloth (on torch < 2.12,
without flash-attn or xformers) calls SDPA once per packed segment, and cuDNN builds a plan for every new
segment length; measured on an H200 (torch 2.11), Unsloth + TRL ran 2,996 tokens/s with cuDNN and 4,670
without. So Unsloth's speed depends on the segments per pack: the record gives each shape's row lengths and
packing (``shapes``), and the table fastft's ratio to each baseline per shape and its range over the shapes.

The matched optimizer: AdamW with fp32 states (fastft's `Trainer` runs torch's fused AdamW; the TRL systems
get ``optim="adamw_torch_fused"``, ``"adamw_torch"`` on a CPU). Unsloth's patched ``SFTConfig`` would
otherwise default to bitsandbytes' 8-bit AdamW, whose states take a quarter of the bytes: on Llama-3.1-8B
r=16, 81 MiB against 320, which until 2026-12-06 made Unsloth's recorded peaks 0.23 GiB lower than its run
with fastft's optimizer (`fastft.vram.measure.resident_memory`, the bench's ``--snapshot``).

One process per system family and workload loads the model once and runs each of its systems (matched first)
on each shape in turn (``--process-per-run``: a process per system, workload and shape). After `--warmup`
steps, `--steps` steps are timed (wall clock between ``torch.cuda.synchronize()`` calls); the report gives
real tokens per second (padding slots not counted), trained tokens per second, the median and the slowest
step, and the peak of ``torch.cuda.max_memory_allocated`` (with ``resident_gib_before``, what the process
held when the run began). A step's time is the wall clock: for TRL's trainers between synchronised step
ends, for fastft's between the arrivals of consecutive steps' events on the host (each after its CUDA events
completed), so a host stall counts; fastft's device-side step times are kept beside (``device_step_seconds``).

    fastft bench sft --systems fastft,unsloth,unsloth-defaults,hf-defaults --workloads bf16,nf4 \
        --shapes short,multi-turn,documents --unsloth-path /tmp/site_unsloth
    fastft bench sft --model Qwen/Qwen3-30B-A3B --layers 12 --workloads bf16
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from fastft.bench.baselines import hf_model, step_clock, trl_run_settings, unsloth_model
from fastft.bench.chat_shapes import SHAPES, TOKENIZER_PRESET, parse_shapes, row_stats, shape_rows
from fastft.bench.common import add_memory_trade_options, memory_trade_argv, set_memory_trades
from fastft.bench.harness import (
    bench_parser,
    ensure_checkpoint,
    fastft_model,
    option_argv,
    packed,
    systems_of,
    worker_env,
    worker_options,
    workloads_of,
)
from fastft.bench.sft_report import print_run, write_record
from fastft.kernels import tiling
from fastft.runtime.model_state import base_model

SYSTEMS = ("fastft", "fastft-trl", "unsloth", "unsloth-defaults", "hf", "hf-defaults")
# The systems one worker process runs on one loaded model (matched before own defaults: see the docstring).
FAMILIES = {
    "fastft": "fastft",
    "fastft-trl": "fastft-trl",
    "unsloth": "unsloth",
    "unsloth-defaults": "unsloth",
}
FAMILIES.update({"hf": "hf", "hf-defaults": "hf"})
TEMPLATE_TOKENS = 5  # a turn's header and end tokens (role, separators), trained only on assistant turns' end

# Every system's optimizer (module docstring): TRL's name for it (the record's words: `sft_report.OPTIMIZER`).
TRL_OPTIMIZER = "adamw_torch_fused"


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


def _model(args, family: str, device):
    precision, seq = args.workload.removesuffix("-fp16"), args.max_seq_length
    if args.workload.endswith(
        "fp16"
    ):  # what a T4 computes in: fastft's trainer with its device-side loss scale
        if family != "fastft":
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
    if precision == "fp8" and family not in ("fastft", "fastft-trl"):  # load_in_fp8: fastft's own format
        raise SystemExit("--workloads fp8: FP8 base weights are measured for the fastft systems only")
    if family in ("fastft", "fastft-trl"):
        return fastft_model(args.folder, precision, seq, "auto", device)
    if family == "hf":
        return hf_model(args.folder, precision, False, device)
    return unsloth_model(args.folder, precision, seq)


def _run_fastft(model, rows, args, device):
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
        losses=[e.loss for e in result.steps],  # every step's, the warm-up's included
        optimizer=_optimizer_name(trainer.optimizer),
        attention=result.attention,
        # every step's, the warm-up's included (each `train` call restarts the allocator's peak; a replay's
        # activations live in the graph's pool, which the trainer's events count from the capture)
        peak_bytes=max(e.peak_memory_bytes for e in result.steps),
        **({"live_at_peak": snapshot.live} if snapshot else {}),
    )


def _optimizer_name(optimizer) -> str:
    return type(optimizer).__name__ + (" (fused)" if optimizer.defaults.get("fused") else "")


def _trl_settings(system: str, args, cuda: bool) -> dict:
    """`SFTConfig`'s arguments for `system`: the workload and the harness, the same for every system, and at
    matched settings the optimizer and TRL's checkpointing switch (a ``-defaults`` system leaves both to its
    library)."""
    settings = dict(
        output_dir=args.scratch,
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=1,
        packing=True,
        max_length=args.max_seq_length,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        **trl_run_settings(cuda),
        seed=3407,
    )
    if not system.endswith("-defaults"):
        settings.update(
            # TRL's default (on) unless --trl-gradient-checkpointing off; Unsloth checkpoints its own way
            gradient_checkpointing=system != "unsloth" and args.trl_gradient_checkpointing == "on",
            gradient_checkpointing_kwargs={"use_reentrant": False},
            optim=TRL_OPTIMIZER if cuda else "adamw_torch",  # every system's optimizer (module docstring)
        )
    return settings


def _run_trl(model, rows, args, device, system: str):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    dataset = Dataset.from_dict(
        {"input_ids": [ids.tolist() for ids, _ in rows], "labels": [labels.tolist() for _, labels in rows]}
    )
    cuda = device.type == "cuda"
    config = SFTConfig(**_trl_settings(system, args, cuda))
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset)
    optim = trainer.args.optim
    ran_with = dict(
        optimizer=str(getattr(optim, "value", optim)),
        gradient_checkpointing=trainer.args.gradient_checkpointing,
    )
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
        losses=[log["loss"] for log in trainer.state.log_history if "loss" in log],  # logged every step
        **ran_with,
        **({"live_at_peak": snapshot.live} if snapshot else {}),
    )


def _tile_every_mlp(rows: int, intermediate: int) -> None:
    """This worker's fused MLPs (16-bit compute, `intermediate` columns) run in tiles of at most `rows` rows at
    every length: the tiling rule's two constants, set in this process only (`fastft.kernels.tiling` reads
    them at each call)."""

    tiling.TILE_FROM_BYTES = 0
    tiling.TILE_BYTES = rows * intermediate * 2


def _load_rows(folder: Path, shape: str) -> list:
    """A shape's rows as the driver saved them (`_save_rows`)."""

    with np.load(folder / f"{shape}.npz") as saved:
        ids, labels, offsets = saved["input_ids"], saved["labels"], saved["offsets"]
    return [(ids[a:b], labels[a:b]) for a, b in zip(offsets[:-1], offsets[1:], strict=True)]


def _save_rows(folder: Path, shape: str, rows: list) -> None:

    folder.mkdir(parents=True, exist_ok=True)
    offsets = np.cumsum([0] + [len(ids) for ids, _ in rows])
    np.savez(
        folder / f"{shape}.npz",
        input_ids=np.concatenate([ids for ids, _ in rows]),
        labels=np.concatenate([labels for _, labels in rows]),
        offsets=offsets,
    )


def _settings_label(system: str) -> str:
    if system in ("fastft", "fastft-trl"):
        return "fastft"
    return "own defaults" if system.endswith("-defaults") else "matched"


def run_worker(args):
    """Load one system family's model once and yield a result for each of its systems (`args.system`,
    comma-separated) on each shape (`args.shapes`), the systems in the given order, each over every shape; a
    run that fails yields its error and the next one runs."""

    systems = args.system.split(",")
    family = FAMILIES[systems[0]]
    if family == "unsloth":
        import unsloth  # noqa: F401 - first, so it patches transformers and TRL before they load
    torch.manual_seed(0)
    device = torch.device(args.device)
    baseline = family in ("unsloth", "hf")
    if not baseline:  # this worker's models (read when they are patched and at each call)
        set_memory_trades(args.adapter_copies, args.dh_slice_mib)
    model = _model(args, family, device)
    base = base_model(model)
    if args.mlp_tile_rows and not baseline:
        _tile_every_mlp(args.mlp_tile_rows, base.config.intermediate_size)
    for system in systems:
        for shape in args.shapes.split(","):
            record = dict(
                system=system, workload=args.workload, shape=shape, settings=_settings_label(system)
            )
            try:
                if baseline:  # matched: cuDNN attention as asked; own defaults: torch's default (on)
                    own = system.endswith("-defaults")
                    cudnn = "on" if own else args.baseline_cudnn_attention
                    torch.backends.cuda.enable_cudnn_sdp(cudnn == "on")
                    record["cudnn_attention"] = cudnn
                else:
                    record["cudnn_attention"] = "fastft's choice"
                rows = _load_rows(Path(args.rows), shape)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                    record["resident_gib_before"] = torch.cuda.memory_allocated(device) / 2**30
                if system == "fastft":
                    measured = _run_fastft(model, rows, args, device)
                else:
                    measured = _run_trl(model, rows, args, device, system)
                yield record | _summary(measured, device)
            except Exception as error:  # noqa: BLE001 - reported in the record; the next run goes on
                tail = traceback.format_exc().strip().splitlines()[-3:]
                yield record | {"error": f"{type(error).__name__}: {error}"[:300], "traceback": tail}


def _summary(measured: dict, device) -> dict:
    steps = measured.pop("step_seconds")
    seconds = measured.pop("seconds")
    peak = measured.pop("peak_bytes", 0)
    if device.type == "cuda":
        peak = max(peak, torch.cuda.max_memory_allocated(device))
    median = statistics.median(steps)
    return dict(
        tokens_per_s=measured["tokens"] / seconds,
        trained_tokens_per_s=measured["trained"] / seconds,
        step_ms=1000 * median,
        slowest_step_ms=1000 * max(steps),
        slowest_over_median=max(steps) / median,
        peak_gib=peak / 2**30 if device.type == "cuda" else None,
        padding_share=measured["padding"] / (measured["tokens"] + measured["padding"]),
        **{key: value for key, value in measured.items() if key not in ("tokens", "trained", "padding")},
    )


# ------------------------------------------------------------------------------------------------ driver


def _shape_rows(args, shape: str) -> list:
    """The rows of `shape` for this run: `--chats` chats or `--documents` documents, the turn options over
    a chat shape's own."""

    if SHAPES[shape].kind == "documents":
        rows = shape_rows(shape, args.documents, args.max_seq_length, args.seed)
    else:
        given = {key: getattr(args, key) for key in ("user_median", "assistant_median", "sigma")}
        overrides = {key: value for key, value in given.items() if value is not None}
        rows = shape_rows(shape, args.chats, args.max_seq_length, args.seed, **overrides)
    if not rows:
        raise SystemExit(
            f"--shapes {shape}: --max-seq-length {args.max_seq_length} cuts every chat before its first answer; "
            "give a longer --max-seq-length or a smaller --user-median"
        )
    return rows


def _check_vocabulary(folder: Path, rows_by_shape: dict[str, list]) -> None:
    """The shapes' token ids (the tiny-llama3 tokenizer's) must be rows of the model's embedding."""

    config = json.loads((folder / "config.json").read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    largest = max(int(ids.max()) for rows in rows_by_shape.values() for ids, _ in rows)
    if vocab is not None and largest >= vocab:
        raise SystemExit(
            f"--model {folder.name}: its vocabulary has {vocab} tokens, but the data shapes are tokenised with "
            f"the {TOKENIZER_PRESET} preset's tokenizer (ids up to {largest}): bench a model with a larger "
            f"vocabulary (any catalog model, or --model {TOKENIZER_PRESET})"
        )


def _run_worker_process(argv: list[str], env: dict, timeout: float) -> tuple[list[dict], str]:
    """One worker process's results (a JSON line each; on a timeout, those it finished before it) and what
    stopped it, for the runs it did not report."""

    command = [sys.executable, "-m", "fastft.bench.sft", *argv]
    try:
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, failure = completed.stdout, completed.stderr, f"exit code {completed.returncode}"
    except subprocess.TimeoutExpired as expired:
        stdout, stderr, failure = expired.stdout or "", "", f"timed out after {timeout:.0f} s"
    stdout = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
    results = []
    for line in stdout.splitlines():  # the worker's lines among the trainers' logs
        try:
            result = json.loads(line) if line.startswith("{") else None
        except json.JSONDecodeError:
            continue
        if isinstance(result, dict) and "system" in result and "shape" in result:
            results.append(result)
    if not failure.startswith("timed out"):
        failure = " | ".join((stderr or stdout).strip().splitlines()[-6:]) or failure
    return results, failure


def _data_options(parser: argparse.ArgumentParser) -> None:
    """The options of the workload: precisions, data shapes, their rows and the pack length."""

    parser.add_argument(
        "--workloads",
        default="bf16,nf4",
        help="bf16, nf4, fp8 (the base's precision; bf16 compute; fp8: the fastft systems only), fp16, nf4-fp16 "
        "(fp16 compute: the fastft system only)",
    )
    parser.add_argument(
        "--shapes",
        "--shape",
        default="short",
        help=f"data shapes, comma-separated, each run in turn into one record: {', '.join(SHAPES)} "
        "(fastft.bench.chat_shapes)",
    )
    parser.add_argument("--chats", type=int, default=3000, help="rows of a chat shape")
    parser.add_argument("--documents", type=int, default=500, help="rows of the documents shape")
    parser.add_argument(
        "--user-median",
        type=float,
        default=None,
        help="median tokens of a user turn (None: the chat shape's own)",
    )
    parser.add_argument(
        "--assistant-median",
        type=float,
        default=None,
        help="median tokens of an answer (None: the chat shape's own)",
    )
    parser.add_argument(
        "--sigma",
        type=float,
        default=None,
        help="log-normal sigma of the turn lengths (None: the chat shape's own)",
    )
    parser.add_argument("--max-seq-length", type=int, default=4096, help="tokens per packed micro-batch")
    parser.add_argument("--seed", type=int, default=0, help="the rows' seed")


def _parser() -> argparse.ArgumentParser:
    parser = bench_parser("sft", __doc__, SYSTEMS, "fastft,fastft-trl,hf")
    _data_options(parser)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--folder", default="/dev/shm/fastft-bench-step", help="the random checkpoints")
    parser.add_argument(
        "--unsloth-path", default=None, help="site folder put first on PYTHONPATH for Unsloth"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300,
        help="seconds per system, workload and shape (a process's limit: this times its runs)",
    )
    parser.add_argument(
        "--process-per-run",
        action="store_true",
        help="a process per system, workload and shape (default: one per system family and workload, which "
        "loads the model once)",
    )
    parser.add_argument(
        "--baseline-cudnn-attention",
        choices=("on", "off"),
        default="off",
        help="torch's cuDNN attention for unsloth and hf at matched settings (off: their faster setting on "
        "packed rows; their -defaults runs keep torch's default, on)",
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
    parser.add_argument("--rows", help=argparse.SUPPRESS)
    return parser


def _save_shapes(args, shapes: list[str], folder: Path, rows_folder: Path) -> dict[str, dict]:
    """Each shape's rows made, checked against the model's vocabulary and saved to `rows_folder` for the
    workers; each shape's row and packing statistics (printed as they come)."""

    rows_by_shape = {shape: _shape_rows(args, shape) for shape in shapes}
    _check_vocabulary(folder, rows_by_shape)
    stats = {}
    for shape, rows in rows_by_shape.items():
        _save_rows(rows_folder, shape, rows)
        stats[shape] = {"description": SHAPES[shape].describe(), **row_stats(rows, args.max_seq_length)}
        print(
            f"{shape:>10}: {len(rows):,} rows, median {stats[shape]['row_tokens_median']:,.0f} tokens, p90 "
            f"{stats[shape]['row_tokens_p90']:,.0f}, {stats[shape]['segments_per_pack']:.2f} segments and "
            f"{stats[shape]['tokens_per_pack']:,.0f} tokens per pack",
            file=sys.stderr,
            flush=True,
        )
    return stats


def _jobs(systems: list[str], shapes: list[str], process_per_run: bool) -> list[tuple[list[str], list[str]]]:
    """The worker processes, as (systems, shapes) each: one per system family (matched systems before their
    -defaults), or one per run."""
    families: dict[str, list[str]] = {}
    for system in sorted(systems, key=lambda s: s.endswith("-defaults")):
        families.setdefault(FAMILIES[system], []).append(system)
    if process_per_run:
        return [([system], [shape]) for group in families.values() for system in group for shape in shapes]
    return [(group, shapes) for group in families.values()]


# the driver's options its workers take as they are
_WORKER_OPTIONS = (
    "max_seq_length",
    "warmup",
    "steps",
    "device",
    "baseline_cudnn_attention",
    "trl_gradient_checkpointing",
    "mlp_tile_rows",
    "scratch",
)


def _run_job(
    args, workload: str, group: list[str], shapes: list[str], folder: Path, rows: Path
) -> list[dict]:
    """One worker process's runs of `group` on `shapes`: a result each (printed), a failed run's error in its
    place."""
    argv = ["--worker", "--system", ",".join(group), "--workload", workload]
    argv += ["--shapes", ",".join(shapes), "--folder", str(folder), "--rows", str(rows)]
    argv += option_argv(args, _WORKER_OPTIONS)
    argv += memory_trade_argv(args)
    argv += ["--snapshot"] if args.snapshot else []
    started = time.perf_counter()
    env = worker_env(FAMILIES[group[0]], args.unsloth_path)
    reported, failure = _run_worker_process(argv, env, args.timeout * len(group) * len(shapes))
    wall = time.perf_counter() - started
    by_run = {(r.get("system"), r.get("shape")): r for r in reported}
    results = []
    for system in group:
        for shape in shapes:
            result = by_run.get((system, shape)) or dict(
                system=system, shape=shape, settings=_settings_label(system), error=failure
            )
            result.setdefault("workload", workload)
            result["process_wall_s"] = wall
            results.append(result)
            print_run(result)
    return results


def main(argv: list[str] | None = None) -> int:

    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        for result in run_worker(args):
            print(json.dumps(result), flush=True)
        return 0
    systems = systems_of(parser, args.systems, SYSTEMS)
    workloads = workloads_of(parser, args.workloads, ("bf16", "nf4", "fp16", "nf4-fp16", "fp8"))
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as error:
        parser.error(str(error))
    args.shapes = ",".join(shapes)
    if args.snapshot and (args.device != "cuda" or args.warmup < 2):
        parser.error("--snapshot records a CUDA allocator: --device cuda and --warmup 2 or more")
    folder = ensure_checkpoint(args)
    rows_folder = Path(args.scratch) / "rows"
    stats = _save_shapes(args, shapes, folder, rows_folder)
    results = []
    for workload in workloads:
        for group, job_shapes in _jobs(systems, shapes, args.process_per_run):
            results += _run_job(args, workload, group, job_shapes, folder, rows_folder)
            write_record(args.out, args, stats, results)  # a later timeout keeps what was measured
    print(write_record(args.out, args, stats, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

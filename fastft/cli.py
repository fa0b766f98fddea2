"""The `fastft` command line: ``fastft demo`` runs the whole path offline; ``fastft models`` lists
what can be loaded; ``fastft estimate MODEL`` sizes a run; ``fastft bench NAME`` reproduces a benchmark; ``fastft export RUN_DIR
--gguf q8_0`` writes a checked GGUF file and an Ollama Modelfile; ``fastft launch --gpus N script.py`` runs a
training script on N GPUs through torchrun.

Building the parser imports only plain-Python modules (the demo's settings, the checkpointing modes, the
benchmark names); torch, transformers, datasets and plotly are imported inside the command that needs them,
so ``--help`` and ``--version`` answer at once (`tests/faces/test_cli.py` checks which modules load)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import typing
from dataclasses import fields
from pathlib import Path

# Function-local imports: the CLI's parser and light commands read this module without torch or transformers
# (tests/faces/test_cli.py); tests replace these names on their modules, so they are looked up when called.
import fastft.weight_formats as weight_formats
from fastft import __version__
from fastft.bench import BENCHMARKS
from fastft.models.catalog import find_model
from fastft.models.errors import ModelLoadError
from fastft.models.presets import PRESETS
from fastft.runtime.activation_checkpointing import KINDS as CHECKPOINTING_KINDS
from fastft.training.demo_config import GRPO_SFT_STEPS, SFT_STEPS, DemoConfig
from fastft.vram.inventory import inventory_of


class _DefaultsOnceFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: …)" to an option's help unless the help already says its default in words
    ("default: seq-len"), and never for a default of None (which only means "decided later")."""

    def _get_help_string(self, action) -> str:
        help_text = action.help or ""
        if "(default" in help_text or action.default is None:
            return help_text
        return super()._get_help_string(action)


def _demo_parser(sub) -> None:
    help_text = {
        "model": "embedded preset, local folder or hub id to fine-tune",
        "dataset": "training data: bundled:NAME, a .jsonl/.json/.csv/.parquet file or a hub id",
        "eval_dataset": "held-out data for eval loss, content accuracy and format compliance",
        "max_seq_length": "tokens per packed bin (longer rows are truncated)",
        "steps": f"SFT optimizer steps (default: {SFT_STEPS}; with --method grpo {GRPO_SFT_STEPS}, a short start "
        "that GRPO goes on from)",
        "learning_rate": "peak learning rate (linear warmup, cosine decay)",
        "lora_r": "LoRA rank",
        "lora_alpha": "LoRA alpha (scale = alpha / r)",
        "gradient_checkpointing": "activation checkpointing: none (the tiny preset's activations are small; "
        "recomputing them costs time), recompute, offload or auto",
        "micro_batch_bins": "packed bins concatenated into each forward pass",
        "eval_every": "steps between eval-loss measurements",
        "eval_samples": "held-out questions answered before and after training",
        "seed": "seed for LoRA init, data order and dropout",
        "output_dir": "folder that receives runs/<name>/",
        "name": "run name (default: demo-<date>-<time>)",
        "device": "cpu or cuda (default: cuda when available)",
        "progress": "show the progress bar (--no-progress to hide)",
        "dpo_steps": "optimizer steps of --method dpo",
        "method": "sft; dpo: pairs from the skills data (the bare right answer over a wordy or wrong one); "
        f"grpo: a short SFT run ({GRPO_SFT_STEPS} steps), then GRPO with the exact-match reward from its result",
        "grpo_steps": "GRPO steps (rollouts) after SFT (--method grpo)",
        "grpo_learning_rate": "GRPO's peak learning rate (--method grpo)",
        "grpo_prompts_per_step": "prompts per GRPO step (--method grpo)",
        "grpo_generations": "completions sampled per prompt, the group (--method grpo)",
        "grpo_max_new_tokens": "longest GRPO completion in tokens (--method grpo)",
        "grpo_temperature": "GRPO sampling temperature (--method grpo)",
    }
    parser = sub.add_parser(
        "demo",
        help="fine-tune the embedded tiny-llama on the bundled skills data and write an HTML report",
        description="Load a model, add LoRA, pack the bundled data, measure accuracy, train, measure "
        "again, save the adapter and write runs/<name>/report.html. Offline; about 40 s of training on a quiet 2-core CPU (the README has the measured times).",
        formatter_class=_DefaultsOnceFormatter,
    )
    defaults = DemoConfig()
    kinds = typing.get_type_hints(DemoConfig)
    for f in fields(DemoConfig):
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is None else getattr(defaults, f.name)  # None: the config picks (steps)
        if f.name == "progress":
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=True, help=help_text[f.name]
            )
        elif f.name == "name":
            parser.add_argument(flag, default=None, help=help_text[f.name])
        else:
            # --lora-alpha 16.5 is a float; --steps (int | None: None picks the method's) an int
            kind = {int: int, float: float, int | None: int}.get(kinds[f.name], str)
            parser.add_argument(flag, type=kind, default=default, help=help_text[f.name])


def _run_demo(args) -> int:
    from fastft.demo import DemoConfig, run_demo
    from fastft.runtime.process_clock import process_started_at

    values = {f.name: getattr(args, f.name) for f in fields(DemoConfig)}
    if values["name"] is None:
        values.pop("name")
    # the time it prints covers the whole command, imports included, from the process's start
    result = run_demo(
        DemoConfig(**values),
        log=lambda message: print(message, file=sys.stderr),
        started_at=process_started_at(),
    )
    print(result.text())
    return 0


def _models_parser(sub) -> None:
    parser = sub.add_parser("models", help="list embedded presets and the catalog of real architectures")
    parser.add_argument("query", nargs="?", default="", help="filter catalog entries by name or family")


def _run_models(args) -> int:
    print("Embedded presets (no download):")
    for preset in PRESETS.values():
        print(f"  {preset.name:<14} {preset.description}")
    print("\nCatalog (shapes as data; load by hub id when online):")
    for spec in find_model(args.query):
        size = spec.parameter_count() / 1e9
        active = f", {spec.active_parameter_count() / 1e9:.1f}B active" if spec.is_moe else ""
        print(f"  {spec.hub_id:<45} {size:6.1f}B{active}")
    return 0


def _bench_parser(sub) -> None:
    parser = sub.add_parser(
        "bench",
        help="benchmarks: fastft beside its baselines in one process (see BENCHMARKS.md)",
        description="Run a benchmark; `fastft bench NAME --help` lists its options.",
    )
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark")


def _run_bench(args) -> int:
    return importlib.import_module(BENCHMARKS[args.name]).main(args.options)


def _launch_parser(sub) -> None:
    parser = sub.add_parser(
        "launch",
        help="run a training script on several GPUs (or CPU processes) through torchrun",
        description="A thin wrapper over torchrun on one machine (`--nnodes=1 --nproc_per_node=N`), where "
        "nothing listens beyond 127.0.0.1 (its rendezvous store, gloo and NCCL on the loopback): fastft.train "
        "inside the script trains one run across the processes (DDP, or FSDP2 with distributed='fsdp'); NCCL "
        "on GPUs, gloo on the CPU. Several machines: use torchrun --nnodes itself, which opens ports to the "
        "network.",
        formatter_class=_DefaultsOnceFormatter,
    )
    parser.add_argument(
        "--gpus",
        "--nproc",
        dest="gpus",
        type=int,
        default=1,
        help="processes, one per GPU (on a CPU: processes)",
    )
    parser.add_argument("script", help="the Python script every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments, passed on unchanged")


def _run_launch(args) -> int:
    from fastft.launch import launch

    return launch(args.script, args.script_args, args.gpus)


def _estimate_parser(sub) -> None:

    parser = sub.add_parser(
        "estimate",
        help="estimate the GPU memory of LoRA/QLoRA training: breakdown, verdict, longest context",
        description="Estimate the VRAM of training MODEL with LoRA (no download for presets and catalog "
        "models; other hub ids read only their config.json) and judge it against a GPU.",
        formatter_class=_DefaultsOnceFormatter,
    )
    parser.add_argument("model", help="embedded preset, catalog hub id, local folder or hub id")
    parser.add_argument("--seq-len", type=int, default=2048, help="longest sequence (packed bin), in tokens")
    parser.add_argument(
        "--batch-tokens", type=int, default=None, help="tokens per micro-batch (default: seq-len)"
    )
    parser.add_argument(
        "--precision",
        default="bf16",
        choices=["bf16", "fp16", "fp32", *weight_formats.quantized_names()],
        help="base weights: 16/32-bit or a quantised format: "
        + ", ".join(f"{record.name} ({record.label})" for record in weight_formats.quantized()),
    )
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    parser.add_argument("--targets", nargs="*", default=None, help="LoRA targets (default: all-linear)")
    parser.add_argument(
        "--checkpointing",
        default="auto",
        choices=CHECKPOINTING_KINDS,
        help="how layers keep activations; auto = offload, what add_lora('auto') runs on a GPU",
    )
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "adamw_8bit", "sgd"],
        help="optimizer of the adapters",
    )
    parser.add_argument(
        "--unfused", action="store_true", help="transformers + peft modules instead of fastft's fused kernels"
    )
    parser.add_argument("--gpu", default="auto", help="GPU preset (rtx4090, a100-80gb, h100, …) or auto")
    parser.add_argument(
        "--host-memory",
        type=_host_gib,
        default="auto",
        help="GiB of host memory offloading may pin (auto: 75%% of what this machine has available; "
        "none: unchecked); an offload that does not fit it is estimated as the recompute it becomes",
    )
    parser.add_argument(
        "--world-size", type=int, default=1, help="GPUs of a torchrun run: the estimate is per GPU"
    )
    parser.add_argument(
        "--sharding",
        default="ddp",
        choices=["ddp", "fsdp"],
        help="with --world-size: ddp (the whole model on each GPU) or fsdp (FSDP2 splits the 16-bit base)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the Python code a folder or hub id ships (auto_map in its config.json) to read its config; "
        "only for code you have read and trust (without it such a model is refused, never asked about)",
    )
    parser.add_argument("--max-context", action="store_true", help="also print the longest seq-len that fits")
    parser.add_argument("--json", action="store_true", help="print the estimate as JSON instead of a table")


def _host_gib(text: str) -> int | str | None:
    """--host-memory: "auto", "none", or GiB (a number) as bytes."""
    if text.strip().lower() in ("auto", "none"):
        return None if text.strip().lower() == "none" else "auto"
    try:
        gib = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give GiB (e.g. 64), auto or none") from None
    if gib < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: host memory cannot be negative")
    return int(gib * 2**30)


def _run_estimate(args) -> int:
    from fastft.vram import GPUS, VramEstimateError, estimate_vram, fits, max_context

    settings = dict(
        batch_tokens=args.batch_tokens,
        precision=args.precision,
        lora_r=args.lora_r,
        targets=args.targets or "all-linear",
        checkpointing=args.checkpointing,
        optimizer=args.optimizer,
        fused=not args.unfused,
        host_memory=args.host_memory,
        world_size=args.world_size,
        sharding=args.sharding,
    )
    try:
        model = inventory_of(args.model, trust_remote_code=args.trust_remote_code)
        estimate = estimate_vram(model, args.seq_len, gpu=args.gpu, **settings)
        gpu = estimate.gpu
        verdict = fits(model, args.seq_len, gpu=gpu, **settings) if gpu is not None else None
        longest = None
        if args.max_context and gpu is not None:
            longest = max_context(model, gpu, **{k: v for k, v in settings.items() if k != "batch_tokens"})
    except (ModelLoadError, VramEstimateError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**estimate.to_dict(), "max_context": longest}, indent=2, default=str))
        return 0
    print(estimate.table())
    print()
    if verdict is None:
        print(f"No GPU visible: pass --gpu with one of {', '.join(GPUS)} to judge the fit.")
    else:
        print(verdict.message)
    if args.max_context:
        if longest is None:
            print("Longest context: pass --gpu to compute it.")
        else:
            print(f"Longest context on {gpu}: {longest:,} tokens" if longest else f"Nothing fits {gpu}.")
    return 0


def _export_parser(sub) -> None:
    parser = sub.add_parser(
        "export",
        help="export a run's trained model as a checked GGUF file plus an Ollama Modelfile",
        description="Merge RUN_DIR's adapter into its base, write it as GGUF (quantised as asked) with an Ollama "
        "Modelfile, read the file back and check it answers like the merged model. RUN_DIR is a run folder "
        "(its adapter/ or newest checkpoint) or an adapter folder.",
        formatter_class=_DefaultsOnceFormatter,
    )
    parser.add_argument("run_dir", help="run folder (runs/NAME) or adapter folder")
    parser.add_argument(
        "--gguf",
        default="q8_0",
        metavar="QUANT",
        help="f16, bf16, q8_0, q4_0 (written by fastft) or a K-quant such as q4_k_m (needs llama-quantize)",
    )
    parser.add_argument("--out", default=None, help="output folder (default: RUN_DIR/gguf-QUANT)")
    parser.add_argument("--prompts", type=int, default=8, help="held-out questions the check compares")
    parser.add_argument("--no-check", action="store_true", help="skip the read-back check (not recommended)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an output folder fastft did not write"
    )


def _run_export(args) -> int:
    from fastft.export import GGUFCheckError, save_ollama
    from fastft.export.check import default_prompts
    from fastft.models.loading import load_model

    if args.prompts < 1 and not args.no_check:
        raise ValueError(
            f"--prompts {args.prompts}: the check would compare nothing and pass having checked nothing. "
            "Give at least 1 (default 8), or skip the check by name with --no-check."
        )
    run_dir = Path(args.run_dir).expanduser()
    adapter = _adapter_folder(run_dir)
    out = Path(args.out) if args.out else run_dir / f"gguf-{args.gguf.lower()}"
    print(f"loading {adapter}", file=sys.stderr)
    model, tokenizer = load_model(str(adapter))

    def progress(stage: str, done: int, total: int) -> None:
        if stage == "write" and (done == total or done % 20 == 0):
            print(f"  wrote {done}/{total} tensors", file=sys.stderr)

    try:
        result = save_ollama(
            model,
            out,
            tokenizer,
            args.gguf,
            check=not args.no_check,
            prompts=default_prompts(args.prompts),
            overwrite=args.overwrite,
            progress=progress,
        )
    except GGUFCheckError as error:
        print(error.check.table(), file=sys.stderr)
        print(f"error: the exported file failed its check and was not kept: {error}", file=sys.stderr)
        return 1
    if result.check is not None:
        print(result.check.table())
    print(f"\nwrote {result.path} and {result.modelfile}")
    print(f"Ollama: ollama create NAME -f {result.modelfile}")
    return 0


def _adapter_folder(run_dir):
    """The adapter a run folder holds: RUN_DIR itself, RUN_DIR/adapter, or its newest checkpoint."""
    if (run_dir / "adapter_config.json").is_file():
        return run_dir
    if (run_dir / "adapter" / "adapter_config.json").is_file():
        return run_dir / "adapter"
    checkpoints = sorted(
        (p for p in (run_dir / "checkpoints").glob("checkpoint-*") if (p / "adapter_config.json").is_file()),
        key=lambda p: int(p.name.rpartition("-")[2]) if p.name.rpartition("-")[2].isdigit() else -1,
    )
    if checkpoints:
        return checkpoints[-1]
    raise ValueError(
        f"{run_dir} holds no adapter (adapter_config.json, adapter/ or checkpoints/checkpoint-N/): give a run "
        "folder written by fastft train / fastft demo, or an adapter folder (fastft.save_adapter)."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastft", description="Fast, exact LoRA/QLoRA fine-tuning from a notebook or the shell."
    )
    parser.add_argument("--version", action="version", version=f"fastft {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _demo_parser(sub)
    _models_parser(sub)
    _estimate_parser(sub)
    _bench_parser(sub)
    _export_parser(sub)
    _launch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    run = {
        "demo": _run_demo,
        "models": _run_models,
        "estimate": _run_estimate,
        "bench": _run_bench,
        "export": _run_export,
        "launch": _run_launch,
    }[args.command]
    try:
        return run(args)
    except user_errors() as error:  # the error and its fix, without a traceback (FASTFT_TRACEBACK=1 shows it)
        if os.environ.get("FASTFT_TRACEBACK"):
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors whose message names the value and the fix: bad settings, data, paths, checkpoints, a run
    stopped by the NaN guard, a full disk."""
    from fastft.training.checkpoint import CheckpointError
    from fastft.training.trainer import NonFiniteLossError

    return (ValueError, OSError, CheckpointError, NonFiniteLossError)


if __name__ == "__main__":
    sys.exit(main())

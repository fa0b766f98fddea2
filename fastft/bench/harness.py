"""The public harness of the bench workers: fastft's model as every bench builds it, the random-weight
checkpoint they share, packed rows, and running a worker in its own process. The competitors' models
(transformers + PEFT, Liger, Unsloth) are in `fastft.bench.baselines`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from fastft.models.presets import PRESETS, load_preset_tokenizer

# Function-local imports: transformers, peft, TRL and the engine load where used: a bench's Unsloth worker imports
# this module and must import unsloth before them (torch may come first; tests/tools/test_bench.py checks it); tests
# replace these names on their modules, so they are looked up when called.

# LoRA targets of every system: the 7 linears ("attention": the first 4); MoE experts as PEFT parameters
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION_TARGETS = TARGETS[:4]
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]  # PEFT target_parameters on MoE models


def fastft_model(
    folder: str,
    precision: str,
    seq: int,
    attention: str,
    device,
    checkpointing="auto",
    lora_targets="all",
    keep_attention="auto",
    dtype=None,
):
    """fastft from `folder`: `load_model`, `add_lora` r=16 on `lora_targets` (fused kernels), packed attention
    `attention`, the offload's `keep_attention` ("on"/"off"; "auto" leaves it)."""
    from fastft.models.loading import load_model
    from fastft.models.lora import add_lora, linear_layer_names
    from fastft.runtime.attention import patch_packed_attention
    from fastft.runtime.offload import enable_offload, offloader_of

    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, _ = load_model(
        folder,
        max_seq_length=seq,
        load_in_4bit=precision == "nf4",
        load_in_fp8=precision == "fp8",
        device=device,
        dtype=dtype,
    )
    available = linear_layer_names(model)
    wanted = ATTENTION_TARGETS if lora_targets == "attention" else [*TARGETS, "experts"]
    targets = [name for name in wanted if name in available]  # dense: the 7 linears; MoE: + "experts"
    model = add_lora(model, r=16, alpha=16, target_modules=targets, gradient_checkpointing=checkpointing)
    patch_packed_attention(model, attention)
    offloader = offloader_of(model)
    if offloader is not None and keep_attention != "auto":
        enable_offload(model, double_buffer=offloader.double_buffer, keep_attention=keep_attention == "on")
    return model


def packed(rows, max_length: int):
    """(input ids, labels) rows packed best-fit into bins of `max_length`."""
    from fastft.data.packing import PackedDataset, best_fit_decreasing
    from fastft.data.tokenize import TokenizedData

    data = TokenizedData(
        input_ids=[ids for ids, _ in rows],
        labels=[labels for _, labels in rows],
        source_rows=list(range(len(rows))),
    )
    return PackedDataset(data, best_fit_decreasing(data.lengths, max_length), max_length)


def checkpoint_folder(root: Path, model_id: str, layers: int | None) -> Path:
    """Where the random checkpoint of `model_id` (cut to `layers`) lives under `root`: one sub-folder per
    architecture and cut, so a later run for another model never loads an earlier run's weights."""
    return root / f"{model_id.replace('/', '--')}-{layers or 'all'}-layers"


def save_random_checkpoint(model_id: str, folder: Path, layers: int | None = None) -> None:
    """The catalog architecture (cut to its first `layers` decoder layers if given) with random bf16
    weights, saved with a tokenizer (for Unsloth) to `folder`."""
    from fastft.models.random_model import random_model

    torch.manual_seed(0)
    cut = {"num_hidden_layers": layers} if layers else {}  # a per-layer layer_types list follows the cut
    model = random_model(model_id, torch.device("cuda"), torch.bfloat16, **cut)
    with torch.no_grad():  # transformers' default init gives std 0.02: keep it, but make norms 1
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.fill_(1.0)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = load_preset_tokenizer()
    tokenizer.save_pretrained(folder)


def ensure_checkpoint(args) -> Path:
    """The random checkpoint of ``args.model`` (cut to ``args.layers``) under ``args.folder``, saved first if
    missing (a preset as it loads: the CPU smoke tests)."""
    from fastft.models.loading import load_model

    folder = checkpoint_folder(Path(args.folder), args.model, args.layers)
    if (folder / "config.json").exists():
        return folder
    print(f"saving a random-weight {args.model} to {folder} ...", file=sys.stderr, flush=True)
    if args.model in PRESETS:  # a tiny preset: the CPU smoke test of this benchmark
        model, tokenizer = load_model(args.model)
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    else:
        save_random_checkpoint(args.model, folder, args.layers)
        torch.cuda.empty_cache()
    return folder


def worker_env(system: str, unsloth_path: str | None) -> dict:
    """A worker's environment: offline, and for Unsloth its site folder first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if system == "unsloth":
        env["UNSLOTH_DISABLE_STATISTICS"] = "1"
        if unsloth_path:
            env["PYTHONPATH"] = unsloth_path + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_in_process(argv: list[str], env: dict, timeout: float, module: str) -> dict:
    """Run a benchmark's worker (`module` with `argv`) in its own process; its last JSON line, or the error."""
    return run_command([sys.executable, "-m", module, *argv], env, timeout)


def run_command(command: list[str], env: dict, timeout: float) -> dict:
    """Run a worker `command` in its own process; its last JSON line, or the error (its output's tail)."""
    try:
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(completed.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (completed.stderr or completed.stdout).strip().splitlines()[-6:]
    return {"error": " | ".join(tail) or f"exit code {completed.returncode}"}


def bench_parser(
    bench: str, doc: str, systems: tuple[str, ...], default_systems: str
) -> argparse.ArgumentParser:
    """A bench driver's parser with the options every one of them has: the model, its layer cut, the systems."""
    parser = argparse.ArgumentParser(
        prog=f"fastft bench {bench}",
        description=doc.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", default="meta-llama/Llama-3.1-8B-Instruct", help="catalog architecture or preset"
    )
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    parser.add_argument(
        "--systems", default=default_systems, help=f"comma-separated, from {','.join(systems)}"
    )
    return parser


def report_parser(bench: str, doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The parser of a bench that runs in this process and prints a report: its module docstring `doc` as the
    description, as written."""
    return argparse.ArgumentParser(
        prog=prog or f"fastft bench {bench}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def save_record(path: str | Path, record: dict, table: str) -> None:
    """A bench's `record` as JSON at `path` and its `table` beside it as markdown (``.md``), folders made."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    out.with_suffix(".md").write_text(table + "\n", encoding="utf-8")


def option_argv(args: argparse.Namespace, keys) -> list[str]:
    """The driver's options `keys` (``args``' attribute names) as its worker process takes them."""
    argv = []
    for key in keys:
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    return argv


def worker_options(parser: argparse.ArgumentParser, bench: str, workload: bool = True) -> None:
    """The hidden options a bench's driver passes to its worker process (``fastft.bench.<bench>``)."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    if workload:
        parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", default=f"/tmp/fastft-bench-{bench}", help=argparse.SUPPRESS)


def parse_or_work(
    parser: argparse.ArgumentParser, argv: list[str] | None, run_worker
) -> argparse.Namespace | None:
    """The driver's options; in a worker process (``--worker``) None, after printing ``run_worker(args)`` as the
    JSON line the driver reads (`run_in_process`)."""
    args = parser.parse_args(argv)
    if not args.worker:
        return args
    print(json.dumps(run_worker(args)), flush=True)
    return None


def workloads_of(parser: argparse.ArgumentParser, text: str, known: tuple[str, ...]) -> list[str]:
    """The comma-separated workloads of `text`; an unknown one is a usage error naming the known ones."""
    workloads = [w.strip() for w in text.split(",") if w.strip()]
    if any(w not in known for w in workloads):
        parser.error(f"--workloads {text}: from {', '.join(known)}")
    return workloads


def systems_of(parser: argparse.ArgumentParser, text: str, known: tuple[str, ...]) -> list[str]:
    """The comma-separated systems of `text`; an unknown one is a usage error naming the known ones."""
    systems = [s.strip() for s in text.split(",") if s.strip()]
    if unknown := [s for s in systems if s not in known]:
        parser.error(f"unknown systems {unknown}; choose from {known}")
    return systems


def run_system(
    system: str, argv: list[str], module: str, timeout: float, unsloth_path: str | None = None
) -> dict:
    """`system`'s worker of bench `module` run in its own process (`run_in_process`): its result, with the
    system's name and the wall time (``wall_s``)."""
    started = time.perf_counter()
    result = run_in_process(argv, worker_env(system, unsloth_path), timeout, module)
    result.setdefault("system", system)
    result["wall_s"] = time.perf_counter() - started
    return result

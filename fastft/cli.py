"""The `fastft` command line: ``fastft demo`` runs the whole path offline; ``fastft models`` lists
what can be loaded; ``fastft bench NAME`` reproduces a benchmark. Heavy imports happen inside each
command, so ``--help`` answers at once."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields


def _demo_parser(sub) -> None:
    from fastft.demo import DemoConfig

    help_text = {
        "model": "embedded preset, local folder or hub id to fine-tune",
        "dataset": "training data: bundled:NAME, a .jsonl/.json/.csv/.parquet file or a hub id",
        "eval_dataset": "held-out data for eval loss and answer accuracy",
        "max_seq_length": "tokens per packed bin (longer rows are truncated)",
        "steps": "optimizer steps",
        "learning_rate": "peak learning rate (linear warmup, cosine decay)",
        "lora_r": "LoRA rank",
        "lora_alpha": "LoRA alpha (scale = alpha / r)",
        "micro_batch_bins": "packed bins concatenated into each forward pass",
        "eval_every": "steps between eval-loss measurements",
        "eval_samples": "held-out questions answered before and after training",
        "seed": "seed for LoRA init, data order and dropout",
        "output_dir": "folder that receives runs/<name>/",
        "name": "run name (default: demo-<date>-<time>)",
        "device": "cpu or cuda (default: cuda when available)",
        "progress": "show the progress bar (--no-progress to hide)",
    }
    parser = sub.add_parser(
        "demo",
        help="fine-tune the embedded tiny-llama on the bundled skills data and write an HTML report",
        description="Load a model, add LoRA, pack the bundled data, measure accuracy, train, measure "
        "again, save the adapter and write runs/<name>/report.html. Offline; about a minute on a CPU.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = DemoConfig(name="demo-<date>-<time>")
    for f in fields(DemoConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if f.name == "progress":
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=True, help=help_text[f.name]
            )
        elif f.name == "name":
            parser.add_argument(flag, default=None, help=help_text[f.name])
        else:
            kind = type(default) if default is not None else str
            parser.add_argument(flag, type=kind, default=default, help=help_text[f.name])


def _run_demo(args) -> int:
    from fastft.demo import DemoConfig, run_demo

    values = {f.name: getattr(args, f.name) for f in fields(DemoConfig)}
    if values["name"] is None:
        values.pop("name")
    result = run_demo(DemoConfig(**values), log=lambda message: print(message, file=sys.stderr))
    print(result.text())
    return 0


def _models_parser(sub) -> None:
    parser = sub.add_parser("models", help="list embedded presets and the catalog of real architectures")
    parser.add_argument("query", nargs="?", default="", help="filter catalog entries by name or family")


def _run_models(args) -> int:
    from fastft.models.catalog import find_model
    from fastft.models.presets import PRESETS

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
    from fastft.bench import BENCHMARKS

    parser = sub.add_parser(
        "bench",
        help="benchmarks: fastft beside its baselines in one process (see BENCHMARKS.md)",
        description="Run a benchmark; `fastft bench NAME --help` lists its options.",
    )
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark")


def _run_bench(args) -> int:
    import importlib

    from fastft.bench import BENCHMARKS

    return importlib.import_module(BENCHMARKS[args.name]).main(args.options)


def build_parser() -> argparse.ArgumentParser:
    from fastft import __version__

    parser = argparse.ArgumentParser(
        prog="fastft", description="Fast, exact LoRA/QLoRA fine-tuning from a notebook or the shell."
    )
    parser.add_argument("--version", action="version", version=f"fastft {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _demo_parser(sub)
    _models_parser(sub)
    _bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return {"demo": _run_demo, "models": _run_models, "bench": _run_bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

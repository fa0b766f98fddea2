"""Peak host memory of a GGUF export: a random-weight model of a catalog architecture (by default
Llama-3.1-8B) written by `fastft.export.write_gguf`, which streams tensor by tensor.

The model is built on the meta device, given storage once (``to_empty``) and filled in place parameter by
parameter, so the process holds one copy of the weights before the export starts. The peak resident set
is then reset (Linux ``/proc/self/clear_refs``) and read again after the export (``VmHWM``): the export's
extra memory is that peak minus the resident set before it. Streaming means the extra stays near one
tensor in fp32 plus its encoding (the largest is the embedding or the output head), far below a second
copy of the model. The tokenizer is the presets' (padded to the model's vocabulary; its size does not
change the weights' memory). No check runs (it would build the merged model a second time, by design).

    python -m fastft.bench.export_rss --out export_rss.json                 # Llama-3.1-8B, bf16
    python -m fastft.bench.export_rss --layers 2 --hidden 512 --intermediate 1024 --vocab 8192 --out small.json
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch

from fastft.bench.harness import report_parser
from fastft.export.writer import write_gguf
from fastft.models.catalog import get_spec
from fastft.models.presets import load_preset_tokenizer
from fastft.models.random_model import random_model as build


def _status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # resets VmHWM to the current resident set
        return True
    except OSError:
        return False


def random_model(hub_id: str, dtype: torch.dtype, seed: int = 0, **shape):
    """The catalog architecture with random weights, one copy (`fastft.models.random_model.random_model` with a
    seed). `shape` overrides config fields (num_hidden_layers, hidden_size, …) for a smaller run."""

    config = {key: value for key, value in shape.items() if value is not None}
    return build(get_spec(hub_id).hub_id, "cpu", dtype, seed=seed, **config).eval()


def run(hub_id: str, quantization: str, folder: Path, **shape) -> dict:
    started = time.perf_counter()
    model = random_model(hub_id, torch.bfloat16, **shape)
    built = time.perf_counter() - started
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters()) * 4
    tokenizer = load_preset_tokenizer()
    before = _status("VmRSS")
    reset = _reset_peak()
    path = folder / "model.gguf"
    started = time.perf_counter()
    written = write_gguf(model, path, tokenizer, quantization)
    seconds = time.perf_counter() - started
    peak = _status("VmHWM")
    extra = peak - before
    result = {
        "model": hub_id,
        "layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        "vocab_size": model.config.vocab_size,
        "quantization": quantization,
        "weights_bytes": weights,
        "largest_tensor_fp32_bytes": largest,
        "rss_before_export_bytes": before,
        "peak_rss_during_export_bytes": peak if reset else None,
        "export_extra_bytes": extra if reset else None,
        "export_extra_over_weights": round(extra / weights, 4) if reset else None,
        "file_bytes": path.stat().st_size,
        "tensors": written.tensors,
        "build_seconds": round(built, 1),
        "export_seconds": round(seconds, 1),
        "peak_reset": reset,
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = report_parser("export_rss", __doc__, prog="python -m fastft.bench.export_rss")
    parser.add_argument(
        "--model", default="meta-llama/Llama-3.1-8B-Instruct", help="catalog hub id (random weights)"
    )
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers (a quick run)")
    parser.add_argument("--hidden", type=int, default=None, help="another hidden size (a quick run)")
    parser.add_argument("--intermediate", type=int, default=None, help="another MLP size (a quick run)")
    parser.add_argument("--vocab", type=int, default=None, help="another vocabulary size (a quick run)")
    parser.add_argument("--quantization", default="bf16", help="bf16, f16, q8_0 or q4_0")
    parser.add_argument(
        "--dir", default=None, help="where the GGUF file goes (default: a temporary folder, removed)"
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    args = parser.parse_args(argv)
    shape = dict(
        num_hidden_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        vocab_size=args.vocab,
    )
    if args.dir:
        folder = Path(args.dir)
        folder.mkdir(parents=True, exist_ok=True)
        result = run(args.model, args.quantization, folder, **shape)
    else:
        with tempfile.TemporaryDirectory(prefix="fastft-export-rss-") as tmp:
            result = run(args.model, args.quantization, Path(tmp), **shape)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

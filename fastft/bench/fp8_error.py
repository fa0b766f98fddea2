"""`fastft bench fp8-error`: each frozen projection's FP8 GEMMs against its bf16 GEMM, on the activations and
output gradients a few packed rows of the bundled data really give it.

The model (an embedded preset, a catalog architecture with random weights, or a local checkpoint) runs a
forward and a backward of its language-model loss over ``--rows`` packed rows of ``bundled:skills`` in bf16,
16-bit weights, no LoRA. Hooks on every projection `load_in_fp8` makes FP8 (`fastft.models.fp8.fp8_targets`)
take its input ``x`` and, on the way back, its output gradient ``dy``; there the projection's weight is
quantised (`fastft.kernels.fp8.quantize_weight`) and, per projection::

    forward         y_fp8  = FP8 GEMM of x (rows quantised)      against  y_bf16  = x W^T   (bf16 GEMM)
    input gradient  dx_fp8 = FP8 GEMM of dy * s_w (rows quant.)  against  dx_bf16 = dy W    (bf16 GEMM)
    weight only     x Wdq^T (the dequantised weight, x unquantised: the CPU path of an FP8 model)
    bf16 vs fp32    the bf16 GEMM against the fp32 one (the rounding a 16-bit run already has)

with relative error ``||a - b|| / ||b||`` and the largest absolute difference. On a card with FP8 tensor
cores the FP8 GEMMs are ``torch._scaled_mm`` (`fastft.kernels.fp8.fp8_forward` / `fp8_input_grad`) where
both widths are multiples of 16 (path ``scaled_mm``); elsewhere (the CPU, or an odd width) the same
quantisation with the product of the dequantised operands in fp32 (path ``emulated``: what ``scaled_mm``
computes, to its accumulation order). Catalog architectures are tokenised with the preset tokenizer (their
own is not downloaded): their random weights give no real text structure anyway.

    fastft bench fp8-error --model tiny-llama --device cpu
    fastft bench fp8-error --model meta-llama/Llama-3.1-8B-Instruct --seq-len 2048 --rows 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fastft.bench.common import environment, markdown_table
from fastft.kernels import fp8

# Function-local imports: peft (through fastft.models) imports bitsandbytes, which asks the hub for a kernel:
# models load through `fastft.models.loading`, which handles it.

PRESET_TOKENIZER = "tiny-llama"  # tokenises the data for catalog architectures (nothing is downloaded)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in fp32 (0 when both are zero)."""
    got, want = got.float(), want.float()
    norm = float(want.norm())
    diff = float((got - want).norm())
    return diff / norm if norm else diff


def max_abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) if want.numel() else 0.0


def _emulated(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale, dtype) -> torch.Tensor:
    """`fastft.kernels.fp8.scaled_mm`'s product on any device: the dequantised operands multiplied in fp32."""
    product = a.float() @ b.float()
    return (product * a_scale.view(-1, 1) * b_scale.view(1, -1)).to(dtype)


def _path(rows: torch.Tensor, q: torch.Tensor) -> tuple[bool, str]:
    real = fp8.fp8_gemm_runs(rows, q)
    return real, "scaled_mm" if real else "emulated"


def forward_errors(x2: torch.Tensor, weight: torch.Tensor) -> dict:
    """The FP8 forward of rows ``x2 [N, in]`` through ``weight [out, in]`` against the bf16 GEMM ``x2 W^T``:
    ``{"bf16_rel", "path", "forward_rel", "forward_max_abs", "weight_only_rel"}`` (``bf16_rel``: the bf16 GEMM's
    own error against the fp32 GEMM, the scale of rounding a 16-bit run already has)."""
    dtype = x2.dtype
    q, scale = fp8.quantize_weight(weight)
    real, path = _path(x2, q)
    want = F.linear(x2, weight)
    if real:
        got = fp8.fp8_forward(x2, q, scale, dtype)
    else:
        xq, x_scale = fp8.quantize_rows(x2)
        got = _emulated(xq, x_scale, q.t(), scale, dtype)
    weight_only = F.linear(x2, fp8.dequantize_weight(q, scale, dtype))
    exact = F.linear(x2.float(), weight.float())
    return {
        "bf16_rel": relative_error(want, exact),
        "path": path,
        "forward_rel": relative_error(got, want),
        "forward_max_abs": max_abs_error(got, want),
        "weight_only_rel": relative_error(weight_only, want),
    }


def grad_errors(dy2: torch.Tensor, weight: torch.Tensor) -> dict:
    """The FP8 input gradient of output gradients ``dy2 [N, out]`` against the bf16 GEMM ``dy2 W``:
    ``{"grad_rel", "grad_max_abs"}``."""
    dtype = dy2.dtype
    q, scale = fp8.quantize_weight(weight)
    real, _ = _path(dy2, q)
    want = dy2 @ weight
    if real:
        got = fp8.fp8_input_grad(dy2, fp8.transposed(q), scale, dtype)
    else:
        gq, g_scale = fp8.quantize_rows(dy2, scale)
        got = _emulated(gq, g_scale, q, torch.ones(q.shape[1], device=q.device), dtype)
    return {"grad_rel": relative_error(got, want), "grad_max_abs": max_abs_error(got, want)}


def _load(name: str, device: torch.device, dtype: torch.dtype, layers: int | None):
    """``(model, tokenizer)``: a preset or local checkpoint through `load_model`, or a catalog architecture
    with random weights (seeded) and the preset tokenizer."""
    from fastft.models.catalog import CATALOG
    from fastft.models.loading import load_model
    from fastft.models.random_model import random_model

    if name in CATALOG:
        config = {} if layers is None else {"num_hidden_layers": layers}
        model = random_model(name, device, dtype, seed=0, **config)
        _, tokenizer = load_model(PRESET_TOKENIZER, device="cpu")
        return model, tokenizer
    if layers is not None:
        raise SystemExit(f"--layers cuts a catalog architecture; {name!r} is loaded as it is")
    return load_model(name, device=device, dtype=dtype)


def _rows(tokenizer, rows: int, seq_len: int, vocab: int):
    """The first `rows` packed bins of the bundled skills data as ``(input_ids, position_ids, labels)``
    ``[1, T]`` tensors each (ids folded into the model's vocabulary)."""
    from fastft.data.loading import load_dataset
    from fastft.data.packing import pack

    rows_data = load_dataset("bundled:skills")
    # enough chats for the bins asked (one token each at least), not the whole set's tokenisation
    rows_data = rows_data.select(range(min(len(rows_data), rows * seq_len)))
    data = pack(rows_data, tokenizer, seq_len)
    if len(data) < rows:
        raise SystemExit(f"--rows {rows}: the bundled data packs into {len(data)} rows of {seq_len} tokens")
    batches = []
    for index in range(rows):
        batch = data.batch([index])
        batches.append((batch.input_ids % vocab, batch.position_ids, batch.labels))
    return batches


def measure(
    name: str,
    device: torch.device,
    rows: int = 2,
    seq_len: int = 256,
    layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """One record per (packed row, projection): its errors (`forward_errors`, `grad_errors`), its layer name and shape."""
    from fastft.models.fp8 import fp8_targets

    model, tokenizer = _load(name, device, dtype, layers)
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    names = set(fp8_targets(model))
    output = model.get_output_embeddings()
    records: list[dict] = []

    def watch(full_name: str, module: torch.nn.Linear):
        def forward_hook(_module, args, y):
            x2 = args[0].detach().reshape(-1, module.in_features)
            record = {"name": full_name, "shape": [module.out_features, module.in_features]}
            record |= forward_errors(x2, module.weight)
            records.append(record)

            def grad_hook(dy):
                with torch.no_grad():
                    dy2 = dy.detach().reshape(-1, module.out_features).to(dtype)
                    record.update(grad_errors(dy2, module.weight))

            if y.requires_grad:
                y.register_hook(grad_hook)

        return module.register_forward_hook(forward_hook)

    handles = [
        watch(full, module)
        for full, module in model.named_modules()
        if type(module) is torch.nn.Linear and module is not output and full.rsplit(".", 1)[-1] in names
    ]
    embeddings = model.get_input_embeddings()
    handles.append(embeddings.register_forward_hook(lambda _m, _a, out: out.requires_grad_(True)))
    try:
        for row, (input_ids, position_ids, labels) in enumerate(
            _rows(tokenizer, rows, seq_len, model.config.vocab_size)
        ):
            start = len(records)
            loss = model(
                input_ids=input_ids.to(device), position_ids=position_ids.to(device), labels=labels.to(device)
            ).loss
            loss.backward()
            for record in records[start:]:
                record["row"] = row
    finally:
        for handle in handles:
            handle.remove()
    return records


def summary(records: list[dict]) -> list[dict]:
    """Per projection kind (``q_proj``, …): the median and worst of each error over layers and rows."""
    kinds: dict[str, list[dict]] = {}
    for record in records:
        kinds.setdefault(record["name"].rsplit(".", 1)[-1], []).append(record)
    out = []
    for kind, group in kinds.items():
        row = {"projection": kind, "count": len(group), "path": "/".join(sorted({r["path"] for r in group}))}
        for key in ("forward_rel", "grad_rel", "weight_only_rel", "bf16_rel"):
            values = [r[key] for r in group if key in r]
            if values:
                row[f"{key}_median"] = statistics.median(values)
                row[f"{key}_max"] = max(values)
        row["forward_max_abs"] = max(r["forward_max_abs"] for r in group)
        row["grad_max_abs"] = max((r["grad_max_abs"] for r in group if "grad_max_abs" in r), default=None)
        out.append(row)
    return out


LAYER_COLUMNS = [
    ("row", "row"),
    ("name", "projection"),
    ("shape", "out × in"),
    ("path", "FP8 GEMM"),
    ("forward_rel_pct", "forward rel. %"),
    ("forward_max_abs", "forward max abs"),
    ("grad_rel_pct", "dx rel. %"),
    ("grad_max_abs", "dx max abs"),
    ("weight_only_rel_pct", "weight-only rel. %"),
    ("bf16_rel_pct", "bf16 vs fp32 rel. %"),
]
SUMMARY_COLUMNS = [
    ("projection", "projection"),
    ("count", "GEMMs"),
    ("path", "FP8 GEMM"),
    ("forward_rel_median_pct", "forward rel. % (median)"),
    ("forward_rel_max_pct", "forward rel. % (worst)"),
    ("grad_rel_median_pct", "dx rel. % (median)"),
    ("grad_rel_max_pct", "dx rel. % (worst)"),
    ("weight_only_rel_median_pct", "weight-only rel. % (median)"),
    ("bf16_rel_median_pct", "bf16 vs fp32 rel. % (median)"),
    ("forward_max_abs", "forward max abs"),
    ("grad_max_abs", "dx max abs"),
]


def _percent(row: dict) -> dict:
    shown = dict(row)
    for key, value in row.items():
        if "_rel" in key and isinstance(value, float):
            shown[f"{key}_pct"] = f"{100 * value:.3f}"
        elif "max_abs" in key and isinstance(value, float):
            shown[key] = f"{value:.3g}"
    if "shape" in shown:
        shown["shape"] = " × ".join(str(v) for v in row["shape"])
    return shown


def tables(records: list[dict], per_layer: bool = True) -> str:
    text = markdown_table([_percent(r) for r in summary(records)], SUMMARY_COLUMNS)
    if per_layer:
        text += "\n\n" + markdown_table([_percent(r) for r in records], LAYER_COLUMNS)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastft bench fp8-error", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="tiny-llama", help="a preset, a catalog hub id, or a local checkpoint"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="cut a catalog architecture to this many layers"
    )
    parser.add_argument("--rows", type=int, default=2, help="packed rows of the bundled data")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per packed row")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--out", default="benchmarks/fp8-error.json", help="the JSON written (and a .md beside)"
    )
    parser.add_argument("--summary-only", action="store_true", help="print the per-projection summary only")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    records = measure(args.model, device, args.rows, args.seq_len, args.layers)
    text = tables(records, per_layer=not args.summary_only)
    print(text)
    result = {
        "bench": "fp8-error",
        "model": args.model,
        "layers": args.layers,
        "rows": args.rows,
        "seq_len": args.seq_len,
        "device": str(device),
        "fp8_tensor_cores": fp8.fp8_supported(device),
        "environment": environment(),
        "summary": summary(records),
        "layers_measured": records,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(tables(records) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

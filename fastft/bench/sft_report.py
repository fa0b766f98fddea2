"""`fastft bench sft`'s record: the tables of its results (each system's tokens/s beside each baseline's, the
data shapes' row and packing statistics, fastft's ratio to each baseline per shape) and the JSON and markdown
it writes (`fastft.bench.sft` runs the systems)."""

from __future__ import annotations

import sys

from fastft.bench.common import environment, markdown_table
from fastft.bench.harness import save_record

BASELINES = ("unsloth", "unsloth-defaults", "hf", "hf-defaults")
# Every system's optimizer (`fastft.bench.sft`'s docstring), as the record says it.
OPTIMIZER = "AdamW, fp32 states (torch fused) for every system; Unsloth's default 8-bit AdamW overridden"

LABELS = {
    "unsloth": "Unsloth (matched)",
    "unsloth-defaults": "Unsloth (own defaults)",
    "hf": "HF+PEFT (matched)",
    "hf-defaults": "HF+PEFT (own defaults)",
}


def ratios(results: list[dict]) -> list[dict]:
    """fastft's tokens/s over each baseline's, per workload and shape, and the range over the shapes."""
    done = {(r["workload"], r["shape"], r["system"]): r for r in results if "error" not in r}
    found = []
    for workload in dict.fromkeys(r["workload"] for r in results):
        shapes = list(dict.fromkeys(r["shape"] for r in results if r["workload"] == workload))
        for system in ("fastft", "fastft-trl"):
            for baseline in BASELINES:
                per_shape = {
                    shape: done[workload, shape, system]["tokens_per_s"]
                    / done[workload, shape, baseline]["tokens_per_s"]
                    for shape in shapes
                    if (workload, shape, system) in done and (workload, shape, baseline) in done
                }
                if per_shape:
                    found.append(
                        dict(
                            workload=workload,
                            system=system,
                            baseline=baseline,
                            against=LABELS[baseline],
                            per_shape=per_shape,
                            low=min(per_shape.values()),
                            high=max(per_shape.values()),
                        )
                    )
    return found


# A workload whose loss curve is compared with another's on the same batches (fastft's trainer packs the same
# rows the same way for every workload): fp16 compute and FP8 base weights against the 16-bit run.
LOSS_REFERENCE = {"fp16": "bf16", "fp8": "bf16", "nf4-fp16": "nf4"}


def loss_table(results: list[dict]) -> str | None:
    """Per fastft run whose reference workload ran on the same shape: the largest per-step relative
    difference of the two loss curves (every step, the warm-up's included), and the first and last losses."""
    done = {(r["workload"], r["shape"], r["system"]): r for r in results if "error" not in r}
    rows = []
    for (workload, shape, system), result in done.items():
        reference = done.get((LOSS_REFERENCE.get(workload), shape, system))
        ours, theirs = result.get("losses") or [], (reference or {}).get("losses") or []
        pairs = [(a, b) for a, b in zip(ours, theirs, strict=False) if a is not None and b]
        if not pairs:
            continue
        worst = max(abs(a - b) / abs(b) for a, b in pairs)
        rows.append(
            dict(
                workload=workload,
                shape=shape,
                system=system,
                reference=reference["workload"],
                steps=len(pairs),
                first=f"{pairs[0][0]:.4f} / {pairs[0][1]:.4f}",
                last=f"{pairs[-1][0]:.4f} / {pairs[-1][1]:.4f}",
                worst=f"{100 * worst:.2f} %",
            )
        )
    columns = [
        ("workload", "workload"),
        ("shape", "shape"),
        ("system", "system"),
        ("reference", "against"),
        ("steps", "steps"),
        ("first", "first loss (this / against)"),
        ("last", "last loss"),
        ("worst", "largest step difference"),
    ]
    return markdown_table(rows, columns) if rows else None


def results_table(results: list[dict]) -> str:
    done = {(r["workload"], r["shape"], r["system"]): r for r in results if "error" not in r}
    present = [b for b in BASELINES if any(r["system"] == b for r in results)]
    rows = []
    for result in results:
        row = dict(result, system=LABELS.get(result["system"], result["system"]))
        if "error" in result:
            rows.append(dict(row, note=result["error"][:160]))
            continue
        for baseline in present:
            other = done.get((result["workload"], result["shape"], baseline))
            if other and baseline != result["system"]:
                row[f"vs_{baseline}"] = f"{result['tokens_per_s'] / other['tokens_per_s']:.2f}x"
        graph = result.get("graph")
        row["note"] = f"graph {graph['replays']} replays" if graph else ""
        rows.append(row)
    vs = [(f"vs_{b}", f"vs {LABELS[b]}") for b in BASELINES if b in present or b == "hf"]
    columns = [
        ("workload", "workload"),
        ("shape", "shape"),
        ("system", "system"),
        ("tokens_per_s", "tokens/s"),
        ("trained_tokens_per_s", "trained tokens/s"),
        ("step_ms", "median step ms"),
        ("slowest_over_median", "slowest / median"),
        ("peak_gib", "peak GiB"),
        ("padding_share", "padding share"),
        ("optimizer", "optimizer"),
        ("cudnn_attention", "cuDNN attention"),
        *vs,
        ("note", "note"),
    ]
    return markdown_table(rows, columns)


def ratio_table(by_baseline: list[dict], shapes: list[str]) -> str:
    rows = [
        dict(
            r,
            **{shape: f"{value:.2f}x" for shape, value in r["per_shape"].items()},
            range=f"{r['low']:.2f}x–{r['high']:.2f}x" if len(r["per_shape"]) > 1 else f"{r['low']:.2f}x",
        )
        for r in by_baseline
    ]
    columns = [("workload", "workload"), ("system", "system"), ("against", "against")]
    columns += [(shape, shape) for shape in shapes] + [("range", "range over shapes")]
    return markdown_table(rows, columns)


def shape_table(shapes: dict[str, dict]) -> str:
    columns = [
        ("shape", "shape"),
        ("rows", "rows"),
        ("row_tokens_median", "row tokens median"),
        ("row_tokens_p90", "p90"),
        ("trained_share", "trained share"),
        ("tokens_per_pack", "tokens per pack"),
        ("segments_per_pack", "segments per pack"),
        ("segments_per_pack_p90", "segments p90"),
    ]
    return markdown_table([dict(stats, shape=name) for name, stats in shapes.items()], columns)


def write_record(path: str, args, shapes: dict[str, dict], results: list[dict]) -> str:
    """Write the record (JSON at `path`, its tables beside it as markdown); the tables."""
    by_baseline = ratios(results)
    losses = loss_table(results)
    text = "\n\n".join(
        [shape_table(shapes), results_table(results)]
        + ([ratio_table(by_baseline, list(shapes))] if by_baseline else [])
        + ([losses] if losses else [])
    )
    keys = DATA_SETTINGS + (
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
        "process_per_run",
    )
    settings = {key: getattr(args, key) for key in keys}
    settings["optimizer"] = OPTIMIZER
    output = {
        "benchmark": "sft",
        "settings": settings,
        "environment": environment(),
        "shapes": shapes,
        "results": results,
        "ratios": by_baseline,
    }
    save_record(path, output, text)
    return text


DATA_SETTINGS = (
    "shapes",
    "chats",
    "documents",
    "user_median",
    "assistant_median",
    "sigma",
    "max_seq_length",
    "seed",
)


def print_run(result: dict) -> None:
    """One run's line on stderr (and, with ``--snapshot``, what was alive at its peak)."""
    summary = result.get("error") or (
        f"{result['tokens_per_s']:,.0f} tok/s, slowest step {result['slowest_over_median']:.2f}x the "
        f"median, {result['peak_gib'] or 0:.1f} GiB"
    )
    label = LABELS.get(result["system"], result["system"])
    print(
        f"{result['workload']:>5} {result['shape']:>10} {label:>22}: {summary}", file=sys.stderr, flush=True
    )
    for site in result.get("live_at_peak", {}).get("sites", [])[:10]:
        print(
            f"      {site['bytes'] / 2**20:9.1f} MiB  {site['tensors']:4d}  {site['site']}", file=sys.stderr
        )
    for owner, nbytes in result.get("live_at_peak", {}).get("resident_before", {}).items():
        print(f"      {nbytes / 2**20:9.1f} MiB  before the step: {owner}", file=sys.stderr)

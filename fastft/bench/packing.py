"""`fastft bench packing`: what building packing metadata once per batch is worth.

Workload: many short chat-like sequences (log-normal lengths, the last 60 % of each labelled)
packed best-fit into bins of `bin_tokens`, one bin per step; the model is a catalog architecture
with random weights, LoRA (all linear layers) and gradient checkpointing; AdamW on the adapters.

Variants, on the same model and the same batches, in one process:
- ``transformers``: the unpatched model fed ``position_ids``; transformers detects the packing
  (a host sync) and builds a dense block-causal mask for SDPA in every forward.
- ``per-layer rebuild``: fastft's packed path, but every attention call rebuilds ``cu_seqlens``
  and ``max_seqlen`` from ``position_ids`` (two host syncs), the way transformers' flash-attention
  path does in each layer.
- ``fastft <backend>``: metadata built once per batch and read by every layer, per backend.
- ``padded``: the same sequences in padded batches of `padded_batch` rows (transformers SDPA).
Times are medians over `steps` timed steps after `warmup`, from CUDA events; "backward" includes
the optimizer step. Syncs are counted by PyTorch's sync debug mode over one step.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from fastft.bench.common import count_syncs, environment, environment_line, markdown_table, time_steps
from fastft.bench.harness import report_parser
from fastft.data.batch import PackedBatch
from fastft.data.packing import best_fit_decreasing
from fastft.models.lora import add_lora
from fastft.models.random_model import random_model
from fastft.runtime import attention
from fastft.training.loss import causal_lm_loss_sum

REBUILD = "rebuilt_per_layer"


def synthetic_sequences(
    count: int, vocab: int, max_length: int, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, labels) pairs shaped like chat data: median ~350 tokens, responses labelled."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(350), 0.8, size=count).astype(int), 16, max_length)
    sequences = []
    for n in lengths:
        ids = rng.integers(3, vocab, size=n).astype(np.int32)
        labels = ids.copy()
        labels[: int(n * 0.4)] = -100
        sequences.append((ids, labels))
    return sequences


def _rebuilt_per_layer(base: str):
    """A backend that re-derives the boundaries from position_ids on every call (the ablation)."""

    def backend(query, key, value, batch, scaling, dropout, window, kept=None):
        positions = batch.position_ids[0]
        starts = torch.nonzero(positions == 0).flatten()  # sync: data-dependent size
        ends = torch.cat([starts[1:], torch.tensor([positions.numel()], device=positions.device)])
        lengths = ends - starts
        cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=positions.device), lengths.cumsum(0).int()])
        rebuilt = replace(
            batch,
            cu_seqlens=cu,
            max_seqlen=int(lengths.max()),  # sync
            sequence_lengths=tuple(lengths.tolist()),  # sync
            _artifacts={},
        )
        return attention.packed_attention(query, key, value, rebuilt, base, scaling, dropout, window, kept)

    backend.__name__ = REBUILD
    return backend


def _padded_batches(sequences, rows: int, seed: int):
    order = np.random.default_rng(seed).permutation(len(sequences))
    for start in range(0, len(order), rows):
        chosen = [sequences[i] for i in order[start : start + rows]]
        width = max(len(ids) for ids, _ in chosen)
        ids = np.zeros((len(chosen), width), dtype=np.int64)
        labels = np.full((len(chosen), width), -100, dtype=np.int64)
        mask = np.zeros((len(chosen), width), dtype=np.int64)
        for r, (i, lab) in enumerate(chosen):
            ids[r, : len(i)], labels[r, : len(i)], mask[r, : len(i)] = i, lab, 1
            labels[r, 0] = -100
        shifted = labels[:, 1:]
        rows_idx, cols_idx = np.nonzero(shifted != -100)
        yield {
            "input_ids": torch.from_numpy(ids),
            "attention_mask": torch.from_numpy(mask),
            "rows": torch.from_numpy(rows_idx),
            "cols": torch.from_numpy(cols_idx),
            "targets": torch.from_numpy(shifted[rows_idx, cols_idx]),
            "trained": len(rows_idx),
            "tokens": int(mask.sum()),
            "padded_tokens": ids.size,
        }


def run(
    model_name: str = "Qwen/Qwen3-8B",
    bin_tokens: int = 8192,
    warmup: int = 2,
    steps: int = 5,
    lora_r: int = 16,
    padded_batch: int = 8,
    backends: list[str] | None = None,
    seed: int = 0,
    precision: str = "bf16",
) -> dict:
    """Run every variant; returns the environment, the workload and one row per variant.

    `precision` "nf4" quantises the random weights with bitsandbytes as QLoRA loads them (CUDA only; the
    issue's published anchor is Qwen3-14B QLoRA)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _lora_model(model_name, precision, device, dtype, lora_r, seed)
    lora = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=1e-5, fused=device.type == "cuda")

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    bins_needed = warmup + steps
    sequences = synthetic_sequences(
        bins_needed * bin_tokens // 200, model.config.vocab_size, bin_tokens, seed
    )
    bins = _full_bins(sequences, bin_tokens, bins_needed, seed)
    batches = [
        PackedBatch.from_sequences([sequences[i][0] for i in b], [sequences[i][1] for i in b]).to(device)
        for b in bins
    ]
    timed = [sequences[i] for b in bins[warmup:] for i in b]
    trained_tokens = sum(batch.num_trained_tokens for batch in batches[warmup:])
    autocast = dict(device_type=device.type, dtype=dtype, enabled=device.type == "cuda")

    def packed_forward(i: int) -> torch.Tensor:
        batch = batches[i]
        with torch.autocast(**autocast):
            return causal_lm_loss_sum(model, batch) / batch.num_trained_tokens

    rows = []

    def measure(variant: str, backend) -> None:  # a backend name, a backend function, or None
        if backend is None:
            attention.unpatch_packed_attention(model)
        else:
            attention.patch_packed_attention(model, backend)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times = time_steps(packed_forward, optimizer_step, device, warmup, steps)
        syncs = count_syncs(lambda: (packed_forward(0).backward(), optimizer.zero_grad(set_to_none=True)))
        median = times.median()
        rows.append(
            {
                "variant": variant,
                "forward_ms": median["forward"],
                "backward_ms": median["backward"],
                "total_ms": median["total"],
                "trained_tokens_per_s": trained_tokens / steps / (median["total"] / 1000.0),
                "syncs_per_step": syncs,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
            }
        )
        print(f"  {variant:<28} total {median['total']:9.1f} ms", flush=True)

    base_backend = "varlen" if "varlen" in attention.available_backends(device) else "sdpa_segments"
    measure("transformers (SDPA, position_ids)", None)
    measure(f"per-layer rebuild ({base_backend})", _rebuilt_per_layer(base_backend))
    for backend in backends or attention.available_backends(device):
        measure(f"fastft {backend}", backend)

    # Padded batches of the same (timed) sequences.
    attention.unpatch_packed_attention(model)
    padded = list(_padded_batches(timed, padded_batch, seed))
    rows.append(_measure_padded(model, padded, padded_batch, optimizer_step, autocast, device))
    baseline = rows[0]["trained_tokens_per_s"]
    for row in rows:
        row["speed_vs_transformers"] = row["trained_tokens_per_s"] / baseline
    padding = sum(b["tokens"] for b in padded) / sum(b["padded_tokens"] for b in padded)
    packing = sum(b.num_tokens for b in batches[warmup:]) / (steps * bin_tokens)
    return {
        "benchmark": "packing",
        "environment": environment(),
        "workload": {
            "model": model_name,
            "precision": precision,
            "bin_tokens": bin_tokens,
            "lora_r": lora_r,
            "warmup": warmup,
            "steps": steps,
            "sequences_timed": len(timed),
            "packing_efficiency": packing,
            "padding_efficiency": padding,
            "attention_chosen_by_auto": _auto_choice(model, batches[0]),
        },
        "rows": rows,
    }


def _lora_model(model_name: str, precision: str, device, dtype, lora_r: int, seed: int):
    """The random-weight `model_name` (bf16, or nf4 as QLoRA loads it) with LoRA on every linear, checkpointed."""
    if precision == "bf16":
        model = random_model(model_name, device, dtype)
    elif precision == "nf4":
        if device.type != "cuda":
            raise RuntimeError(
                "--precision nf4 quantises with bitsandbytes on a CUDA GPU; on a CPU use bf16."
            )
        from fastft.models.random_model import build_random_model

        model = build_random_model(model_name, "nf4", device)
    else:
        raise ValueError(f"precision={precision!r}: use 'bf16' or 'nf4'.")
    model.config.use_cache = False
    return add_lora(model, r=lora_r, alpha=lora_r, gradient_checkpointing=True, seed=seed)


def _full_bins(sequences, bin_tokens: int, count: int, seed: int) -> list:
    """`count` bins of `sequences` (indices), best-fit-decreasing, drawn at random among the (nearly) full ones:
    it opens bins longest-first, so the timed steps hold the workload's real length mix, not its longest
    sequences."""
    all_bins = best_fit_decreasing([len(ids) for ids, _ in sequences], bin_tokens)
    full = [b for b in all_bins if sum(len(sequences[i][0]) for i in b) >= 0.95 * bin_tokens]
    chosen = np.random.default_rng(seed).permutation(len(full))[:count]
    return [full[i] for i in chosen]


def _measure_padded(
    model, padded: list[dict], padded_batch: int, optimizer_step, autocast: dict, device
) -> dict:
    """The padded variant's row: every padded batch a step (transformers' SDPA, the unpatched model), the loss
    on the trained positions only."""
    base = model.get_base_model()

    def padded_forward(i: int) -> torch.Tensor:
        b = padded[i % len(padded)]
        with torch.autocast(**autocast):
            hidden = base.model(
                input_ids=b["input_ids"].to(device),
                attention_mask=b["attention_mask"].to(device),
                use_cache=False,
            ).last_hidden_state
            picked = hidden[b["rows"].to(device), b["cols"].to(device)]
            logits = base.lm_head(picked).float()
            return F.cross_entropy(logits, b["targets"].to(device), reduction="sum") / b["trained"]

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    times = time_steps(
        padded_forward, optimizer_step, device, warmup=min(2, len(padded) - 1), steps=len(padded)
    )
    padded_trained = sum(b["trained"] for b in padded)
    return {
        "variant": f"padded ({padded_batch} rows, SDPA)",
        "forward_ms": None,
        "backward_ms": None,
        "total_ms": None,
        "trained_tokens_per_s": padded_trained / (sum(times.total) / 1000.0),
        "syncs_per_step": None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }


def _auto_choice(model, batch) -> str:
    attention.patch_packed_attention(model, "auto")
    choice = attention.choose_backend(model, batch)
    attention.unpatch_packed_attention(model)
    return choice


COLUMNS = [
    ("variant", "variant"),
    ("forward_ms", "forward ms"),
    ("backward_ms", "backward + optimizer ms"),
    ("total_ms", "step ms"),
    ("trained_tokens_per_s", "trained tokens/s"),
    ("speed_vs_transformers", "× transformers"),
    ("syncs_per_step", "host syncs / step"),
    ("peak_gib", "peak GiB"),
]


def report(result: dict) -> str:
    env, work = result["environment"], result["workload"]
    head = (
        f"packing — {work['model']} ({work.get('precision', 'bf16')}), bins of {work['bin_tokens']} tokens, LoRA r={work['lora_r']}, "
        f"{work['steps']} timed steps ({work['sequences_timed']} sequences); packing {work['packing_efficiency']:.1%} "
        f"full, padding {work['padding_efficiency']:.1%} real tokens; "
        f"'auto' uses {work['attention_chosen_by_auto']}\n"
        + environment_line(env, "torch", "transformers", "peft")
    )
    return head + "\n\n" + markdown_table(result["rows"], COLUMNS)


def main(argv: list[str] | None = None) -> int:
    parser = report_parser("packing", __doc__)
    parser.add_argument("--model", default="Qwen/Qwen3-8B", help="catalog hub id (random weights) or preset")
    parser.add_argument(
        "--bin-tokens", type=int, default=8192, help="tokens per packed bin (one bin per step)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank")
    parser.add_argument("--padded-batch", type=int, default=8, help="rows per padded batch")
    parser.add_argument(
        "--backends", nargs="*", default=None, help="fastft backends to time (default: all here)"
    )
    parser.add_argument(
        "--precision", choices=("bf16", "nf4"), default="bf16", help="nf4: QLoRA weights (CUDA)"
    )
    parser.add_argument("--json", default=None, help="also write the full result to this file")
    args = parser.parse_args(argv)
    result = run(
        args.model,
        args.bin_tokens,
        args.warmup,
        args.steps,
        args.lora_r,
        args.padded_batch,
        args.backends,
        precision=args.precision,
    )
    print(report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0

"""`fastft bench step`: one LoRA training step of a real architecture, fastft beside its baselines.

The workload of issue 3 (and ../shared/gpu/README.md): Llama-3.1-8B architecture with random weights, LoRA
r=16 on q, k, v, o, gate, up and down, AdamW, gradient checkpointing, random tokens, 3 warm-up steps and
10 timed ones (median), for three workloads -- bf16 2x2048, NF4 2x2048, bf16 1x16384. Systems:

* ``fastft``  -- `load_model` + `add_lora` (fused kernels) + packed attention + fused linear cross-entropy;
  the batch is a `PackedBatch` of the same sequences, every token trained.
* ``hf``      -- transformers + PEFT, SDPA attention, ``model(input_ids, labels=...)``.
* ``liger``   -- the same after ``liger_kernel.transformers.apply_liger_kernel_to_llama()``.
* ``unsloth`` -- ``FastLanguageModel.from_pretrained`` / ``get_peft_model(use_gradient_checkpointing="unsloth")``.

Every system runs in its own Python process (Liger and Unsloth patch transformers' classes globally), from
one random-weight checkpoint saved once to a local folder (Unsloth only loads from a folder; NF4 bases are
quantised at load, the same way for everyone). Each process reports the median step time (wall clock between
``torch.cuda.synchronize()`` calls, so every system pays for its own host syncs) and
``torch.cuda.max_memory_allocated`` over the whole run, weights included.

    fastft bench step --systems fastft,hf,liger,unsloth --workloads bf16:2x2048,nf4:2x2048,bf16:1x16384

Unsloth's process needs its own site folder first on ``PYTHONPATH``: pass ``--unsloth-path /tmp/site_unsloth``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from fastft.bench.baselines import hf_model, unsloth_model
from fastft.bench.common import (
    add_memory_trade_options,
    environment,
    markdown_table,
    memory_trade_argv,
    set_memory_trades,
)
from fastft.bench.harness import (
    checkpoint_folder,
    fastft_model,
    option_argv,
    parse_or_work,
    run_system,
    save_random_checkpoint,
    save_record,
    systems_of,
)

# Function-local imports: transformers, peft, TRL and the engine load where used: a bench's Unsloth worker imports
# this module and must import unsloth before them (torch may come first; tests/tools/test_bench.py checks it); tests
# replace these names on their modules, so they are looked up when called.

SYSTEMS = ("fastft", "hf", "liger", "unsloth")
DEFAULT_WORKLOADS = "bf16:2x2048,nf4:2x2048,bf16:1x16384"


def parse_workload(text: str) -> tuple[str, int, int]:
    """``"bf16:2x2048"`` -> ``("bf16", 2, 2048)``."""
    try:
        precision, shape = text.split(":")
        batch, seq = (int(part) for part in shape.lower().split("x"))
    except ValueError as error:
        raise ValueError(
            f"workload {text!r}: write PRECISION:BATCHxSEQ, e.g. bf16:2x2048 or nf4:1x16384"
        ) from error
    if precision not in ("bf16", "nf4"):
        raise ValueError(f"workload {text!r}: precision must be bf16 or nf4")
    return precision, batch, seq


def flops_per_token(config, seq: int) -> float:
    """Model FLOPs per trained token with LoRA and recompute: 6 N (forward, input gradients, recompute; the
    frozen base has no weight gradient) plus causal attention, 4 * layers * seq * hidden per token for the
    two attention matmuls, times 3 (forward, recompute, and backward's two of them), halved for causality."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    q = config.num_attention_heads * head_dim
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:  # MoE: the router, and the top-k experts each token passes through
        top_k, inter = config.num_experts_per_tok, config.moe_intermediate_size or config.intermediate_size
        mlp = hidden * experts + top_k * 3 * hidden * inter
    else:
        mlp = 3 * hidden * config.intermediate_size
    per_layer = hidden * (q + 2 * kv) + q * hidden + mlp
    n = layers * per_layer + config.vocab_size * hidden
    attention = 4 * layers * seq * config.num_attention_heads * head_dim * 3 / 2
    return 6 * n + attention


# ------------------------------------------------------------------------------------------------ workers


def _random_batch(vocab: int, batch: int, seq: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=generator)


def run_worker(args) -> dict:
    """Build one system, run warm-up + timed steps, return its measurements."""
    torch.manual_seed(0)
    precision, batch, seq = parse_workload(args.workload)
    device = torch.device(args.device)
    load_start = time.perf_counter()
    trades = None
    if args.system == "fastft":
        trades = set_memory_trades(args.adapter_copies, args.dh_slice_mib)
        mode = args.checkpointing
        model = fastft_model(
            args.folder,
            precision,
            seq,
            args.attention,
            device,
            mode,
            args.lora_targets,
            keep_attention=args.keep_attention,
        )
    elif args.system in ("hf", "liger"):
        model = hf_model(args.folder, precision, args.system == "liger", device, args.lora_targets)
    elif args.system == "unsloth":
        model = unsloth_model(args.folder, precision, seq, args.lora_targets)
    else:
        raise ValueError(f"unknown system {args.system!r}")
    load_seconds = time.perf_counter() - load_start
    pinned_free = None
    if device.type == "cuda":
        # the long-context bench's own model build once left 1.2 GiB of a 6 GiB cap so; this is the same
        # reading after each system's real loader
        from fastft.vram.measure import free_in_pinned_segments

        pinned_free = free_in_pinned_segments(device) / 2**30
    kept = None
    if args.system == "fastft":
        from fastft.runtime.offload import offloader_of

        offloader = offloader_of(model)
        kept = None if offloader is None else offloader.keep  # what "auto" (or on/off) came to
    model.train()
    vocab = model.config.vocab_size if hasattr(model, "config") else model.get_base_model().config.vocab_size
    ids = _random_batch(vocab, batch, seq).to(device)
    parameters = [p for p in model.parameters() if p.requires_grad]
    from fastft.training.optimizer import adamw  # after the model: Unsloth's import must come first

    optimizer = adamw(parameters, lr=1e-5, fused=device.type == "cuda")
    cuda = device.type == "cuda"
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)

    graph_stats = None
    if args.system == "fastft":
        from fastft.data.batch import PackedBatch
        from fastft.training.graph import StepGraph
        from fastft.training.loss import causal_lm_loss_sum

        rows = [row.cpu().numpy() for row in ids]
        packed = PackedBatch.from_sequences(rows, [row.copy() for row in rows]).to(device)
        divisor = torch.tensor(float(packed.num_trained_tokens), device=device)
        # as fastft's Trainer runs a micro-batch: under bf16 autocast on a GPU, replayed from a CUDA graph
        # once its shape has repeated (TrainConfig(cuda_graph=True), the default)
        graph = StepGraph(parameters, enabled=args.cuda_graph == "on")

        def micro_batch_loss(batch, divisor):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                return causal_lm_loss_sum(model, batch) / divisor

        def forward_backward():
            graph.mode(packed, first_micro_batch=True)
            return graph.forward_backward(packed, divisor, micro_batch_loss)
    else:
        graph = None

        def forward_backward():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss.detach()

    synchronize()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    losses = []
    for step in range(args.warmup + args.steps):
        synchronize()
        start = time.perf_counter()
        loss = forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=not (graph and graph.holds_gradients))
        synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.clone())
    if graph is not None:
        graph_stats = graph.stats
        graph.release()
    median = statistics.median(times)
    config = model.config if hasattr(model, "config") else model.get_base_model().config
    tokens = batch * seq
    return {
        "system": args.system,
        "workload": args.workload,
        "attention": args.attention if args.system == "fastft" else "sdpa",
        "step_ms": median * 1000,
        "tokens_per_s": tokens / median,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "mfu": flops_per_token(config, seq) * tokens / median / args.peak_flops,
        "load_s": load_seconds,
        "free_in_pinned_segments_after_load_gib": pinned_free,
        "losses": [float(x) for x in losses],
        "cuda_graph": graph_stats,
        "keep_attention": kept,
        "memory_trades": trades,
        "step_ms_all": [t * 1000 for t in times],
    }


# ------------------------------------------------------------------------------------------------ driver


def _table(results: list[dict]) -> str:
    def ratios(row: dict, reference: dict) -> dict:
        for baseline in ("hf", "unsloth"):
            if baseline in reference and baseline != row["system"]:
                row[f"vs_{baseline}"] = f"{row['tokens_per_s'] / reference[baseline]['tokens_per_s']:.2f}x"
        return row

    rows = []
    for result in results:
        if "error" in result:
            rows.append(
                {"system": result["system"], "workload": result["workload"], "note": result["error"][:160]}
            )
            continue
        same = [
            r
            for r in results
            if r["workload"] == result["workload"] and r.get("round", 0) == result.get("round", 0)
        ]
        reference = {r["system"]: r for r in same if "error" not in r}
        row = ratios(dict(result), reference)
        row["mfu"] = f"{100 * result['mfu']:.1f}%"
        rows.append(row)
    # with --rounds, each system's median over its rounds, and the ratios of those medians
    groups: dict[tuple, list[dict]] = {}
    for result in results:
        if "error" not in result:
            key = (result["workload"], result["system"], result.get("attention"))
            groups.setdefault(key, []).append(result)
    medians = {}
    for (workload, system, attention), runs in groups.items():
        if len(runs) > 1:
            tokens = statistics.median(r["tokens_per_s"] for r in runs)
            medians[(workload, system, attention)] = {
                "workload": workload,
                "system": system,
                "attention": attention,
                "tokens_per_s": tokens,
                "peak_gib": max(r["peak_gib"] for r in runs),
                "step_ms": statistics.median(r["step_ms"] for r in runs),
                "mfu": f"{100 * statistics.median(r['mfu'] for r in runs):.1f}%",
                "note": f"median of {len(runs)} rounds (peak: the highest)",
            }
    for (workload, _, _), row in medians.items():
        reference = {m["system"]: m for (w, _, _), m in medians.items() if w == workload}
        rows.append(ratios(row, reference))
    columns = [
        ("workload", "workload"),
        ("system", "system"),
        ("attention", "attention"),
        ("tokens_per_s", "tokens/s"),
        ("peak_gib", "peak GiB"),
        ("step_ms", "step ms"),
        ("mfu", "MFU"),
        ("vs_hf", "vs HF+PEFT"),
        ("vs_unsloth", "vs Unsloth"),
        ("note", "note"),
    ]
    return markdown_table(rows, columns)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastft bench step",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--model", default="meta-llama/Llama-3.1-8B-Instruct", help="catalog architecture (random weights)"
    )
    parser.add_argument("--systems", default="fastft,hf", help=f"comma-separated, from {','.join(SYSTEMS)}")
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="PRECISION:BATCHxSEQ, comma-separated")
    parser.add_argument(
        "--attention", default="auto", help="fastft's packed-attention backend(s), comma-separated"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--folder",
        default="/dev/shm/fastft-bench-step",
        help="where the random checkpoints go (one sub-folder per model and layer cut, reused by later runs)",
    )
    parser.add_argument(
        "--unsloth-path", default=None, help="site folder put first on PYTHONPATH for Unsloth"
    )
    parser.add_argument("--peak-flops", type=float, default=776e12, help="measured bf16 matmul ceiling")
    parser.add_argument(
        "--checkpointing",
        default="auto",
        choices=("auto", "recompute", "offload"),
        help="fastft's gradient checkpointing (auto: offloaded on a GPU)",
    )
    parser.add_argument(
        "--keep-attention",
        default="auto",
        choices=("auto", "on", "off"),
        help="offloaded checkpointing keeps each layer's attention and o_proj outputs (from 2,048 tokens) "
        "and MoE routing order for the recompute (off: the recompute runs attention, o_proj and the top-k "
        "and sort again; auto: fastft's default, on for 16-bit bases and off for quantised ones)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the systems in turn this many times per workload (fastft, unsloth, fastft, unsloth, ...): "
        "the table gives each round's ratios and the median over rounds, so drift between processes shows",
    )
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    parser.add_argument(
        "--lora-targets",
        default="all",
        choices=("all", "attention"),
        help="all: every linear (and the experts of MoE models); attention: q/k/v/o only",
    )
    parser.add_argument(
        "--cuda-graph",
        default="on",
        choices=("on", "off"),
        help="fastft replays each step's forward and backward from a CUDA graph (its Trainer's default)",
    )
    add_memory_trade_options(parser)
    parser.add_argument("--timeout", type=float, default=300, help="seconds per system and workload")
    parser.add_argument("--out", default="benchmarks/step.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return parser


def _worker_argv(args, system: str, workload: str, attention: str, folder: Path) -> list[str]:
    """The worker's options for one run: the driver's, as given, for `system`, `workload` and `attention`."""
    argv = ["--worker", "--system", system, "--workload", workload, "--attention", attention]
    argv += ["--folder", str(folder)]
    keys = ("warmup", "steps", "peak_flops", "checkpointing", "lora_targets", "cuda_graph", "keep_attention")
    return argv + option_argv(args, keys) + memory_trade_argv(args)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parse_or_work(parser, argv, run_worker)
    if args is None:
        return 0

    if not torch.cuda.is_available():
        print("fastft bench step needs a CUDA GPU (it trains an 8B-parameter architecture).", file=sys.stderr)
        return 2
    systems = systems_of(parser, args.systems, SYSTEMS)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for workload in workloads:
        parse_workload(workload)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    folder = checkpoint_folder(Path(args.folder), args.model, args.layers)
    if not (folder / "config.json").exists():
        print(f"saving a random-weight {args.model} to {folder} ...", file=sys.stderr, flush=True)
        save_random_checkpoint(args.model, folder, args.layers)
        torch.cuda.empty_cache()

    results = []
    runs = [
        (workload, round_, system)
        for workload in workloads
        for round_ in range(args.rounds)
        for system in systems
    ]
    for workload, round_, system in runs:
        attentions = args.attention.split(",") if system == "fastft" else ["sdpa"]
        for attention in attentions:
            argv_worker = _worker_argv(args, system, workload, attention, folder)
            result = run_system(system, argv_worker, "fastft.bench.step", args.timeout, args.unsloth_path)
            result.setdefault("workload", workload)
            result.setdefault("attention", attention)
            result["round"] = round_
            results.append(result)
            _write(args.out, args.model, environment(), results)  # a later timeout keeps what was measured
            summary = (
                result.get("error") or f"{result['tokens_per_s']:,.0f} tok/s, {result['peak_gib']:.1f} GiB"
            )
            print(f"{workload:>14} {system:>8} {attention:>13}: {summary}", file=sys.stderr, flush=True)

    print(_write(args.out, args.model, environment(), results))
    return 0


def _write(path: str, model: str, env: dict, results: list[dict]) -> str:
    table = _table(results)
    output = {"benchmark": "step", "model": model, "environment": env, "results": results}
    save_record(path, output, table)
    return table


if __name__ == "__main__":
    sys.exit(main())

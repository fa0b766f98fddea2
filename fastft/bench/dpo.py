"""`fastft bench dpo`: one DPO training step, fastft beside TRL's ``DPOTrainer`` + PEFT, on the same pairs.

Random weights of a catalog architecture (`fastft bench step`'s checkpoints; Llama-3.1-8B by default), QLoRA
NF4 by default (``--workloads nf4``; ``bf16`` for a 16-bit base), LoRA r=16 on the seven projections. Each
pair is a shared prompt of ``--prompt-length`` random tokens with a chosen and a rejected answer, each side
``--side-length`` tokens (2 × 1,024 by default; ``--ragged`` draws every prompt's and answer's length, up
to those), trained on the answers only; one pair per micro-batch,
sigmoid DPO with β = 0.1, the reference being the model with its adapters off. Systems, each in its own
process:

* ``fastft`` -- `load_model` + `add_lora` + fastft's `Trainer(method="dpo")`: both sides packed into one
  padding-free row, the log-probs from the fused head, offloaded checkpointing, the step (reference pass
  included) replayed as a CUDA graph from the third step on (``graph_replays`` counts the timed ones).
* ``trl``    -- transformers + PEFT (SDPA) under TRL's ``DPOTrainer`` with its defaults (gradient
  checkpointing on, bf16), fed the same token ids (its dataset preparation is skipped: the pairs are
  already token ids; its collator, reference pass and loss run as they are).

After `--warmup` steps, `--steps` steps are timed (wall clock between ``torch.cuda.synchronize()`` calls);
the report gives tokens per second (both sides of every pair), the median step and the peak of
``torch.cuda.max_memory_allocated``, and fastft's ratios to TRL (the bar: ≥ 1.5× the tokens/s at ≤ 60 % of
the peak memory).

    fastft bench dpo                                   # Llama-3.1-8B shape, NF4, 2 × 1,024 tokens, on CUDA
    fastft bench dpo --model tiny-llama --device cpu --workloads bf16 --side-length 48 --prompt-length 16
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from fastft.bench.baselines import hf_model, step_clock, trl_run_settings
from fastft.bench.common import environment, markdown_table
from fastft.bench.harness import (
    bench_parser,
    ensure_checkpoint,
    fastft_model,
    option_argv,
    parse_or_work,
    run_system,
    save_record,
    systems_of,
    worker_options,
    workloads_of,
)
from fastft.models.remote_code import from_pretrained

# Function-local imports: transformers, peft, TRL and the engine load where used: a bench's Unsloth worker imports
# this module and must import unsloth before them (torch may come first; tests/tools/test_bench.py checks it); TRL is
# an optional dependency (the baselines and the facade's trainers); tests replace these names on their modules, so
# they are looked up when called.

SYSTEMS = ("fastft", "trl")
BETA = 0.1


def pair_rows(count: int, vocab: int, prompt_length: int, side_length: int, seed: int, ragged: bool = False):
    """`count` pairs as (prompt ids, chosen answer ids, rejected answer ids), int64, random in ``[3, vocab)``;
    each side (prompt + answer) is `side_length` tokens. `ragged` draws every length instead: the prompt
    between half and all of `prompt_length`, each answer independently between a quarter and all of
    ``side_length - prompt_length``, as real pairs are. The same seed gives both systems the same pairs."""

    if not 0 < prompt_length < side_length:
        raise ValueError(
            f"--prompt-length {prompt_length} must be at least 1 and below --side-length {side_length}"
        )
    rng = np.random.default_rng(seed)
    answer = side_length - prompt_length

    def lengths():
        if not ragged:
            return prompt_length, answer, answer
        prompt = int(rng.integers(max(1, prompt_length // 2), prompt_length + 1))
        return (prompt, *(int(n) for n in rng.integers(max(1, answer // 4), answer + 1, 2)))

    return [tuple(rng.integers(3, vocab, n).astype(np.int64) for n in lengths()) for _ in range(count)]


def pair_tokens(row) -> int:
    """Tokens a pair trains through: the prompt twice (once a side) and both answers."""
    prompt, chosen, rejected = row
    return 2 * len(prompt) + len(chosen) + len(rejected)


def packed_pairs(rows, side_length: int):
    """The pairs as fastft's `PackedPairs`: one pair (chosen, then rejected) per bin, answers trained."""

    from fastft.data.pairs import PackedPairs, PairStats
    from fastft.data.tokenize import IGNORE_INDEX, TokenizedData

    input_ids, labels = [], []
    for prompt, *answers in rows:
        for answer in answers:
            ids = np.concatenate([prompt, answer])
            input_ids.append(ids)
            labels.append(np.concatenate([np.full(len(prompt), IGNORE_INDEX, dtype=np.int64), answer]))
    data = TokenizedData(
        input_ids=input_ids, labels=labels, source_rows=[i // 2 for i in range(len(input_ids))]
    )
    bins = [[2 * p, 2 * p + 1] for p in range(len(rows))]
    return PackedPairs(data, bins, 2 * side_length, PairStats(len(rows), len(rows)))


# ------------------------------------------------------------------------------------------------ workers


def _run_fastft(args, rows, device):
    from fastft.training.trainer import TrainConfig, Trainer

    model = fastft_model(args.folder, args.workload, 2 * args.side_length, "auto", device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    config = TrainConfig(
        method="dpo", beta=BETA, max_steps=args.warmup + args.steps, warmup=0, learning_rate=1e-5
    )
    trainer = Trainer(model, None, packed_pairs(rows, args.side_length), config=config)
    trainer.train(steps=args.warmup)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    started = time.perf_counter()
    result = trainer.train(steps=args.steps)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    timed = result.steps[args.warmup :]
    return dict(
        seconds=time.perf_counter() - started,
        tokens=sum(e.tokens for e in timed),
        padding_tokens=sum(e.padding_tokens for e in timed),  # pad slots of a static shape, not counted
        step_seconds=[e.step_seconds for e in timed],
        attention=result.attention,
        graph_replays=sum(e.graph_replays for e in timed),  # of the timed micro-batches, one per step
        # every step's, the warm-up's included (each `train` call restarts the allocator's peak; a replay's
        # activations live in the graph's pool, which the trainer's events count from the capture)
        peak_bytes=max(e.peak_memory_bytes for e in result.steps),
    )


def _run_trl(args, rows, device):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    class TokenIdsDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # already TRL's tokenised columns (prompt_ids, chosen_ids, rejected_ids)

        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)  # the timed pairs are known

    model = hf_model(args.folder, args.workload, False, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokenizer = from_pretrained(AutoTokenizer, args.folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    dataset = Dataset.from_dict(
        {
            "prompt_ids": [p.tolist() for p, _, _ in rows],
            "chosen_ids": [c.tolist() for _, c, _ in rows],
            "rejected_ids": [r.tolist() for _, _, r in rows],
        }
    )
    cuda = device.type == "cuda"
    config = DPOConfig(
        output_dir=args.scratch,
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=1,
        max_length=None,  # no side is longer than --side-length
        beta=BETA,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        **trl_run_settings(cuda),
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        seed=3407,
    )
    trainer = TokenIdsDPOTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer)
    clock = step_clock(device)
    trainer.add_callback(clock)
    trainer.train()
    marks = clock.marks
    first, last = args.warmup - 1, args.warmup + args.steps - 1
    return dict(
        seconds=marks[last] - marks[first],
        tokens=sum(map(pair_tokens, rows[args.warmup : args.warmup + args.steps])),
        step_seconds=[b - a for a, b in zip(marks[first:last], marks[first + 1 : last + 1], strict=True)],
    )


def run_worker(args) -> dict:
    from transformers import AutoConfig

    torch.manual_seed(0)
    device = torch.device(args.device)
    vocab = from_pretrained(AutoConfig, args.folder).vocab_size
    rows = pair_rows(
        args.warmup + args.steps, vocab, args.prompt_length, args.side_length, args.seed, args.ragged
    )
    measured = (_run_fastft if args.system == "fastft" else _run_trl)(args, rows, device)
    steps = measured.pop("step_seconds")
    seconds = measured.pop("seconds")
    peak = measured.pop("peak_bytes", 0)
    if device.type == "cuda":
        peak = max(peak, torch.cuda.max_memory_allocated(device))
    return dict(
        system=args.system,
        workload=args.workload,
        tokens_per_s=measured.pop("tokens") / seconds,
        step_ms=1000 * statistics.median(steps),
        slowest_step_ms=1000 * max(steps),
        peak_gib=peak / 2**30 if device.type == "cuda" else None,
        **measured,
    )


# ------------------------------------------------------------------------------------------------ driver


def verdict(results: list[dict]) -> dict[str, dict]:
    """Per workload, fastft's tokens/s over TRL's and its peak memory over TRL's, with the bar's answer
    (≥ 1.5× the speed at ≤ 60 % of the memory; None off CUDA, where there is no peak to compare)."""
    by_workload: dict[str, dict] = {}
    for result in results:
        by_workload.setdefault(result["workload"], {})[result["system"]] = result
    verdicts = {}
    for workload, systems in by_workload.items():
        ours, theirs = systems.get("fastft"), systems.get("trl")
        if not ours or not theirs or "error" in ours or "error" in theirs:
            continue
        speed = ours["tokens_per_s"] / theirs["tokens_per_s"]
        memory = None
        if ours.get("peak_gib") and theirs.get("peak_gib"):
            memory = ours["peak_gib"] / theirs["peak_gib"]
        verdicts[workload] = dict(
            speed_vs_trl=speed,
            memory_vs_trl=memory,
            meets_bar=None if memory is None else speed >= 1.5 and memory <= 0.6,
        )
    return verdicts


def _table(results: list[dict]) -> str:
    verdicts = verdict(results)
    rows = []
    for result in results:
        if "error" in result:
            rows.append(
                dict(workload=result["workload"], system=result["system"], note=result["error"][:160])
            )
            continue
        row = dict(result)
        found = verdicts.get(result["workload"])
        if found and result["system"] == "fastft":
            row["vs_trl"] = f"{found['speed_vs_trl']:.2f}x"
            if found["memory_vs_trl"] is not None:
                row["memory_vs_trl"] = f"{100 * found['memory_vs_trl']:.0f} %"
            bar = found["meets_bar"]
            row["note"] = (
                "no CUDA peak: no bar" if bar is None else "meets the bar" if bar else "below the bar"
            )
        rows.append(row)
    columns = [
        ("workload", "workload"),
        ("system", "system"),
        ("tokens_per_s", "tokens/s"),
        ("step_ms", "median step ms"),
        ("peak_gib", "peak GiB"),
        ("vs_trl", "tokens/s vs TRL"),
        ("memory_vs_trl", "peak vs TRL"),
        ("note", "note"),
    ]
    return markdown_table(rows, columns)


_SETTINGS = ("prompt_length", "side_length", "seed", "warmup", "steps")
_FLAGS = ("ragged",)


def _write(path: str, args, results: list[dict]) -> str:
    table = _table(results)
    settings = {key: getattr(args, key) for key in (*_SETTINGS, *_FLAGS, "model", "layers")}
    output = {
        "benchmark": "dpo",
        "settings": {**settings, "beta": BETA, "lora_r": 16, "pairs_per_step": 1},
        "environment": environment(),
        "results": results,
        "verdict": verdict(results),
    }
    save_record(path, output, table)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("dpo", __doc__, SYSTEMS, "fastft,trl")
    parser.add_argument("--workloads", default="nf4", help="nf4 (QLoRA) and/or bf16 (the base's precision)")
    parser.add_argument("--side-length", type=int, default=1024, help="tokens of each side (prompt + answer)")
    parser.add_argument("--prompt-length", type=int, default=256, help="tokens of the shared prompt")
    parser.add_argument("--seed", type=int, default=0, help="the pairs' seed")
    parser.add_argument(
        "--ragged", action="store_true", help="draw each prompt's and answer's length, as real pairs vary"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--folder", default="/dev/shm/fastft-bench-step", help="the random checkpoints")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per system and workload")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="benchmarks/dpo.json")
    worker_options(parser, "dpo")
    args = parse_or_work(parser, argv, run_worker)
    if args is None:
        return 0

    systems = systems_of(parser, args.systems, SYSTEMS)
    workloads = workloads_of(parser, args.workloads, ("bf16", "nf4"))
    if not 0 < args.prompt_length < args.side_length:
        parser.error(f"--prompt-length must be at least 1 and below --side-length ({args.side_length})")
    folder = ensure_checkpoint(args)
    results = []
    for workload in workloads:
        for system in systems:
            argv_worker = ["--worker", "--system", system, "--workload", workload, "--folder", str(folder)]
            argv_worker += option_argv(args, (*_SETTINGS, "device"))
            argv_worker += [f"--{key}" for key in _FLAGS if getattr(args, key)]
            result = run_system(system, argv_worker, "fastft.bench.dpo", args.timeout)
            result.setdefault("workload", workload)
            results.append(result)
            _write(args.out, args, results)  # a later timeout keeps what was measured
            summary = result.get("error") or (
                f"{result['tokens_per_s']:,.0f} tok/s, median step {result['step_ms']:.0f} ms, "
                f"{result['peak_gib'] or 0:.1f} GiB"
            )
            print(f"{workload:>5} {system:>7}: {summary}", file=sys.stderr, flush=True)
    print(_write(args.out, args, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`fastft bench grpo`: one GRPO step's peak memory beside TRL's ``GRPOTrainer``, and generation tokens/s
beside plain ``model.generate``, on the same random-weight model and settings.

Random weights of a catalog architecture (`fastft bench step`'s checkpoints; Llama-3.1-8B by default), LoRA
r=16 on the seven projections, the base in 16 bits or NF4 (QLoRA, the default). `--prompts` prompts of
`--prompt-tokens` random tokens, `--generations` (G) completions each of up to `--completion-tokens`
(random weights rarely draw EOS, so nearly all run to the limit), one reward that varies between
completions. Systems, each in its own process (its peak memory is its own):

* ``fastft``   -- `fastft.training.objectives.grpo.GRPOTrainer`: one warm-up rollout, then one timed GRPO step
  (rollout, packed completions, fused log-probs, update); the step's peak of
  ``torch.cuda.max_memory_allocated``, and the timed rollout's generated tokens per second.
* ``trl``      -- TRL's ``GRPOTrainer`` (its defaults: gradient checkpointing on, no vLLM) on the same
  checkpoint loaded with transformers + PEFT (bitsandbytes NF4), one step; its peak memory.
* ``generate`` -- plain ``model.generate`` (sampling, KV cache) on the transformers + PEFT model with the
  same batch: the baseline of generation tokens/s.

    fastft bench grpo --workload nf4                      # on a CUDA machine
    fastft bench grpo --model tiny-llama --device cpu --prompt-tokens 16 --completion-tokens 8  # smoke test
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from fastft.bench.baselines import hf_model, trl_run_settings
from fastft.bench.common import environment
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
)
from fastft.models.remote_code import from_pretrained

# Function-local imports: transformers, peft, TRL and the engine load where used: a bench's Unsloth worker imports
# this module and must import unsloth before them (torch may come first; tests/tools/test_bench.py checks it); TRL is
# an optional dependency (the baselines and the facade's trainers); tests replace these names on their modules, so
# they are looked up when called.

SYSTEMS = ("fastft", "trl", "generate")


def prompt_ids(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` random token ids in ``[3, vocab)``; the same seed for every system."""

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(count)]


def varied_reward(prompts, completions, **row) -> list[float]:
    """A reward that differs between completions (so advantages and the loss are not zero)."""
    return [float(sum(map(ord, completion)) % 7) for completion in completions]


def _vocab(model, tokenizer) -> int:
    """Prompt ids stay inside both the model's and the tokenizer's vocabularies (a random checkpoint carries
    the tiny preset's tokenizer), so TRL's text prompts decode and re-encode."""
    return min(model.get_base_model().config.vocab_size, len(tokenizer))


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _run_fastft(args, device) -> dict:
    from transformers import AutoTokenizer

    from fastft.training.objectives.grpo import GRPOConfig, GRPOTrainer

    seq = args.prompt_tokens + args.completion_tokens
    model = fastft_model(args.folder, args.workload, seq, "auto", device)
    tokenizer = from_pretrained(AutoTokenizer, args.folder)
    vocab = _vocab(model, tokenizer)
    rows = [{"prompt_ids": ids} for ids in prompt_ids(args.prompts, args.prompt_tokens, vocab, args.seed)]
    config = GRPOConfig(
        max_steps=2,
        prompts_per_step=args.prompts,
        num_generations=args.generations,
        max_new_tokens=args.completion_tokens,
        learning_rate=1e-5,
        warmup=0,
        profile=False,
    )
    trainer = GRPOTrainer(model, tokenizer, rows, [varied_reward], config)
    trainer.rollout(0)  # warm-up: kernels compiled, allocator primed
    _sync(device)
    started = time.perf_counter()
    rollout = trainer.rollout(1)
    _sync(device)
    generation_s = time.perf_counter() - started
    _reset_peak(device)
    started = time.perf_counter()
    result = trainer.train(steps=1)
    _sync(device)
    step_s = time.perf_counter() - started
    generated = sum(len(ids) for ids in rollout.completion_ids)
    return dict(
        peak_gib=_peak(device),
        step_s=step_s,
        generated_tokens=generated,
        generation_tokens_per_s=generated / generation_s,
        loss=result.steps[-1].loss,
    )


def _run_generate(args, device) -> dict:
    from transformers import AutoTokenizer

    model = hf_model(args.folder, args.workload, False, device)
    model.config.use_cache = True
    model.eval()
    vocab = _vocab(model, from_pretrained(AutoTokenizer, args.folder))
    ids = torch.tensor(prompt_ids(args.prompts, args.prompt_tokens, vocab, args.seed), device=device)
    kwargs = dict(
        do_sample=True,
        top_k=0,
        max_new_tokens=args.completion_tokens,
        num_return_sequences=args.generations,
        attention_mask=torch.ones_like(ids),
        pad_token_id=0,
        use_cache=True,
    )
    with torch.no_grad():
        model.generate(ids, **kwargs)  # warm-up
        _sync(device)
        started = time.perf_counter()
        output = model.generate(ids, **kwargs)
        _sync(device)
    seconds = time.perf_counter() - started
    generated = int(output.shape[0] * (output.shape[1] - ids.shape[1]))
    return dict(
        generated_tokens=generated, generation_tokens_per_s=generated / seconds, peak_gib=_peak(device)
    )


def _run_trl(args, device) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = hf_model(args.folder, args.workload, False, device)
    tokenizer = from_pretrained(AutoTokenizer, args.folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    vocab = _vocab(model, tokenizer)
    prompts = [
        tokenizer.decode(ids) for ids in prompt_ids(args.prompts, args.prompt_tokens, vocab, args.seed)
    ]
    cuda = device.type == "cuda"
    config = GRPOConfig(
        output_dir=args.scratch,
        max_steps=1,
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=args.completion_tokens,
        learning_rate=1e-5,
        beta=0.0,
        top_k=0,
        **trl_run_settings(cuda),
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        seed=3407,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[varied_reward],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    _reset_peak(device)
    started = time.perf_counter()
    trainer.train()
    _sync(device)
    return dict(peak_gib=_peak(device), step_s=time.perf_counter() - started)


def run_worker(args) -> dict:
    torch.manual_seed(0)
    device = torch.device(args.device)
    run = {"fastft": _run_fastft, "trl": _run_trl, "generate": _run_generate}[args.system]
    return dict(system=args.system, workload=args.workload, **run(args, device))


def summarise(results: list[dict]) -> dict:
    """The two ratios of the issue's bars: fastft's peak over TRL's, fastft's generation over plain
    ``generate``'s (None where a system is missing, failed or ran on a CPU without a peak)."""
    by = {r["system"]: r for r in results if "error" not in r}
    memory = speed = None
    if "fastft" in by and "trl" in by and by["fastft"].get("peak_gib") and by["trl"].get("peak_gib"):
        memory = by["fastft"]["peak_gib"] / by["trl"]["peak_gib"]
    if "fastft" in by and "generate" in by:
        speed = by["fastft"]["generation_tokens_per_s"] / by["generate"]["generation_tokens_per_s"]
    return {"peak_memory_vs_trl": memory, "generation_speed_vs_generate": speed}


def _table(results: list[dict], summary: dict) -> str:
    lines = ["| system | peak GiB | step s | generation tokens/s |", "| --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['system']} | error: {r['error'][:80]} | | |")
            continue
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "–"
        step = f"{r['step_s']:.2f}" if "step_s" in r else "–"
        speed = f"{r['generation_tokens_per_s']:,.0f}" if "generation_tokens_per_s" in r else "–"
        lines.append(f"| {r['system']} | {peak} | {step} | {speed} |")
    memory, speed = summary["peak_memory_vs_trl"], summary["generation_speed_vs_generate"]
    lines.append("")
    lines.append(
        f"fastft peak memory vs TRL GRPOTrainer: {f'{memory:.0%}' if memory else 'not measured'}; "
        f"generation vs plain generate: {f'{speed:.2f}x' if speed else 'not measured'}"
    )
    return "\n".join(lines)


# the driver's options its workers take and its record's settings repeat
_WORKER_OPTIONS = ("workload", "prompts", "generations", "prompt_tokens", "completion_tokens")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("grpo", __doc__, SYSTEMS, "fastft,trl,generate")
    parser.add_argument("--workload", choices=("bf16", "nf4"), default="nf4", help="the base's precision")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--completion-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0, help="the prompts' seed")
    parser.add_argument("--folder", default="/dev/shm/fastft-bench-step", help="the random checkpoints")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per system")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="benchmarks/grpo.json")
    worker_options(parser, "grpo", workload=False)
    args = parse_or_work(parser, argv, run_worker)
    if args is None:
        return 0

    systems = systems_of(parser, args.systems, SYSTEMS)
    folder = ensure_checkpoint(args)
    results = []
    for system in systems:
        worker = ["--worker", "--system", system, "--folder", str(folder)]
        worker += option_argv(args, (*_WORKER_OPTIONS, "seed", "device"))
        result = run_system(system, worker, "fastft.bench.grpo", args.timeout)
        results.append(result)
        print(f"{system:>9}: {result.get('error') or 'done'}", file=sys.stderr, flush=True)
    summary = summarise(results)
    settings = {key: getattr(args, key) for key in ("model", "layers", *_WORKER_OPTIONS)}

    record = {"benchmark": "grpo", "settings": settings, "environment": environment(), "results": results}
    table = _table(results, summary)
    save_record(args.out, record | {"summary": summary}, table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

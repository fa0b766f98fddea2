"""One rank of a distributed test run (started by torchrun from `test_distributed.py`), or the same run in one
process: tiny-llama with LoRA trained by plain `fastft.train`, which finds torchrun's environment itself.

``python distributed_worker.py OUT CONFIG_JSON``: rank 0 (or the single process) writes ``OUT/result.pt`` with
the step losses, the events' trained-token counts and the final LoRA weights; every rank writes
``OUT/rank-N.json`` with the checkpoint folders it saw written.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch

import fastft
from fastft.data.skills import generate
from fastft.training.distributed import is_main_process

ROWS = list(generate(96, seed=21))


def run(out: Path, config: dict) -> dict:
    """Train with `config` (TrainConfig fields, plus "checkpointing", "dropout", "eval": held-out rows, and
    "fp16_overflow": ``[rank, step]``, fp16's loss scale on the CPU with one rank's gradient shard made infinite
    at that step, `_overflow_on_one_rank`)."""
    torch.set_num_threads(1)
    config = dict(config)
    checkpointing, dropout = config.pop("checkpointing", "none"), config.pop("dropout", 0.0)
    held_out = config.pop("eval", False)
    overflow = config.pop("fp16_overflow", None)
    scaler_steps = _overflow_on_one_rank(*overflow) if overflow else []
    writes = _count_checkpoint_writes()
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128, device="cpu")
    model = fastft.add_lora(
        model, r=4, alpha=8, dropout=dropout, seed=7, gradient_checkpointing=checkpointing
    )
    if config.get("method") == "grpo":  # GRPO on skills questions, each rank sampling its share
        from fastft.data.rewards import content_match, length_penalty
        from fastft.training.objectives.grpo import grpo

        config.pop("method")
        settings = (
            dict(
                prompts_per_step=4,
                num_generations=3,
                max_new_tokens=6,
                learning_rate=1e-2,
                warmup=0,
                seed=11,
                micro_batch_tokens=96,
                attention="sdpa_masked",
            )
            | config
        )
        rewards = [content_match, length_penalty(limit=4, per_char=0.05)]
        result = grpo(model, tokenizer, ROWS[:16], rewards, progress=False, **settings)
        return _summarise(out, model, result, writes)
    if config.get("method", "sft") == "sft":
        data = fastft.pack(ROWS, tokenizer, 128)
        eval_data = fastft.pack(list(generate(20, seed=3)), tokenizer, 128) if held_out else None
    else:  # preference rows, packed into pairs by the trainer
        data, eval_data = preference_rows(48, seed=1), preference_rows(12, seed=2) if held_out else None
    # a fixed attention backend: "auto" times the backends and may pick another one run to run
    settings = dict(learning_rate=3e-3, micro_batch_bins=2, seed=5, attention="sdpa_masked") | config
    result = fastft.train(model, tokenizer, data, eval_data, progress=False, **settings)
    return _summarise(out, model, result, writes, scaler_steps)


def _overflow_on_one_rank(rank: int, step: int) -> list[dict]:
    """The trainer's fp16 path (autocast in fp16, `fastft.training.loss_scale.LossScaler`) on the CPU, and on
    rank `rank` one element of its own gradient shard set to inf before the unscale of optimizer step `step`
    (1-based): an overflow only that rank sees, as an FSDP2 shard can. Returns the list each step's
    ``found_inf`` and scale are appended to, as the scaler leaves them (read on the host: a test)."""
    from fastft.training.loss_scale import LossScaler
    from fastft.training.trainer import Trainer

    Trainer._autocast_dtype = lambda self: torch.float16
    here = int(os.environ.get("RANK", 0))
    seen: list[dict] = []
    unscale, update = LossScaler.unscale_, LossScaler.update

    def unscale_(self, parameters, all_reduce=None):
        parameters = list(parameters)
        if here == rank and len(seen) + 1 == step:
            grad = next(p.grad for p in parameters if p.grad is not None and p.grad.numel())
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[0] = float("inf")
        return unscale(self, parameters, all_reduce)

    def recorded_update(self):
        found = float(self.found_inf)
        update(self)
        seen.append({"found_inf": found, "scale": float(self.scale)})

    LossScaler.unscale_, LossScaler.update = unscale_, recorded_update
    return seen


def _summarise(out: Path, model, result, writes: list[str], scaler_steps: list[dict] = ()) -> dict:
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    weights = {n: (w.full_tensor() if hasattr(w, "full_tensor") else w) for n, w in weights.items()}
    rank = int(os.environ.get("RANK", 0))
    summary = {
        "losses": [e.loss for e in result.steps],
        "trained": [e.trained_tokens for e in result.steps],
        "grad_norms": [e.grad_norm for e in result.steps],
        "phases": sorted({name for e in result.steps for name in e.phases}),
        "evals": [e.eval_loss for e in result.evals],
        "preference": [e.preference for e in result.steps] + [e.preference for e in result.evals],
        "grpo": [e.grpo for e in result.steps],
        "weights": weights,
    }
    out.mkdir(parents=True, exist_ok=True)
    if is_main_process():
        torch.save(summary, out / "result.pt")
    (out / f"rank-{rank}.json").write_text(
        json.dumps({"checkpoints": result.checkpoints, "writes": writes, "scaler": list(scaler_steps)})
    )
    return summary


def preference_rows(count: int, seed: int) -> list[dict]:
    """Prompt, chosen and rejected texts of random words (seeded)."""
    rng = np.random.default_rng(seed)
    words = "the a cat dog runs sat on mat blue green red one two three four".split()

    def text(n):
        return " ".join(rng.choice(words, n))

    return [
        {
            "prompt": text(int(rng.integers(3, 17))),
            "chosen": text(int(rng.integers(1, 9))),
            "rejected": text(int(rng.integers(2, 13))),
        }
        for _ in range(count)
    ]


def _count_checkpoint_writes() -> list[str]:
    """The folders this process writes through `fastft.atomic.replace_folder_atomically` (the checkpoint's
    one writer), recorded by a wrapper set in this worker process only."""
    from fastft.training import checkpoint

    written: list[str] = []
    original = checkpoint.replace_folder_atomically

    def recording(write, folder, **options):
        written.append(Path(folder).name)
        return original(write, folder, **options)

    checkpoint.replace_folder_atomically = recording
    return written


if __name__ == "__main__":
    run(Path(sys.argv[1]), json.loads(sys.argv[2]))
    if torch.distributed.is_initialized():
        # every rank done with every collective before any tears its group down: once, in CI, a rank
        # aborted ("terminate called without an active exception") while the two ended their groups
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()

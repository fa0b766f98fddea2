"""`python -m fastft.bench.fsdp_limits`: what `FSDP_LIMITS` refuses under FSDP2, tried anyway on a GPU.

`fastft.training.distributed.FSDP_LIMITS` names what fastft does not run under ``distributed="fsdp"``: a
quantised (NF4) base, and CUDA-graph replay. This probe forces each past fastft's refusal, under torchrun
with the NCCL backend, and records what happens, so the refusal's reason is a measured one:

* **quantised base**: a random-weight NF4 model with LoRA; its loss and LoRA gradients on one batch,
  unsharded; then `fully_shard` on every decoder layer and the decoder as `shard_model` does, and the same
  batch again. The record says at which stage it failed (shard, forward, backward) with the error, or the
  loss's and gradients' differences from the unsharded pass.
* **cuda_graph**: fastft's Trainer under FSDP2 on packed chat data (`fastft bench sft`'s workload), with
  its step graph turned back on; beside an eager run of the same model and data. The record gives the
  graph's captures and replays, any capture warning, and each step's loss in both runs.

    python3 -m torch.distributed.run --standalone --nproc_per_node=1 -m fastft.bench.fsdp_limits \\
        --model meta-llama/Llama-3.2-1B-Instruct --json benchmarks/fsdp_limits.json

One rank on one GPU shows whether the mechanism runs at all; the collectives of two or more ranks are a
separate question (a graph of one rank captures trivial all-gathers).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

from fastft.bench.common import environment
from fastft.bench.harness import checkpoint_folder, ensure_checkpoint, fastft_model, packed
from fastft.bench.sft import chat_rows
from fastft.models.lora import add_lora
from fastft.models.random_model import build_random_model
from fastft.training.distributed import decoder_layers, full_tensor, launched, setup
from fastft.training.graph import GraphCaptureWarning, StepGraph
from fastft.training.trainer import TrainConfig, Trainer
from fastft.vram.measure import synthetic_batch

# Function-local imports: torch.distributed's checkpoint and FSDP modules load only in a distributed run; tests
# replace these names on their modules, so they are looked up when called.


def _error(stage: str, error: BaseException) -> dict:
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return {"stage": stage, "error": f"{type(error).__name__}: {error}"[:2000], "raised_at": where}


def _relative(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def quantised_base(model_name: str, tokens: int, device) -> dict:
    """NF4 + LoRA: one batch unsharded, then sharded as `shard_model` would (its refusal skipped)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fastft.training.loss import causal_lm_loss_sum

    model = add_lora(build_random_model(model_name, "nf4", device), r=16, alpha=16, seed=0)
    model.train()
    batch = synthetic_batch(tokens, tokens, model.config.vocab_size, seed=0).to(device)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def loss_and_grads():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = causal_lm_loss_sum(model, batch) / batch.num_trained_tokens
        loss.backward()
        grads = {n: full_tensor(p.grad).detach().clone() for n, p in trained}
        for _, p in trained:
            p.grad = None
        return loss.detach().float(), grads

    reference_loss, reference_grads = loss_and_grads()
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    record: dict = {"model": model_name, "tokens": tokens, "parameter_types": kinds}
    try:
        mesh = init_device_mesh("cuda", (torch.distributed.get_world_size(),))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        base = model.get_base_model()
        fully_shard(base.get_decoder(), mesh=mesh)
        record["sharded_parameter_types"] = sorted({type(p).__name__ for p in model.parameters()})
    except Exception as error:  # noqa: BLE001 - the record is the point
        record.update(_error("shard", error))
        return record
    try:
        loss, grads = loss_and_grads()
    except Exception as error:  # noqa: BLE001
        record.update(_error("forward or backward", error))
        return record
    record.update(
        stage="ran",
        loss=float(loss),
        reference_loss=float(reference_loss),
        loss_relative_difference=abs(float(loss - reference_loss)) / abs(float(reference_loss)),
        worst_gradient_relative_difference=max(
            _relative(grads[n], reference_grads[n]) for n in reference_grads
        ),
    )
    return record


def cuda_graph(checkpoint: str, steps: int, chats: int, device) -> dict:
    """fastft's Trainer under FSDP2 with its step graph on, beside the same run eager."""

    runs = {}
    for name, graphs in (("eager", False), ("graphed", True)):
        model = fastft_model(checkpoint, "bf16", 4096, "auto", device)
        vocab = model.get_input_embeddings().weight.shape[0]
        rows = chat_rows(chats, vocab, 120.0, 220.0, 0.7, 4096, 0)
        config = TrainConfig(
            max_steps=steps, warmup=0, learning_rate=1e-4, distributed="fsdp", seed=0, static_shapes=True
        )
        trainer = Trainer(model, None, packed(rows, 4096), config=config)
        if graphs:  # what FSDP_LIMITS turns off, turned back on
            trainer.step_graph = StepGraph(
                trainer.parameters, enabled=True, accumulators=[trainer.metric_sums]
            )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", GraphCaptureWarning)
            try:
                result = trainer.train()
            except Exception as error:  # noqa: BLE001
                runs[name] = _error("train", error)
                del trainer, model
                gc.collect()
                torch.cuda.empty_cache()
                continue
        runs[name] = {
            "cuda_graph": dict(result.cuda_graph),
            "graph_replays": sum(e.graph_replays for e in result.steps),
            "micro_batches": sum(e.micro_batches for e in result.steps),
            "losses": [e.loss for e in result.steps],
            "capture_warnings": [str(w.message)[:2000] for w in caught if w.category is GraphCaptureWarning],
        }
        del trainer, model, result
        gc.collect()
        torch.cuda.empty_cache()
    eager, graphed = runs.get("eager", {}), runs.get("graphed", {})
    if "losses" in eager and "losses" in graphed:
        runs["worst_loss_relative_difference"] = max(
            abs(g - e) / abs(e) for g, e in zip(graphed["losses"], eager["losses"], strict=True)
        )
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fastft.bench.fsdp_limits", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", default="meta-llama/Llama-3.2-1B-Instruct", help="catalog hub id")
    parser.add_argument("--tokens", type=int, default=2048, help="the quantised probe's batch")
    parser.add_argument("--steps", type=int, default=8, help="the graph probe's steps")
    parser.add_argument("--chats", type=int, default=400)
    parser.add_argument("--folder", default="/dev/shm/fastft-bench-step", help="the random checkpoint")
    parser.add_argument("--json", default="benchmarks/fsdp_limits.json")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available() or not launched():
        parser.error("run under torchrun on a CUDA GPU (see the module's docstring)")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    parallel = setup(device, "fsdp")
    report = {"command": " ".join(sys.argv), "world_size": parallel.world_size, "environment": environment()}
    report["quantised_base"] = quantised_base(args.model, args.tokens, device)
    gc.collect()
    torch.cuda.empty_cache()
    if parallel.rank == 0:  # the random checkpoint the graph probe loads, once
        args.layers = None
        checkpoint = ensure_checkpoint(args)
    torch.distributed.barrier()
    if parallel.rank != 0:
        checkpoint = checkpoint_folder(Path(args.folder), args.model, None)
    report["cuda_graph"] = cuda_graph(str(checkpoint), args.steps, args.chats, device)
    if parallel.rank == 0:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2)[:6000])
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""fp16 on CUDA keeps the CUDA graph: the loss scaler's step replays like a bf16 one, with no host sync, the
same losses as the eager fp16 run and as bf16 within fp16 noise, and an overflow during replays is skipped
on the device (the replayed backward reads the lowered scale)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fastft
from fastft.bench.common import count_syncs
from fastft.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.gpu


def _fixed_length_data(vocab: int, rows: int, length: int, seed: int = 0):
    """Rows of exactly `length` random tokens, every token trained: every batch has one shape."""
    from fastft.data.packing import PackedDataset
    from fastft.data.tokenize import TokenizedData

    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, vocab, length).astype(np.int32) for _ in range(rows)]
    data = TokenizedData(input_ids=ids, labels=[row.copy() for row in ids], source_rows=list(range(rows)))
    return PackedDataset(data, [[i] for i in range(rows)], max_seq_length=length)


def _trainer(
    dtype: torch.dtype,
    cuda_graph: bool,
    steps: int,
    preset: str = "tiny-llama",
    load_in_4bit: bool = False,
    **config,
) -> Trainer:
    torch.manual_seed(0)
    model, tokenizer = fastft.load_model(preset, device="cuda", dtype=dtype, load_in_4bit=load_in_4bit)
    model = fastft.add_lora(model, r=8, target_modules="all-linear", seed=1)
    data = _fixed_length_data(model.config.vocab_size, rows=64, length=96)
    config = TrainConfig(max_steps=steps, warmup=0, cuda_graph=cuda_graph, learning_rate=1e-3, **config)
    return Trainer(model, tokenizer, data, config=config)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_gpu_fp16_steps_replay_a_cuda_graph_with_the_eager_losses(preset):
    steps = 8
    eager = _trainer(torch.float16, False, steps, preset, grad_accum_steps=2)
    graphed = _trainer(torch.float16, True, steps, preset, grad_accum_steps=2)
    assert graphed.loss_scaler is not None and graphed.autocast_dtype == torch.float16
    eager_losses = [e.loss for e in eager.train().steps]
    result = graphed.train()
    # two eager micro-batches (step 1), the first of step 2 captured, every later one replayed
    assert result.cuda_graph == dict(captures=1, replays=2 * steps - 3, eager=2, drops=0)
    assert sum(e.graph_replays for e in result.steps) == 2 * steps - 3
    np.testing.assert_allclose([e.loss for e in result.steps], eager_losses, rtol=2e-2)
    assert all(math.isfinite(e.grad_norm) for e in result.steps)


def test_gpu_fp16_and_bf16_runs_learn_the_same_losses():
    steps = 12
    bf16 = _trainer(torch.bfloat16, True, steps).train()
    fp16 = _trainer(torch.float16, True, steps).train()
    assert fp16.cuda_graph["replays"] == bf16.cuda_graph["replays"] == steps - 3
    bf16_losses, fp16_losses = [e.loss for e in bf16.steps], [e.loss for e in fp16.steps]
    print("bf16", bf16_losses, "\nfp16", fp16_losses)
    np.testing.assert_allclose(fp16_losses, bf16_losses, rtol=3e-2)


def test_gpu_fp16_qlora_keeps_fp16_weights_replays_and_learns_the_bf16_losses():
    """QLoRA in fp16 (a T4's): the frozen embeddings, norms and head stay fp16 (no fp32 residual stream),
    the step replays as a CUDA graph, and the losses are bf16's within fp16 noise."""
    steps = 12
    bf16 = _trainer(torch.bfloat16, True, steps, load_in_4bit=True)
    fp16 = _trainer(torch.float16, True, steps, load_in_4bit=True)
    frozen = {p.dtype for p in fp16.model.parameters() if not p.requires_grad and p.is_floating_point()}
    assert frozen == {torch.float16} and {p.dtype for p in fp16.parameters} == {torch.float32}
    bf16_result, fp16_result = bf16.train(), fp16.train()
    assert fp16_result.cuda_graph["replays"] == bf16_result.cuda_graph["replays"] == steps - 3
    bf16_losses, fp16_losses = [e.loss for e in bf16_result.steps], [e.loss for e in fp16_result.steps]
    print("bf16", bf16_losses, "\nfp16", fp16_losses)
    np.testing.assert_allclose(fp16_losses, bf16_losses, rtol=3e-2)


def test_gpu_a_replayed_fp16_step_makes_no_host_sync():
    trainer = _trainer(torch.float16, True, 10)
    trainer.train(steps=4)  # warm-up, capture, a replay
    syncs = count_syncs(trainer._train_step)
    trainer.step += 1
    assert trainer.step_graph.stats["replays"] >= 2
    assert syncs == 0


def test_gpu_an_overflow_during_replays_is_skipped_and_the_scale_backs_off():
    """A scale far too large, set between replays, overflows the replayed fp16 backward: the step is skipped
    on the device (weights, moments and step count unchanged), the scale halves, and the run goes on."""
    trainer = _trainer(torch.float16, True, 8)
    trainer.train(steps=4)
    assert trainer.step_graph.holds_gradients
    weights = [p.detach().clone() for p in trainer.parameters]
    moments = [trainer.optimizer.state[p]["exp_avg"].clone() for p in trainer.parameters]
    counts = [float(trainer.optimizer.state[p]["step"]) for p in trainer.parameters]
    trainer.loss_scaler.scale.fill_(2.0**100)  # in place: the graph reads it at the next replay
    trainer.train(steps=1)
    event = trainer.result.steps[-1]
    assert event.graph_replays == 1 and not math.isfinite(event.grad_norm) and math.isfinite(event.loss)
    assert float(trainer.loss_scaler.scale) == 2.0**99
    assert all(torch.equal(p, w) for p, w in zip(trainer.parameters, weights, strict=True))
    assert all(
        torch.equal(trainer.optimizer.state[p]["exp_avg"], m)
        for p, m in zip(trainer.parameters, moments, strict=True)
    )
    assert [float(trainer.optimizer.state[p]["step"]) for p in trainer.parameters] == counts
    trainer.loss_scaler.scale.fill_(2.0**12)
    result = trainer.train()
    assert all(math.isfinite(e.grad_norm) for e in result.steps[-3:])
    assert trainer.step_graph.stats["captures"] == 1 and trainer.step_graph.stats["drops"] == 0

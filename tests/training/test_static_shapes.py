"""Packed micro-batches padded to one static shape (`fastft.data.batch.BatchShape`, `PackedBatch.padded`,
`TrainConfig.static_shapes`): the layout, and the same loss and LoRA gradients as the unpadded batch.

Tolerance (fp32 on the CPU): loss and every LoRA gradient within 1e-5 relative (``||a - b|| / ||b||`` per
parameter); padding changes only the summation order of the matmuls' token dimension.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import fastft
from fastft.data.batch import BatchShape, PackedBatch
from fastft.data.tokenize import IGNORE_INDEX
from fastft.models.patch import UnfusedWarning
from fastft.runtime.attention import patch_packed_attention
from fastft.training.graph import batch_signature
from fastft.training.loss import causal_lm_loss_sum
from fastft.training.trainer import TrainConfig, Trainer

RAGGED = (7, 31, 3, 40, 2, 17)


def _batch(lengths=RAGGED, vocab: int = 500, prompt: int = 3, seed: int = 0) -> PackedBatch:
    """Chat-like rows: the first `prompt` tokens of each (a prompt) are not trained."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, vocab, n) for n in lengths]
    labels = [
        np.where(np.arange(n) >= prompt, row, IGNORE_INDEX) for n, row in zip(lengths, ids, strict=True)
    ]
    return PackedBatch.from_sequences(ids, labels)


def test_padded_batch_is_a_pad_tail_segment_with_zero_length_boundaries_and_ignored_targets():
    batch = _batch()
    shape = BatchShape.covering(
        tokens=batch.num_tokens + 9, sequences=9, targets=batch.num_trained_tokens + 5
    )
    padded = batch.padded(shape)
    real, pad = batch.num_tokens, shape.tokens - batch.num_tokens
    assert padded.static and padded.padding == pad and padded.real_tokens == real
    assert padded.input_ids.shape == (1, shape.tokens) and padded.max_seqlen == shape.tokens
    assert torch.equal(padded.input_ids[0, :real], batch.input_ids[0])
    assert torch.equal(padded.labels[0, real:], torch.full((pad,), IGNORE_INDEX))
    assert torch.equal(padded.position_ids[0, real:], torch.arange(pad))  # the pad tail is its own sequence
    cu = padded.cu_seqlens.tolist()
    assert len(cu) == shape.segments + 1 == padded.num_sequences + 1
    assert cu[: batch.num_sequences + 1] == batch.cu_seqlens.tolist()
    assert cu[batch.num_sequences + 1 :] == [shape.tokens] * (len(cu) - batch.num_sequences - 1)
    assert padded.target_ids.shape == (shape.targets,)
    assert torch.equal(padded.target_ids[: batch.num_trained_tokens], batch.target_ids)
    assert set(padded.target_ids[batch.num_trained_tokens :].tolist()) == {IGNORE_INDEX}
    # host statistics stay the real ones
    assert padded.num_trained_tokens == batch.num_trained_tokens
    assert padded.sequence_lengths == (*batch.sequence_lengths, pad)


def test_shapes_round_up_refuse_what_does_not_fit_and_grow_for_it():
    shape = BatchShape.covering(tokens=100, sequences=3, targets=70)
    assert (shape.tokens, shape.segments, shape.targets) == (128, 8, 128)
    assert BatchShape.covering(tokens=4096, sequences=40, targets=3000).targets == 3008
    big = _batch((120, 60))
    assert not shape.holds(big)
    with pytest.raises(ValueError, match="does not fit"):
        big.padded(shape)
    grown = shape.grown_to(big)
    assert grown.holds(big) and grown.tokens >= 2 * shape.tokens
    assert shape.holds(_batch((64, 64)))  # exactly full: no pad segment needed
    with pytest.raises(ValueError, match="already padded"):
        _batch((5, 6)).padded(shape).padded(shape)


def test_every_ragged_batch_padded_to_the_shape_signs_the_same():
    shape = BatchShape.covering(tokens=128, sequences=12, targets=128)
    batches = [
        _batch(lengths, seed=i) for i, lengths in enumerate([(5, 7), (40, 2, 9, 33), (100,), (3,) * 11])
    ]
    assert len({batch_signature(batch.padded(shape)) for batch in batches}) == 1


def _odd_llama():
    """Odd hidden and intermediate sizes, one kv head for three query heads, a 32,001-token vocabulary."""
    config = LlamaConfig(
        hidden_size=90,
        intermediate_size=181,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=30,
        num_hidden_layers=2,
        vocab_size=32001,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _lora(model, fused: bool):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnfusedWarning)
        model = fastft.add_lora(model, r=4, alpha=8, gradient_checkpointing=False, fused=fused)
    with torch.no_grad():  # B = 0 at init would make every A gradient zero: give the adapters some weight
        generator = torch.Generator().manual_seed(1)
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    model.train()
    return model


def _loss_and_grads(model, batch):
    lora = [p for p in model.parameters() if p.requires_grad]
    loss = causal_lm_loss_sum(model, batch)
    return loss.detach(), torch.autograd.grad(loss, lora)


def _assert_close(padded, unpadded):
    (loss, grads), (want_loss, want) = padded, unpadded
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)
    for got, expected in zip(grads, want, strict=True):
        assert float((got - expected).norm() / expected.norm().clamp_min(1e-30)) <= 1e-5


@pytest.mark.parametrize(
    "name, fused",
    [("tiny-llama", False), ("tiny-qwen3", False), ("tiny-moe", False), ("tiny-llama", True), ("odd", False)],
)
def test_padded_batch_gives_the_unpadded_loss_and_every_lora_gradient(name, fused):
    if name == "odd":
        model, vocab = _odd_llama(), 32001
    else:
        model, vocab = fastft.load_model(name)[0], 500
    model = _lora(model, fused)
    patch_packed_attention(model, "sdpa_masked")
    batch = _batch(vocab=vocab)
    shape = BatchShape.covering(tokens=batch.num_tokens + 50, sequences=10, targets=batch.num_tokens)
    _assert_close(_loss_and_grads(model, batch.padded(shape)), _loss_and_grads(model, batch))


def _chat_rows(count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    words = "the a cat dog runs sat on mat quickly blue green red one two three".split()
    rows = []
    for _ in range(count):
        question = " ".join(rng.choice(words, rng.integers(2, 12)))
        answer = " ".join(rng.choice(words, rng.integers(1, 20)))
        rows.append(
            {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        )
    return rows


def _run(static_shapes, **config):
    model, tokenizer = fastft.load_model("tiny-llama")
    model = _lora(model, fused=False)
    data = fastft.pack(_chat_rows(48), tokenizer, max_seq_length=96)
    trainer = Trainer(
        model,
        tokenizer,
        data,
        config=TrainConfig(max_steps=4, attention="sdpa_masked", static_shapes=static_shapes, **config),
    )
    return trainer, trainer.train()


@pytest.mark.parametrize("accumulation", [dict(), dict(micro_batch_bins=2, grad_accum_steps=2)])
def test_a_run_on_static_shapes_trains_like_one_on_ragged_batches(accumulation):
    """Every step's loss and gradient norm, with gradient accumulation's varying trained-token counts too;
    the events count real tokens and report the padding."""
    padded_trainer, padded = _run(True, **accumulation)
    ragged_trainer, ragged = _run(False, **accumulation)
    assert ragged_trainer.batch_shape is None and padded_trainer.batch_shape is not None
    np.testing.assert_allclose([e.loss for e in padded.steps], [e.loss for e in ragged.steps], rtol=1e-5)
    np.testing.assert_allclose(
        [e.grad_norm for e in padded.steps], [e.grad_norm for e in ragged.steps], rtol=1e-5
    )
    assert [e.tokens for e in padded.steps] == [e.tokens for e in ragged.steps]
    assert [e.trained_tokens for e in padded.steps] == [e.trained_tokens for e in ragged.steps]
    assert all(e.padding_tokens > 0 for e in padded.steps) and all(
        e.padding_tokens == 0 for e in ragged.steps
    )
    shape = padded_trainer.batch_shape
    size = accumulation.get("micro_batch_bins", 1)
    assert shape.tokens >= padded_trainer.train_data.largest_batch(size)[0]
    assert shape.tokens <= 96 * size + 63  # the run's largest micro-batch, rounded up: not a worst case


def test_auto_pads_only_where_a_cuda_graph_can_replay():
    trainer, result = _run(None)  # the CPU: no graph, so no padding to pay for
    assert trainer.batch_shape is None and all(e.padding_tokens == 0 for e in result.steps)


gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_run(preset: str, checkpointing, graphed: bool, steps: int, **config):
    torch.manual_seed(0)
    model, tokenizer = fastft.load_model(preset, device="cuda", dtype=torch.bfloat16)
    targets = "all-linear" if preset != "tiny-moe" else ["q_proj", "v_proj", "experts"]
    model = fastft.add_lora(model, r=8, target_modules=targets, gradient_checkpointing=checkpointing)
    data = fastft.pack(_chat_rows(160), tokenizer, max_seq_length=128)
    static = None if graphed else False
    trainer = Trainer(
        model,
        tokenizer,
        data,
        config=TrainConfig(
            max_steps=steps, warmup=0, learning_rate=1e-3, cuda_graph=graphed, static_shapes=static, **config
        ),
    )
    return trainer, trainer.train()


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "preset, checkpointing, accumulation",
    [
        ("tiny-llama", "offload", {}),
        ("tiny-qwen3", False, {}),
        ("tiny-moe", True, {}),
        ("tiny-llama", True, dict(micro_batch_bins=2, grad_accum_steps=2)),
    ],
)
def test_gpu_chat_data_replays_one_graph_and_trains_like_ragged_eager_steps(
    preset, checkpointing, accumulation
):
    """Packed chat bins (every one its own lengths) padded to the run's shape by default: two eager warm-up
    micro-batches, one capture, then every micro-batch replays, through varlen attention with zero-length
    boundaries, and the losses follow the unpadded eager run's."""
    steps = 8
    trainer, graphed = _gpu_run(preset, checkpointing, True, steps, **accumulation)
    _, eager = _gpu_run(preset, checkpointing, False, steps, **accumulation)
    micro = accumulation.get("grad_accum_steps", 1)
    assert trainer.batch_shape is not None and "varlen" in graphed.attention
    # two micro-batches run eagerly (warm-up), whole steps of them; the next step's first is captured
    warm_steps = -(-2 // micro)
    warm = warm_steps * micro
    assert graphed.cuda_graph == dict(captures=1, replays=steps * micro - warm - 1, eager=warm, drops=0)
    assert [e.graph_replays for e in graphed.steps][warm_steps + 1 :] == [micro] * (steps - warm_steps - 1)
    assert eager.cuda_graph["replays"] == 0 and all(e.padding_tokens == 0 for e in eager.steps)
    np.testing.assert_allclose([e.loss for e in graphed.steps], [e.loss for e in eager.steps], rtol=2e-2)
    assert len({e.loss for e in graphed.steps}) == steps  # every replay read its own batch
    assert [e.tokens for e in graphed.steps] == [e.tokens for e in eager.steps]  # real tokens, not pad slots


def test_fixed_length_rows_are_left_unpadded_where_graphs_run_and_chat_data_is_padded():
    """Rows that already share one shape replay as they are (and keep the uniform bins' attention path);
    chat data is padded. The decision as a CUDA run makes it, with the graph policy switched on by hand."""
    from fastft.data.packing import PackedDataset
    from fastft.data.tokenize import TokenizedData

    model, tokenizer = fastft.load_model("tiny-llama")
    model = _lora(model, fused=False)
    rng = np.random.default_rng(0)
    ids = [rng.integers(3, 500, 64) for _ in range(8)]
    fixed = PackedDataset(TokenizedData(input_ids=ids, labels=[i.copy() for i in ids], source_rows=list(range(8))),
                          [[i] for i in range(8)], max_seq_length=64)  # fmt: skip
    chats = fastft.pack(_chat_rows(48), tokenizer, max_seq_length=96)
    assert fixed.batches_repeat_one_shape() and not chats.batches_repeat_one_shape()
    for data, pads in ((fixed, False), (chats, True)):
        trainer = Trainer(model, tokenizer, data, config=TrainConfig(max_steps=2, attention="sdpa_masked"))
        trainer.step_graph.policy.enabled = True  # as on CUDA
        assert trainer.objective.pads_batches(trainer, data.batch([0])) is pads

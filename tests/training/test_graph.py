"""CUDA-graph replay of a micro-batch's forward and backward (`fastft.training.graph`).

The policy (when to run eagerly, capture, replay or drop) is host logic and runs everywhere; the capture
itself needs a GPU: those tests train the same fixed-length data with and without graphs and compare.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import fastft
from fastft.data.batch import BatchShape, PackedBatch
from fastft.data.packing import PackedDataset
from fastft.data.tokenize import TokenizedData
from fastft.training.graph import CAPTURE, EAGER, REPLAY, GraphPolicy, StepGraph, batch_signature
from fastft.training.trainer import TrainConfig, Trainer

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _batch(lengths, trained_from=1, seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, 100, n) for n in lengths]
    labels = [np.where(np.arange(n) >= trained_from, row, -100) for n, row in zip(lengths, ids, strict=True)]
    return PackedBatch.from_sequences(ids, labels)


def _divisor(batch):
    return torch.tensor(float(batch.num_trained_tokens), device=batch.device)


def test_signature_holds_every_host_value_a_step_reads():
    a, b = _batch([5, 7]), _batch([5, 7], seed=1)
    assert batch_signature(a) == batch_signature(b)  # other tokens, same shape: replayable
    assert batch_signature(a) != batch_signature(_batch([7, 5]))  # same total, other boundaries
    assert batch_signature(a) != batch_signature(_batch([5, 7], trained_from=2))  # trained count


def test_batches_padded_to_one_shape_share_one_signature_whatever_their_sequences():
    shape = BatchShape.covering(tokens=40, sequences=5, targets=30)
    ragged = [
        _batch([5, 7]),
        _batch([13, 2, 9], trained_from=3, seed=2),
        _batch([40]),
        _batch([3, 3, 3, 3, 3]),
    ]
    signatures = {batch_signature(batch.padded(shape)) for batch in ragged}
    assert len(signatures) == 1
    assert len({batch_signature(batch) for batch in ragged}) == len(ragged)  # unpadded, each its own


def test_attended_length_is_the_token_weighted_mean_length_and_a_static_batch_reports_its_shapes():
    """What the kept-attention decision reads: one sequence's length, equal-length sequences' length, and for a
    bin of short chats with one long answer far less than its longest; a padded batch reports its shape's, or
    where the shape does not know it, its token count (the keeping decision then is the one before)."""
    assert _batch([4096]).attended_length == 4096
    assert _batch([2048, 2048]).attended_length == 2048
    chats = _batch([2100] + [300] * 6)  # 3,900 tokens
    assert chats.max_seqlen == 2100
    assert chats.attended_length == (2100**2 + 6 * 300**2) // 3900 == 1269
    shape = BatchShape.covering(tokens=4096, sequences=8, targets=4000, attended=1269)
    assert chats.padded(shape).attended_length == 1269 and chats.padded(shape).max_seqlen == 4096
    unknown = BatchShape.covering(tokens=4096, sequences=8, targets=4000)
    assert chats.padded(unknown).attended_length == 4096
    assert shape.grown_to(_batch([5000])).attended == 1269  # a widened shape keeps the run's value


def test_a_run_shape_knows_the_attended_length_of_all_its_sequences():
    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=4)
    rng = np.random.default_rng(0)
    lengths = [40, 8, 8, 8, 30, 30, 12]
    ids = [rng.integers(3, 100, n).astype(np.int32) for n in lengths]
    data = TokenizedData(input_ids=ids, labels=[row.copy() for row in ids], source_rows=list(range(len(ids))))
    packed = PackedDataset(data, [[0, 1, 2, 3], [4, 5], [6]], max_seq_length=64)
    # the token-weighted mean of the bins' (28, 30 and 12): one decision for every replay of the run's graph
    assert packed.attended_length() == sum(n * n for n in lengths) // sum(lengths) == 3736 // 136 == 27
    trainer = Trainer(model, tokenizer, packed, config=TrainConfig(max_steps=1, warmup=0))
    assert trainer.objective.covering_shape(trainer).attended == 27


def test_policy_captures_after_warmup_at_a_step_start_and_replays_the_same_shape():
    policy = GraphPolicy(warmup=2)
    assert [policy.decide("s", True) for _ in range(2)] == [EAGER, EAGER]
    assert policy.decide("s", False) == EAGER  # not at a step's first micro-batch: gradients may be non-zero
    assert policy.decide("s", True) == CAPTURE
    assert [policy.decide("s", first) for first in (True, False, True)] == [REPLAY] * 3
    assert policy.stats == dict(captures=1, replays=3, eager=3, drops=0)


def test_policy_drops_a_graph_for_another_shape_and_gives_up_when_shapes_never_settle():
    policy = GraphPolicy(warmup=1, max_captures=2)
    decisions = []
    for signature in ["a", "a", "a", "b", "b", "b", "c", "c", "c", "c"]:
        if policy.must_drop(signature):
            policy.dropped()
        decisions.append(policy.decide(signature, True))
    assert decisions == [EAGER, CAPTURE, REPLAY, EAGER, CAPTURE, REPLAY, EAGER, EAGER, EAGER, EAGER]
    assert policy.stats == dict(captures=2, replays=2, eager=6, drops=2)
    policy = GraphPolicy(enabled=False)
    assert {policy.decide("a", True) for _ in range(5)} == {EAGER}


def test_off_cuda_every_micro_batch_runs_eagerly_and_gives_the_plain_loss():
    model, _ = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=4)
    parameters = [p for p in model.parameters() if p.requires_grad]
    graph = StepGraph(parameters)
    batch = _batch([9, 14])

    def loss_fn(b, divisor):
        from fastft.training.loss import causal_lm_loss_sum

        return causal_lm_loss_sum(model, b) / divisor

    for _ in range(4):
        assert graph.mode(batch, True) == EAGER
        loss = graph.forward_backward(batch, _divisor(batch), loss_fn)
    assert not graph.holds_gradients and graph.stats["captures"] == 0
    expected = loss_fn(batch, _divisor(batch))
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_trainer_on_a_cpu_runs_every_micro_batch_eagerly_and_says_so():
    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=4)
    data = _fixed_length_data(model.config.vocab_size, rows=8, length=32)
    trainer = Trainer(model, tokenizer, data, config=TrainConfig(max_steps=3, warmup=0))
    result = trainer.train()
    assert result.cuda_graph == dict(captures=0, replays=0, eager=3, drops=0)
    assert not trainer.step_graph.holds_gradients


def _fixed_length_data(vocab: int, rows: int, length: int, seed: int = 0) -> PackedDataset:
    """`rows` sequences of exactly `length` tokens, every token trained, one sequence per bin: every
    batch has the same shape, the case a CUDA graph replays."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, vocab, length).astype(np.int32) for _ in range(rows)]
    data = TokenizedData(input_ids=ids, labels=[row.copy() for row in ids], source_rows=list(range(rows)))
    return PackedDataset(data, [[i] for i in range(rows)], max_seq_length=length)


def _train(preset: str, cuda_graph: bool, steps: int, checkpointing="auto", **config):
    torch.manual_seed(0)
    model, tokenizer = fastft.load_model(preset, device="cuda", dtype=torch.bfloat16)
    targets = (
        "all-linear" if "moe" not in preset and "mixtral" not in preset else ["q_proj", "v_proj", "experts"]
    )
    model = fastft.add_lora(model, r=8, target_modules=targets, gradient_checkpointing=checkpointing)
    data = _fixed_length_data(model.config.vocab_size, rows=64, length=96)
    trainer = Trainer(
        model,
        tokenizer,
        data,
        config=TrainConfig(max_steps=steps, warmup=0, cuda_graph=cuda_graph, learning_rate=1e-3, **config),
    )
    result = trainer.train()
    assert result.cuda_graph == trainer.step_graph.stats
    return [event.loss for event in result.steps], result.cuda_graph, result.steps[-1].phases


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "preset, checkpointing",
    [("tiny-llama", True), ("tiny-qwen3", False), ("tiny-moe", True), ("tiny-llama", "offload")],
)
def test_gpu_graph_replays_train_like_eager_steps(preset, checkpointing):
    steps = 8
    eager, eager_stats, _ = _train(preset, False, steps, checkpointing)
    graphed, stats, _ = _train(preset, True, steps, checkpointing)
    assert eager_stats["captures"] == 0
    # steps 1-2 eager (warm-up), step 3 captured and replayed, then replays
    assert stats == dict(captures=1, replays=steps - 3, eager=2, drops=0)
    np.testing.assert_allclose(graphed, eager, rtol=2e-2)
    # every replay read its own batch (random tokens: eight different losses, eagerly and replayed alike)
    assert len(set(graphed)) == steps


@gpu
@needs_cuda
def test_gpu_replayed_steps_report_the_peak_their_activations_reach():
    """A replay allocates nothing the allocator's counters see (its activations live in the graph's pool):
    the events report the capture's peak, also after a paused run restarts the counters, and it is no
    lower than the eager run's."""

    def peaks(cuda_graph: bool) -> tuple[list[int], int]:
        """The second call's steps' peaks, and what the run holds at rest (weights, adapters, optimizer)."""
        gc.collect()
        torch.cuda.empty_cache()
        torch.manual_seed(0)
        model, tokenizer = fastft.load_model("tiny-llama", device="cuda", dtype=torch.bfloat16)
        model = fastft.add_lora(model, r=8, gradient_checkpointing="offload")
        data = _fixed_length_data(model.config.vocab_size, rows=64, length=512)
        config = TrainConfig(max_steps=8, warmup=0, cuda_graph=cuda_graph)
        trainer = Trainer(model, tokenizer, data, config=config)
        resting = torch.cuda.memory_allocated()
        trainer.train(steps=4)
        result = trainer.train(steps=4)  # `train` restarts the allocator's peak: only replays from here
        assert result.cuda_graph["replays"] == (5 if cuda_graph else 0)
        return [event.peak_memory_bytes for event in result.steps], resting

    (eager, eager_resting), (graphed, graphed_resting) = peaks(False), peaks(True)
    # the step's activations above what the run holds at rest: as large replayed as eager
    activations = max(eager) - eager_resting
    assert activations > 0
    assert min(graphed) - graphed_resting >= 0.98 * activations


@gpu
@needs_cuda
def test_gpu_graph_with_gradient_accumulation_and_the_profiler_phase():
    steps = 6
    eager, _, _ = _train("tiny-llama", False, steps, True, micro_batch_bins=2, grad_accum_steps=2)
    graphed, stats, phases = _train("tiny-llama", True, steps, True, micro_batch_bins=2, grad_accum_steps=2)
    # two eager micro-batches (step 1), the first of step 2 captured, every later one replayed
    assert stats == dict(captures=1, replays=2 * steps - 3, eager=2, drops=0)
    np.testing.assert_allclose(graphed, eager, rtol=2e-2)
    # a replayed step is data, one `graph` phase per micro-batch and the optimizer; no hook fired inside
    assert phases["graph"] > 0 and phases.get("forward", 0.0) == 0.0 and "layers.attention" not in phases


@gpu
@needs_cuda
def test_gpu_graph_is_dropped_for_another_shape_and_its_memory_returns():
    model, tokenizer = fastft.load_model("tiny-llama", device="cuda", dtype=torch.bfloat16)
    model = fastft.add_lora(model, r=8, gradient_checkpointing=True)
    parameters = [p for p in model.parameters() if p.requires_grad]
    graph = StepGraph(parameters, warmup=1)
    from fastft.training.loss import causal_lm_loss_sum

    def loss_fn(b, divisor):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return causal_lm_loss_sum(model, b) / divisor

    short, long = _batch([40, 56]).to("cuda"), _batch([300, 211]).to("cuda")
    modes = []
    for batch in (short, short, short, long):
        modes.append(graph.mode(batch, True))
        loss = graph.forward_backward(batch, _divisor(batch), loss_fn)
        assert torch.isfinite(loss)
        for p in parameters:
            p.grad.zero_()
    assert modes == [EAGER, CAPTURE, REPLAY, EAGER]
    assert not graph.holds_gradients and graph.stats["drops"] == 1
    # replaying writes the new batch's tokens into the captured inputs: the loss follows the data
    graph = StepGraph(parameters, warmup=0)
    other = _batch([40, 56], seed=5).to("cuda")
    graph.mode(short, True)
    first = graph.forward_backward(short, _divisor(short), loss_fn).clone()
    graph.mode(other, True)
    replayed = graph.forward_backward(other, _divisor(other), loss_fn).clone()
    for p in parameters:
        p.grad.zero_()
    assert replayed.item() == pytest.approx(loss_fn(other, _divisor(other)).item(), rel=2e-2)
    assert replayed.item() != first.item()


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["offload", "offload-single", True])
def test_gpu_capture_replays_each_checkpointing_mode_like_eager(mode):
    """Forward and backward replayed against eager ones on the same weights, batch after batch: the loss
    and every LoRA gradient, for the offloaded modes too (their copy stream's work is captured)."""
    from fastft.training.loss import causal_lm_loss_sum

    torch.manual_seed(0)
    model, _ = fastft.load_model("tiny-llama", device="cuda", dtype=torch.bfloat16)
    model = fastft.add_lora(
        model, r=8, gradient_checkpointing="offload" if mode == "offload-single" else mode
    )
    if mode == "offload-single":  # the one-buffer ablation
        from fastft.runtime.offload import enable_offload

        enable_offload(model, double_buffer=False)
    model.train()
    parameters = [p for p in model.parameters() if p.requires_grad]

    def loss_fn(b, divisor):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return causal_lm_loss_sum(model, b) / divisor

    batches = [_batch([70, 33, 120], seed=seed).to("cuda") for seed in range(5)]
    expected = []
    for batch in batches:
        loss = loss_fn(batch, _divisor(batch))
        loss.backward()
        expected.append((loss.item(), [p.grad.clone() for p in parameters]))
        for p in parameters:
            p.grad = None
    graph = StepGraph(parameters, warmup=1)
    for batch, (loss, grads) in zip(batches, expected, strict=True):
        graph.mode(batch, True)
        replayed = graph.forward_backward(batch, _divisor(batch), loss_fn).item()
        assert replayed == pytest.approx(loss, rel=2e-2)
        for p, g in zip(parameters, grads, strict=True):
            scale = g.float().abs().max().clamp_min(1e-12)
            assert ((p.grad.float() - g.float()).abs().max() / scale).item() < 2e-2
            p.grad.zero_()
    assert graph.stats == dict(captures=1, replays=3, eager=1, drops=0)


@gpu
@needs_cuda
def test_gpu_captures_leave_no_memory_behind():
    """A run that captured, then ended, holds no device memory afterwards: each capture once kept a 64 MiB
    cuBLAS workspace for the new stream it warmed up on (a notebook that trains ten times lost 2 GB)."""
    import gc

    def one_run():
        _train("tiny-llama", True, 4, True)
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    one_run()  # the first capture may create what every later one reuses (the warm-up stream's workspace)
    after_one = one_run()
    assert one_run() - after_one < 2**20


def _pair_rows(count: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = "the a cat dog runs sat on mat blue green red one two three four".split()

    def text(low, high):
        return " ".join(rng.choice(words, int(rng.integers(low, high))))

    return [{"prompt": text(3, 30), "chosen": text(1, 20), "rejected": text(2, 25)} for _ in range(count)]


def _train_dpo(cuda_graph: bool, steps: int, **config):
    """DPO on ragged pairs with a trained-looking adapter (B random: rewards are not 0 at step 1) and a
    learning rate too small to move fp32 weights: every step sees the same weights, so eager and replayed
    steps compare batch by batch, with no bf16 noise compounding through updates."""
    from fastft.data.pairs import pack_pairs

    torch.manual_seed(0)
    model, tokenizer = fastft.load_model("tiny-llama", device="cuda", dtype=torch.bfloat16)
    model = fastft.add_lora(model, r=8, gradient_checkpointing="offload", seed=0)
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02, generator=generator)
    data = pack_pairs(_pair_rows(64), tokenizer, 160)
    settings = dict(method="dpo", max_steps=steps, warmup=0, learning_rate=1e-12, micro_batch_bins=2)
    trainer = Trainer(model, tokenizer, data, config=TrainConfig(cuda_graph=cuda_graph, **settings, **config))
    result = trainer.train()
    return result.steps, result.cuda_graph


def _follows(run, reference, value) -> None:
    ours, theirs = (np.array([value(e) for e in r]) for r in (run, reference))
    scale = np.abs(theirs).max()
    assert scale > 0
    np.testing.assert_allclose(ours, theirs, rtol=2e-2, atol=2e-2 * scale)


@gpu
@needs_cuda
def test_gpu_dpo_steps_on_ragged_pairs_replay_one_graph_like_eager_steps():
    """Pairs of varying lengths padded to one static shape (pad pairs take no loss) replay a single graph
    from the third step on, the adapter-disabled reference pass inside it: each step's loss, rewards and
    gradient norm equal the eager step's on the same pairs and weights (bf16, 2e-2), and each replay read
    its own pairs. By default (static_shapes=None) ragged pairs pad and replay the same way."""
    steps = 8
    eager, eager_stats = _train_dpo(False, steps, static_shapes=True)
    graphed, stats = _train_dpo(True, steps, static_shapes=True)
    assert eager_stats["captures"] == 0
    assert stats == dict(captures=1, replays=steps - 3, eager=2, drops=0)
    for a, b in zip(eager, graphed, strict=True):
        assert a.preference["pairs"] == b.preference["pairs"]
    # the accuracy is not compared: it counts signs of margins, which bf16 noise flips near 0
    _follows(graphed, eager, lambda e: e.loss)
    _follows(graphed, eager, lambda e: e.grad_norm)
    for key in ("rewards_chosen", "rewards_rejected"):
        _follows(graphed, eager, lambda e, key=key: e.preference[key])
    assert len({e.preference["rewards_chosen"] for e in graphed[3:]}) == steps - 3
    default, default_stats = _train_dpo(True, steps)
    assert default_stats == stats
    assert sum(e.padding_tokens for e in default) > 0 and sum(e.graph_replays for e in default) == steps - 3
    assert [e.padding_tokens for e in default] == [e.padding_tokens for e in graphed]
    _follows(default, eager, lambda e: e.loss)

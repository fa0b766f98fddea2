"""The SFT trainer: falling loss, token-weighted accumulation, exact resume, NaN handling, checkpoints."""

from __future__ import annotations

import math

import pytest
import torch

import fastft
from fastft.data.skills import generate
from fastft.training.checkpoint import list_checkpoints
from fastft.training.events import EvalEvent, StepEvent
from fastft.training.objectives import sft as sft_objective
from fastft.training.trainer import NonFiniteLossError, TrainConfig, Trainer, cosine_with_warmup

ROWS = list(generate(240, seed=11))


def _lora_model(name: str = "tiny-llama", dropout: float = 0.0):
    model, tokenizer = fastft.load_model(name, max_seq_length=128)
    return fastft.add_lora(model, r=8, alpha=16, dropout=dropout, seed=5), tokenizer


def _losses(result) -> list[float]:
    return [event.loss for event in result.steps]


def test_loss_falls_and_every_step_emits_an_event():
    model, tokenizer = _lora_model()
    data = fastft.pack(ROWS, tokenizer, 128)
    seen = []
    result = fastft.train(
        model,
        tokenizer,
        data,
        max_steps=30,
        learning_rate=3e-3,
        micro_batch_bins=2,
        progress=False,
        subscribers=[seen.append],
    )
    steps = [e for e in seen if isinstance(e, StepEvent)]
    assert [e.step for e in steps] == list(range(1, 31)) and steps == result.steps
    first, last = sum(_losses(result)[:5]) / 5, sum(_losses(result)[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    event = steps[-1]
    assert event.max_steps == 30 and event.memory_kind == "cpu-rss" and event.peak_memory_bytes > 0
    assert event.trained_tokens > 0 and event.tokens >= event.trained_tokens
    assert event.trained_tokens_per_second == pytest.approx(event.trained_tokens / event.step_seconds)
    assert math.isfinite(event.grad_norm) and event.learning_rate > 0


def test_gradient_accumulation_is_token_weighted():
    """Two micro-batches of one bin give the same gradients and loss as one micro-batch of both bins."""
    results = []
    for micro_batch_bins, grad_accum_steps in ((2, 1), (1, 2)):
        model, tokenizer = _lora_model()
        data = fastft.pack(ROWS, tokenizer, 128)
        config = TrainConfig(
            max_steps=3,
            learning_rate=1e-3,
            micro_batch_bins=micro_batch_bins,
            grad_accum_steps=grad_accum_steps,
            max_grad_norm=None,
        )
        trainer = Trainer(model, tokenizer, data, config=config)
        grads = []
        trainer.optimizer.register_step_pre_hook(
            lambda *_, t=trainer, g=grads: g.append([p.grad.clone() for p in t.parameters])
        )
        results.append((_losses(trainer.train()), grads[0]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):  # first step: identical weights, so compare gradients
        assert (a - b).norm() <= 1e-5 * b.norm() + 1e-12


def test_warmup_then_cosine_schedule():
    multiplier = cosine_with_warmup(warmup_steps=4, total_steps=20, min_ratio=0.1)
    values = [multiplier(step) for step in range(20)]
    assert values[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert values[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[4:], values[5:], strict=False))
    assert multiplier(20) == pytest.approx(0.1)


def test_data_order_is_a_pure_function_of_seed_and_epoch():
    model, tokenizer = _lora_model()
    data = fastft.pack(ROWS, tokenizer, 128)
    a = Trainer(model, tokenizer, data, config=TrainConfig(max_steps=50, micro_batch_bins=3, seed=1))
    b = Trainer(model, tokenizer, data, config=TrainConfig(max_steps=50, micro_batch_bins=3, seed=1))
    assert [a.bins_for_step(s) for s in (0, 7, 40)] == [b.bins_for_step(s) for s in (40, 7, 0)][::-1]
    epoch = [i for s in range(len(data) // 3) for mb in a.bins_for_step(s) for i in mb]
    assert len(set(epoch)) == len(epoch)  # no bin twice within an epoch


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-moe"])
def test_resumed_run_equals_uninterrupted_run(tmp_path, name):
    rows = ROWS[:120]

    def run(max_steps_before_stop: int | None, resume: bool, output):
        model, tokenizer = _lora_model(name, dropout=0.1)  # dropout: RNG state must be restored too
        data = fastft.pack(rows, tokenizer, 128)
        config = TrainConfig(
            max_steps=8,
            learning_rate=2e-3,
            micro_batch_bins=2,
            save_every=4,
            output_dir=str(output),
            resume_from="latest" if resume else None,
            seed=9,
        )
        trainer = Trainer(model, tokenizer, data, config=config)
        if max_steps_before_stop:
            trainer.subscribe(lambda e: trainer.stop() if isinstance(e, StepEvent) and e.step == 4 else None)
        return trainer.train()

    full = run(None, False, tmp_path / "full")
    interrupted = run(4, False, tmp_path / "split")
    assert interrupted.stopped_early and len(interrupted.steps) == 4
    assert [p.name for p in list_checkpoints(tmp_path / "split")] == ["checkpoint-4"]
    resumed = run(None, True, tmp_path / "split")
    assert [e.step for e in resumed.steps] == list(range(1, 9))
    assert _losses(resumed) == _losses(full)  # bit-for-bit: same data order, RNG and state


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_good_checkpoint(tmp_path, monkeypatch):
    model, tokenizer = _lora_model()
    data = fastft.pack(ROWS, tokenizer, 128)
    real_loss = sft_objective.causal_lm_loss_sum
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        loss = real_loss(model, batch)
        return loss * float("nan") if calls["n"] == 6 else loss

    monkeypatch.setattr(sft_objective, "causal_lm_loss_sum", poisoned)
    config = TrainConfig(max_steps=10, save_every=3, output_dir=str(tmp_path), save_total_limit=5)
    trainer = Trainer(model, tokenizer, data, config=config)
    with pytest.raises(NonFiniteLossError) as error:
        trainer.train()
    message = str(error.value)
    assert (
        "nan" in message and "step 6" in message and "checkpoint-3" in message and "learning rate" in message
    )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-3"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no half-written folder


def _poison_one_gradient(model, at_step: int, value: float) -> None:
    """Multiply the first LoRA B's gradient by `value` in backward number `at_step` (one per step here)."""
    lora_b = next(p for name, p in model.named_parameters() if "lora_B" in name)
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        return grad * value if calls["n"] == at_step else grad

    lora_b.register_hook(poison)


def test_a_non_finite_gradient_stops_the_run_at_its_own_step():
    """A finite loss with a NaN gradient: clipping would spread the NaN into every weight, so the run stops
    at that step, naming the gradient, rather than one step later at the loss it ruined."""
    model, tokenizer = _lora_model()
    data = fastft.pack(ROWS, tokenizer, 128)
    _poison_one_gradient(model, at_step=4, value=float("nan"))
    trainer = Trainer(model, tokenizer, data, config=TrainConfig(max_steps=10))
    with pytest.raises(NonFiniteLossError) as error:
        trainer.train()
    assert "gradient norm became nan at step 4" in str(error.value)
    assert [math.isfinite(event.loss) for event in trainer.result.steps] == [True] * 4


def test_a_finished_run_lets_its_model_be_freed():
    """Nothing fastft keeps (the profiler's hook registry, the CUDA-graph stream) holds a model once the
    user drops it: the profile once held its model strongly as the value of a WeakKeyDictionary keyed by
    that model's backbone, so every profiled model lived until the kernel restarted (on the H200 the GPU
    tests' memory grew with each run)."""
    import gc
    import weakref

    def run():
        model, tokenizer = _lora_model()
        trainer = Trainer(
            model, tokenizer, fastft.pack(ROWS, tokenizer, 128), config=TrainConfig(max_steps=2)
        )
        trainer.train()
        assert trainer.profile is not None and trainer.profile.attached
        return weakref.ref(model), weakref.ref(trainer)

    _lora_model()  # first use imports fastft's modules, whose import-time tracebacks keep the caller's frame
    model, trainer = run()
    gc.collect()
    assert model() is None and trainer() is None


def test_checkpoints_rotate_and_load_with_weights_only(tmp_path):
    model, tokenizer = _lora_model()
    data = fastft.pack(ROWS, tokenizer, 128)
    config = TrainConfig(max_steps=6, save_every=2, save_total_limit=2, output_dir=str(tmp_path))
    Trainer(model, tokenizer, data, config=config).train()
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["checkpoint-4", "checkpoint-6"]
    for file in ("optimizer.pt", "scheduler.pt", "rng.pt"):
        torch.load(tmp_path / "checkpoint-6" / file, weights_only=True)
    base, _ = fastft.load_model("tiny-llama")
    from peft import PeftModel

    PeftModel.from_pretrained(base, tmp_path / "checkpoint-6")  # every checkpoint is a usable adapter


def test_eval_loss_is_token_weighted_over_the_eval_set():
    model, tokenizer = _lora_model()
    eval_data = fastft.pack(ROWS[:40], tokenizer, 128)
    trainer = Trainer(
        model, tokenizer, fastft.pack(ROWS, tokenizer, 128), eval_data, TrainConfig(max_steps=1)
    )
    event = trainer.evaluate()
    assert isinstance(event, EvalEvent) and event.eval_trained_tokens == eval_data.stats.trained_tokens
    total = 0.0
    with torch.no_grad():
        for i in range(len(eval_data)):
            total += float(sft_objective.causal_lm_loss_sum(model, eval_data.batch([i])))
    assert event.eval_loss == pytest.approx(total / eval_data.stats.trained_tokens, rel=1e-5)


def test_trainer_refuses_a_model_without_trainable_parameters():
    model, tokenizer = fastft.load_model("tiny-llama")
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    with pytest.raises(ValueError, match="add_lora"):
        Trainer(model, tokenizer, fastft.pack(ROWS, tokenizer, 128))


def test_bad_config_values_are_named():
    with pytest.raises(ValueError, match="micro_batch_bins"):
        TrainConfig(micro_batch_bins=0)
    with pytest.raises(ValueError, match="output_dir"):
        TrainConfig(save_every=5)


def test_the_optimizer_state_is_made_at_setup_not_in_the_first_step():
    """`fastft.training.optimizer`: near a memory cap, moments made in step 1 split the activations' freed
    segments and step 2 runs out of memory."""
    model, tokenizer = _lora_model()
    trainer = Trainer(
        model, tokenizer, fastft.pack(ROWS[:8], tokenizer, 128), config=TrainConfig(max_steps=1)
    )
    assert len(trainer.optimizer.state) == len(trainer.parameters) > 0
    for p in trainer.parameters:
        assert trainer.optimizer.state[p]["exp_avg"].shape == p.shape

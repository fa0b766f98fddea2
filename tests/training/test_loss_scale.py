"""fp16 loss scaling on the device: GradScaler's decisions and parameters bit for bit, skipped steps that
change nothing, no host sync in a step, an exact resume through a skipped step, and the trainer's
fp16 path (CPU autocast in fp16 stands in for the GPU's)."""

from __future__ import annotations

import math

import pytest
import torch
from host_syncs import SyncTrap

import fastft
from fastft.data.skills import generate
from fastft.training.loss_scale import LossScaler
from fastft.training.trainer import TrainConfig, Trainer

# steps whose gradients overflow: an inf at 3, a NaN at 4 (two skips in a row), an inf at 9
POISONED = {3: float("inf"), 4: float("nan"), 9: float("inf")}


def _model_and_data(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    inputs = [torch.randn(5, 7, generator=generator) for _ in range(12)]
    targets = [torch.randn(5, 3, generator=generator) for _ in range(12)]
    return model, inputs, targets


def _train(use_grad_scaler: bool, steps: int = 12, accumulate: int = 2):
    """A fused AdamW with clipping on unscaled gradients, two micro-batches a step, growth every 3 steps."""
    model, inputs, targets = _model_and_data()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    kwargs = dict(init_scale=2.0**10, growth_interval=3)
    scaler = torch.amp.GradScaler("cpu", **kwargs) if use_grad_scaler else LossScaler("cpu", **kwargs)
    trail = []
    for step in range(steps):
        for micro in range(accumulate):
            index = (step * accumulate + micro) % len(inputs)
            loss = torch.nn.functional.mse_loss(model(inputs[index]), targets[index]) / accumulate
            (scaler.scale(loss) if use_grad_scaler else scaler.scaled(loss)).backward()
        if step in POISONED:
            params[0].grad[0, 0] = POISONED[step]
        if use_grad_scaler:
            scaler.unscale_(optimizer)
        else:
            scaler.unscale_(params)
        torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        scale = scaler.get_scale() if use_grad_scaler else float(scaler.scale)
        trail.append((scale, [p.detach().clone() for p in params]))
    return trail, optimizer


def test_the_scaler_matches_grad_scaler_bit_for_bit():
    """Same scales after every step (backed off at the overflows, grown after 3 clean steps) and the same
    parameters and optimizer state, bit for bit."""
    theirs, their_optimizer = _train(use_grad_scaler=True)
    ours, our_optimizer = _train(use_grad_scaler=False)
    assert [scale for scale, _ in ours] == [scale for scale, _ in theirs]
    scales = [scale for scale, _ in ours]
    assert scales[:5] == [2.0**10, 2.0**10, 2.0**11, 2.0**10, 2.0**9]  # grown after 3 clean steps, backed off
    for (_, mine), (_, reference) in zip(ours, theirs, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, reference, strict=True))
    for mine, reference in zip(our_optimizer.state.values(), their_optimizer.state.values(), strict=True):
        assert all(torch.equal(mine[key], reference[key]) for key in ("step", "exp_avg", "exp_avg_sq"))


def test_a_skipped_step_leaves_parameters_moments_and_step_count_unchanged():
    model, inputs, targets = _model_and_data(seed=1)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
    scaler = LossScaler("cpu")
    for poisoned in (False, True):
        before = (
            [p.detach().clone() for p in params],
            {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params},
        )
        scaler.scaled(torch.nn.functional.mse_loss(model(inputs[0]), targets[0])).backward()
        if poisoned:
            params[1].grad[2] = float("inf")
        scaler.unscale_(params)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert float(scaler.found_inf) == 1.0 and float(scaler.scale) == 2.0**15
    weights, state = before
    assert all(torch.equal(p, w) for p, w in zip(params, weights, strict=True))
    for p in params:
        assert all(
            torch.equal(optimizer.state[p][k], state[id(p)][k]) for k in ("step", "exp_avg", "exp_avg_sq")
        )
    assert float(optimizer.state[params[0]]["step"]) == 1.0


def test_a_scaled_step_makes_no_host_sync():
    model, inputs, targets = _model_and_data(seed=2)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-2, fused=True)
    scaler = LossScaler("cpu")
    with SyncTrap() as trap:
        for step in range(3):
            scaler.scaled(torch.nn.functional.mse_loss(model(inputs[step]), targets[step])).backward()
            scaler.unscale_(params)
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    assert trap.syncs == []


def test_an_unfused_optimizer_is_refused_with_the_fix():
    model, _, _ = _model_and_data()
    with pytest.raises(ValueError, match=r"fused=True"):
        LossScaler("cpu").step(torch.optim.AdamW(model.parameters(), fused=False))


def test_state_round_trips_in_place():
    scaler = LossScaler("cpu", growth_interval=5)
    scale = scaler.scale
    other = LossScaler("cpu")
    other.scale.fill_(1024.0)
    other.growth_tracker.fill_(3)
    scaler.load_state_dict(other.state_dict())
    assert scaler.scale is scale and float(scale) == 1024.0 and int(scaler.growth_tracker) == 3
    assert scaler.growth_interval == 2000


# -- the trainer's fp16 path on the CPU ---------------------------------------------------------------

ROWS = list(generate(120, seed=7))


@pytest.fixture
def fp16_on_cpu(monkeypatch):
    """The trainer's fp16 path (autocast in fp16, the loss scaler, the fused AdamW) on the CPU."""
    monkeypatch.setattr(Trainer, "_autocast_dtype", lambda self: torch.float16)


def _trainer(**config) -> Trainer:
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    model = fastft.add_lora(model, r=4, alpha=8, seed=2)
    return Trainer(model, tokenizer, fastft.pack(ROWS, tokenizer, 128), config=TrainConfig(**config))


def _poison(trainer: Trainer, at_backward: int) -> None:
    """An infinite gradient in backward number `at_backward` of this trainer's model."""
    lora_b = next(p for name, p in trainer.model.named_parameters() if "lora_B" in name)
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        return grad * math.inf if calls["n"] == at_backward else grad

    lora_b.register_hook(poison)


def test_an_fp16_run_skips_an_overflowing_step_on_the_device_and_goes_on(fp16_on_cpu):
    """The NaN guard keeps its rule: an overflowing gradient is the scaler's (that step is skipped, the scale
    halves, the run goes on); the weights stay finite."""
    trainer = _trainer(max_steps=4, grad_accum_steps=2, max_grad_norm=1.0)
    assert trainer.loss_scaler is not None and trainer.optimizer.defaults["fused"]
    _poison(trainer, at_backward=4)  # step 2's second micro-batch
    result = trainer.train()
    assert [math.isfinite(event.grad_norm) for event in result.steps] == [True, False, True, True]
    assert all(math.isfinite(event.loss) for event in result.steps)
    assert float(trainer.loss_scaler.scale) == 2.0**15
    assert all(float(state["step"]) == 3.0 for state in trainer.optimizer.state.values())  # one skipped
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_an_fp16_step_makes_no_host_sync(fp16_on_cpu):
    trainer = _trainer(max_steps=3, grad_accum_steps=2)
    trainer._train_step()  # the first step builds what the run keeps (attention backend, batch shape)
    trainer.step += 1
    with SyncTrap() as trap:
        trainer._train_step()
    assert trap.syncs == []


def test_an_fp16_resume_through_a_skipped_step_equals_the_uninterrupted_run(fp16_on_cpu, tmp_path):
    """The checkpoint after a skipped step carries the lowered scale and its growth count: the resumed run's
    losses, gradient norms and weights equal the uninterrupted run's, bit for bit."""

    def run(output, resume: bool = False, stop_at: int | None = None):
        trainer = _trainer(
            max_steps=6, save_every=3, output_dir=str(output), resume_from="latest" if resume else None
        )
        trainer.loss_scaler.growth_interval = 2  # the scale grows within the run too
        if not resume:
            _poison(trainer, at_backward=2)
        result = trainer.train(steps=stop_at)  # save_every=3 writes checkpoint-3
        weights = [p.detach().clone() for p in trainer.parameters]
        return result, weights, trainer.loss_scaler.state_dict()

    whole, whole_weights, whole_scale = run(tmp_path / "whole")
    run(tmp_path / "cut", stop_at=3)
    resumed, resumed_weights, resumed_scale = run(tmp_path / "cut", resume=True)
    assert not math.isfinite(whole.steps[1].grad_norm)  # step 2 was skipped before the checkpoint
    assert [repr((e.loss, e.grad_norm)) for e in resumed.steps] == [
        repr((e.loss, e.grad_norm)) for e in whole.steps
    ]
    assert all(torch.equal(a, b) for a, b in zip(resumed_weights, whole_weights, strict=True))
    assert resumed_scale == whole_scale and whole_scale["scale"] != 2.0**16


def test_a_grpo_run_in_fp16_scales_its_loss_and_skips_an_overflowing_update(monkeypatch):
    """GRPO updates through the same scaler (its own step: `num_iterations` updates per rollout)."""
    from fastft.data.rewards import content_match
    from fastft.training.objectives.grpo import GRPOConfig, GRPOTrainer

    monkeypatch.setattr(GRPOTrainer, "_autocast_dtype", lambda self: torch.float16)
    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=4, alpha=8, gradient_checkpointing=False, seed=1)
    config = GRPOConfig(
        max_steps=1, prompts_per_step=2, num_generations=2, max_new_tokens=4, warmup=0, seed=11,
        num_iterations=2, micro_batch_tokens=96,
    )  # fmt: skip
    trainer = GRPOTrainer(model, tokenizer, list(generate(8, seed=5)), [content_match], config)
    assert trainer.loss_scaler is not None and trainer.optimizer.defaults["fused"]
    _poison(trainer, at_backward=1)
    lora_b = next(p for name, p in model.named_parameters() if "lora_B" in name)
    result = trainer.train()
    assert len(result.steps) == 1 and math.isfinite(result.steps[0].loss)
    # the step's first update overflowed and was skipped; its second was applied
    assert (
        float(trainer.optimizer.state[lora_b]["step"]) == 1.0 and float(trainer.loss_scaler.scale) == 2.0**15
    )
    assert all(torch.isfinite(p).all() for p in trainer.parameters)

"""An objective plugs into the `Trainer`'s loop through `fastft.training.objectives`: a new one (a KTO, a reward
model) is one class, passed as ``Trainer(..., objective=...)``, and gets the loop's schedule, events and
evaluation."""

from __future__ import annotations

import pytest
import torch

import fastft
from fastft.data.skills import generate
from fastft.training.loss import causal_lm_loss_sum
from fastft.training.objectives import Objective
from fastft.training.objectives.packed import PackedObjective
from fastft.training.readout import StepTimer
from fastft.training.trainer import TrainConfig, Trainer

ROWS = list(generate(48, seed=17))


def _lora_model():
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    return fastft.add_lora(model, r=4, alpha=8, seed=9), tokenizer


class HalfSFT(PackedObjective):
    """Half the next-token loss, with the trained-token count as its one metric (its mean per token is 1)."""

    name = "half_sft"
    metrics = ("tokens",)

    def __init__(self):
        super().__init__()
        self.read_back: list[list[float]] = []

    def loss_sum(self, model, batch, extra=None):
        loss = causal_lm_loss_sum(model, batch)
        return 0.5 * loss, loss.new_tensor([float(batch.num_trained_tokens)])

    def event_fields(self, metrics, info):
        self.read_back.append(metrics)
        return {}


def test_a_packed_objective_plugged_in_trains_and_evaluates_on_the_loop():
    config = TrainConfig(max_steps=2, warmup=0, micro_batch_bins=1, grad_accum_steps=2, learning_rate=1e-3)
    losses = {}
    for objective in (None, HalfSFT()):  # None: the config's SFT objective
        model, tokenizer = _lora_model()
        data, held_out = fastft.pack(ROWS[8:], tokenizer, 128), fastft.pack(ROWS[:8], tokenizer, 128)
        trainer = Trainer(model, tokenizer, data, held_out, config=config, objective=objective)
        evaluated = trainer.evaluate().eval_loss
        result = trainer.train()
        losses[type(trainer.objective).__name__] = (evaluated, result.steps[0].loss)
        assert [event.step for event in result.steps] == [1, 2]
    sft, half = losses["SFTObjective"], losses["HalfSFT"]
    assert half[0] == pytest.approx(0.5 * sft[0], rel=1e-5)  # evaluation through its loss_sum
    assert half[1] == pytest.approx(0.5 * sft[1], rel=1e-5)  # the first step, before any update
    assert objective.read_back == [[pytest.approx(1.0)], [pytest.approx(1.0)]]  # metric sums per token


class ShrinkAdapters(Objective):
    """An objective without packed data: every step pulls the trainable weights toward zero."""

    name = "shrink"

    def prepare(self, trainer, train_data, eval_data):
        return list(train_data), None

    def units_per_step(self, trainer):
        return 3

    def train_step(self, trainer):
        timer = StepTimer(trainer.device)
        units = trainer.units_for_step(trainer.step)
        loss = sum((p.float() ** 2).sum() for p in trainer.parameters)
        loss.backward()
        learning_rate = trainer.scheduler.get_last_lr()[0]
        grad_norm = trainer.update()
        timer.stop()
        info = dict(
            step=trainer.step + 1, lr=learning_rate, trained=len(units), tokens=len(units), timer=timer
        )
        info.update(
            timing=None, padding=0, replays=0, micro_batches=1, pairs=0, epoch=trainer.epoch_progress()
        )
        trainer.queue_readout(torch.stack([loss.detach(), grad_norm]), info)


def test_an_objective_with_its_own_step_runs_on_the_loop():
    model, tokenizer = _lora_model()
    config = TrainConfig(max_steps=3, warmup=0, learning_rate=1e-2, weight_decay=0.0)
    trainer = Trainer(model, tokenizer, list(range(7)), config=config, objective=ShrinkAdapters())
    result = trainer.train()
    assert [event.step for event in result.steps] == [1, 2, 3]
    assert all(event.trained_tokens == 3 for event in result.steps)
    assert result.steps[0].epoch == pytest.approx(3 / 7)
    assert result.steps[2].loss < result.steps[1].loss < result.steps[0].loss
    assert result.steps[1].learning_rate < result.steps[0].learning_rate  # the loop's cosine schedule

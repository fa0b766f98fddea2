"""The NaN guard's "last good checkpoint" is good: a checkpoint is written only when every trained weight is
finite (checked once at save time, on the device, never per step), and the error names the newest one."""

from __future__ import annotations

import math

import pytest
import torch
from host_syncs import SyncTrap

import fastft
from fastft.checks import SettingError
from fastft.data.skills import generate
from fastft.training.checkpoint import list_checkpoints, read_checkpoint
from fastft.training.events import StepEvent
from fastft.training.objectives import sft as sft_objective
from fastft.training.trainer import NonFiniteLossError, TrainConfig, Trainer

ROWS = list(generate(120, seed=7))


def _setup(**config):
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    model = fastft.add_lora(model, r=4, alpha=8, seed=2)
    return Trainer(model, tokenizer, fastft.pack(ROWS, tokenizer, 128), config=TrainConfig(**config))


def _lora_b(model):
    return next(p for name, p in model.named_parameters() if "lora_B" in name)


def test_a_poisoned_weight_is_never_checkpointed_and_the_error_names_the_newest_good_one(tmp_path):
    """A LoRA weight turned infinite after step 4's update: the step's loss and gradient were finite, so only
    the weights show it. Checkpoint 4 is refused; checkpoint 2 is named, and it really is finite."""
    trainer = _setup(max_steps=8, save_every=2, save_total_limit=5, output_dir=str(tmp_path))

    def poison(event):
        if isinstance(event, StepEvent) and event.step == 4:
            with torch.no_grad():
                _lora_b(trainer.model)[0, 0] = float("inf")

    trainer.subscribe(poison)
    with pytest.raises(NonFiniteLossError) as error:
        trainer.train()
    message = str(error.value)
    assert "NaN or infinite values at step 4" in message and "no checkpoint was written" in message
    assert f"newest good checkpoint is {tmp_path / 'checkpoint-2'}" in message
    assert "reset_optimizer=True" in message
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2"]
    adapter = read_checkpoint(tmp_path / "checkpoint-2")["adapter"]
    assert all(torch.isfinite(tensor).all() for tensor in adapter.values())


def test_the_named_checkpoint_is_one_still_on_disk(tmp_path, monkeypatch):
    """With save_total_limit=1 the earlier checkpoints are pruned: the error names the newest that exists."""
    real_loss = sft_objective.causal_lm_loss_sum
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        return real_loss(model, batch) * (float("nan") if calls["n"] == 7 else 1.0)

    monkeypatch.setattr(sft_objective, "causal_lm_loss_sum", poisoned)
    trainer = _setup(max_steps=10, save_every=2, save_total_limit=1, output_dir=str(tmp_path))
    with pytest.raises(NonFiniteLossError, match="loss became nan at step 7") as error:
        trainer.train()
    assert f"newest good checkpoint is {tmp_path / 'checkpoint-6'}" in str(error.value)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-6"]


def test_the_weight_check_runs_at_save_time_only(tmp_path, monkeypatch):
    """The check (one reduction and one sync) runs when a checkpoint is written, never in a step."""
    checks = []
    real = Trainer._weights_are_finite
    monkeypatch.setattr(Trainer, "_weights_are_finite", lambda self: checks.append(self.step) or real(self))
    trainer = _setup(max_steps=6, save_every=3, output_dir=str(tmp_path))
    trainer.train()
    assert checks == [3, 6]
    with SyncTrap() as trap:
        assert trainer._weights_are_finite()
    assert trap.syncs == ["aten._local_scalar_dense"]  # one read of one flag, for all the weights


def test_an_infinite_learning_rate_is_refused_and_a_huge_one_warned_about():
    with pytest.raises(SettingError, match="learning_rate must be a finite number, got inf"):
        TrainConfig(learning_rate=math.inf)
    with pytest.warns(UserWarning, match=r"learning_rate=1e\+06 is far above"):
        TrainConfig(learning_rate=1e6)

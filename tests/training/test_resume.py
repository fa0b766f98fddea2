"""Resume: new hyperparameters are either honoured (``reset_optimizer=True``) or reported as kept (and really
kept); damaged checkpoints are named by file and skipped by ``resume_from="latest"``; a checkpoint of another
adapter, other data, batching, packing length, method or loss settings is refused before anything loads,
listing what differs, unless a reset option accepts it; a typo of "latest" gets a hint."""

from __future__ import annotations

import argparse
import warnings

import pytest
import torch

import fastft
from fastft.checks import SettingError
from fastft.data.skills import generate
from fastft.training.checkpoint import CheckpointError, ResumeMismatchError, list_checkpoints
from fastft.training.trainer import ResumeWarning, TrainConfig, Trainer, cosine_with_warmup

ROWS = list(generate(120, seed=13))


def _trainer(
    r: int = 4, targets="all-linear", alpha=8, dropout=0.1, rows=ROWS, length=128, **config
) -> Trainer:
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    model = fastft.add_lora(model, r=r, alpha=alpha, target_modules=targets, dropout=dropout, seed=4)
    # a fixed attention backend: "auto" times the backends and may pick another one run to run
    defaults = dict(max_steps=8, learning_rate=2e-3, micro_batch_bins=2, seed=9, attention=None)
    data = rows if config.get("method", "sft") != "sft" else fastft.pack(rows, tokenizer, length)
    return Trainer(model, tokenizer, data, config=TrainConfig(**defaults | config))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished run of 8 steps with checkpoints 4, 6 and 8, and the losses of its steps."""
    folder = tmp_path_factory.mktemp("run")
    result = _trainer(save_every=2, save_total_limit=3, output_dir=str(folder)).train()
    assert [p.name for p in list_checkpoints(folder)] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    return folder, [event.loss for event in result.steps]


def _adapter_weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def test_a_resume_that_keeps_the_checkpoint_values_says_which_new_ones_it_ignores(run_dir):
    folder, losses = run_dir
    trainer = _trainer(learning_rate=1e-4, weight_decay=0.1, resume_from=str(folder / "checkpoint-4"))
    with pytest.warns(ResumeWarning, match="NOT used") as caught:
        result = trainer.train()
    message = next(str(w.message) for w in caught if issubclass(w.category, ResumeWarning))
    assert "learning_rate 0.002 → 0.0001" in message and "weight_decay 0.0 → 0.1" in message
    assert "reset_optimizer=True" in message
    # the old values really were kept: the same run (a new learning rate would move the losses by far more)
    assert [e.loss for e in result.steps] == pytest.approx(losses, rel=1e-5)


def test_reset_optimizer_trains_on_with_the_new_learning_rate_and_prints_it(run_dir):
    folder, losses = run_dir
    trainer = _trainer(learning_rate=1e-4, reset_optimizer=True, resume_from=str(folder / "checkpoint-4"))
    with pytest.warns(ResumeWarning, match="fresh optimizer") as caught:
        result = trainer.train()
    schedule = cosine_with_warmup(trainer.warmup_steps, 8, 0.1)
    assert f"learning rate now {1e-4 * schedule(4):.3g}" in next(
        str(w.message) for w in caught if issubclass(w.category, ResumeWarning)
    )
    resumed = result.steps[4:]
    assert [e.step for e in resumed] == [5, 6, 7, 8]
    for event in resumed:
        assert event.learning_rate == pytest.approx(1e-4 * schedule(event.step - 1))
    assert [e.loss for e in result.steps[:4]] == losses[:4]
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * schedule(8))


def _copy_run(run_dir, tmp_path):
    import shutil

    folder, _ = run_dir
    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    return copy


def test_a_truncated_file_is_named_and_latest_falls_back_to_the_newest_loadable(run_dir, tmp_path):
    copy = _copy_run(run_dir, tmp_path)
    _, losses = run_dir
    adapter = copy / "checkpoint-8" / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])
    (copy / "checkpoint-6" / "trainer_state.json").write_text('{"step": 6, "max_st')

    explicit = _trainer(resume_from=str(copy / "checkpoint-8"))
    before = _adapter_weights(explicit)
    with pytest.raises(CheckpointError, match=r"checkpoint-8/adapter_model\.safetensors cannot be read"):
        explicit.train()
    after = _adapter_weights(explicit)
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing half-loaded

    trainer = _trainer(max_steps=8, resume_from="latest", output_dir=str(copy))
    with pytest.warns(ResumeWarning, match="Skipped a damaged checkpoint") as caught:
        result = trainer.train()
    skipped = [str(w.message) for w in caught if "Skipped" in str(w.message)]
    assert "checkpoint-8/adapter_model.safetensors" in skipped[0]
    assert "checkpoint-6/trainer_state.json" in skipped[1]
    assert [e.loss for e in result.steps] == pytest.approx(losses, rel=1e-5)  # resumed at 4, as the full run


def test_an_unsafe_optimizer_file_is_refused_without_torch_advice(run_dir, tmp_path):
    copy = _copy_run(run_dir, tmp_path)
    torch.save(argparse.Namespace(payload="not tensors"), copy / "checkpoint-8" / "optimizer.pt")
    with pytest.raises(CheckpointError) as error:
        _trainer(resume_from=str(copy / "checkpoint-8")).train()
    message = str(error.value)
    assert "checkpoint-8/optimizer.pt" in message and "never unpickles" in message
    assert "weights_only=False" not in message and "weights_only" not in message


@pytest.mark.parametrize(
    ("adapter", "expected"),
    [(dict(r=8), "another LoRA rank r"), (dict(targets=["q_proj", "v_proj"]), "other LoRA targets")],
)
def test_a_checkpoint_of_another_adapter_is_refused_before_anything_loads(run_dir, adapter, expected):
    folder, _ = run_dir
    trainer = _trainer(resume_from=str(folder / "checkpoint-4"), **adapter)
    before = _adapter_weights(trainer)
    with pytest.raises(CheckpointError, match=expected):
        trainer.train()
    after = _adapter_weights(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_a_typo_of_latest_gets_a_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SettingError, match="Did you mean resume_from='latest'"):
        TrainConfig(resume_from="lastest", output_dir="runs")
    with pytest.raises(SettingError, match=r"does not exist\. Give a checkpoint folder"):
        TrainConfig(resume_from="runs/checkpoint-9")


def test_an_unchanged_resume_passes_the_check_and_is_the_uninterrupted_run(run_dir):
    """Bit for bit in a fresh process (tests/training/test_kill.py); here, after the module's fixture run in the
    same process, the first resumed step differs in the 7th digit, on the code before the check too."""
    folder, losses = run_dir
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeWarning)
        result = _trainer(resume_from=str(folder / "checkpoint-4")).train()
    assert [e.loss for e in result.steps] == pytest.approx(losses, rel=1e-6)


def test_a_kept_warmup_is_really_kept(run_dir):
    """The warning says the checkpoint's schedule is kept: the new warmup must not reshape it."""
    folder, losses = run_dir
    with pytest.warns(ResumeWarning, match=r"NOT used: warmup 0\.05 → 3"):
        result = _trainer(warmup=3, resume_from=str(folder / "checkpoint-4")).train()
    assert [e.loss for e in result.steps] == pytest.approx(losses, rel=1e-6)  # this config's warmup: 1e-2 off


PAIRS = [{"prompt": f"Pick a colour {i}.", "chosen": "blue", "rejected": "red and green"} for i in range(12)]


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (dict(micro_batch_bins=1), "micro_batch_bins 2 → 1"),
        (dict(grad_accum_steps=2), "grad_accum_steps 1 → 2"),
        (dict(rows=ROWS[:60] + ROWS[61:] + ROWS[60:61]), "data (fingerprint"),  # the same rows, reordered
        (dict(length=96), "max_seq_length 128 → 96"),
        (dict(max_grad_norm=0.5), "max_grad_norm 1.0 → 0.5"),
        (dict(method="dpo", rows=PAIRS), "method 'sft' → 'dpo'"),
        (dict(alpha=16), "lora_alpha 8 → 16"),
        (dict(dropout=0.0), "lora_dropout 0.1 → 0.0"),
    ],
)
def test_a_resume_that_changes_the_run_is_refused_listing_what_differs(run_dir, change, expected):
    folder, _ = run_dir
    trainer = _trainer(resume_from=str(folder / "checkpoint-4"), **change)
    before = _adapter_weights(trainer)
    with pytest.raises(ResumeMismatchError) as error:
        trainer.train()
    message = str(error.value)
    assert expected in message and str(folder / "checkpoint-4") in message
    assert "Resume with the saved values" in message
    fix = {"method": "fastft.load_adapter", "alpha": "fastft.load_adapter", "dropout": "fastft.load_adapter"}
    assert next((v for k, v in fix.items() if k in change), "reset_") in message
    after = _adapter_weights(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before) and trainer.step == 0


@pytest.mark.parametrize(
    ("change", "option"),
    [(dict(micro_batch_bins=1), "reset_data"), (dict(max_grad_norm=0.5), "reset_objective")],
)
def test_a_reset_option_accepts_its_changes_with_a_warning(run_dir, change, option):
    folder, _ = run_dir
    trainer = _trainer(resume_from=str(folder / "checkpoint-6"), **change, **{option: True})
    with pytest.warns(ResumeWarning, match=rf"changes you accepted: .*\({option}=True\)"):
        result = trainer.train()
    assert [e.step for e in result.steps][-2:] == [7, 8]


def test_latest_does_not_skip_a_checkpoint_of_another_run_as_damaged(run_dir, tmp_path):
    copy = _copy_run(run_dir, tmp_path)
    with pytest.raises(ResumeMismatchError, match="micro_batch_bins 2 → 1"):
        _trainer(micro_batch_bins=1, resume_from="latest", output_dir=str(copy)).train()


@pytest.mark.parametrize("damage", ['{"r": 4, "lora_al', "{}"])
def test_a_damaged_adapter_config_is_named(run_dir, tmp_path, damage):
    copy = _copy_run(run_dir, tmp_path)
    (copy / "checkpoint-8" / "adapter_config.json").write_text(damage)
    with pytest.raises(CheckpointError, match=r"checkpoint-8/adapter_config\.json"):
        _trainer(resume_from=str(copy / "checkpoint-8")).train()

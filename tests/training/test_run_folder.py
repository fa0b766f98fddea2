"""The run folder: a run locks its output_dir (a second run is refused, naming the first; a dead run's lock
blocks nothing), a new run never deletes or overwrites another run's checkpoints, and pruning touches only the
run's own (`fastft.training.run_folder`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import fastft
from fastft.data.skills import generate
from fastft.training.checkpoint import list_checkpoints
from fastft.training.run_folder import (
    LOCK_NAME,
    FolderHoldsAnotherRunError,
    FolderInUseError,
    OutputDirOverwriteWarning,
    prune_own_checkpoints,
)
from fastft.training.trainer import TrainConfig, Trainer

ROWS = list(generate(24, seed=3))


def _trainer(**config) -> Trainer:
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    model = fastft.add_lora(model, r=4, alpha=8, seed=4, gradient_checkpointing=False)
    defaults = dict(max_steps=2, micro_batch_bins=2, seed=9, attention=None, profile=False)
    return Trainer(
        model, tokenizer, fastft.pack(ROWS, tokenizer, 128), config=TrainConfig(**defaults | config)
    )


def _files(folder):
    """Every file under `folder` with its bytes (what "nothing was touched" compares)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_new_run_refuses_a_folder_holding_another_runs_checkpoints_and_touches_nothing(tmp_path):
    _trainer(save_every=1, output_dir=str(tmp_path)).train()
    before = _files(tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]
    with pytest.raises(FolderHoldsAnotherRunError) as error:
        _trainer(max_steps=1, save_every=1, output_dir=str(tmp_path)).train()
    message = str(error.value)
    assert str(tmp_path) in message and "checkpoint-1, checkpoint-2" in message
    assert "resume_from='latest'" in message and "another output_dir" in message
    assert "overwrite_output_dir=True" in message
    assert _files(tmp_path) == before  # not one byte of the earlier run changed


def test_overwrite_output_dir_removes_the_earlier_runs_checkpoints_first_and_says_so(tmp_path):
    _trainer(max_steps=3, save_every=1, save_total_limit=3, output_dir=str(tmp_path)).train()
    trainer = _trainer(max_steps=1, save_every=1, output_dir=str(tmp_path), overwrite_output_dir=True)
    with pytest.warns(OutputDirOverwriteWarning, match="removed 3 checkpoint"):
        trainer.train()
    # the folder holds one run: "latest" cannot pick the earlier run's newer checkpoint-3
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-1"]
    state = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())
    assert state["run"]["id"] == trainer.run_id


def test_pruning_removes_only_the_runs_own_checkpoints(tmp_path):
    for step, run in ((1, "other"), (2, "mine"), (3, "mine"), (4, "other"), (5, "mine"), (6, None)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"step": step, "run": {"id": run}}))
    (tmp_path / "checkpoint-7").mkdir()  # unreadable: whose it is cannot be told, so it stays
    prune_own_checkpoints(tmp_path, "mine", keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "checkpoint-1",
        "checkpoint-4",
        "checkpoint-5",
        "checkpoint-6",
        "checkpoint-7",
    ]


HOLDER = textwrap.dedent(
    """
    import sys
    import fastft
    from fastft.data.skills import generate
    from fastft.training.trainer import TrainConfig, Trainer

    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    model = fastft.add_lora(model, r=4, alpha=8, seed=4, gradient_checkpointing=False)
    config = TrainConfig(max_steps=3, micro_batch_bins=2, attention=None, profile=False, output_dir=sys.argv[1])

    def hold(event):  # after the first step: say so, then wait until the test is done with this run
        print("training", flush=True)
        sys.stdin.readline()

    Trainer(model, tokenizer, fastft.pack(list(generate(24, seed=3)), tokenizer, 128), config=config, subscribers=[hold]).train()
    """
)


def test_a_second_run_into_a_folder_in_use_is_refused_naming_the_first_and_a_dead_runs_lock_blocks_nothing(
    tmp_path,
):
    folder = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        line = holder.stdout.readline()
        assert line.strip() == "training", holder.stderr.read()
        record = json.loads((folder / LOCK_NAME).read_text())
        assert record["pid"] == holder.pid and record["command"]
        trainer = _trainer(max_steps=1, save_every=1, output_dir=str(folder))
        with pytest.raises(FolderInUseError) as error:
            trainer.train()
        message = str(error.value)
        assert f"process {holder.pid}" in message and record["started"] in message
        assert "another output_dir" in message
        assert trainer.step == 0 and not list_checkpoints(folder)  # refused before any step or write
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding the lock: the kernel drops it
        holder.communicate()
    assert (folder / LOCK_NAME).exists()  # the dead run's lock file is still there
    result = trainer.train()  # and blocks nothing
    assert [e.step for e in result.steps] == [1] and [p.name for p in list_checkpoints(folder)] == [
        "checkpoint-1"
    ]
    assert not (folder / LOCK_NAME).exists()  # a run that ends removes its lock file


def test_a_paused_run_keeps_its_folder_locked_until_it_ends_or_is_closed(tmp_path):
    first = _trainer(max_steps=2, output_dir=str(tmp_path))
    first.train(steps=1)  # paused mid-run: the folder is still its
    second = _trainer(max_steps=1, output_dir=str(tmp_path))
    with pytest.raises(FolderInUseError, match=r"this process .* trainer\.close\(\)"):
        second.train()
    first.close()  # frees the folder
    assert [e.step for e in second.train().steps] == [1]
    assert [e.step for e in first.train().steps] == [1, 2]  # takes the folder again and ends the run
    assert not (tmp_path / LOCK_NAME).exists()

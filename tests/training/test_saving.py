"""Saving never destroys what fastft did not write: adapters, merged models and checkpoints (fastft.atomic).

Each case of issue 26's "data lost" list is a test: a run's output folder, a project folder and a file at
the path are refused; an overwrite, a kill between the two renames of the fallback path and a kill while
pruning leave a complete folder (or one restored on the next save or load, with a warning); leftovers are
cleaned when a run starts; ``~`` expands; a full disk says so and keeps the previous checkpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
import torch
from peft import PeftModel

import fastft
from fastft import atomic
from fastft.data.skills import generate
from fastft.training.checkpoint import clean_output_dir, list_checkpoints, prune_checkpoints
from fastft.training.trainer import TrainConfig, Trainer

ROWS = list(generate(60, seed=3))


@pytest.fixture(scope="module")
def lora():
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    return fastft.add_lora(model, r=4, alpha=8, seed=1), tokenizer


def _tree(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_run_output_folder_is_refused_and_kept_whole(lora, tmp_path):
    model, tokenizer = lora
    run = tmp_path / "run"
    (run / "checkpoint-4").mkdir(parents=True)
    (run / "checkpoint-4" / "adapter_model.safetensors").write_bytes(b"weights")
    (run / "notes.txt").write_text("my notes")
    before = _tree(run)
    for save in (fastft.save_adapter, fastft.save_merged):
        with pytest.raises(atomic.FolderInTheWayError, match="not written by fastft.*overwrite=True"):
            save(model, run, tokenizer)
    assert _tree(run) == before and (run / "notes.txt").read_text() == "my notes"
    assert not atomic.leftovers(tmp_path)


def test_a_project_folder_is_refused_unless_overwrite_is_named(lora, tmp_path):
    model, tokenizer = lora
    project = tmp_path / "project"
    project.mkdir()
    (project / "code.py").write_text("print('mine')")
    with pytest.raises(atomic.FolderInTheWayError, match=r"code\.py"):
        fastft.save_adapter(model, project)
    assert (project / "code.py").exists()
    fastft.save_adapter(model, project, overwrite=True)  # the caller asked for it by name
    assert not (project / "code.py").exists() and (project / "adapter_model.safetensors").exists()


def test_a_file_at_the_path_is_never_renamed_away(lora, tmp_path):
    model, _ = lora
    target = tmp_path / "adapter"
    target.write_text("a user's file")
    for overwrite in (False, True):
        with pytest.raises(atomic.FolderInTheWayError, match="is a file"):
            fastft.save_adapter(model, target, overwrite=overwrite)
    assert target.read_text() == "a user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no hidden .adapter.old-*


def test_fastft_replaces_its_own_folders_and_empty_ones(lora, tmp_path):
    model, tokenizer = lora
    empty = tmp_path / "empty"
    empty.mkdir()
    fastft.save_adapter(model, empty, tokenizer)
    assert atomic.written_by_fastft(empty)
    lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b.add_(1.0)
    try:
        fastft.save_adapter(model, empty, tokenizer)  # its own folder: replaced without overwrite=True
        base, _ = fastft.load_model("tiny-llama")
        loaded = PeftModel.from_pretrained(base, empty)
        name = next(n for n, _ in model.named_parameters() if "lora_B" in n)
        torch.testing.assert_close(dict(loaded.named_parameters())[name], lora_b)
    finally:
        with torch.no_grad():
            lora_b.sub_(1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_a_tilde_path_expands_to_the_home_folder(lora, tmp_path, monkeypatch):
    model, _ = lora
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    path = fastft.save_adapter(model, "~/x")
    assert path == home / "x" and (home / "x" / "adapter_config.json").exists()
    assert not (cwd / "~").exists()
    config = TrainConfig(output_dir="~/runs", resume_from=None)
    assert config.output_dir == str(home / "runs")


def _die_at_second_replace(model, path) -> None:
    """In a forked child: save with the two-rename fallback and SIGKILL itself between the renames."""
    real_replace = os.replace

    def replace(src, dst):
        if os.fspath(dst) == os.fspath(path):  # the new folder's rename into place: the old one is aside
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    atomic._exchange = lambda a, b: False
    atomic.os.replace = replace
    fastft.save_adapter(model, path)


def _fork_and_kill(fn, *args) -> None:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            fn(*args)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status


def test_a_kill_between_the_two_renames_is_recovered_on_the_next_save_or_load(lora, tmp_path):
    """The fallback path of systems without an atomic exchange: killed with the old folder moved aside and
    the new one not yet in, the next save (or `load_model` of a merged folder) puts the finished one back."""
    model, tokenizer = lora
    path = tmp_path / "adapter"
    fastft.save_adapter(model, path)
    _fork_and_kill(_die_at_second_replace, model, path)
    assert not path.exists() and len(atomic.leftovers(tmp_path, "adapter")) == 2  # the gap, as killed
    with pytest.warns(atomic.RecoveredFolderWarning, match="restored the finished new save"):
        atomic.recover_folder(path)
    assert (path / "adapter_model.safetensors").exists() and not atomic.leftovers(tmp_path)

    merged = tmp_path / "merged"
    fastft.save_merged(model, merged, tokenizer, dtype=torch.float32)
    old = tmp_path / ".merged.old-0123abcd"
    os.replace(merged, old)  # as if killed after the first rename, the new folder not yet written
    with pytest.warns(atomic.RecoveredFolderWarning, match="the previous folder"):
        reloaded, _ = fastft.load_model(str(merged))
    assert reloaded.config.model_type == "llama" and not atomic.leftovers(tmp_path)


def test_an_overwrite_swaps_in_one_step(lora, tmp_path, monkeypatch):
    """On Linux the old and new folders are exchanged atomically: no moment without a complete folder."""
    model, _ = lora
    path = tmp_path / "adapter"
    fastft.save_adapter(model, path)
    seen = []
    real_exchange = atomic._exchange

    def exchange(a, b):
        seen.append(b.exists())
        ok = real_exchange(a, b)
        seen.append((b / "adapter_model.safetensors").exists())
        return ok

    monkeypatch.setattr(atomic, "_exchange", exchange)
    fastft.save_adapter(model, path)
    assert seen == [True, True] and sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def _make_checkpoints(model, tokenizer, output_dir, steps=4, limit=5):
    config = TrainConfig(max_steps=steps, save_every=1, save_total_limit=limit, output_dir=str(output_dir))
    Trainer(model, tokenizer, fastft.pack(ROWS, tokenizer, 128), config=config).train()


def test_pruning_renames_before_deleting(lora, tmp_path, monkeypatch):
    """A prune killed mid-delete leaves a hidden leftover, never a half-deleted ``checkpoint-N``."""
    model, tokenizer = lora
    _make_checkpoints(model, tokenizer, tmp_path)
    deleting = []

    def half_delete(path, ignore_errors=False):  # deletes one file, then "dies"
        deleting.append(path.name)
        next(p for p in path.iterdir() if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic.shutil, "rmtree", half_delete)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(tmp_path, keep=2)
    monkeypatch.undo()
    assert deleting == [deleting[0]] and deleting[0].startswith(".checkpoint-1.prune-")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert clean_output_dir(tmp_path) and not atomic.leftovers(tmp_path)


def test_a_run_start_removes_leftover_temporary_folders(lora, tmp_path):
    model, tokenizer = lora
    for name in (".checkpoint-3.tmp-0123abcd", ".checkpoint-1.prune-89abcdef"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "optimizer.pt").write_bytes(b"half")
    (tmp_path / "notes.txt").write_text("kept")
    _make_checkpoints(model, tokenizer, tmp_path, steps=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "notes.txt"]


def _small_tmpfs(tmp_path, size: str):
    mount = tmp_path / "small"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here, so no small tmpfs for a disk-full test")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip() or done.returncode})")
    return mount


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(lora, tmp_path):
    model, tokenizer = lora
    mount = _small_tmpfs(tmp_path, "1m")
    try:
        config = TrainConfig(max_steps=6, save_every=1, save_total_limit=10, output_dir=str(mount / "run"))
        trainer = Trainer(model, tokenizer, fastft.pack(ROWS, tokenizer, 128), config=config)
        with pytest.raises(atomic.DiskFullError) as error:
            trainer.train()
        message = str(error.value)
        assert "no space left on device while writing" in message and "is intact" in message
        assert "enforce fail" not in message
        good = list_checkpoints(mount / "run")
        assert good and str(good[-1]) in message
        base, _ = fastft.load_model("tiny-llama")
        PeftModel.from_pretrained(base, good[-1])  # the previous checkpoint still loads
        assert not atomic.leftovers(mount / "run")  # the half-written one was removed
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _manifest(folder):
    import json

    return json.loads((folder / atomic.MARKER).read_text())["files"]


def test_a_second_save_keeps_what_the_user_added_to_the_folder(lora, tmp_path):
    """Issue 53: save_adapter, the user adds NOTES.md (and a folder of code), save_adapter again: both stay."""
    model, tokenizer = lora
    path = tmp_path / "a"
    fastft.save_adapter(model, path, tokenizer)
    (path / "NOTES.md").write_text("what I tried")
    (path / "code").mkdir()
    (path / "code" / "run.py").write_text("print('mine')")
    fastft.save_adapter(
        model, path
    )  # no tokenizer this time: its files, fastft's and unchanged, are left out
    assert (path / "NOTES.md").read_text() == "what I tried"
    assert (path / "code" / "run.py").read_text() == "print('mine')"
    listed = _manifest(path)
    assert set(listed) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    assert {record["by"] for record in listed.values()} == {"save_adapter"}
    assert not (path / "tokenizer_config.json").exists()
    base, _ = fastft.load_model("tiny-llama")
    PeftModel.from_pretrained(base, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_a_copied_manifest_gives_no_licence_over_the_users_files(lora, tmp_path):
    """A manifest copied from a fastft folder into the user's project: files that do not match it stay, and
    a save that would replace one of them is refused, naming it."""
    model, tokenizer = lora
    fastft.save_adapter(model, tmp_path / "saved")
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(tmp_path / "saved" / atomic.MARKER, project / atomic.MARKER)
    (project / "code.py").write_text("print('mine')")
    (project / "adapter_config.json").write_text('{"my": "own config"}')
    before = _tree(project)
    with pytest.raises(atomic.FolderInTheWayError, match=r"adapter_config\.json.*did not write them"):
        fastft.save_adapter(model, project)
    assert (
        _tree(project) == before and (project / "adapter_config.json").read_text() == '{"my": "own config"}'
    )
    assert not atomic.leftovers(tmp_path)
    (project / "adapter_config.json").unlink()
    fastft.save_adapter(model, project)  # nothing of the user's in the way: saved beside their code
    assert (project / "code.py").read_text() == "print('mine')" and (
        project / "adapter_model.safetensors"
    ).exists()


def test_a_file_fastft_wrote_and_the_user_changed_is_not_replaced(lora, tmp_path):
    model, _ = lora
    path = tmp_path / "a"
    fastft.save_adapter(model, path)
    config = path / "adapter_config.json"
    config.write_text(config.read_text().replace('"r": 4', '"r": 4 '))  # same meaning, other bytes
    edited = config.read_text()
    with pytest.raises(atomic.FolderInTheWayError, match=r"adapter_config\.json.*changed since"):
        fastft.save_adapter(model, path)
    assert config.read_text() == edited
    fastft.save_adapter(model, path, overwrite=True)  # named: the whole folder is replaced
    assert config.read_text() != edited


def test_a_model_saved_over_another_leaves_out_fastfts_old_files_but_keeps_changed_ones(lora, tmp_path):
    """save_merged then save_adapter into one folder: the merged weights (fastft's, unchanged) go, so the
    folder never mixes two models; a file the user edited since stays theirs."""
    model, tokenizer = lora
    path = tmp_path / "m"
    fastft.save_merged(model, path, tokenizer, dtype=torch.float32)
    (path / "generation_config.json").write_text('{"my": "edit"}')
    fastft.save_adapter(model, path)
    names = {p.name for p in path.iterdir()}
    assert "model.safetensors" not in names and "config.json" not in names and "tokenizer.json" not in names
    assert (path / "generation_config.json").read_text() == '{"my": "edit"}'
    assert "generation_config.json" not in _manifest(path)  # the user's file now, never fastft's to delete


def test_a_folder_from_an_earlier_fastft_is_refused_where_its_files_would_be_replaced(lora, tmp_path):
    """A manifest without a file list (fastft before issue 53) cannot tell fastft's files from the user's."""
    model, _ = lora
    path = tmp_path / "a"
    fastft.save_adapter(model, path)
    (path / atomic.MARKER).write_text('{"written_by": "fastft", "kind": "adapter"}\n')
    with pytest.raises(atomic.FolderInTheWayError, match="earlier fastft.*overwrite=True"):
        fastft.save_adapter(model, path)
    fastft.save_adapter(model, path, overwrite=True)
    assert "adapter_model.safetensors" in _manifest(path)


def test_a_folder_that_cannot_be_written_is_named_not_the_hidden_temporary_one(lora, tmp_path, monkeypatch):
    """Tests run as root, which chmod does not stop: the refusal is simulated where the save creates its
    temporary folder, as a read-only parent refuses it."""
    model, _ = lora
    real_mkdir = atomic.Path.mkdir

    def mkdir(self, *args, **kwargs):
        if ".tmp-" in self.name:
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(atomic.Path, "mkdir", mkdir)
    target = tmp_path / "adapter"
    with pytest.raises(PermissionError) as caught:
        fastft.save_adapter(model, target)
    message = str(caught.value)
    assert (
        f"cannot write {target}:" in message and ".tmp-" not in message and "folder you can write" in message
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_named(lora, tmp_path):
    model, _ = lora
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=f"cannot write {parent / 'adapter'}:"):
            fastft.save_adapter(model, parent / "adapter")
    finally:
        parent.chmod(0o755)


def test_a_file_added_while_a_save_runs_is_kept(tmp_path):
    path = tmp_path / "folder"
    atomic.replace_folder_atomically(lambda tmp: (tmp / "weights.bin").write_bytes(b"1"), path, by="test")

    def write(tmp):
        (tmp / "weights.bin").write_bytes(b"2")
        (path / "late.txt").write_text("written by the user during the save")

    atomic.replace_folder_atomically(write, path, by="test")
    assert (path / "late.txt").read_text() == "written by the user during the save"
    assert (path / "weights.bin").read_bytes() == b"2" and not atomic.leftovers(tmp_path)

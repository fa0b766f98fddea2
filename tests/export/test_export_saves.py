"""Where GGUF and Ollama exports land and how they fail (issue 53): a second quantisation lands beside the
first and nothing else in the folder is touched; a check of no prompts is refused; a full disk and a folder
that cannot be written name the user's path (with the bytes needed and free), never the hidden partial file;
the partial file of a killed save is removed by the next save into the folder, which says so. Untrained
tiny-llama, mostly with ``check=False``: each test is about the file, not the model."""

from __future__ import annotations

import json
import os
import signal
import warnings

import pytest

import fastft
from fastft import atomic
from fastft.cli import main
from fastft.export import save_gguf, save_ollama, writer
from fastft.export.check import check_gguf
from fastft.export.writer import GGUFExportError, remove_stale_partials, temporary_sibling


@pytest.fixture(scope="module")
def llama():
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    return fastft.add_lora(model, r=4, alpha=8, seed=1).eval(), tokenizer


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def _listed(folder):
    return json.loads((folder / atomic.MARKER).read_text())["files"]


def test_two_quantisations_saved_into_one_folder_both_stay(llama, tmp_path):
    model, tokenizer = llama
    (tmp_path / "NOTES.md").write_text("mine")
    first = save_gguf(model, tmp_path / "model.Q8_0.gguf", tokenizer, "q8_0", check=False)
    before = first.path.read_bytes()
    save_gguf(model, tmp_path / "model.F16.gguf", tokenizer, "f16", check=False)
    assert _names(tmp_path) == ["NOTES.md", "model.F16.gguf", "model.Q8_0.gguf"]
    assert first.path.read_bytes() == before


def test_a_second_ollama_save_keeps_the_first_quantisation_and_the_users_files(llama, tmp_path):
    model, tokenizer = llama
    folder = tmp_path / "ollama"
    save_ollama(model, folder, tokenizer, "q8_0", check=False)
    (folder / "NOTES.md").write_text("mine")
    first = (folder / "model.Q8_0.gguf").read_bytes()
    result = save_ollama(model, folder, tokenizer, "f16", check=False)
    assert _names(folder) == [atomic.MARKER, "Modelfile", "NOTES.md", "model.F16.gguf", "model.Q8_0.gguf"]
    assert (folder / "model.Q8_0.gguf").read_bytes() == first and (folder / "NOTES.md").read_text() == "mine"
    assert (folder / "Modelfile").read_text().startswith("FROM ./model.F16.gguf\n")
    assert result.path == folder / "model.F16.gguf"
    assert set(_listed(folder)) == {
        "Modelfile",
        "model.F16.gguf",
        "model.Q8_0.gguf",
    }  # NOTES.md: not fastft's
    save_gguf(
        model, folder / "model.BF16.gguf", tokenizer, "bf16", check=False
    )  # into fastft's folder: listed
    assert _listed(folder)["model.BF16.gguf"]["by"] == "save_gguf"


def test_an_adapter_saved_again_keeps_the_gguf_exported_into_its_folder(llama, tmp_path):
    model, tokenizer = llama
    folder = tmp_path / "adapter"
    fastft.save_adapter(model, folder)
    save_gguf(model, folder / "model.gguf", tokenizer, "q8_0", check=False)
    fastft.save_adapter(model, folder)  # a whole-model save: leaves out only an earlier model's files
    assert (folder / "model.gguf").is_file() and set(_listed(folder)) >= {"model.gguf", "adapter_config.json"}


def test_the_unsloth_save_pretrained_gguf_twice_keeps_both_quantisations(tmp_path):
    from fastft import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained("tiny-llama", max_seq_length=128)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8)
    model.save_pretrained_gguf(tmp_path / "g", tokenizer, quantization_method="q8_0", check=False)
    model.save_pretrained_gguf(tmp_path / "g", tokenizer, quantization_method="f16", check=False)
    assert {"model.Q8_0.gguf", "model.F16.gguf"} <= set(_names(tmp_path / "g"))


def test_a_gguf_fastft_wrote_and_the_user_changed_is_not_replaced(llama, tmp_path):
    model, tokenizer = llama
    folder = tmp_path / "ollama"
    save_ollama(model, folder, tokenizer, "q8_0", check=False)
    target = folder / "model.Q8_0.gguf"
    with open(target, "ab") as f:
        f.write(b"edited")  # still carries fastft's key; the manifest knows it changed
    with pytest.raises(atomic.FolderInTheWayError, match="changed since fastft wrote it"):
        save_gguf(model, target, tokenizer, "q8_0", check=False)
    assert target.read_bytes().endswith(b"edited")


def test_a_check_of_no_prompts_is_refused(llama, tmp_path, capsys):
    model, tokenizer = llama
    for save in (
        lambda: save_gguf(model, tmp_path / "m.gguf", tokenizer, "bf16", prompts=[]),
        lambda: save_ollama(model, tmp_path / "o", tokenizer, "bf16", prompts=[]),
    ):
        with pytest.raises(ValueError, match="prompts is empty.*check=False"):
            save()
    assert _names(tmp_path) == []  # refused before any work
    save_gguf(
        model, tmp_path / "m.gguf", tokenizer, "bf16", check=False, prompts=[]
    )  # no check: nothing to say
    with pytest.raises(ValueError, match="prompts is empty"):
        check_gguf(tmp_path / "m.gguf", model, tokenizer, "bf16", prompts=[])
    with pytest.raises(ValueError, match="one string"):
        save_gguf(model, tmp_path / "n.gguf", tokenizer, "bf16", prompts="What is 2 + 2?")
    assert main(["export", str(tmp_path / "run"), "--prompts", "0"]) == 2
    err = capsys.readouterr().err
    assert "--prompts 0" in err and "--no-check" in err


def test_a_full_disk_names_the_file_the_bytes_needed_and_free_and_the_fix(llama, tmp_path, monkeypatch):
    model, tokenizer = llama
    target = tmp_path / "m.gguf"
    free = 8160
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: type("U", (), {"free": free})())
    with pytest.raises(atomic.DiskFullError) as caught:
        save_gguf(model, target, tokenizer, "f16", check=False)
    message = str(caught.value)
    needed = caught.value.needed
    assert needed > 1_000_000 and caught.value.free == free  # the tensors' bytes; the free space it read
    assert f"while writing {target} (it needs {atomic._size(needed)} and 8.0 KiB are free there)" in message
    assert "Free some space or save somewhere else" in message and ".partial" not in message
    assert _names(tmp_path) == []


def test_a_disk_that_fills_while_writing_names_the_file(llama, tmp_path, monkeypatch):
    """numpy's short write ("46784 requested and 8160 written", no errno) mid-file, as on a full disk."""
    model, tokenizer = llama
    monkeypatch.setattr(writer, "_encode", _short_write)
    target = tmp_path / "m.gguf"
    with pytest.raises(atomic.DiskFullError) as caught:
        save_gguf(model, target, tokenizer, "f16", check=False)
    message = str(caught.value)
    assert f"no space left on device while writing {target}" in message and "it needs" in message
    assert "requested and" not in message and ".partial" not in message
    assert isinstance(caught.value.__cause__, OSError) and _names(tmp_path) == []


def _short_write(tensor, kind):
    raise OSError("46784 requested and 8160 written")


def test_a_folder_that_cannot_be_written_names_the_gguf_path(llama, tmp_path, monkeypatch):
    """Tests run as root, which ignores chmod: the refusal comes where the partial file is created."""
    model, tokenizer = llama

    def refuse(path, mode="r", *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(writer, "open", refuse, raising=False)
    target = tmp_path / "m.gguf"
    with pytest.raises(PermissionError) as caught:
        save_gguf(model, target, tokenizer, "bf16", check=False)
    message = str(caught.value)
    assert f"cannot write {target}:" in message and ".partial" not in message and "write to" in message


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_names_the_gguf_path(llama, tmp_path):
    model, tokenizer = llama
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=f"cannot write {tmp_path / 'm.gguf'}:"):
            save_gguf(model, tmp_path / "m.gguf", tokenizer, "bf16", check=False)
    finally:
        tmp_path.chmod(0o755)


def _killed_mid_write(model, tokenizer, target) -> None:
    def die(tensor, kind):
        os.kill(os.getpid(), signal.SIGKILL)

    writer._encode = die
    save_gguf(model, target, tokenizer, "bf16", check=False)


def test_the_partial_file_of_a_killed_save_is_removed_by_the_next_and_a_live_one_is_kept(llama, tmp_path):
    model, tokenizer = llama
    target = tmp_path / "m.gguf"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            _killed_mid_write(model, tokenizer, target)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    (stale,) = tmp_path.iterdir()
    assert stale.name.startswith(".m.gguf.") and stale.name.endswith(".partial")
    claims = []
    live = temporary_sibling(tmp_path / "other.gguf", claims)  # a save that is still writing
    try:
        with pytest.warns(atomic.RemovedLeftoverWarning, match=f"interrupted save_gguf.*{stale.name}"):
            save_gguf(model, target, tokenizer, "bf16", check=False)
        assert _names(tmp_path) == sorted([live.name, "m.gguf"])
    finally:
        for handle in claims:
            handle.close()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert remove_stale_partials(tmp_path) == [live]  # its writer gone: removed


def test_export_error_paths_name_the_input(llama, tmp_path):
    model, tokenizer = llama
    (tmp_path / "a_file").write_text("mine")
    with pytest.raises(atomic.FolderInTheWayError, match="is a file"):
        save_ollama(model, tmp_path / "a_file", tokenizer, check=False)
    with pytest.raises(GGUFExportError, match="unknown GGUF quantization 'q9_9'"):
        save_ollama(model, tmp_path / "o", tokenizer, "q9_9")
    with pytest.raises(ValueError, match=r"does not end in \.gguf"):
        save_gguf(model, tmp_path / "model.bin", tokenizer, check=False)
    (tmp_path / "dir.gguf").mkdir()
    with pytest.raises(atomic.FolderInTheWayError, match="is a folder"):
        save_gguf(model, tmp_path / "dir.gguf", tokenizer, check=False)
    project = tmp_path / "project"
    project.mkdir()
    (project / "code.py").write_text("print('mine')")
    with pytest.raises(atomic.FolderInTheWayError, match=r"not written by fastft.*code\.py"):
        save_ollama(model, project, tokenizer, check=False)
    assert _names(tmp_path) == ["a_file", "dir.gguf", "project"] and _names(project) == ["code.py"]

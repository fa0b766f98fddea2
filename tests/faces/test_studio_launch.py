"""The Run tab's "all GPUs": the run goes to a torchrun subprocess (here 2 CPU processes over gloo, as
``fastft launch --nproc 2`` runs them), the plots follow its events, Stop ends it, and a finished run's adapter
comes back into the kernel's model."""

from __future__ import annotations

import time

import pytest
import torch

import fastft
from fastft.studio.launched import LaunchedRun
from fastft.studio.run import RunPanel
from fastft.studio.state import StudioState
from fastft.training.events import EvalEvent, EventLog, StepEvent, read_events

TWO = [("this kernel", 1), ("2 CPU processes (torchrun, gloo)", 2)]


def _state(tmp_path):
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    model = fastft.add_lora(model, r=4, seed=3)
    rows = fastft.load_dataset("bundled:skills").select(range(48))
    packed = fastft.pack(rows, tokenizer, 128)
    return StudioState(model_name="tiny-llama", model=model, tokenizer=tokenizer, rows=rows, packed=packed)


def _panel(state, tmp_path, steps: int) -> RunPanel:
    panel = RunPanel(state, live="text", processes=TWO)
    panel.processes.value = 2
    panel.steps.value = steps
    panel.warmup.value = 0
    panel.learning_rate.value = 1e-3
    panel.output_dir.value = str(tmp_path / "run")
    return panel


def _adapter(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_run_on_two_processes_plots_its_steps_and_brings_the_trained_adapter_back(tmp_path):
    state = _state(tmp_path)
    before = _adapter(state.model)
    panel = _panel(state, tmp_path, steps=3)
    assert panel.processes.layout.display != "none"  # offered: there is a choice
    run = panel.start()
    assert isinstance(run, LaunchedRun) and state.run is run
    assert panel.pause_button.disabled and panel.save_button.disabled  # not offered on several processes
    run.wait(timeout=600)
    assert run.status == "finished", run.error_message
    assert [e.step for e in run.events if isinstance(e, StepEvent)] == [1, 2, 3]
    panel.refresh(final=True)
    assert len(panel.series) == 3  # the plots followed the subprocess's events
    script = (tmp_path / "run" / "launch" / "train.py").read_text()
    assert "load_packed" in script and "EventLog" in script and "max_steps=3" in script
    after = _adapter(state.model)
    assert any(not torch.equal(before[n], after[n]) for n in before)  # trained weights came back
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "run" / "launch" / "trained" / "adapter_model.safetensors"))
    mine = get_peft_model_state_dict(state.model)
    assert saved.keys() == mine.keys() and all(torch.equal(saved[k], mine[k].cpu()) for k in saved)
    assert "Finished" in panel.status.value or run.result.final_loss == run.events[-1].loss


def test_stop_ends_the_processes_and_keeps_the_model(tmp_path):
    state = _state(tmp_path)
    before = _adapter(state.model)
    panel = _panel(state, tmp_path, steps=10_000)
    run = panel.start()
    deadline = time.monotonic() + 300
    while run.step < 1:
        assert time.monotonic() < deadline and not run.done, run.error_message
        time.sleep(0.2)
    panel.stop_button.click()
    run.wait(timeout=60)
    assert run.status == "stopped" and run.process.poll() is not None
    after = _adapter(state.model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # a stopped run does not touch the model


def test_settings_a_run_on_several_processes_cannot_take_are_named_before_start(tmp_path):
    state = _state(tmp_path)
    panel = _panel(state, tmp_path, steps=3)
    panel.output_dir.value = ""
    assert any("output dir" in text for kind, text in panel.problems() if kind == "error")
    with pytest.raises(ValueError, match="output dir"):
        panel.start()
    panel.output_dir.value = str(tmp_path / "run")
    assert not [text for kind, text in panel.problems() if kind == "error"]
    single = RunPanel(state, live="text", processes=[("this kernel", 1)])
    assert single.processes.layout.display == "none"  # one GPU (or none): nothing to choose


def test_the_event_log_reads_back_whole_lines_only(tmp_path):
    log = EventLog(tmp_path / "events.jsonl")
    step = StepEvent(1, 3, 0.1, 2.5, 1e-3, 0.5, 10, 20, 0.1, 100.0, 2**20, "rss", {"step": 1.0})
    log(step)
    log(EvalEvent(1, 2.0, 10))
    events, offset = read_events(tmp_path / "events.jsonl")
    assert events == [step, EvalEvent(1, 2.0, 10)]
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"kind": "StepEvent", "step"')  # a line still being written
    assert read_events(tmp_path / "events.jsonl", offset) == ([], offset)
    assert read_events(tmp_path / "missing.jsonl") == ([], 0)


def test_packed_data_saved_and_loaded_gives_the_same_batches(tmp_path):
    from fastft.data.packing import load_packed

    state = _state(tmp_path)
    packed = state.packed
    again = load_packed(packed.save(tmp_path / "data"))
    assert again.bins == packed.bins and again.stats == packed.stats
    for index in range(len(packed)):
        a, b = packed.batch([index]), again.batch([index])
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    # preference pairs come back as pairs (a child process trains DPO on them as the kernel would)
    from fastft.data.pairs import PackedPairs

    rows = [
        {"prompt": f"What is {i} plus {i}?", "chosen": f"{2 * i}", "rejected": f"Maybe {2 * i + 1}."}
        for i in range(7)
    ] + [{"prompt": "What is 1 plus 1?", "chosen": "2", "rejected": "2"}]  # left out, and named, in the stats
    with pytest.warns(UserWarning, match="left out"):
        pairs = fastft.pack_pairs(rows, state.tokenizer, 64)
    assert pairs.pair_stats.identical_rows == (7,)
    back = load_packed(pairs.save(tmp_path / "pairs"))
    assert isinstance(back, PackedPairs) and back.pair_stats == pairs.pair_stats and back.bins == pairs.bins
    assert type(load_packed(tmp_path / "data.npz")) is not PackedPairs
    (tmp_path / "other.npz").write_bytes(b"not packed data")
    with pytest.raises(ValueError, match="cannot be read as packed data"):
        load_packed(tmp_path / "other.npz")
    import numpy as np

    np.savez(tmp_path / "arrays.npz", x=np.arange(3))
    with pytest.raises(ValueError, match="not packed data written by PackedDataset.save"):
        load_packed(tmp_path / "arrays.npz")

"""Studio VRAM, Run and Export panels without a browser: set values, click buttons, read what is shown."""

from __future__ import annotations

import html
import threading
import time

import numpy as np
import pytest
import torch

import fastft
from fastft.studio import export as export_module
from fastft.studio.export import ExportPanel
from fastft.studio.live import LiveFigure, SeriesBuffer
from fastft.studio.run import RunPanel
from fastft.studio.run_control import Run, explain
from fastft.studio.state import LoadSettings, LoraSettings, PackSettings, StudioState
from fastft.studio.vram import VramPanel
from fastft.training.events import StepEvent
from fastft.training.objectives import sft as sft_objective
from fastft.training.trainer import TrainConfig

SEQ = 128
GiB = 2**30
_PACKED: dict = {}


def _studio_state(**fields) -> StudioState:
    """A fresh LoRA tiny-llama and the bundled skills data packed into 128-token bins."""
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=SEQ)
    model = fastft.add_lora(model, r=8, alpha=16, seed=5)
    if "packed" not in _PACKED:
        rows = fastft.load_dataset("bundled:skills").select(range(160))
        _PACKED["rows"], _PACKED["packed"] = rows, fastft.pack(rows, tokenizer, SEQ)
    return StudioState(
        model_name="tiny-llama",
        model=model,
        tokenizer=tokenizer,
        load_settings=LoadSettings(max_seq_length=SEQ),
        lora_settings=LoraSettings(r=8, alpha=16),
        dataset_name="bundled:skills",
        rows=_PACKED["rows"],
        packed=_PACKED["packed"],
        pack_settings=PackSettings(max_seq_length=SEQ),
        **fields,
    )


def _run_panel(state: StudioState, steps: int, **settings) -> RunPanel:
    panel = RunPanel(state, live="text")
    panel.train_in.value = "kernel"  # these runs are monkeypatched and read in this process
    panel.steps.value = steps
    for name, value in settings.items():
        getattr(panel, name).value = value
    return panel


def _until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _text(widget) -> str:
    return html.unescape(widget.value)


# -- VRAM ------------------------------------------------------------------------------------------------


def test_vram_panel_draws_the_stacked_bar_and_the_verdict_from_a_name_alone():
    state = StudioState(model_name="tiny-llama")
    panel = VramPanel(state, live="text")
    panel.gpu.value = "rtx4090"
    panel.seq_len.value = 1024
    estimate = panel.estimate
    assert estimate.settings.seq_len == 1024 and estimate.gpu.name == "rtx4090"
    bars = panel.figure.figure.data
    assert [bar.name for bar in bars] == ["weights", "LoRA + optimizer", "activations", "logits", "workspace"]
    assert sum(bar.x[0] for bar in bars) == pytest.approx(estimate.total_bytes / GiB, rel=1e-6)
    assert "Fits" in _text(panel.verdict) and "RTX 4090" in _text(panel.verdict)
    assert panel.max_context >= 1024 and f"{panel.max_context:,} tokens" in _text(panel.longest)
    assert panel.batch_tokens.value >= 1024  # a micro-batch holds at least one whole sequence

    state.lora_settings.r = 64  # the Model panel changed the rank: the estimate follows
    state.notify("lora_settings")
    assert panel.rank.value == 64 and panel.estimate.settings.lora_r == 64
    code = panel.code()
    assert "fastft.estimate_vram(" in code and all(
        f"{part}," in code for part in ('"tiny-llama"', "seq_len=1024", "lora_r=64", 'gpu="rtx4090"')
    )
    exec(compile(code.replace("print(", "(lambda *a: None)("), "<vram panel code>", "exec"), {})


def test_vram_panel_names_the_fix_before_a_run_that_cannot_fit():
    panel = VramPanel(StudioState(model_name="Qwen/Qwen3-8B"), live="text")
    panel.gpu.value = "t4"
    panel.seq_len.value = 4096
    verdict = _text(panel.verdict)
    assert panel.fit.fits is False and "Does not fit" in verdict and "4-bit" in verdict
    assert panel.figure.figure.layout.title.text.endswith(
        f"short by {-panel.estimate.headroom_bytes / GiB:.2f} GiB"
    )

    panel.model_name.value = "Qwen/Qwen3-32B"  # nothing single fixes a 32B model on a T4
    assert "smaller model or a larger GPU" in _text(panel.verdict)

    panel.model_name.value = "no-such-model"  # shown with the presets to pick from, never raised
    assert panel.wait()  # any name but a preset or a catalog id is looked up once typing pauses
    assert "tiny-llama" in _text(panel.status) and panel.estimate is None and panel.verdict.value == ""


# -- Run -------------------------------------------------------------------------------------------------


def test_run_panel_trains_on_a_background_thread_and_plots_every_loss(tmp_path):
    state = _studio_state()
    panel = _run_panel(state, 6, output_dir=str(tmp_path / "run"))
    threads = []
    panel.start_button.click()
    panel.run.subscribe(lambda event: threads.append(threading.current_thread().name))
    assert panel.start_button.disabled and not panel.stop_button.disabled
    result = panel.wait(60)
    run = panel.run
    assert run.status == "finished" and run.error is None and state.run is run
    assert set(threads) <= {"fastft-run"}
    losses = [event.loss for event in result.steps]
    assert len(losses) == 6
    np.testing.assert_allclose(panel.plots.figure.data[0].y, losses, rtol=1e-6)
    np.testing.assert_array_equal(panel.plots.figure.data[0].x, np.arange(1, 7))
    assert panel.plots.figure.data[1].y[-1] != losses[-1]  # the smoothed curve
    assert panel.progress.value == 6 and "step 6/6" in panel.progress_text.value
    assert "Finished 6 steps" in _text(panel.status) and not panel.start_button.disabled
    assert "Attention: sdpa_masked (SDPA with a block-diagonal causal mask)." in _text(panel.status)
    assert "forward" in panel.timing_table.value and len(panel.timing_figure.figure.data) > 3

    again = RunPanel(state, live="text")  # the studio shown again finds the state's run
    assert again.run is run and list(again.plots.figure.data[0].y) == list(panel.plots.figure.data[0].y)

    panel.steps.value = 2  # the preview follows the controls, and runs as it reads
    code = panel.code()
    assert code.strip() in _text(panel.code_preview)
    assert "max_steps=2" in code and 'fastft.load_model("tiny-llama", max_seq_length=128)' in code
    namespace: dict = {}
    exec(compile(code.replace("print(", "(lambda *a: None)("), "<run panel code>", "exec"), namespace)
    assert len(namespace["result"].steps) == 2


def test_pause_says_pausing_until_the_step_ends_holds_the_steps_save_writes_a_checkpoint(
    tmp_path, monkeypatch
):
    real_loss = sft_objective.causal_lm_loss_sum
    calls, inside, release = {"n": 0}, threading.Event(), threading.Event()

    def gated(model, batch):  # step 3's forward waits for the test: Pause is clicked mid-step
        calls["n"] += 1
        if calls["n"] == 3:
            inside.set()
            release.wait(30)
        return real_loss(model, batch)

    monkeypatch.setattr(sft_objective, "causal_lm_loss_sum", gated)
    panel = _run_panel(_studio_state(), 30, output_dir=str(tmp_path))
    panel.start_button.click()
    run = panel.run
    assert inside.wait(60)
    panel.pause_button.click()
    panel.refresh()
    assert run.status == "pausing" and panel.pause_button.description == "Resume"
    assert "pausing · step 2/30" in panel.progress_text.value and "Paused at" not in _text(panel.status)
    release.set()
    _until(lambda: run.parked)  # the step in flight ends, then the run holds
    panel.refresh()
    held = run.step
    assert run.status == "paused" and held == 3 and "paused · step 3/30" in panel.progress_text.value
    assert "Paused at step 3" in _text(panel.status)
    time.sleep(0.4)
    assert run.step == held and run.status == "paused"

    panel.save_button.click()  # done by the training thread, which is parked between steps
    _until(lambda: (tmp_path / f"checkpoint-{held}").is_dir())
    _until(lambda: "Checkpoint saved" in _text(panel.status))
    assert run.step == held

    panel.pause_button.click()
    assert run.status == "running" and panel.pause_button.description == "Pause"
    panel.wait(60)
    assert run.status == "finished" and run.step == 30
    assert [e.step for e in run.events if isinstance(e, StepEvent)] == list(range(1, 31))


def test_a_new_run_starts_with_an_empty_step_timing_chart(tmp_path, monkeypatch):
    panel = _run_panel(_studio_state(), 3)
    panel.start_button.click()
    panel.wait(60)
    assert panel.timing_figure.figure.data and "forward" in panel.timing_table.value  # the first run's bars
    real_loss, inside, release = sft_objective.causal_lm_loss_sum, threading.Event(), threading.Event()

    def held(model, batch):  # the second run's first step waits: its chart must not show the first run's
        inside.set()
        release.wait(30)
        return real_loss(model, batch)

    monkeypatch.setattr(sft_objective, "causal_lm_loss_sum", held)
    panel.steps.value = 2
    panel.start_button.click()
    assert inside.wait(60)
    panel.refresh()
    assert not panel.timing_figure.figure.data and panel.timing_table.value == ""
    release.set()
    panel.wait(60)
    assert [bar.x[-1] for bar in panel.timing_figure.figure.data][0] == 2


def test_stop_mid_run_keeps_the_last_checkpoint_on_disk(tmp_path):
    panel = _run_panel(_studio_state(), 500, save_every=2, output_dir=str(tmp_path))
    panel.start_button.click()
    run = panel.run
    _until(lambda: run.step >= 3)
    panel.stop_button.click()
    panel.wait(60)
    assert run.status == "stopped" and run.step < 500
    last = run.checkpoints[-1]
    assert last.endswith(f"checkpoint-{run.step}") and (tmp_path / f"checkpoint-{run.step}").is_dir()
    assert "Stopped at step" in _text(panel.status) and last in _text(panel.status)
    assert panel.progress.bar_style == "warning" and not run._thread.is_alive()


def test_nan_loss_shows_the_fix_keeps_the_good_checkpoint_and_ends_the_thread(tmp_path, monkeypatch):
    real_loss = sft_objective.causal_lm_loss_sum
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        loss = real_loss(model, batch)
        return loss * float("nan") if calls["n"] == 5 else loss

    monkeypatch.setattr(sft_objective, "causal_lm_loss_sum", poisoned)
    panel = _run_panel(_studio_state(), 10, save_every=2, output_dir=str(tmp_path))
    panel.start_button.click()
    panel.wait(60)
    run = panel.run
    assert run.status == "failed" and type(run.error).__name__ == "NonFiniteLossError"
    assert not run._thread.is_alive()
    shown = _text(panel.status)
    assert "step 5" in shown and "lower the learning rate" in shown and "checkpoint-4" in shown
    assert (tmp_path / "checkpoint-4").is_dir() and panel.progress.bar_style == "danger"
    assert panel.save_button.disabled and not panel.start_button.disabled  # a new run may start
    assert run.save_checkpoint().exception() is not None  # never write damaged weights


def test_out_of_memory_is_shown_with_its_fix_and_the_kernel_lives_on(monkeypatch):
    def out_of_memory(model, batch):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(sft_objective, "causal_lm_loss_sum", out_of_memory)
    panel = _run_panel(_studio_state(), 4, micro_batch_bins=4)
    panel.start_button.click()
    panel.wait(60)
    shown = _text(panel.status)
    assert (
        panel.run.status == "failed"
        and "Out of GPU memory" in shown
        and "fewer micro-batch bins (now 4)" in shown
    )
    assert "No checkpoint was written" in shown


def test_mistakes_before_a_run_are_shown_with_their_fix_not_raised():
    panel = RunPanel(StudioState(), live="text")
    panel.start_button.click()
    assert "No model yet" in _text(panel.status) and panel.run is None
    state = _studio_state()
    state.packed = None
    panel = RunPanel(state, live="text")
    panel.start_button.click()
    assert "No packed data yet" in _text(panel.status)
    state.packed = _PACKED["packed"]
    panel.learning_rate.value = -1.0
    panel.start_button.click()
    assert "learning_rate must be above 0, got -1" in _text(panel.status) and panel.run is None
    assert "A token id is outside" in explain(IndexError("index out of range in self"), Run(None, None, None))


def test_live_plot_buffer_thins_old_points_and_keeps_the_whole_run():
    buffer = SeriesBuffer(("loss",), max_points=2000)
    for step in range(1, 10_001):
        buffer.append(step, loss=1.0 / step)
    x, loss = buffer.column("x"), buffer.column("loss")
    assert buffer.count == 10_000 and 1000 <= len(buffer) <= 2000 and x.dtype == loss.dtype == np.float32
    assert x[0] == 1 and x[-1] == 10_000  # from the first step to the latest
    assert set(np.diff(x[:-1])) == {buffer.stride} == {8}  # thinned evenly
    np.testing.assert_allclose(loss, 1.0 / x, rtol=1e-6)  # each x keeps its own values

    panel = RunPanel(StudioState(), live="widget")  # 10,000 events through the panel's plots
    panel.run = Run(None, None, None, config=TrainConfig(max_steps=10_000))
    event = dict(
        max_steps=10_000, epoch=0.0, learning_rate=1e-4, grad_norm=1.0, trained_tokens=100, tokens=128
    )
    more = dict(step_seconds=0.01, trained_tokens_per_second=1e4, peak_memory_bytes=2**30, memory_kind="cuda")
    for start in range(0, 10_000, 2500):
        panel.run.events += [
            StepEvent(step=s, loss=2.0, **event, **more) for s in range(start + 1, start + 2501)
        ]
        panel.refresh()
    trace = panel.plots.figure.data[0]
    assert len(trace.x) <= 2000 and trace.x[-1] == 10_000 and panel.progress.value == 10_000


def test_status_line_says_when_micro_batches_replay_a_cuda_graph():
    panel = RunPanel(StudioState(), live="widget")
    panel.run = Run(None, None, None, config=TrainConfig(max_steps=100))
    event = dict(max_steps=100, epoch=0.0, learning_rate=1e-4, grad_norm=1.0, trained_tokens=100, tokens=128)
    more = dict(step_seconds=0.01, trained_tokens_per_second=1e4, peak_memory_bytes=2**30, memory_kind="cuda")
    panel.run.events = [StepEvent(step=s, loss=2.0, **event, **more) for s in range(1, 11)]
    assert "CUDA graph" not in panel._status_line()  # eager steps: nothing to say
    panel.run.events += [
        StepEvent(step=s, loss=2.0, graph_replays=2, micro_batches=2, padding_tokens=9, **event, **more)
        for s in range(11, 21)
    ]
    # the last 20 steps: 10 eager ones of one micro-batch, 10 replayed ones of two
    assert "CUDA graph: 20/30 micro-batches replayed" in panel._status_line()


def test_display_mode_draws_the_figure_by_setting_the_output_widget():
    from fastft.report.figures import run_dashboard_figure

    live = LiveFigure(run_dashboard_figure(), "display")
    live.set_data({0: ([1, 2], [3.0, 2.0])})
    live.flush()
    (output,) = live._output.outputs
    assert "text/html" in output["data"] and list(live.figure.data[0].y) == [3.0, 2.0]
    assert live.widget.children == (live._output, live._ops)  # the figure, and its update scripts
    assert "[[0,0,[1,2],[3,2]]]" in live.last_update  # the points came as an update, not a new figure


# -- Export ----------------------------------------------------------------------------------------------


def test_export_saves_an_adapter_peft_reloads(tmp_path):
    from peft import PeftModel

    state = _studio_state()
    with torch.no_grad():  # adapters that are not the zero initialisation
        for name, parameter in state.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.02)
    panel = ExportPanel(state)
    panel.adapter_dir.value = str(tmp_path / "adapter")
    panel.save_adapter_button.click()
    assert panel.wait(60)
    assert "Adapter saved" in _text(panel.status)
    base, _ = fastft.load_model("tiny-llama", max_seq_length=SEQ)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    ours = {n: p for n, p in state.model.named_parameters() if "lora_" in n}
    theirs = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert ours.keys() == theirs.keys() and ours
    for name, parameter in ours.items():
        torch.testing.assert_close(theirs[name], parameter)


def test_merge_is_refused_for_a_4bit_base_with_the_way_round_it(tmp_path):
    state = _studio_state()
    state.model.get_base_model().is_loaded_in_4bit = True
    panel = ExportPanel(state)
    panel.merged_dir.value = str(tmp_path / "merged")
    panel.merge_button.click()
    panel.wait(10)
    shown = _text(panel.status)
    assert (
        "Not merged" in shown
        and "4-bit" in shown
        and "16-bit" in shown
        and "PeftModel.from_pretrained" in shown
    )
    assert not (tmp_path / "merged").exists()


def test_generation_streams_the_answer_token_by_token(monkeypatch):
    monkeypatch.setattr(export_module, "STREAM_INTERVAL", 0.0)
    state = _studio_state()
    training = state.model.training
    panel = ExportPanel(state)
    panel.prompt.value = "Compute 48 plus 8."
    panel.max_new_tokens.value = 12
    panel.generate_button.click()
    assert panel.wait(60)
    assert panel.completion.strip() and panel.updates >= 3  # redrawn as the tokens came
    assert panel.completion.strip()[:10] in panel.answer.value and "Generated" in _text(panel.status)
    assert state.model.training == training  # generation leaves the model as it found it

    state.run = type("Busy", (), {"active": True})()  # no export while a run trains the model
    panel.generate_button.click()
    assert "A run is training" in _text(panel.status)


def test_scoring_shows_content_accuracy_beside_format_compliance():
    state = _studio_state()  # the untrained preset: right in its own words, never in the bare format
    panel = ExportPanel(state)
    panel.questions.value = 16
    panel.score_button.click()
    assert panel.wait(60)
    result = panel.last_scores
    assert len(result.completions) == 16 and result.overall == 0.0 < result.content
    shown, table = _text(panel.status), _text(panel.scores)
    assert f"content accuracy {result.content:.1%}, format compliance 0.0%" in shown
    assert "content accuracy" in table and "format compliance" in table
    for task, content in result.content_per_task.items():
        assert f"<td>{task}</td><td style='text-align:right'>{content:.1%}</td>" in table
    assert "fastft.evaluate_accuracy(model, tokenizer, questions)" in panel.code()
    state.run = type("Busy", (), {"active": True})()  # no scoring while a run trains the model
    panel.score_button.click()
    assert "A run is training" in _text(panel.status)

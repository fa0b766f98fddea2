"""The studio as a user meets it, headless: nothing lost on a failed click, no keystroke waits for the hub,
every view shown and cleared when stale, settings checked before Start, plots that choose their way."""

from __future__ import annotations

import html
import json
import time

import pytest

pytest.importorskip("ipywidgets")

import fastft  # noqa: E402
from fastft.studio.data import DataPanel  # noqa: E402
from fastft.studio.live import LiveFigure, frontend  # noqa: E402
from fastft.studio.model import ModelPanel  # noqa: E402
from fastft.studio.notices import StatusLog  # noqa: E402
from fastft.studio.run import RunPanel  # noqa: E402
from fastft.studio.state import Debouncer, StudioState  # noqa: E402
from fastft.studio.vram import VramPanel  # noqa: E402

WAIT = 120


def _text(widget) -> str:
    return html.unescape(widget.value)


def _loaded(panel: ModelPanel) -> ModelPanel:
    panel.load_button.click()
    assert panel.wait(WAIT) and panel.error.value == "", panel.error.value
    return panel


def _packed_state(seq: int = 128, rows: int = 48) -> StudioState:
    state = StudioState()
    _loaded(ModelPanel(state))
    state.rows = fastft.load_dataset("bundled:skills").select(range(rows))
    state.dataset_name = "bundled:skills"
    state.packed = fastft.pack(state.rows, state.tokenizer, seq)
    return state


# -- loading is transactional ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, precision, shown",
    [("nobody/no-such-model", "16-bit", "offline"), ("tiny-lama", "16-bit", "UnknownModelError")],
)
def test_a_failed_load_keeps_the_loaded_model(name, precision, shown):
    panel = _loaded(ModelPanel())
    model, tokenizer = panel.state.model, panel.state.tokenizer
    summary = panel.summary.value
    panel.model_name.value = name
    panel.precision.value = precision
    panel.load_button.click()
    assert panel.wait(WAIT)
    assert shown in panel.error.value and "tiny-llama is still loaded" in _text(panel.error)
    assert panel.state.model is model and panel.state.tokenizer is tokenizer
    assert panel.summary.value == summary and not panel.apply_button.disabled
    # the loaded model picked again: the failed load's error goes, the panel says what is loaded
    panel.model_name.value, panel.precision.value = "tiny-llama", "16-bit"
    assert panel.error.value == "" and "Loaded tiny-llama" in panel.status.value


def test_loading_over_a_trained_unsaved_model_saves_its_adapter_first(tmp_path):
    from peft import PeftModel

    state = _packed_state()
    run = RunPanel(state, live="text")
    run.train_in.value = "kernel"
    run.steps.value = 3
    run.output_dir.value = str(tmp_path / "runs")
    run.start()
    run.wait(WAIT)
    assert state.unsaved_steps() == 3
    trained = {k: v.clone() for k, v in state.model.named_parameters() if v.requires_grad}

    panel = ModelPanel(state)
    panel.model_name.value = "tiny-qwen3"
    panel.load_button.click()
    assert panel.wait(WAIT) and panel.error.value == "", panel.error.value
    folder = tmp_path / "runs" / "adapter-tiny-llama-step3"
    assert str(folder) in _text(panel.saved_note) and state.saved[2] == str(folder)
    assert state.model.fastft_info.name == "tiny-qwen3" and state.unsaved_steps() == 0

    base, _ = fastft.load_model("tiny-llama", max_seq_length=128)
    again = PeftModel.from_pretrained(base, str(folder))
    reloaded = {k: v for k, v in again.named_parameters() if "lora_" in k}
    assert len(reloaded) == len(trained)
    for key, value in trained.items():
        match = [v for k, v in reloaded.items() if k.replace(".default", "") == key.replace(".default", "")]
        assert match and (match[0] - value).abs().max().item() == 0.0, key


def test_a_saved_or_checkpointed_adapter_is_not_saved_again(tmp_path):
    state = _packed_state()
    run = RunPanel(state, live="text")
    run.train_in.value = "kernel"
    run.steps.value = 2
    run.save_every.value = 2
    run.output_dir.value = str(tmp_path / "runs")
    run.start()
    run.wait(WAIT)
    assert state.trained_steps() == 2 and state.unsaved_steps() == 0  # checkpoint-2 holds it


# -- nothing slow on the kernel's thread -----------------------------------------------------------------


def test_a_hub_id_typed_offline_is_looked_up_once_off_the_thread_and_answers_fast():
    panel = VramPanel(StudioState())
    started = time.monotonic()
    for prefix in ("s", "so", "som", "some/", "some/m", "some/mo", "some/model"):  # keystrokes
        panel.model_name.value = prefix
    typed = time.monotonic() - started
    assert typed < 0.5, f"keystrokes took {typed:.2f} s"
    assert "Looking up some/model" in _text(panel.status) and panel.estimate is None
    assert panel.wait(10)
    answered = time.monotonic() - started
    assert answered < 2.0, f"answered after {answered:.2f} s"
    assert panel.lookups == 1  # debounced: only the last name typed was looked up
    shown = _text(panel.status)
    assert "offline" in shown and "hf download some/model" in shown
    assert "unset HF_HUB_OFFLINE" not in shown or "HF_HUB_OFFLINE is set" in shown
    assert panel.figure.figure.layout.shapes == ()  # no capacity line on an empty chart
    panel.model_name.value = "tiny-llama"
    assert panel.estimate is not None and panel.status.value == ""
    panel.model_name.value = "some/model"  # known now: answered from the kept outcome, no new lookup
    assert "offline" in _text(panel.status) and panel.lookups == 1


def test_a_vram_plan_does_not_move_with_this_machines_free_memory(monkeypatch):
    """8B, 4-bit, RTX 4090, offloaded checkpointing: the longest context is bound by the host memory the
    offloader may pin. The plan states that memory (this machine's total by default, editable); the free
    memory of the moment (monkeypatched here, as it moves on a busy machine) never changes the answer. The
    slider reaches the answer; the base model is planned offline as its -Instruct entry is."""
    from fastft.runtime import host_budget

    answers = []
    for free in (6 * 2**30, 60 * 2**30):
        monkeypatch.setattr(host_budget, "host_memory_available", lambda free=free: free)
        panel = VramPanel(StudioState(), live="text")
        panel.model_name.value = "meta-llama/Llama-3.1-8B"
        panel.gpu.value = "rtx4090"
        panel.precision.value = "4-bit"
        panel.checkpointing.value = "offload"
        assert panel.estimate is not None, _text(panel.status)
        answers.append((panel.max_context, panel.estimate.total_bytes, panel.verdict.value))
        assert panel.seq_len.max >= panel.max_context > 32768  # the slider reaches the answer
        panel.seq_len.value = panel.seq_len.max
        assert panel.seq_len.value >= panel.max_context
    assert answers[0] == answers[1]
    total = host_budget.host_memory_total()
    assert panel.host_memory.value == pytest.approx(total / 2**30, abs=0.05)  # this machine's total RAM
    longest = panel.max_context
    panel.host_memory.value = 8.0  # a smaller machine: less can be offloaded, a shorter context fits
    assert panel.max_context < longest and "0.75 * 8 * 2**30" in panel.code_view.value


def test_the_vram_tab_says_what_runs_on_this_machine(monkeypatch):
    """Whatever GPU the plan is for, one line says what runs here: on this CPU-only machine the PyTorch
    references (Triton kernels need a CUDA GPU), and 4-bit through bitsandbytes' slow CPU backend."""
    panel = VramPanel(StudioState(), live="text")
    panel.model_name.value = "tiny-llama"
    panel.precision.value = "16-bit"
    line = _text(panel.this_machine)
    assert "no CUDA GPU" in line and "slowly" not in line
    panel.precision.value = "4-bit"
    assert "CPU backend" in _text(panel.this_machine) and "slowly" in _text(panel.this_machine)


def test_debouncer_calls_once_with_the_last_value():
    calls = []
    debounce = Debouncer(calls.append, delay=0.05)
    for value in range(5):
        debounce(value)
    time.sleep(0.3)
    assert calls == [4]


# -- the VRAM tab plans --------------------------------------------------------------------------------


def test_vram_planner_suggests_the_smallest_gpu_and_flows_back_to_the_model_tab():
    from fastft.vram import GPUS, fits

    state = StudioState()
    model = ModelPanel(state)
    vram = VramPanel(state)
    assert "what-if planner" in vram.widget.children[0].value
    vram.model_name.value = "Qwen/Qwen3-8B"
    vram.gpu.value = "t4"
    vram.seq_len.value = 2048
    smallest = vram.smallest_gpu
    assert smallest is not None and smallest.label in _text(vram.suggestion)
    smaller = [g for g in GPUS.values() if g.capacity_bytes < smallest.capacity_bytes]
    settings = vram.settings()
    assert all(not fits("Qwen/Qwen3-8B", 2048, gpu=g, **settings).fits for g in smaller)
    assert fits("Qwen/Qwen3-8B", 2048, gpu=smallest, **settings).fits
    assert "fastft.fits(" in vram.code_view.value  # its Python section

    vram.precision.value = "4-bit"
    vram.rank.value = 32
    vram.checkpointing.value = "offload"
    vram.use_button.click()
    assert model.model_name.value == "Qwen/Qwen3-8B" and model.precision.value == "4-bit"
    assert model.rank.value == 32 and model.gradient_checkpointing.value == "offload"
    assert model.max_seq_length.value == 2048 and state.load_settings.max_seq_length == 2048
    assert "VRAM tab" in _text(model.status)


# -- every promised view appears, stale ones go --------------------------------------------------------


def test_pack_keeps_the_rows_line_and_a_new_load_clears_the_stale_stats():
    panel = DataPanel(live="display")
    panel.load_button.click()
    assert panel.wait(WAIT) and panel.error.value == ""
    rows_line = _text(panel.rows_info)
    assert "4,000 rows of chats from bundled:skills" in rows_line
    assert panel.histogram.layout.display == "none"
    panel.pack_button.click()
    assert panel.wait(WAIT) and panel.error.value == ""
    assert _text(panel.rows_info) == rows_line  # still there after Pack
    assert "sequences per bin" in panel.stats.value and panel.histogram.layout.display is None
    (output,) = panel.length_plot._output.outputs  # drawn by setting the widget, not `with output:`
    assert output["data"]  # the (empty) figure, drawn once; the packed lengths came as an update of it
    (update,) = panel.length_plot._ops.outputs
    assert "4,000 sequences" in update["data"]["application/javascript"]

    panel.source.value = "bundled:skills-eval"
    panel.load_button.click()
    assert panel.wait(WAIT) and panel.error.value == ""
    assert panel.stats.value == "" and panel.figure is None and panel.histogram.layout.display == "none"
    assert panel.state.packed is None and "bundled:skills-eval" in _text(panel.rows_info)


# -- settings checked before Start ---------------------------------------------------------------------


def test_settings_that_cannot_work_are_named_before_start():
    state = _packed_state(seq=512, rows=24)  # a few bins only
    bins = len(state.packed)
    panel = RunPanel(state, live="text")
    panel.train_in.value = "kernel"
    panel.steps.value = 10
    panel.warmup.value = 10
    assert "warmup is 10 steps, as long as the whole run (10 steps)" in _text(panel.checks)
    panel.warmup.value = 0.1
    assert _text(panel.checks) == ""
    panel.micro_batch_bins.value = bins
    panel.grad_accum_steps.value = 2
    assert f"= {2 * bins} bins, but the packed data has only {bins}" in _text(panel.checks)
    panel.start_button.click()
    assert panel.run is None and "Cannot start" in _text(panel.status)
    panel.grad_accum_steps.value = 1
    panel.save_every.value = 50
    assert "one checkpoint, at the end" in _text(panel.checks)


def test_run_settings_survive_a_rerun_of_the_studio_cell():
    first = fastft.studio(fresh=True, display=False)
    first.run.steps.value = 123
    first.run.learning_rate.value = 0.003
    first.run.output_dir.value = "runs/mine"
    again = fastft.studio(display=False)
    assert again.run is not first.run
    assert again.run.steps.value == 123 and again.run.learning_rate.value == 0.003
    assert again.run.output_dir.value == "runs/mine" and "max_steps=123" in again.run.code()


def test_status_messages_do_not_overwrite_each_other():
    log = StatusLog(keep=3)
    log.say("eval every is set but there is no eval set", "warn")
    log.say("working", "busy")
    log.say("Stopped at step 4.", "warn")
    log.say("Checkpoint saved: runs/x/checkpoint-4", "ok")
    text = _text(log.widget)
    assert "Checkpoint saved" in text and "Stopped at step 4" in text and "no eval set" in text
    assert "working" not in text  # a busy line only says "working": the next message replaces it
    assert text.index("Checkpoint saved") < text.index("Stopped at step 4")  # newest first


def test_every_tab_has_a_python_section():
    studio = fastft.studio(fresh=True, display=False)
    assert set(studio.panels) == {"Model", "Data", "VRAM", "Run", "Export"}
    for title, panel in studio.panels.items():
        sections = [w for w in _walk(panel.widget) if type(w).__name__ == "Accordion"]
        assert sections and "Python" in sections[0].get_title(0), title


def test_no_control_has_a_fixed_pixel_width():
    """Every tab's controls size in em or percent and wrap, so a laptop's narrow notebook never cuts them
    (the browser test checks the result at 800, 1,024 and 1,440 px); only zero-size helpers say 0."""
    studio = fastft.studio(fresh=True, display=False)
    fixed = [
        f"{title}: {type(w).__name__} {getattr(w, 'description', '')!r} {key}={value}"
        for title, panel in studio.panels.items()
        for w in _walk(panel.widget)
        for key, value in [
            *((k, getattr(getattr(w, "layout", None), k, None)) for k in ("width", "min_width", "max_width")),
            ("description_width", getattr(getattr(w, "style", None), "description_width", None)),
        ]
        if isinstance(value, str) and value.endswith("px") and value != "0px"
    ]
    assert fixed == []


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()) or ():
        yield from _walk(child)


# -- live plots choose their way by what renders --------------------------------------------------------


def test_a_live_figure_falls_back_when_no_probe_reports_and_returns_when_one_does():
    from fastft.report.figures import run_dashboard_figure

    assert frontend({}, kernel=True) == "auto" and frontend({}, kernel=False) == "text"
    assert frontend({"COLAB_RELEASE_TAG": "x"}, kernel=True) == "auto"  # no guessing from the environment
    assert frontend({"FASTFT_LIVE": "display"}, kernel=True) == "display"

    live = LiveFigure(run_dashboard_figure(), "auto", probe_timeout=0.2)
    assert live.mode == "widget" and live.probe is live.plot is not None
    plot = live.plot
    time.sleep(0.5)
    assert live.mode == "display" and live.fell_back_at is not None
    assert plot.layout.display == "none" and plot in live.widget.children  # hidden, still able to report
    live.set_data({0: ([1, 2], [3.0, 2.0])})
    live.flush()
    (output,) = live._output.outputs
    assert list(live.figure.data[0].y) == [3.0, 2.0] and output["data"]
    sent = live._output.outputs
    live.set_data({0: ([1, 2], [3.0, 2.0])})  # the same data again: nothing resent
    live.flush()
    assert live._output.outputs is sent

    plot.rendered = True  # the browser drew the plot after all
    assert live.mode == "widget" and list(live.figure.data[0].y) == [3.0, 2.0]
    # the same plot, shown again with the data the fallback drew (its listeners are its views' own: a view
    # taken down leaves none behind), and its updates reach it
    assert live.plot is plot and plot.comm is not None and plot.layout.display is None
    assert live.widget.children == (plot,)
    assert _plot_y(plot, 0) == [3.0, 2.0]
    live.set_data({0: ([1, 2, 3], [3.0, 2.0, 1.0])})
    assert list(live.figure.data[0].y) == [3.0, 2.0, 1.0] and _plot_y(plot, 0) == [3.0, 2.0, 1.0]


def test_a_plot_that_stops_drawing_what_it_is_sent_is_replaced(monkeypatch):
    """anywidget drops every message to a model that was slow to initialize (a busy page): the plot drew its
    first figure and froze. The browser answers each figure with its revision; one left unanswered gets a new
    plot holding the latest data. A plot no browser draws (no view) is never replaced."""
    from fastft.report.figures import run_dashboard_figure
    from fastft.studio import live

    monkeypatch.setattr(live, "DRAWN_TIMEOUT", 0.1)
    figure = LiveFigure(run_dashboard_figure(memory_kind="cpu"), "widget")
    plot = figure.plot
    plot.drawn, plot.rendered = plot.revision, True  # a browser drew the first figure
    figure.set_data({0: ([1, 2], [3.0, 2.0])})
    plot.drawn = plot.revision  # and the next one
    time.sleep(0.4)
    assert figure.plot is plot and figure.replaced_plots == 0
    figure.set_data({0: ([1, 2, 3], [3.0, 2.0, 1.0])})  # never answered: frozen in the browser
    time.sleep(0.4)
    assert figure.plot is not plot and figure.replaced_plots == 1 and plot.comm is None
    assert figure.widget.children == (figure.plot,) and _plot_y(figure.plot, 0) == [3.0, 2.0, 1.0]
    figure.set_data({0: ([1], [1.0])})  # the new plot has not drawn yet: nothing to judge
    time.sleep(0.4)
    assert figure.replaced_plots == 1
    # it reports having drawn only its first figure, the one it was made with: frozen from the start
    figure.plot.drawn, figure.plot.rendered = 0, True
    time.sleep(0.4)
    assert figure.replaced_plots == 2 and _plot_y(figure.plot, 0) == [1.0]


def _plot_y(plot, index: int) -> list[float]:
    """Trace `index`'s y as the browser gets it (a base64 typed array, or a list)."""
    import base64

    import numpy as np

    y = plot.figure["data"][index]["y"]
    if isinstance(y, dict):
        return np.frombuffer(base64.b64decode(y["bdata"]), dtype=np.dtype(y["dtype"])).tolist()
    return list(y)


def test_a_live_figure_whose_probe_reports_stays_a_widget():
    from fastft.report.figures import vram_figure

    live = LiveFigure(vram_figure({}), "auto", probe_timeout=0.3)
    live.plot.rendered = True
    time.sleep(0.5)
    assert live.mode == "widget" and live.rendered


def test_timing_figure_updates_trace_by_trace():
    from fastft.report.figures import phases_figure

    live = LiveFigure(
        phases_figure([1, 2, 3], [{"forward": 3.0}, {"forward": 2.0}, {"forward": 2.5}]), "widget"
    )
    first = live.figure.data[0]
    live.update_from(phases_figure([2, 3, 4], [{"forward": 2.0}, {"forward": 2.5}, {"forward": 1.0}]))
    assert live.figure.data[0] is first and list(first.x) == [2, 3, 4] and list(first.y) == [2.0, 2.5, 1.0]


# -- no warnings a user did not cause ------------------------------------------------------------------

_NOISE = """
import sys, warnings, tempfile
import torch
import fastft
from peft import PeftModel
model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=64)
model = fastft.add_lora(model, r=4)
folder = fastft.save_adapter(model, tempfile.mkdtemp() + "/adapter", tokenizer)
base, _ = fastft.load_model("tiny-llama", max_seq_length=64)
PeftModel.from_pretrained(base, folder)  # as notebooks 01 and 03 reload an adapter with plain peft
from fastft.profile.window import _without_kineto_notices
profiler = torch.profiler.profile()
with _without_kineto_notices():
    profiler.start()
    print("a line of the user's own", file=sys.stderr)
torch.ones(2) + 1
with _without_kineto_notices():
    profiler.stop()
warnings.warn("a warning of the user's own", FutureWarning)
"""


def test_the_notebooks_third_party_noise_is_silenced_and_nothing_else():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", _NOISE],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "is_gradient_checkpointing" not in done.stderr
    assert "USDT" not in done.stderr and "profiler_start" not in done.stderr
    assert "a line of the user's own" in done.stderr and "a warning of the user's own" in done.stderr


def test_the_display_fallback_draws_the_figure_once_then_sends_only_the_new_points():
    import numpy as np

    from fastft.report.figures import run_dashboard_figure

    live = LiveFigure(run_dashboard_figure(max_steps=400), "display")
    drawn = live._output.outputs
    (output,) = drawn
    assert live._id in str(output["data"])  # the plot carries the id the update scripts look for
    rng = np.random.default_rng(3)
    loss = rng.random(301).astype(np.float32)
    for n in (100, 200, 300, 301):  # four updates: 100 points at a time, then one
        x = np.arange(1, n + 1, dtype=np.float32)
        live.set_data({0: (x, loss[:n]), 1: (x, loss[:n] / 2)})
        live.flush()
        assert live._output.outputs is drawn  # the figure is never drawn again
    script = live.last_update
    (update,) = live._ops.outputs
    assert update["data"]["application/javascript"] == script
    assert len(script) < 3_000, len(script)  # the boilerplate and two numbers per trace
    assert "[[0,300,[301],[" in script and "[1,300,[301],[" in script
    for figure_only in ("<script", "newPlot", "bdata", "plotly.min", '"template"', "Loss"):
        assert figure_only not in script, figure_only
    before = live.last_update
    live.set_data({0: (x, loss[:n]), 1: (x, loss[:n] / 2)})  # nothing new: nothing sent
    live.flush()
    assert live.last_update is before


def _pair_rows(tmp_path, n: int = 12):
    path = tmp_path / "pairs.jsonl"
    lines = []
    for i in range(n):
        lines.append(
            json.dumps(
                {
                    "prompt": f"What is {i} plus {i}?",
                    "chosen": f"{2 * i}",
                    "rejected": f"I think it might be {2 * i + 1}, but I am not sure at all.",
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_data_tab_previews_and_packs_preference_pairs_as_the_model_sees_them(tmp_path):
    state = StudioState()
    _loaded(ModelPanel(state))
    data = DataPanel(state, live="text")
    data.source.value = str(_pair_rows(tmp_path))
    data.load_button.click()
    assert data.wait(WAIT) and data.error.value == "", data.error.value
    assert "12 rows of preference pairs" in _text(data.rows_info)
    sides = data.preview_segments(3)
    assert set(sides) == {"chosen", "rejected"}
    chosen = "".join(s.text for s in sides["chosen"] if s.kind == "trained")
    rejected = "".join(s.text for s in sides["rejected"] if s.kind == "trained")
    assert "6" in chosen and "I think it might be 7" in rejected
    for side in sides.values():  # the prompt, rendered with the chat template, trains nothing
        assert "What is 3 plus 3?" in "".join(s.text for s in side if s.kind == "prompt")
    data.row.value = 3
    shown = _text(data.preview)
    assert "chosen" in shown and "rejected" in shown and "I think it might be 7" in shown
    data.pack_button.click()
    assert data.wait(WAIT) and data.error.value == "", data.error.value
    from fastft.data.pairs import PackedPairs

    assert isinstance(state.packed, PackedPairs) and state.packed.pairs == 12
    assert "fastft.pack_pairs(rows, tokenizer" in data.code()


def test_the_method_and_the_data_must_agree_before_start(tmp_path):
    state = _packed_state(seq=256, rows=24)
    panel = RunPanel(state, live="text")
    panel.train_in.value = "kernel"
    panel.steps.value = 10
    assert _text(panel.checks) == ""
    panel.method.value = "dpo"
    assert "DPO trains on preference pairs" in _text(panel.checks)
    assert "Fix: load rows with 'prompt', 'chosen' and 'rejected'" in _text(panel.checks)
    panel.start_button.click()
    assert panel.run is None and "Cannot start" in _text(panel.status)

    state.rows = fastft.load_dataset(str(_pair_rows(tmp_path)))
    state.packed = fastft.pack_pairs(state.rows, state.tokenizer, 256)
    state.notify("packed")
    assert _text(panel.checks) == ""
    panel.method.value = "sft"
    assert "SFT trains on chats or text, but the loaded data is preference pairs" in _text(panel.checks)
    assert "Fix: pick DPO, ORPO or SimPO" in _text(panel.checks)


def test_a_dpo_run_from_the_run_tab_plots_rewards_margin_and_accuracy(tmp_path):
    state = StudioState()
    _loaded(ModelPanel(state))
    state.rows = fastft.load_dataset(str(_pair_rows(tmp_path)))
    state.dataset_name = str(_pair_rows(tmp_path))
    state.packed = fastft.pack_pairs(state.rows, state.tokenizer, 128)
    panel = RunPanel(state, live="text")
    panel.train_in.value = "kernel"
    assert panel.preference_plots.widget.layout.display == "none"  # SFT: no preference curves
    assert [label for label, _ in panel.method.options][:4] == ["SFT", "DPO", "ORPO", "SimPO"]
    panel.method.value = "simpo"
    assert panel.beta.value == 2.0 and panel.dpo_loss.layout.display == "none"
    panel.method.value = "dpo"
    assert panel.beta.value == 0.1 and panel.dpo_loss.layout.display is None
    panel.dpo_loss.value = "ipo"
    panel.steps.value = 3
    panel.output_dir.value = ""
    code = panel.code()
    assert "fastft.pack_pairs(rows, tokenizer, max_seq_length=" in code
    assert 'method="dpo"' in code and "beta=0.1" in code and 'dpo_loss="ipo"' in code
    compile(code, "run.py", "exec")
    assert panel.train_config().method == "dpo" and panel.train_config().dpo_loss == "ipo"
    panel.start_button.click()
    assert panel.run is not None, _text(panel.status)
    panel.wait(WAIT)
    assert panel.run.error is None, panel.run.error_message
    assert panel.preference_plots.widget.layout.display is None
    assert len(panel.preference_series) == 3
    figure = panel.preference_plots.figure
    assert [t.name for t in figure.data] == ["rewards chosen", "rewards rejected", "margin", "accuracy"]
    events = [e for e in panel.run.events if hasattr(e, "preference") and e.step]
    last = events[-1].preference
    assert abs(float(figure.data[2].y[-1]) - last["margin"]) < 1e-5
    assert abs(float(figure.data[3].y[-1]) - last["accuracy"]) < 1e-6
    assert "accuracy" in panel._status_line() and "margin" in panel._status_line()


def test_a_grpo_run_from_the_run_tab_plots_rewards_and_shows_the_rollouts(tmp_path):
    """GRPO from the Run tab on the loaded skills rows (no packing): its own settings replace the SFT-only
    ones, the code preview is a runnable `fastft.grpo` call, a rewards choice the rows cannot feed is named
    before Start, and the run plots the reward of each function and shows the latest rollout's completions
    with their rewards and advantages."""
    state = StudioState()
    _loaded(ModelPanel(state))
    state.rows = fastft.load_dataset("bundled:skills").select(range(16))
    state.dataset_name = "bundled:skills"
    panel = RunPanel(state, live="text")
    panel.train_in.value = "kernel"
    assert (
        panel.grpo_plots.widget.layout.display == "none" and panel.grpo.generations.layout.display == "none"
    )
    assert "GRPO" in [label for label, _ in panel.method.options]
    panel.method.value = "grpo"
    assert panel.grpo.generations.layout.display is None and panel.micro_batch_bins.layout.display == "none"
    shown = [c.description for c in panel._controls if c.layout.display != "none"]
    assert shown[:2] == ["method", "completions (G)"] and {"steps", "learning rate", "output dir"} <= set(
        shown
    )
    assert len({id(c.layout) for c in panel._controls}) == len(panel._controls)  # none shares a Layout
    assert panel.beta.layout.display == "none" and panel.grpo_plots.widget.layout.display is None
    assert _text(panel.checks) == ""  # rows, not a pack: GRPO samples the prompts itself
    panel.grpo.rewards.value = ("content_match", "length")
    panel.grpo.generations.value = 3
    panel.grpo.prompts_per_step.value = 2
    panel.grpo.max_new_tokens.value = 6
    panel.steps.value = 2
    panel.warmup.value = 0
    panel.output_dir.value = ""
    code = panel.code()
    assert "rewards = [fastft.rewards.content_match, fastft.rewards.length_penalty()]" in code
    call = code[code.index("result = fastft.grpo(") :]
    assert [a.strip() for a in call.split("\n")[1:5]] == ["model,", "tokenizer,", "rows,", "rewards,"]
    assert "num_generations=3," in call and "max_new_tokens=6," in call
    assert "micro_batch_bins" not in code and "save_every" not in code
    compile(code, "run.py", "exec")
    config = panel.train_config()
    assert type(config).__name__ == "GRPOConfig" and config.num_generations == 3

    state.rows = state.rows.remove_columns("answer")
    state.notify("rows")
    assert "needs the column 'answer'" in _text(panel.checks)
    panel.start_button.click()
    assert panel.run is None and "Cannot start" in _text(panel.status)
    state.rows = fastft.load_dataset("bundled:skills").select(range(16))
    state.notify("rows")
    assert _text(panel.checks) == ""

    panel.start_button.click()
    assert panel.run is not None, _text(panel.status)
    panel.wait(WAIT)
    assert panel.run.error is None, panel.run.error_message
    assert len(panel.grpo_series) == 2
    figure = panel.grpo_plots.figure
    names = [t.name for t in figure.data]
    assert names == ["reward", "reward/content_match", "reward/length", "kl", "completion length", "accuracy"]
    last = [e for e in panel.run.events if getattr(e, "grpo", None)][-1].grpo
    assert abs(float(figure.data[0].y[-1]) - last["reward"]) < 1e-5
    assert abs(float(figure.data[2].y[-1]) - last["reward/length"]) < 1e-5
    assert abs(float(figure.data[4].y[-1]) - last["completion_length"]) < 1e-4
    shown = _text(panel.rollouts)
    rollout = panel.run.trainer.last_rollout
    assert (
        rollout.step == 2 and "Latest rollout (step 2)" in shown and "2 of 2 prompts, 3 completions" in shown
    )
    assert html.escape(rollout.completions[0][:40]) in panel.rollouts.value
    assert f"{rollout.advantages[0]:+.2f}" in shown and "content_match" in shown
    assert "reward" in panel._status_line()

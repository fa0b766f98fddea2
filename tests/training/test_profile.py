"""The step profiler: phases per step, their nesting, its overhead, hooks on and off, the torch.profiler window."""

from __future__ import annotations

import json
import statistics
import time

import plotly.graph_objects as go
import pytest
import torch

import fastft
from fastft.data.skills import generate
from fastft.profile import (
    TOP_LEVEL,
    StepProfile,
    copy_compute_overlap,
    exclusive_phases,
    nvtx_available,
    nvtx_tool_attached,
    profile_window,
)
from fastft.report import RunReport, render_report
from fastft.report.figures import GRAPH_NOTE, kernels_figure, phases_figure, timeline_figure
from fastft.training import nvtx as ranges_module
from fastft.training.objectives import sft as sft_objective
from fastft.training.trainer import TrainConfig, Trainer

ROWS = list(generate(160, seed=23))
FORWARD_PARTS = ("embed", "layers.norm", "layers.attention", "layers.mlp", "layers.moe", "final_norm")
EPS_MS = 1e-6


def _lora_model(name: str = "tiny-llama", device: str = "cpu", **lora):
    model, tokenizer = fastft.load_model(name, max_seq_length=128, device=device)
    return fastft.add_lora(model, r=8, alpha=16, seed=5, **lora), tokenizer


def _trainer(model, tokenizer, **config) -> Trainer:
    config = {"max_steps": 4, "micro_batch_bins": 2, "learning_rate": 1e-3} | config
    return Trainer(model, tokenizer, fastft.pack(ROWS, tokenizer, 128), config=TrainConfig(**config))


def _hook_count(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _inside(span, spans) -> bool:
    return any(o.start_ms - EPS_MS <= span.start_ms and span.end_ms <= o.end_ms + EPS_MS for o in spans)


def _assert_phases_nest(event) -> None:
    phases = event.phases
    expected = {
        *TOP_LEVEL,
        "step",
        "embed",
        "layers.norm",
        "layers.attention",
        "layers.mlp",
        "final_norm",
    } - {"graph", "communication"}  # one process: no graph replay, no gradient all-reduce
    expected |= {"loss_backward", "layers.backward", "layers.recompute"}  # add_lora checkpoints by default
    assert expected <= set(phases), sorted(expected - set(phases))
    assert all(value >= 0 for value in phases.values())
    assert sum(phases.get(name, 0.0) for name in FORWARD_PARTS) <= phases["forward"] + EPS_MS
    assert phases["loss_backward"] + phases["layers.backward"] <= phases["backward"] + EPS_MS
    assert phases["layers.recompute"] <= phases["layers.backward"] + EPS_MS
    inside_the_timer = phases["forward"] + phases["loss"] + phases["backward"] + phases["optimizer"]
    assert inside_the_timer <= event.step_seconds * 1000 + 1e-3  # CUDA events resolve about 0.5 µs
    assert sum(phases.get(name, 0.0) for name in TOP_LEVEL) <= phases["step"] + EPS_MS
    # the stacked bar's parts add up to the step
    assert sum(exclusive_phases(phases).values()) == pytest.approx(phases["step"], rel=1e-6)


def test_tiny_llama_phases_are_present_and_nest():
    model, tokenizer = _lora_model()
    layers = model.config.num_hidden_layers
    trainer = _trainer(model, tokenizer, grad_accum_steps=2)
    result = trainer.train()
    assert len(trainer.profile.phases) == len(result.steps) == 4
    for event in result.steps:
        _assert_phases_nest(event)

    timing = trainer.profile.timing()
    assert timing.step == 4 and timing.total_ms == pytest.approx(result.steps[-1].phases["step"])
    names = [span.name for span in timing.spans]
    # two micro-batches: each module runs once per forward; recompute is counted apart, never as forward
    assert names.count("forward") == names.count("backward") == names.count("loss") == 2
    for index in range(layers):
        assert names.count(f"layers.{index}.attention") == names.count(f"layers.{index}.mlp") == 2
        assert names.count(f"layers.{index}.norm") == 4
        assert names.count(f"layers.{index}.backward") == 2
        assert names.count(f"layers.{index}.recompute") >= 2
    top = {name: [s for s in timing.spans if s.name == name and s.depth == 0] for name in TOP_LEVEL}
    for span in timing.spans:
        if span.depth == 1 and span.name not in ("loss_backward",) and not span.name.endswith(".backward"):
            assert _inside(span, top["forward"]), span
        if span.name.endswith((".backward", ".recompute")) or span.name == "loss_backward":
            assert _inside(span, top["backward"]), span
        if span.name.endswith(".recompute"):
            layer = span.name.rsplit(".", 1)[0]
            assert _inside(span, [s for s in timing.spans if s.name == f"{layer}.backward"]), span
    # the top-level phases tile the step: data → forward → loss → backward → … → optimizer
    ordered = [s for s in timing.spans if s.depth == 0]
    assert [s.name for s in ordered] == ["data", "forward", "loss", "backward"] * 1 + [
        "forward",
        "loss",
        "backward",
        "optimizer",
    ]
    for before, after in zip(ordered, ordered[1:], strict=False):
        assert before.end_ms == pytest.approx(after.start_ms)
    # per-layer backward spans tile the layers' part of backward without overlap
    layer_spans = sorted((s for s in timing.spans if s.name.endswith(".backward")), key=lambda s: s.start_ms)
    for before, after in zip(layer_spans, layer_spans[1:], strict=False):
        assert before.end_ms <= after.start_ms + EPS_MS


def test_tiny_moe_times_the_moe_block():
    model, tokenizer = _lora_model("tiny-moe")
    trainer = _trainer(model, tokenizer, max_steps=2)
    phases = trainer.train().steps[-1].phases
    assert phases["layers.moe"] > 0 and "layers.mlp" not in phases
    assert {"layers.attention", "layers.norm", "layers.backward"} <= set(phases)
    assert sum(phases.get(name, 0.0) for name in FORWARD_PARTS) <= phases["forward"] + EPS_MS
    assert any(name.endswith(".moe") for name in trainer.profile.instrumented)


def test_without_checkpointing_there_is_no_recompute():
    model, tokenizer = _lora_model(gradient_checkpointing=False)
    phases = _trainer(model, tokenizer, max_steps=2).train().steps[-1].phases
    assert "layers.recompute" not in phases and phases["layers.backward"] > 0


def test_overhead_is_small_on_cpu():
    """Two identical runs, one profiled, stepping in turn over the same bins; the median ratio of
    their CPU time per step. CPU time (one thread) rather than wall time: other processes on a
    shared machine stretch wall time by tens of percent, CPU time hardly.

    Measured at +1.2 to +2.5 % (tiny-llama, 32 ms steps; an A/A run reads ±0.5 %); the bound leaves
    room for noise. Real models spend far more per hooked module, so their share is smaller.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainers = []
        for profile in (True, False):
            model, tokenizer = _lora_model()
            trainers.append(_trainer(model, tokenizer, max_steps=60, micro_batch_bins=1, profile=profile))
        for trainer in trainers:
            trainer.train(steps=4)  # warm up
        seconds: list[list[float]] = [[], []]
        for _ in range(40):
            for trainer, spent in zip(trainers, seconds, strict=True):
                started = time.process_time()
                trainer.train(steps=1)
                spent.append(time.process_time() - started)
    finally:
        torch.set_num_threads(threads)
    ratio = statistics.median(a / b for a, b in zip(*seconds, strict=True))
    print(
        f"profiler overhead on CPU: {100 * (ratio - 1):+.2f} % of a {1000 * statistics.median(seconds[1]):.1f} ms step"
    )
    assert ratio < 1.10, ratio
    assert trainers[0].result.steps[-1].phases and not trainers[1].result.steps[-1].phases


def test_hooks_are_idempotent_and_removed_when_disabled():
    model, tokenizer = _lora_model()
    bare = _hook_count(model)
    first = _trainer(model, tokenizer, max_steps=2)
    hooked = _hook_count(model)
    assert hooked > bare and first.profile.attached
    second = _trainer(model, tokenizer, max_steps=2)  # a second trainer on the same model
    assert _hook_count(model) == hooked
    assert second.profile.attached and not first.profile.attached
    first.train()  # the first still times its top-level phases and does not crash
    assert {"data", "forward", "backward", "optimizer"} <= set(first.result.steps[-1].phases)  # no "loss":
    assert "layers.attention" not in first.result.steps[-1].phases  # that needs the final norm's hook
    second.profile.attach(model)  # attaching again changes nothing
    assert _hook_count(model) == hooked
    off = _trainer(model, tokenizer, max_steps=2, profile=False)
    assert off.profile is None and _hook_count(model) == bare
    assert all(event.phases == {} for event in off.train().steps)
    profile = StepProfile(model)
    assert _hook_count(model) == hooked
    profile.detach()
    assert _hook_count(model) == bare and not profile.attached


def test_unknown_shapes_get_top_level_phases_only(monkeypatch):
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    profile = StepProfile(other)
    assert profile.instrumented == [] and not profile.attached and _hook_count(other) == 0
    from fastft.training import timing_hooks as hooks

    def unforeseen(module, names):
        raise AttributeError("an unforeseen layer")

    model, tokenizer = _lora_model()
    bare = _hook_count(model)
    monkeypatch.setattr(hooks, "_child", unforeseen)
    with pytest.warns(UserWarning, match="only data, forward"):
        trainer = _trainer(model, tokenizer, max_steps=1)
    assert _hook_count(model) == bare  # nothing half-registered is left behind
    assert {"data", "forward", "backward", "optimizer"} <= set(trainer.train().steps[-1].phases)


def test_nvtx_is_never_called_without_cuda(monkeypatch):
    assert torch.cuda.is_available() or not nvtx_available()
    profile = StepProfile(device="cpu", nvtx=True)
    assert profile._ranges == ()
    profile.step_begin()
    profile.begin("forward")
    pending = profile.step_end(1)
    assert set(profile.collect(pending)) == {"step", "data", "forward"}

    def broken(*args):
        raise RuntimeError("NVTX functions not installed. Are you sure you have a CUDA build?")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", broken)
    ranges_module.nvtx_available.cache_clear()
    try:
        assert not ranges_module.nvtx_available()  # a GPU without NVTX: the probe says no, nothing raises
    finally:
        ranges_module.nvtx_available.cache_clear()


def test_nvtx_ranges_follow_an_attached_tool(monkeypatch):
    monkeypatch.delenv("NVTX_INJECTION64_PATH", raising=False)
    monkeypatch.delenv("NVTX_INJECTION32_PATH", raising=False)
    assert not nvtx_tool_attached()
    monkeypatch.setenv("NVTX_INJECTION64_PATH", "/opt/nvidia/nsight-systems/libToolsInjection64.so")
    assert nvtx_tool_attached()
    monkeypatch.setattr(ranges_module, "nvtx_available", lambda: True)  # stand in for a CUDA build
    from fastft.training import timing as steps_module

    monkeypatch.setattr(steps_module, "nvtx_available", lambda: True)
    monkeypatch.setattr(steps_module, "_CudaClock", steps_module._CpuClock)
    assert StepProfile(device="cuda")._nvtx and not StepProfile(device="cuda", nvtx=False)._nvtx
    monkeypatch.delenv("NVTX_INJECTION64_PATH")
    assert not StepProfile(device="cuda")._nvtx and StepProfile(device="cuda", nvtx=True)._nvtx


def test_custom_phase_is_timed_inside_a_step_and_free_outside(monkeypatch):
    real = sft_objective.causal_lm_loss_sum
    model, tokenizer = _lora_model()
    trainer = _trainer(model, tokenizer, max_steps=2)
    with trainer.profile.span("offload_wait"):  # no step running: a no-op
        pass
    assert trainer.profile._spans == []

    def waiting(model, batch):
        with trainer.profile.span("offload_wait"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        return real(model, batch)

    monkeypatch.setattr(sft_objective, "causal_lm_loss_sum", waiting)
    phases = trainer.train().steps[-1].phases
    assert 0 < phases["offload_wait"] <= phases["forward"]


def test_the_attached_profile_times_the_offloaders_waits_and_detaching_hands_them_back():
    from fastft.runtime.offload import enable_offload, no_span, offloader_of

    model, tokenizer = _lora_model()
    enable_offload(model)
    offloader = offloader_of(model)
    assert offloader.span is no_span
    profile = StepProfile(model)
    assert offloader.span == profile.span
    other = StepProfile(model)  # a model carries one profile's hooks: the second takes over
    assert offloader.span == other.span
    other.detach()
    assert offloader.span is no_span


def test_a_step_cut_short_leaves_nothing_open(monkeypatch):
    real = sft_objective.causal_lm_loss_sum
    calls = {"n": 0}

    def failing(model, batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("out of memory (simulated)")
        return real(model, batch)

    monkeypatch.setattr(sft_objective, "causal_lm_loss_sum", failing)
    model, tokenizer = _lora_model()
    trainer = _trainer(model, tokenizer, max_steps=3)
    with pytest.raises(RuntimeError, match="simulated"):
        trainer.train()
    assert trainer.profile._state == 0
    with trainer.profile.span("offload_wait"):  # no step running: nothing is recorded
        pass
    assert trainer.profile._spans == []
    result = trainer.train()  # the run goes on from the failed step
    assert [e.step for e in result.steps] == [1, 2, 3] and all(e.phases for e in result.steps)


def test_partial_train_continues_like_one_run():
    model, tokenizer = _lora_model()
    whole = _trainer(model, tokenizer, max_steps=5).train()
    model, tokenizer = _lora_model()
    trainer = _trainer(model, tokenizer, max_steps=5)
    assert len(trainer.train(steps=2).steps) == 2 and trainer.step == 2
    resumed = trainer.train()
    assert [e.loss for e in resumed.steps] == [e.loss for e in whole.steps]


def test_profile_window_writes_a_trace_and_ranks_operators(tmp_path):
    model, tokenizer = _lora_model()
    trainer = _trainer(model, tokenizer, max_steps=4)
    path = tmp_path / "traces" / "window.json"
    window = profile_window(trainer, steps=2, path=path, warmup=1)
    assert trainer.step == 3 and len(trainer.result.steps) == 3
    events = json.loads(path.read_text())["traceEvents"]
    assert len(events) > 100
    names = {event.get("name") for event in events}
    assert {"forward", "backward", "optimizer", "layers.0.attention"} <= names  # phases annotate the trace
    assert window.device == "cpu" and window.steps == 2 and window.path == path
    assert window.overlap is None  # no device copies on a CPU
    assert window.kernels and window.kernel_ms > 0
    assert all(row.name not in ("forward", "backward", "layers.0.attention") for row in window.kernels)
    assert any(row.name.startswith("aten::") for row in window.kernels)
    times = [row.total_ms for row in window.kernels]
    assert times == sorted(times, reverse=True) and sum(row.share for row in window.kernels) <= 1 + 1e-9
    assert "calls" in str(window) and isinstance(fastft.kernel_profile_figure(window), go.Figure)
    trainer.train()  # the run goes on after the window, with annotations off again
    assert trainer.step == 4 and trainer.profile._ranges == ()
    with pytest.raises(ValueError, match="max_steps"):
        profile_window(trainer, steps=1)


def test_copy_compute_overlap_counts_copy_time_under_kernels():
    events = [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 5, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "c", "ts": 20, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 12, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 40, "dur": 4},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},
    ]
    copy, overlapped = copy_compute_overlap(events)
    assert copy == 14 and overlapped == 5  # [12, 15) under a/b, [20, 22) under c, the second copy alone


def test_figures_tables_and_report_build():
    model, tokenizer = _lora_model()
    trainer = _trainer(model, tokenizer, max_steps=3)
    result = trainer.train()
    profile = trainer.profile

    bars = fastft.step_profile_figure(profile)
    assert isinstance(bars, go.Figure) and bars.layout.barmode == "stack"
    first = [trace.y[0] for trace in bars.data]
    assert sum(first) == pytest.approx(result.steps[0].phases["step"], rel=1e-6)
    assert {"layers.attention", "layers.recompute", "optimizer", "forward (rest)"} <= {
        t.name for t in bars.data
    }

    timeline = fastft.step_timeline_figure(profile)
    spans = profile.timing().spans
    assert sum(len(trace.x) for trace in timeline.data) == len(spans)
    assert {"layers.attention", "forward", "layers.recompute"} <= {trace.name for trace in timeline.data}
    from dataclasses import asdict

    as_dicts = timeline_figure([asdict(s) for s in spans], step=3)
    assert sum(len(trace.x) for trace in as_dicts.data) == len(spans)

    table = profile.table()
    rows = {row["phase"]: row for row in table.to_dicts()}
    assert rows["layers.attention"]["inside"] == "forward" and rows["forward"]["inside"] == "step"
    assert rows["step"]["share of step"] == pytest.approx(1.0)
    assert "layers.attention" in str(table) and "<table>" in table._repr_html_()

    kernels = kernels_figure(
        [{"name": "gemm", "calls": 3, "total_ms": 1.5, "share": 0.75}], steps=3, overlap=0.5
    )
    assert "50%" in kernels.layout.title.text and list(kernels.data[0].cells.values[0]) == ["gemm"]
    for empty in (phases_figure([], []), timeline_figure([]), kernels_figure([])):
        assert isinstance(empty, go.Figure) and empty.layout.annotations

    report = RunReport(title="t", steps=result.steps, timeline=[asdict(s) for s in spans])
    page = render_report(report)
    assert 'id="fig-phases"' in page and 'id="fig-timeline"' in page and "Step timing" in page
    assert RunReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report


@pytest.mark.gpu
def test_cuda_phases_come_from_events_and_the_window_sees_kernels_and_copies(tmp_path):
    model, tokenizer = _lora_model(device="cuda")
    # eager steps: a replayed CUDA graph has no per-layer phases to nest (its own test is test_graph's)
    trainer = _trainer(model, tokenizer, max_steps=8, grad_accum_steps=2, cuda_graph=False)
    assert bool(trainer.profile._nvtx) == nvtx_tool_attached()  # NVTX ranges when nsys listens
    assert StepProfile(device="cuda", nvtx=True)._nvtx and not StepProfile(device="cuda", nvtx=False)._nvtx
    seen = []
    trainer.subscribe(seen.append)
    trainer.train(steps=5)
    assert [e.step for e in seen] == [1, 2, 3, 4, 5]  # read one step late, flushed at the pause
    for event in seen[1:]:
        _assert_phases_nest(event)
    assert len(trainer.profile.timings) == 5
    window = profile_window(trainer, steps=2, path=tmp_path / "cuda.json", warmup=1)
    assert window.device == "cuda" and window.kernels and window.kernel_ms > 0
    assert window.copy_ms > 0 and 0.0 <= window.overlap <= 1.0  # the batches' host-to-device copies
    assert trainer.step == 8


def test_train_returns_its_profile_and_the_phase_chart_cuts_a_slow_first_step():
    model, tokenizer = _lora_model()
    data = fastft.pack(ROWS, tokenizer, 128)
    result = fastft.train(model, tokenizer, data, max_steps=3, micro_batch_bins=2, progress=False)
    assert result.profile is not None and result.profile.steps == [1, 2, 3]
    assert isinstance(fastft.step_profile_figure(result.profile), go.Figure)
    off = fastft.train(model, tokenizer, data, max_steps=1, profile=False, progress=False)
    assert off.profile is None

    steady = {"step": 100.0, "data": 1.0, "forward": 40.0, "loss": 9.0, "backward": 49.0, "optimizer": 1.0}
    slow_first = [{key: 10 * value for key, value in steady.items()}] + [steady] * 5
    figure = phases_figure(list(range(1, 7)), slow_first)
    assert figure.layout.yaxis.range[1] == pytest.approx(2.5 * 100.0 * 1.05)
    assert [a.text for a in figure.layout.annotations] == ["1,000 ms"]
    even = phases_figure(list(range(1, 7)), [steady] * 6)
    assert even.layout.yaxis.range is None and not even.layout.annotations
    # a step replayed from a CUDA graph has one opaque phase: both figures say why
    replayed = {"step": 60.0, "data": 1.0, "graph": 58.0, "optimizer": 1.0}
    graphed = phases_figure([1, 2], [steady, replayed])
    assert [a.text for a in graphed.layout.annotations] == [GRAPH_NOTE]
    spans = [{"name": "graph", "start_ms": 1.0, "end_ms": 59.0, "depth": 0}]
    assert [a.text for a in timeline_figure(spans).layout.annotations] == [GRAPH_NOTE]

"""Tests of the report figures and the self-contained HTML page (fast, CPU only, no network)."""

from __future__ import annotations

import json
import math
import os
import random
import re

import numpy as np
import plotly.graph_objects as go
import pytest
from plotly.offline import get_plotlyjs

from fastft.report import (
    RunReport,
    accuracy_figure,
    learning_rate_figure,
    loss_figure,
    render_report,
    smooth,
    throughput_figure,
    write_report,
)
from fastft.report.figures import memory_label
from fastft.training.events import EvalEvent, StepEvent

MAX_STEPS = 50
PAYLOAD = "<script>alert('x')</script>"


def make_steps(n: int = MAX_STEPS, seed: int = 0, memory_kind: str = "cuda") -> list[StepEvent]:
    """A falling, noisy loss with a warmup+linear-decay learning rate."""
    rng = np.random.default_rng(seed)
    py_rng = random.Random(seed)
    steps = []
    for i in range(1, n + 1):
        loss = 2.5 * math.exp(-i / 20) + 0.4 + float(rng.normal(0, 0.08))
        lr = 2e-4 * min(i / 5, (n - i + 1) / (n - 4))
        trained = py_rng.randint(800, 1200)
        seconds = 0.5 + py_rng.random() * 0.1
        steps.append(
            StepEvent(
                step=i,
                max_steps=n,
                epoch=i / n,
                loss=loss,
                learning_rate=lr,
                grad_norm=float(abs(rng.normal(1.0, 0.2))),
                trained_tokens=trained,
                tokens=trained + 300,
                step_seconds=seconds,
                trained_tokens_per_second=trained / seconds,
                peak_memory_bytes=(3 << 30) + i * (1 << 20),
                memory_kind=memory_kind,
            )
        )
    return steps


def make_evals() -> list[EvalEvent]:
    return [EvalEvent(step=s, eval_loss=2.0 - s / 50, eval_trained_tokens=5000) for s in (10, 20, 30, 40, 50)]


def make_report() -> RunReport:
    return RunReport(
        title=f"demo {PAYLOAD} run",
        config={"model": "tiny", "lora": {"r": 16, "alpha": 32}, "lr": 2e-4, f"note{PAYLOAD}": "a&b"},
        steps=make_steps(),
        evals=make_evals(),
        summary={"model": "tiny-llm", "device": "cpu", "duration_s": 61.25, "final_loss": 0.51234},
        accuracy_before={"add": 0.1, "reverse": 0.0, "all": 0.05},
        accuracy_after={"add": 0.9, "reverse": 0.5, "all": 0.7},
        samples=[
            {"prompt": f"say {PAYLOAD}", "expected": "ok", "before": "x < y & z", "after": "ok"},
            {"prompt": "2+2", "expected": "4", "before": None, "after": "4"},
        ],
        created="2025-01-02T03:04:05+00:00",
    )


def y_of(fig: go.Figure, name_prefix: str) -> list[float]:
    (trace,) = [t for t in fig.data if t.name.startswith(name_prefix)]
    return list(trace.y)


def annotation_texts(fig: go.Figure) -> list[str]:
    return [a.text for a in fig.layout.annotations]


# ---------------------------------------------------------------------------------------------- smooth


def test_smooth_hand_checked_with_bias_correction():
    # ema: 0.5, 1.25, 2.125 ; debias: 1-0.5, 1-0.25, 1-0.125
    assert smooth([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    # first value is never pulled towards zero, a constant stays constant
    assert smooth([4.0], 0.9) == pytest.approx([4.0])
    assert smooth([3.0] * 20, 0.99) == pytest.approx([3.0] * 20)
    assert smooth([1.0, 5.0, 2.0], 0.0) == [1.0, 5.0, 2.0]
    assert smooth([], 0.9) == []


def test_smooth_skips_non_finite_and_validates():
    out = smooth([1.0, float("nan"), 3.0], 0.5)
    assert out[0] == pytest.approx(1.0)
    assert math.isnan(out[1])
    assert out[2] == pytest.approx((0.25 + 1.5) / 0.75)  # the NaN did not count as a sample
    with pytest.raises(ValueError):
        smooth([1.0], 1.0)
    with pytest.raises(ValueError):
        smooth([1.0], -0.1)


# ---------------------------------------------------------------------------------------------- figures


def test_loss_figure_traces():
    steps, evals = make_steps(), make_evals()
    fig = loss_figure(steps, evals, smoothing=0.8)
    assert isinstance(fig, go.Figure)
    raw = next(t for t in fig.data if t.name == "train loss")
    assert list(raw.y) == [s.loss for s in steps]
    assert list(raw.x) == list(range(1, MAX_STEPS + 1))
    assert y_of(fig, "train loss (smoothed") == pytest.approx(smooth([s.loss for s in steps], 0.8))
    ev = next(t for t in fig.data if t.name == "eval loss")
    assert "markers" in ev.mode
    assert list(ev.x) == [10, 20, 30, 40, 50]
    assert list(ev.y) == [e.eval_loss for e in evals]
    assert fig.layout.title.text
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text
    assert fig.layout.height == 350
    assert fig.layout.template.layout.plot_bgcolor == "white"  # plotly_white


def test_smoothed_loss_falls():
    smoothed = y_of(loss_figure(make_steps()), "train loss (smoothed")
    assert smoothed[-1] < smoothed[0]


def test_throughput_figure_median_and_memory_label():
    steps = make_steps()
    fig = throughput_figure(steps)
    assert y_of(fig, "trained tokens/s") == [s.trained_tokens_per_second for s in steps]
    median = float(np.median([s.trained_tokens_per_second for s in steps]))
    assert y_of(fig, "median") == pytest.approx([median, median])
    mem = next(t for t in fig.data if t.name == "GPU peak allocated")
    assert list(mem.y) == pytest.approx([s.peak_memory_bytes / 2**30 for s in steps])
    assert mem.yaxis == "y2"
    assert "GiB" in fig.layout.yaxis2.title.text
    cpu = throughput_figure(make_steps(memory_kind="cpu"))
    assert any(t.name == "CPU peak RSS" for t in cpu.data)
    assert "CPU peak RSS" in cpu.layout.yaxis2.title.text


@pytest.mark.parametrize(
    ("kind", "label"),
    [("cuda", "GPU peak allocated"), ("GPU peak allocated", "GPU peak allocated"), ("cpu", "CPU peak RSS"),
     ("CPU peak RSS", "CPU peak RSS"), ("", "Peak memory")],
)  # fmt: skip
def test_memory_label(kind, label):
    assert memory_label(kind) == label


@pytest.mark.parametrize(("cuda", "label"), [(False, "CPU peak RSS"), (True, "GPU peak allocated")])
def test_an_empty_run_dashboard_names_the_memory_this_machine_measures(monkeypatch, cuda, label):
    import torch

    from fastft.report.figures import run_dashboard_figure

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    titles = [note.text for note in run_dashboard_figure().layout.annotations]
    assert f"{label} (GiB)" in titles
    assert f"{memory_label('cpu-rss' if cuda else 'cuda')} (GiB)" not in titles
    assert f"{memory_label('cuda')} (GiB)" in [
        n.text for n in run_dashboard_figure(memory_kind="cuda").layout.annotations
    ]


def test_loss_axes_never_read_tiny_numbers_in_si_prefixes():
    """A SimPO loss or a KL near 0 (2e-12) must not read "2p": plotly's default exponent format on tiny
    numbers is an SI prefix (pico); the loss-like axes use exponents."""
    from fastft.report.figures import run_dashboard_figure
    from fastft.studio.grpo import grpo_figure
    from fastft.studio.preference import preference_figure

    axes = [
        run_dashboard_figure(memory_kind="cpu").layout.yaxis,  # loss
        preference_figure().layout.yaxis,  # rewards
        preference_figure().layout.yaxis2,  # margin
        grpo_figure().layout.yaxis,  # reward
        grpo_figure().layout.yaxis2,  # KL
    ]
    assert [axis.exponentformat for axis in axes] == ["e"] * len(axes)


def test_learning_rate_figure():
    steps = make_steps()
    fig = learning_rate_figure(steps)
    assert y_of(fig, "learning rate") == [s.learning_rate for s in steps]


def test_accuracy_figure_groups_and_all_last():
    fig = accuracy_figure({"all": 0.25, "add": 0.1, "sort": 0.4}, {"add": 0.9, "sort": 0.6, "all": 0.75})
    before = next(t for t in fig.data if t.name == "before training")
    after = next(t for t in fig.data if t.name == "after training")
    assert list(before.x) == ["add", "sort", "all"]
    assert list(before.y) == pytest.approx([10.0, 40.0, 25.0])
    assert list(after.y) == pytest.approx([90.0, 60.0, 75.0])
    assert fig.layout.barmode == "group"
    assert fig.layout.yaxis.range[0] == 0 and fig.layout.yaxis.range[1] >= 100
    # percentages are recognised and kept, missing tasks leave a gap
    pct = accuracy_figure({"add": 12.5}, {"add": 80.0, "sort": 50.0})
    assert list(next(t for t in pct.data if t.name == "before training").y) == [12.5, None]
    assert list(next(t for t in pct.data if t.name == "after training").y) == [80.0, 50.0]
    only_after = accuracy_figure(None, {"add": 1.0})
    assert [t.name for t in only_after.data] == ["after training"]


def test_empty_figures_do_not_crash():
    for fig in (loss_figure([]), throughput_figure([]), learning_rate_figure([])):
        assert isinstance(fig, go.Figure)
        assert "no steps yet" in annotation_texts(fig)
        assert fig.layout.title.text
        fig.to_html(include_plotlyjs=False)
    assert annotation_texts(accuracy_figure({}, {})) == ["no accuracy results yet"]
    # evals but no steps yet: markers still drawn
    fig = loss_figure([], make_evals())
    assert [t.name for t in fig.data] == ["eval loss"]
    assert "no steps yet" in annotation_texts(fig)


# ---------------------------------------------------------------------------------------------- html


@pytest.fixture(scope="module")
def page() -> str:
    return render_report(make_report())


def test_render_escapes_user_strings(page):
    assert PAYLOAD not in page
    assert "alert('x')" not in page  # quotes are escaped as well
    assert "say &lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page
    assert "<title>demo &lt;script&gt;" in page
    assert "x &lt; y &amp; z" in page
    assert "note&lt;script&gt;" in page and "a&amp;b" in page
    # the only <script> tags are ours: config, the bundle and one per figure
    assert page.count("<script") == 2 + 4


def test_render_sections(page):
    for text in ("Summary", "tiny-llm", "61.25", "Configuration", "lora.r", "lora.alpha", "Samples"):
        assert text in page
    for div_id in ("fig-loss", "fig-throughput", "fig-lr", "fig-accuracy"):
        assert f'id="{div_id}"' in page
    no_acc = render_report(RunReport(title="t", steps=make_steps(5)))
    assert 'id="fig-accuracy"' not in no_acc
    empty = render_report(RunReport(title="empty"))
    assert "no steps yet" in empty


def test_content_accuracy_and_format_compliance_are_drawn_apart(tmp_path):
    report = make_report()
    plain = render_report(report)  # accuracy alone: one figure under its plain title
    assert "Accuracy per task" in plain and 'id="fig-format"' not in plain
    report.format_before = {"add": 0.0, "reverse": 0.0, "all": 0.0}
    report.format_after = {"add": 0.8, "reverse": 0.4, "all": 0.6}
    page = render_report(report)
    assert 'id="fig-accuracy"' in page and 'id="fig-format"' in page
    assert "Content accuracy per task (right answer, any wording)" in page
    assert "Format compliance per task (the bare answer the prompt asks for)" in page
    write_report(report, tmp_path / "report.html")
    loaded = RunReport.from_json(tmp_path / "report.json")
    assert loaded.format_after == report.format_after and loaded.accuracy_after == report.accuracy_after


def test_plotlyjs_embedded_once_and_offline(page):
    bundle = get_plotlyjs()
    assert page.count(bundle) == 1
    assert page.count("plotly.js v") == 1  # the bundle's licence header
    assert not re.search(r"<script[^>]*\bsrc\s*=", page)
    # plotly.js itself carries default URLs (topojson for geo maps, map icons and attributions) that
    # these charts never fetch; everything outside the bundle must be free of remote references.
    outside = page.replace(bundle, "")
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", outside)
    assert "cdn.plot.ly" not in outside
    assert "https://cdn" not in outside
    assert "http://" not in outside and "https://" not in outside


def test_write_report_atomic_and_round_trip(tmp_path):
    report = make_report()
    target = tmp_path / "runs" / "demo" / "report.html"
    out = write_report(report, target)
    assert out == target
    assert sorted(p.name for p in target.parent.iterdir()) == ["report.html", "report.json"]
    assert target.read_text(encoding="utf-8") == render_report(report)
    data = json.loads((target.parent / "report.json").read_text(encoding="utf-8"))
    assert data["steps"][0] == report.steps[0].as_dict()
    assert data["evals"][-1] == report.evals[-1].as_dict()

    loaded = RunReport.from_json(target.parent / "report.json")
    assert loaded == report
    assert RunReport.from_json(target) == report  # the page's path works too
    assert RunReport.from_json(target.parent) == report
    assert isinstance(loaded.steps[0], StepEvent) and isinstance(loaded.evals[0], EvalEvent)


def test_write_report_failure_leaves_old_files_and_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "report.html"
    write_report(RunReport(title="first"), target)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_report(RunReport(title="second"), target)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_write_report_into_directory(tmp_path):
    out = write_report(RunReport(title="d", steps=make_steps(3)), tmp_path)
    assert out == tmp_path / "report.html"
    assert RunReport.from_json(tmp_path).steps == make_steps(3)
    with pytest.raises(ValueError):
        write_report(RunReport(title="bad"), tmp_path / "x" / "report.json")

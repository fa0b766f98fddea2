"""The studio's Model and Data panels and the tabbed studio, headless: set values, click, read state."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("ipywidgets")

import fastft  # noqa: E402
from fastft.runtime.model_state import model_state  # noqa: E402
from fastft.studio.data import DataPanel, uploaded_files  # noqa: E402
from fastft.studio.model import ModelPanel, model_facts  # noqa: E402
from fastft.studio.state import LoraSettings, StudioState  # noqa: E402

WAIT = 120  # seconds; a tiny preset loads in about one


def _loaded(panel: ModelPanel) -> ModelPanel:
    panel.load_button.click()
    assert panel.wait(WAIT)
    assert panel.error.value == "", panel.error.value
    return panel


def _linear_count(model) -> tuple[int, int]:
    from fastft.models.lora import trainable_parameter_count

    return trainable_parameter_count(model)


# ------------------------------------------------------------------------------------------------ state


def test_state_notifies_observers_of_their_names_and_forgets_closed_panels():
    state = StudioState()
    seen: list[tuple[str, str]] = []

    class Panel:
        def on(self, name):
            seen.append(("panel", name))

    panel = Panel()
    state.observe(panel.on, "model")
    state.observe(lambda name: seen.append(("any", name)))
    state.notify("model")
    state.notify("packed")
    assert seen == [("panel", "model"), ("any", "model"), ("any", "packed")]
    state.unobserve(owner=panel)
    state.notify("model")
    assert seen[-1] == ("any", "model") and len(seen) == 4
    state.observe(panel.on, "rows")
    del panel  # a bound method is held weakly: a panel nobody references is not called
    state.notify("rows")
    assert seen[-1] == ("any", "rows") and len(seen) == 5


def test_settings_map_to_api_arguments():
    state = StudioState()
    state.load_settings.precision = "4-bit"
    assert state.load_settings.load_kwargs == {"max_seq_length": 256, "load_in_4bit": True}
    assert state.load_settings.vram_precision == "nf4"
    state.load_settings.precision = "FP8"
    assert state.load_settings.load_kwargs == {"max_seq_length": 256, "load_in_fp8": True}
    assert state.load_settings.vram_precision == "fp8"
    lora = LoraSettings(r=8, alpha=16.0, target_modules=["q_proj"], gradient_checkpointing="recompute")
    assert lora.add_lora_kwargs == dict(
        r=8, alpha=16, dropout=0.0, target_modules=["q_proj"], gradient_checkpointing="recompute"
    )
    # the studio speaks add_lora's and the estimator's vocabulary: one `Checkpointing` kind per choice
    for kind in ("auto", "offload", "recompute", "none"):
        value = LoraSettings(gradient_checkpointing=kind).add_lora_kwargs["gradient_checkpointing"]
        assert fastft.Checkpointing.parse(value) == fastft.Checkpointing(kind)


# ------------------------------------------------------------------------------------------------ model


def test_model_panel_loads_tiny_llama_with_fused_summary_and_real_linear_layers():
    panel = fastft.studio.ModelPanel()  # works alone, with its own state
    assert panel.model_name.value == "tiny-llama" and panel.state.model_name == "tiny-llama"
    assert "every part" in panel.info.value  # predicted from the preset's config, nothing loaded yet
    assert panel.target_checkboxes == {}
    _loaded(panel)

    model = panel.state.model
    expected = fastft.linear_layer_names(model.get_base_model())
    assert expected == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert list(panel.target_checkboxes) == expected
    assert all(box.value for box in panel.target_checkboxes.values())
    assert panel.fused_report is not None and panel.fused_report.not_fused == []
    assert panel.fused_report.fused == {"rms_norm": 9, "attention": 4, "mlp": 4, "cross_entropy": 1}
    assert "every part" in panel.summary.value and "4 attention blocks" in panel.summary.value
    assert panel.state.tokenizer is not None and model_state(panel.state.model).lora.r == 16
    # The parameter count shown before Load is the base model's real one.
    trainable, total = _linear_count(model)
    assert model_facts("tiny-llama").parameters == total - trainable


def test_model_panel_code_round_trips_after_apply_lora():
    panel = _loaded(ModelPanel())
    panel.rank.value = 4
    panel.alpha.value = 8
    panel.gradient_checkpointing.value = "none"
    panel.target_checkboxes["k_proj"].value = False
    assert "Apply LoRA" in panel.status.value
    assert panel.state.lora_settings.target_modules == [
        "q_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    panel.apply_button.click()
    assert panel.wait(WAIT) and panel.error.value == ""
    model = panel.state.model
    assert model_state(model).lora.r == 4 and "k_proj" not in model_state(model).lora.target_modules
    assert "Apply LoRA" not in panel.status.value

    namespace: dict = {}
    exec(panel.code(), namespace)  # noqa: S102 - the generated code is the point of the test
    again = namespace["model"]
    assert model_state(again).lora == model_state(model).lora
    assert again.fastft_info == model.fastft_info
    ours = {k: v for k, v in model.named_parameters() if v.requires_grad}
    theirs = {k: v for k, v in again.named_parameters() if v.requires_grad}
    assert ours.keys() == theirs.keys() and len(ours) == 4 * 6 * 2
    for key, value in ours.items():  # same seeded initialisation through either path
        assert torch.equal(value, theirs[key]), key


def test_unknown_model_shows_error_with_fix():
    panel = ModelPanel()
    panel.model_name.value = "tiny-lama"
    assert "Did you mean tiny-llama" in panel.info.value
    panel.load_button.click()
    assert panel.wait(WAIT)
    assert "UnknownModelError" in panel.error.value
    assert "tiny-llama" in panel.error.value and "Presets:" in panel.error.value
    assert panel.state.model is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the notice is about loading 4-bit without CUDA")
def test_four_bit_on_cpu_loads_and_says_it_is_slow():
    panel = ModelPanel()
    panel.precision.value = "4-bit"
    assert "CPU backend, which is slow" in panel.status.value  # said before the click
    assert "load_in_4bit=True" in panel.code()
    panel.load_button.click()
    assert panel.wait(WAIT)
    assert panel.error.value == ""
    assert panel.state.model.fastft_info.quantization == "nf4"


def test_wrong_lora_target_shows_the_real_layers():
    state = StudioState()
    state.lora_settings.target_modules = ["qkv_proj"]
    panel = ModelPanel(state)
    panel.load_button.click()
    assert panel.wait(WAIT)
    assert "LoraTargetError" in panel.error.value and "q_proj" in panel.error.value


def test_picker_describes_catalog_models_without_downloading():
    from fastft.models.catalog import CATALOG

    panel = ModelPanel()
    panel.model_name.value = "Qwen/Qwen3-30B-A3B"
    assert panel.state.model_name == "Qwen/Qwen3-30B-A3B"
    assert "catalog" in panel.info.value and "MoE expert blocks (128 experts" in panel.info.value
    facts = model_facts("Qwen/Qwen3-30B-A3B")
    assert facts.parameters == CATALOG["Qwen/Qwen3-30B-A3B"].parameter_count()
    assert facts.experts == 128 and facts.all_fused and facts.layers == 48
    gated = next(spec.hub_id for spec in CATALOG.values() if spec.gated)
    panel.model_name.value = gated
    assert "licence" in panel.info.value
    assert model_facts("google/gemma-3-1b-it").not_fused  # the fusion plan fuses nothing of Gemma 3
    assert model_facts("someone/some-model").source == "hub"
    assert model_facts("tiny-moe").experts == 8 and model_facts("tiny-moe").all_fused
    gpt_oss = model_facts("openai/gpt-oss-20b")
    assert "MoE expert blocks" in gpt_oss.fused[0] and "attention" in gpt_oss.not_fused[0]


# ------------------------------------------------------------------------------------------------ data


@pytest.fixture(scope="module")
def data_panel() -> DataPanel:
    panel = fastft.studio.DataPanel()  # works alone: the presets' tokenizer until a model is loaded
    panel.load_button.click()
    assert panel.wait(WAIT)
    assert panel.error.value == "", panel.error.value
    return panel


def test_data_panel_loads_bundled_skills_and_marks_trained_tokens(data_panel):
    assert data_panel.state.dataset_name == "bundled:skills"
    assert len(data_panel.state.rows) == 4000 and data_panel.row.max == 3999
    segments = data_panel.preview_segments(0)
    text = "".join(s.text for s in segments)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n56<|im_end|>\n")
    trained = [s for s in segments if s.kind == "trained"]
    assert [s.text for s in trained] == ["56<|im_end|>\n"]
    assert {s.kind for s in segments} == {"prompt", "trained"}
    assert (
        'background:#c9efd6;color:#10331f;border-radius:2px">56&lt;|im_end|&gt;' in data_panel.preview.value
    )
    # The preview counts the same tokens and labels as packing does.
    from fastft.data.tokenize import IGNORE_INDEX, tokenize_rows

    tokenized = tokenize_rows([data_panel.state.rows[0]], data_panel._tokenizer(), 256)
    assert sum(s.tokens for s in segments) == len(tokenized.input_ids[0])
    assert sum(s.tokens for s in trained) == int((tokenized.labels[0] != IGNORE_INDEX).sum())


def test_pack_shows_stats_and_a_length_histogram_and_code_round_trips(data_panel):
    data_panel.pack_button.click()
    assert data_panel.wait(WAIT) and data_panel.error.value == ""
    packed = data_panel.state.packed
    stats = packed.stats
    assert stats.sequences == 4000 and stats.max_seq_length == 256
    assert f"{stats.efficiency:.1%}" in data_panel.stats.value
    assert f"{stats.sequences_per_bin:.2f}" in data_panel.stats.value
    assert "truncated" in data_panel.stats.value and "skipped" in data_panel.stats.value
    figure = data_panel.figure
    assert figure.data[0].name == "sequences"
    assert sum(figure.data[0].y) == stats.sequences
    assert "4,000 sequences" in figure.layout.title.text

    namespace: dict = {}
    exec(data_panel.code(), namespace)  # noqa: S102
    assert namespace["data"].stats == stats
    assert [list(b) for b in namespace["data"].bins] == [list(b) for b in packed.bins]


def test_shorter_max_length_cuts_the_preview_and_drops_the_stale_pack(data_panel):
    data_panel.pack_button.click()
    assert data_panel.wait(WAIT) and data_panel.state.packed is not None
    data_panel.max_seq_length.value = 16
    assert data_panel.state.packed is None and "Pack again" in data_panel.stats.value
    segments = data_panel.preview_segments(0)
    # as pack does by default: the long prompt loses its start, the answer stays whole
    assert segments[0].kind == "cut" and segments[-1].kind == "trained"
    assert sum(s.tokens for s in segments if s.kind != "cut") == 16
    assert "fastft.pack(rows, tokenizer, 16)" in data_panel.code()
    data_panel.max_seq_length.value = 256


def test_chat_template_choice_renders_with_chatml():
    from fastft.models.presets import load_preset_tokenizer

    state = StudioState(model_name="tiny-llama")
    state.tokenizer = load_preset_tokenizer()
    state.tokenizer.chat_template = None  # a base model's tokenizer: no template of its own
    panel = DataPanel(state)
    panel.source.value = "bundled:skills-eval"
    panel.load_button.click()
    assert panel.wait(WAIT)
    assert "ChatTemplateError" in panel.preview.value and "format=" in panel.preview.value
    panel.chat_template.value = "chatml"
    assert "ChatTemplateError" not in panel.preview.value
    assert any(s.kind == "trained" for s in panel.preview_segments(0))
    assert "tokenizer.chat_template = CHATML_TEMPLATE" in panel.code()
    panel.chat_template.value = "tokenizer"
    assert state.tokenizer.chat_template is None  # the tokenizer's own (none) again


def test_malformed_jsonl_shows_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        "\n"
        '{"messages": 3}\n'
    )
    panel = DataPanel()
    panel.source.value = str(path)
    panel.load_button.click()
    assert panel.wait(WAIT)
    assert "MalformedRowError" in panel.error.value and "broken.jsonl line 3" in panel.error.value
    assert panel.state.rows is None


@pytest.mark.parametrize("version", [7, 8])
def test_upload_is_saved_and_loaded_in_either_ipywidgets_format(version):
    content = b'{"instruction": "Say hi.", "output": "hi"}\n{"instruction": "Add 2 and 2.", "output": "4"}\n'
    if version == 7:
        value = {"mine.jsonl": {"metadata": {"name": "mine.jsonl", "size": len(content)}, "content": content}}
    else:
        value = ({"name": "mine.jsonl", "type": "", "size": len(content), "content": memoryview(content)},)
    assert uploaded_files(value) == [("mine.jsonl", content)]
    panel = DataPanel()
    assert panel.load_upload(value)
    assert panel.wait(WAIT) and panel.error.value == ""
    assert len(panel.state.rows) == 2 and panel.state.dataset_name.endswith("mine.jsonl")
    trained = [s.text for s in panel.preview_segments(1) if s.kind == "trained"]
    assert trained == ["4<|im_end|>\n"]

    broken = b'{"instruction": "x", "output": "y"}\n{"instruction": 5, "output": "y"}\n'
    panel.load_upload({"bad.jsonl": {"metadata": {}, "content": broken}})
    assert panel.wait(WAIT)
    assert "bad.jsonl line 2" in panel.error.value


def test_data_panel_follows_the_model_panel_and_its_tokenizer():
    state = StudioState()
    model_panel, data_panel = ModelPanel(state), DataPanel(state)
    model_panel.max_seq_length.value = 128
    assert data_panel.max_seq_length.value == 128 and state.pack_settings.max_seq_length == 128
    data_panel.load_button.click()
    assert data_panel.wait(WAIT)
    assert "tiny presets" in data_panel.preview.value  # no model yet
    _loaded(model_panel)
    assert "tiny presets" not in data_panel.preview.value
    assert "load_preset_tokenizer" not in data_panel.code()


# ------------------------------------------------------------------------------------------------ studio


def test_studio_shows_five_tabs_over_one_state():
    studio = fastft.studio(fresh=True)
    titles = [studio.tabs.get_title(i) for i in range(len(studio.tabs.children))]
    assert titles == ["Model", "Data", "VRAM", "Run", "Export"]
    for title, panel in studio.panels.items():
        assert panel.state is studio.state, title
        assert hasattr(panel, "code") and panel.widget in studio.tabs.children
    # Any panel whose module is missing or broken is a tab saying why, not a crash.
    for title, problem in studio.problems.items():
        assert problem, title
    assert {"Model", "Data"} <= set(studio.panels)
    studio.model.model_name.value = "tiny-qwen3"
    assert studio.state.model_name == "tiny-qwen3"


def test_rerunning_studio_keeps_the_state_and_closes_the_old_panels():
    first = fastft.studio(fresh=True)
    first.model.rank.value = 8
    second = fastft.studio()
    assert second.state is first.state and second.model.rank.value == 8
    owners = {getattr(ref(), "__self__", None) for ref, _ in second.state._observers}
    assert not owners & set(first.panels.values())  # the old panels no longer react
    _loaded(second.model)
    model = second.state.model
    third = fastft.studio()  # a re-run after Load: the model is shown as loaded, not loaded again
    assert third.state.model is model and third.model.fused_report is not None
    assert list(third.model.target_checkboxes) == fastft.linear_layer_names(model.get_base_model())
    assert "Loaded tiny-llama" in third.model.status.value
    fresh = fastft.studio(fresh=True)
    assert fresh.state is not third.state and fresh.state.model is None


def test_import_fastft_stays_light_until_the_studio_is_used():
    code = (
        "import sys, fastft\n"
        "studio = fastft.studio\n"
        "assert callable(studio) and studio.__name__ == 'fastft.studio'\n"
        "assert 'ipywidgets' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/", timeout=60)

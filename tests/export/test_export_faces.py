"""The faces of the GGUF export: Unsloth's save methods on a facade model, `fastft export RUN_DIR`, the
studio's Export tab (GGUF / Ollama with a progress bar and the check's table), and the export RSS bench."""

from __future__ import annotations

import html
import json

import pytest
import torch

import fastft
from fastft import FastLanguageModel
from fastft.cli import main
from fastft.export.reference import read_metadata
from fastft.export.writer import k_quantizer
from fastft.unsloth.saving import HubUploadError


def _trained_enough(model):
    """Adapters that are not the zero initialisation, so merging changes the weights."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.01, generator=torch.Generator().manual_seed(3))
    return model


@pytest.fixture(scope="module")
def facade_model():
    model, tokenizer = FastLanguageModel.from_pretrained("tiny-llama", max_seq_length=128)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16)
    return _trained_enough(model).eval(), tokenizer


def test_unsloth_save_methods_write_merged_lora_and_gguf(facade_model, tmp_path):
    model, tokenizer = facade_model
    merged = model.save_pretrained_merged(tmp_path / "merged", tokenizer, save_method="merged_16bit")
    assert (merged / "model.safetensors").is_file()
    lora = model.save_pretrained_merged(tmp_path / "lora", tokenizer, save_method="lora")
    assert (lora / "adapter_config.json").is_file()
    with pytest.raises(ValueError, match="merged_16bit"):
        model.save_pretrained_merged(tmp_path / "m4", tokenizer, save_method="merged_4bit")
    result = model.save_pretrained_gguf(tmp_path / "gguf", tokenizer, quantization_method="not_quantized")
    assert result.path.name == "model.BF16.gguf" and result.check.passed
    assert (tmp_path / "gguf" / "Modelfile").is_file()
    assert read_metadata(result.path)["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id


def test_push_to_hub_variants_say_they_need_network_and_a_token(facade_model, tmp_path):
    model, tokenizer = facade_model
    for call in (
        lambda: model.push_to_hub_gguf("me/model", tokenizer, quantization_method="q8_0", token="hf_x"),
        lambda: model.push_to_hub_merged("me/model", tokenizer, save_method="merged_16bit"),
        lambda: model.save_pretrained_gguf(tmp_path / "g", tokenizer, push_to_hub=True),
    ):
        with pytest.raises(HubUploadError, match="network access and a token"):
            call()
    assert not (tmp_path / "g").exists()


def test_cli_export_writes_a_checked_gguf_and_modelfile(tmp_path, capsys):
    model, tokenizer = fastft.load_model("tiny-qwen3")
    model = _trained_enough(fastft.add_lora(model, r=8, alpha=16))
    fastft.save_adapter(model, tmp_path / "run" / "adapter", tokenizer)
    assert main(["export", str(tmp_path / "run"), "--gguf", "q8_0", "--prompts", "2"]) == 0
    out = capsys.readouterr().out
    assert "check passed" in out and "ollama create" in out
    folder = tmp_path / "run" / "gguf-q8_0"
    assert (folder / "model.Q8_0.gguf").is_file() and (folder / "Modelfile").is_file()
    assert main(["export", str(tmp_path / "nothing")]) == 2  # no adapter there: the error and its fix
    assert "holds no adapter" in capsys.readouterr().err


def test_studio_export_tab_writes_gguf_and_ollama_with_progress_and_the_table(tmp_path):
    from fastft.studio.export import ExportPanel
    from fastft.studio.state import StudioState

    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128)
    model = _trained_enough(fastft.add_lora(model, r=8, alpha=16))
    panel = ExportPanel(StudioState(model_name="tiny-llama", model=model, tokenizer=tokenizer))
    panel.gguf_quantization.value = "bf16"
    panel.gguf_path.value = str(tmp_path / "m.gguf")
    panel.gguf_button.click()
    assert panel.wait(900)
    status = html.unescape(panel.status.value)
    assert "check passed" in status, status
    assert (
        panel.gguf_progress.value == panel.gguf_progress.max > 1
        and panel.gguf_progress.bar_style == "success"
    )
    table = html.unescape(panel.gguf_check.value)
    assert table.count(">matched<") == len(panel.last_export.check.prompts) == 8
    panel.gguf_format.value = "ollama"
    assert panel.gguf_path.description == "Ollama folder"
    panel.gguf_path.value = str(tmp_path / "ollama")
    panel.gguf_quantization.value = "q4_k_m"
    panel.gguf_button.click()
    assert panel.wait(900)
    status = html.unescape(panel.status.value)
    if k_quantizer() is None:  # the K-quant is refused with the way to get it
        assert "llama-quantize tool, which is not on PATH" in status and not (tmp_path / "ollama").exists()
    else:
        assert "check passed" in status and (tmp_path / "ollama" / "Modelfile").is_file()
    assert "save_ollama" in panel.code()


def test_export_rss_bench_streams_a_small_llama_3_1_shape(tmp_path):
    from fastft.bench.export_rss import main as bench

    out = tmp_path / "rss.json"
    shape = ["--layers", "2", "--hidden", "512", "--intermediate", "1024", "--vocab", "8192"]
    assert bench([*shape, "--quantization", "q8_0", "--dir", str(tmp_path), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (
        result["layers"] == 2 and result["tensors"] == 22
    )  # 9 per layer + embedding, norm, head, rope_freqs
    assert (tmp_path / "model.gguf").stat().st_size == result["file_bytes"]
    if result["peak_reset"]:
        # streaming: the export's extra memory is a few tensors, not a second copy of the weights
        assert result["export_extra_bytes"] < result["weights_bytes"]


@pytest.mark.parametrize("name", ["chatml", "llama-3.1", "qwen-2.5", "phi-3"])
def test_chat_templates_translate_to_ollama_and_render_the_same(name):
    from fastft.export.ollama import render_pieces, translate
    from fastft.models.presets import load_preset_tokenizer
    from fastft.unsloth.chat_templates import get_chat_template

    tokenizer = get_chat_template(load_preset_tokenizer(), chat_template=name)
    template, pieces = translate(tokenizer)
    assert "{{ range $i, $_ := .Messages }}" in template and "{{-" not in template
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    for conversation in (messages, messages[1:]):  # with a system message, and with the default one
        want = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert render_pieces(pieces, conversation, True) == want.removeprefix(tokenizer.bos_token or "\0")


def test_a_template_that_merges_the_system_prompt_into_the_user_turn_is_refused():
    from fastft.export.ollama import TemplateTranslationError, translate
    from fastft.models.presets import load_preset_tokenizer
    from fastft.unsloth.chat_templates import get_chat_template

    with pytest.raises(TemplateTranslationError, match="system message changes how the user message"):
        translate(get_chat_template(load_preset_tokenizer(), chat_template="mistral"))

"""Loading and saving as Unsloth's notebooks write them, through ``fastft.unsloth``: 4-bit without CUDA, every
``from_pretrained`` / ``get_peft_model`` argument they pass (carried out, refused with the fix, or noticed),
gpt-oss / MoE notebooks' MLP targets on fused experts, and ``save_pretrained_gguf`` called twice."""

from __future__ import annotations

import warnings

import pytest
import torch

import fastft
from fastft.runtime.model_state import model_state
from fastft.unsloth import FastLanguageModel, FastModel

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHATS = [
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]},
    {
        "messages": [
            {"role": "user", "content": "Spell cat backwards."},
            {"role": "assistant", "content": "tac"},
        ]
    },
] * 2


def _peft(model, **overrides):
    settings = dict(
        r=8,
        target_modules=TARGETS,
        lora_alpha=16,
        lora_dropout=0,
        bias="none",
        use_gradient_checkpointing="unsloth",
        random_state=3407,
        use_rslora=False,
        loftq_config=None,
    )
    return FastLanguageModel.get_peft_model(model, **{**settings, **overrides})


@pytest.mark.skipif(torch.cuda.is_available(), reason="4-bit without CUDA")
def test_load_in_4bit_without_cuda_trains_with_a_notice():
    import bitsandbytes as bnb

    with pytest.warns(UserWarning, match="4-bit \\(NF4\\) on the CPU .* slow"):
        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name="tiny-llama", max_seq_length=64, dtype=None, load_in_4bit=True
        )
    assert isinstance(model.model.layers[0].mlp.down_proj, bnb.nn.Linear4bit)
    model = _peft(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    result = fastft.train(model, tokenizer, CHATS, max_steps=2, progress=False)
    assert all(torch.isfinite(torch.tensor(e.loss)) for e in result.steps)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)


def test_every_from_pretrained_argument_the_notebooks_pass():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, tokenizer = FastModel.from_pretrained(
            model_name="tiny-qwen3",
            max_seq_length=64,
            dtype=None,
            load_in_4bit=False,
            load_in_8bit=False,
            full_finetuning=False,
            token=None,
        )
    assert not [w for w in caught if "does not apply" in str(w.message) or "vLLM" in str(w.message)]
    assert tokenizer.model_max_length == 64 and model.fastft_tokenizer is tokenizer
    with pytest.warns(UserWarning, match="vLLM's; fastft has no vLLM"):
        FastLanguageModel.from_pretrained("tiny-llama", gpu_memory_utilization=0.6, max_lora_rank=16)
    with pytest.raises(ValueError, match="full_finetuning=False"):
        FastLanguageModel.from_pretrained("tiny-llama", full_finetuning=True)
    with pytest.raises(TypeError, match="not_an_argument"):
        FastLanguageModel.from_pretrained("tiny-llama", not_an_argument=1)


def test_every_get_peft_model_argument_the_notebooks_pass():
    model = _peft(FastLanguageModel.from_pretrained("tiny-llama", max_seq_length=64)[0], use_rslora=True)
    lora = model_state(model).lora
    assert lora.use_rslora and lora.r == 8 and lora.alpha == 16 and set(lora.target_modules) == set(TARGETS)
    again = _peft(FastLanguageModel.from_pretrained("tiny-llama", max_seq_length=64)[0], use_rslora=True)
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), name  # random_state seeds the adapters' initialisation
    with pytest.raises(ValueError, match="loftq_config=None"):
        _peft(FastLanguageModel.from_pretrained("tiny-llama")[0], loftq_config={"loftq_bits": 4})
    FastLanguageModel.for_inference(model)
    assert not model.training and model.config.use_cache
    FastLanguageModel.for_training(model)
    assert model.training and not model.config.use_cache


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-gpt-oss"])
def test_moe_notebook_targets_put_adapters_on_the_experts(name):
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=name, max_seq_length=64, load_in_4bit=False
    )
    with pytest.warns(UserWarning, match="fused experts"):
        model = _peft(model)
    assert set(model_state(model).lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "experts"}
    experts = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" in n and "lora_" in n}
    assert experts and all(p.requires_grad for n, p in model.named_parameters() if n in experts)
    # gpt-oss's attention sinks run transformers' attention (fastft's packed kernel has none yet)
    attention = {"attention": None} if name == "tiny-gpt-oss" else {}
    fastft.train(model, tokenizer, CHATS, max_steps=2, learning_rate=1e-2, progress=False, **attention)
    assert any(not torch.equal(experts[n], p) for n, p in model.named_parameters() if n in experts)
    with pytest.raises(fastft.LoraTargetError, match="gate/up and down weights are adapted together"):
        _peft(FastLanguageModel.from_pretrained(name)[0], target_modules=["q_proj", "down_proj"])


def _trained(model):
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.01, generator=torch.Generator().manual_seed(3))
    return model.eval()


def test_save_pretrained_gguf_twice_keeps_both_files_and_a_merged_model_beside(tmp_path, monkeypatch):
    from fastft.export.reference import read_metadata
    from fastft.export.writer import GGUFExportError

    model, tokenizer = FastLanguageModel.from_pretrained("tiny-llama", max_seq_length=64)
    model = _trained(_peft(model))
    folder = tmp_path / "model"
    merged = model.save_pretrained_merged(folder, tokenizer, save_method="merged_16bit")
    weights = (merged / "model.safetensors").read_bytes()
    # check=False: the files' check is the export's own tests' (tests/export); here, what lands where
    first = model.save_pretrained_gguf(folder, tokenizer, quantization_method="q8_0", check=False)
    second = model.save_pretrained_gguf(folder, tokenizer, quantization_method="f16", check=False)
    assert first.path.name == "model.Q8_0.gguf" and second.path.name == "model.F16.gguf"
    assert first.path.is_file() and second.path.is_file()
    assert read_metadata(first.path)["general.file_type"] != read_metadata(second.path)["general.file_type"]
    assert (folder / "model.safetensors").read_bytes() == weights  # the merged model saved first is kept
    assert "./model.F16.gguf" in (folder / "Modelfile").read_text()
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))  # no llama-quantize
    for where in ("fastft.unsloth.saving", "fastft.export.writer"):  # nor llama-cpp-python's binding
        monkeypatch.setattr(f"{where}.k_quantizer", lambda: None)
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(GGUFExportError, match="quantization_method='q4_0', the nearest type fastft writes"):
        model.save_pretrained_gguf(folder, tokenizer, quantization_method="q4_k_m")
    with pytest.raises(GGUFExportError, match="llama-quantize"):
        model.save_pretrained_gguf(tmp_path / "new", tokenizer, quantization_method="quantized")
    assert sorted(p.name for p in folder.iterdir()) == before and not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match="merged_16bit"):
        model.save_pretrained_merged(tmp_path / "mx", tokenizer, save_method="mxfp4")


def test_fast_model_gguf_call_without_tokenizer_and_with_quantization_type(tmp_path):
    """Gemma 3 / 3n and other FastModel notebooks: save_pretrained_gguf(dir, quantization_type="Q8_0"), no
    tokenizer: the one from_pretrained returned (with the template get_chat_template set on it) is written."""
    from fastft.export.reference import read_metadata
    from fastft.unsloth.chat_templates import get_chat_template

    model, tokenizer = FastModel.from_pretrained("tiny-llama", max_seq_length=64)
    model = _trained(FastModel.get_peft_model(model, r=8, lora_alpha=8, lora_dropout=0, random_state=3407))
    tokenizer = get_chat_template(tokenizer, chat_template="gemma-3")
    result = model.save_pretrained_gguf(tmp_path / "gemma-3-finetune", quantization_type="Q8_0", check=False)
    meta = read_metadata(result.path)
    assert result.path.name.endswith(".gguf") and meta["tokenizer.chat_template"] == tokenizer.chat_template
    f16 = model.save_pretrained_gguf(tmp_path / "gemma-3-finetune", quantization_type="F16", check=False)
    assert f16.path.name == "model.F16.gguf" and result.path.is_file()
    with pytest.raises(ValueError, match="both name the GGUF type"):
        model.save_pretrained_gguf(
            tmp_path / "x", tokenizer, quantization_method="f16", quantization_type="Q8_0"
        )


def test_save_pretrained_merged_into_the_adapter_folder_keeps_the_adapter(tmp_path):
    """gpt-oss notebook: model.save_pretrained("finetuned_model") (peft's files, no fastft manifest), then
    save_pretrained_merged("finetuned_model", ...): the merged model lands beside the adapter, whose files are
    kept byte for byte (the manifest lists only what the merge wrote); a user's file of a name the merge
    writes, with other bytes, refuses the save and stays."""
    import json

    from fastft.atomic import MARKER, FolderInTheWayError

    model, tokenizer = FastLanguageModel.from_pretrained("tiny-llama", max_seq_length=64)
    model = _trained(_peft(model))
    folder = tmp_path / "finetuned_model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # the same bytes the merge writes: replaced, nothing lost
    adapter = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.warns(UserWarning, match="applies the adapter on top"):
        model.save_pretrained_merged(folder, tokenizer, save_method="merged_16bit")
    for name, data in adapter.items():
        assert (folder / name).read_bytes() == data, name
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    listed = json.loads((folder / MARKER).read_text())["files"]
    assert "model.safetensors" in listed and "adapter_model.safetensors" not in listed
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(folder)  # what the warning says: the adapter goes on top
    assert getattr(reloaded, "_hf_peft_config_loaded", False)
    other = tmp_path / "other"
    model.save_pretrained(other)
    (other / "config.json").write_text("{}")  # the user's own config.json
    with pytest.raises(FolderInTheWayError, match="config.json"):
        model.save_pretrained_merged(other, tokenizer, save_method="merged_16bit")
    assert (other / "config.json").read_text() == "{}" and not (other / "model.safetensors").exists()


def test_adapter_saved_into_the_merged_folder_warns_as_the_other_order_does(tmp_path):
    """DeepSeek_R1_0528_Qwen3_(8B)_GRPO: save_pretrained_merged("model", ...) then model.save_pretrained("model")
    (the notebook's if-False saves switched on): the adapter lands beside the merged model, which transformers
    would then load with the adapter applied on top; said as in the other order. A folder of its own: silent."""
    model, tokenizer = FastLanguageModel.from_pretrained("tiny-llama", max_seq_length=64)
    model = _trained(_peft(model))
    folder = tmp_path / "model"
    model.save_pretrained_merged(folder, tokenizer, save_method="merged_16bit")
    with pytest.warns(UserWarning, match="applies the adapter on top"):
        model.save_pretrained(folder)
    assert (folder / "adapter_model.safetensors").is_file() and (folder / "model.safetensors").is_file()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save_pretrained(tmp_path / "lora")
    assert (tmp_path / "lora" / "adapter_config.json").is_file()
    assert not any("on top" in str(w.message) for w in caught)


def test_every_argument_of_unsloths_from_pretrained_is_taken_applied_or_refused():
    """Unsloth's full FastLanguageModel.from_pretrained signature: the ones that do not apply are accepted with
    a notice, the ones fastft cannot honour are refused naming the way, never a bare TypeError."""
    with pytest.warns(UserWarning, match="does not apply in fastft"):
        model, _ = FastLanguageModel.from_pretrained(
            model_name="tiny-llama",
            max_seq_length=64,
            load_in_16bit=True,
            device_map="sequential",
            device_map_planner_kwargs=None,
            fix_tokenizer=True,
            use_gradient_checkpointing="unsloth",
            use_exact_model_name=False,
            offload_embedding=False,
            float32_mixed_precision=None,
            random_state=3407,
            unsloth_tiled_mlp=False,
            text_only=False,
            rope_scaling=None,
            resize_model_vocab=None,
            revision=None,
            qat_scheme=None,
            load_in_fp8=False,
        )
    assert not getattr(model, "is_loaded_in_4bit", False)
    for name, value in [
        ("rope_scaling", {"type": "linear", "factor": 2.0}),
        ("revision", "v1"),
        ("load_in_fp8", "block"),
        ("qat_scheme", "int4"),
        ("resize_model_vocab", 600),
    ]:
        with pytest.raises(ValueError, match=f"{name} is not supported by fastft"):
            FastLanguageModel.from_pretrained("tiny-llama", **{name: value})
    with pytest.raises(ValueError, match="choose one precision"):
        FastLanguageModel.from_pretrained("tiny-llama", load_in_16bit=True, load_in_4bit=True)
    fp8_model, _ = FastLanguageModel.from_pretrained("tiny-llama", load_in_fp8=True)  # per-channel FP8
    assert fp8_model.fastft_info.quantization == "fp8"
    for method in ("save_pretrained_ggml", "push_to_hub_ggml", "save_pretrained_torchao"):
        with pytest.raises(NotImplementedError, match="save_pretrained_gguf|save_pretrained_merged"):
            getattr(model, method)("folder", None)


def test_fp8_notebook_row_mode_and_its_merge_names_fp8(tmp_path):
    """Llama_FP8_GRPO: Unsloth's load_in_fp8=True is its "row" mode (one scale per output row), fastft's FP8,
    so "row" loads the same (on the CPU with a notice that the GEMMs are emulated); the merged save says the base
    is FP8 (not 4-bit) and names load_in_fp8=False."""
    with pytest.warns(UserWarning, match="on the CPU their GEMMs run on the weights dequantised"):
        model, tokenizer = FastLanguageModel.from_pretrained(
            "tiny-llama", max_seq_length=64, load_in_fp8="row"
        )
    assert model.fastft_info.quantization == "fp8"
    model = FastLanguageModel.get_peft_model(model, r=4, target_modules=["q_proj"])
    with pytest.warns(UserWarning, match="the base is FP8") as caught:
        model.save_pretrained_merged(tmp_path / "merged", tokenizer, save_method="merged_16bit")
    message = next(str(w.message) for w in caught if "the base is" in str(w.message))
    assert "dequantised FP8 weights" in message and "load_in_fp8=False" in message
    assert "4-bit" not in message and "NF4" not in message


def test_get_peft_model_takes_the_rest_of_unsloths_signature():
    from fastft.unsloth.chat_templates import remove_special_tokens

    model, tokenizer = FastLanguageModel.from_pretrained("tiny-llama", max_seq_length=64)
    with pytest.raises(ValueError, match="leave it True"):
        FastLanguageModel.get_peft_model(model, r=4, init_lora_weights="gaussian")
    with pytest.warns(UserWarning, match="'temporary_location' does not apply"):
        model = FastLanguageModel.get_peft_model(
            model, r=4, init_lora_weights=True, temporary_location="_unsloth_temporary_saved_buffers"
        )
    assert all(float(p.abs().max()) == 0 for n, p in model.named_parameters() if "lora_B" in n)
    bos = tokenizer.bos_token or "<|im_start|>"
    tokenizer.bos_token = bos
    assert (
        remove_special_tokens(tokenizer, bos + "Hi") == "Hi"
        and remove_special_tokens(tokenizer, "Hi") == "Hi"
    )

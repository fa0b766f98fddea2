"""The weight-format registry (`fastft.weight_formats`): every record complete, and a model loaded in each
format the CPU loads (16-bit, NF4) detected as that format by every reader: the loader's `ModelInfo`, the
model and parameter look-ups, the estimator's inventory, the LoRA kernels' frozen base, the GGUF writer's
shapes and the studio."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

import fastft.weight_formats as weight_formats
from fastft.models.hf_save import merged_state_dict
from fastft.models.loading import _LOADERS, load_model
from fastft.models.lora import add_lora, trainable_parameter_count
from fastft.models.patch import _frozen_base
from fastft.studio.export import quantized_base
from fastft.studio.state import PRECISIONS, LoadSettings
from fastft.vram.inventory import inventory_of
from fastft.vram.settings import precisions

# fields that are None by meaning: the dense format loads with no flag, stores no bits of its own, and has
# no flag, state or dense view; int8 has no state attribute and no dense view (bitsandbytes' forward runs);
# FP8's state (its channel scales) is its layer's `weight_scale` buffer, not an attribute of the weight
NONE_WHERE = {
    "load_flag": {"16bit"},
    "bits_per_weight": {"16bit"},
    "model_flag": {"16bit"},
    "state_attribute": {"16bit", "int8", "fp8"},
    "dense_view": {"16bit", "int8"},
}


@pytest.mark.parametrize("record", weight_formats.formats(), ids=lambda record: record.name)
def test_every_record_is_complete(record):
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if record.name in NONE_WHERE.get(field.name, ()):
            assert value is None, field.name
            continue
        assert value is not None, field.name
        if isinstance(value, str):
            assert value.strip(), field.name
    assert weight_formats.get(record.name) is record
    for alias in record.aliases:
        assert weight_formats.get(alias) is record
    assert weight_formats.from_choice(record.choice) is record
    assert record.loader in _LOADERS  # models.loading knows how to load it
    assert record.merge in ("as-is", "dequantize", "refuse")
    assert record.compute_dtypes and all(
        isinstance(getattr(torch, d), torch.dtype) for d in record.compute_dtypes
    )
    n, rows = 4096 * 1024, 4096
    assert record.constant_bytes(n, rows) >= 0 and record.dense_bytes(n, 2) >= 0
    if record.quantized:
        assert record.load_flag.startswith("load_in_") and 0 < record.bits_per_weight < 16
        assert record.parameter_types or record.storage_dtypes
        assert weight_formats.from_flags(**{record.load_flag: True}) is record
        assert record.name in precisions()
        # a dense view reads the state: the weight's attribute, or (FP8) its layer's scales
        assert record.dense_view is None or record.state_attribute or record.name == "fp8"
    else:
        assert record.dense_bytes(n, 2) == 0 and record.constant_bytes(n, rows) == 0


def test_names_are_unique_and_unknown_names_are_refused():
    names = [name for record in weight_formats.formats() for name in (record.name, *record.aliases)]
    assert len(names) == len(set(names))
    assert len({record.choice for record in weight_formats.formats()}) == len(weight_formats.formats())
    assert PRECISIONS == ("16-bit", "8-bit", "FP8", "4-bit")  # the studio's order: widest first
    with pytest.raises(weight_formats.UnknownWeightFormatError, match="'nf5'.*'nf4'"):
        weight_formats.get("nf5")
    with pytest.raises(ValueError, match="already registered"):
        weight_formats.register(dataclasses.replace(weight_formats.NF4, name="nf4-again"))
    with pytest.raises(
        weight_formats.UnknownWeightFormatError, match="load_in_4bit=True or load_in_8bit=True"
    ):
        weight_formats.from_flags(load_in_4bit=True, load_in_8bit=True)


def test_nf4_bytes_are_bitsandbytes_layout():
    """4 bits a weight; one 8-bit absmax per 64 weights, one fp32 absmax per 256 blocks, the offset, the
    codebook and the nested map; the dense view a 16-bit weight and the fp32 absmax it expands."""
    n = 128 * 256
    blocks = math.ceil(n / 64)
    assert weight_formats.NF4.constant_bytes(n, 128) == blocks + 4 * math.ceil(blocks / 256) + 4 + 64 + 1024
    assert weight_formats.NF4.dense_bytes(n, 2) == 2 * n + 4 * blocks
    assert weight_formats.INT8.constant_bytes(n, 128) == 4 * 128  # one fp32 scale a row


@pytest.mark.parametrize("flags", [{}, {"load_in_4bit": True}], ids=["16-bit", "4-bit"])
def test_a_loaded_model_reads_as_its_format_everywhere(flags):
    expected = weight_formats.from_flags(**flags)
    with _cpu_notice(flags):
        model, _ = load_model("tiny-llama", device="cpu", **flags)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert weight_formats.of_model(model) is expected
    assert weight_formats.of_parameter(q_proj.weight) is expected
    assert weight_formats.of_parameter(model.model.embed_tokens.weight) is weight_formats.DENSE
    assert weight_formats.get(model.fastft_info.quantization) is expected
    assert inventory_of(model).loaded.quantization == model.fastft_info.quantization
    assert expected.logical_shape(q_proj.weight) == (q_proj.out_features, q_proj.in_features)

    load = LoadSettings(precision=expected.choice)
    assert {k: v for k, v in load.load_kwargs.items() if k != "max_seq_length"} == flags
    assert load.vram_precision == (expected.name if expected.quantized else None)

    model = add_lora(model, r=4)
    assert weight_formats.of_model(model) is expected  # through the PEFT model
    base = _frozen_base(q_proj)  # the LoRA layer's base layer, frozen by add_lora
    assert base.out_features == q_proj.out_features
    dense = base.dense(torch.float32)
    if expected.quantized:
        import bitsandbytes.functional as bnbf

        assert base.weight_format is expected
        assert torch.equal(dense, bnbf.dequantize_4bit(q_proj.weight.data, q_proj.weight.quant_state).float())
    else:
        assert torch.equal(dense, q_proj.weight.float())

    assert quantized_base(model) == (expected.choice if expected.quantized else None)
    _, total = trainable_parameter_count(model)
    stored = sum(p.numel() for p in model.parameters())
    assert (total > stored) == expected.quantized  # packed 4-bit counted as its weights
    if expected.merge == "dequantize":
        with pytest.raises(ValueError, match="dequantize=True"):
            merged_state_dict(model)
    lora = model.get_base_model().model.layers[0].self_attn.q_proj
    with torch.no_grad():
        lora.lora_B["default"].weight.normal_(generator=torch.Generator().manual_seed(3))
    merged = merged_state_dict(model, torch.float32, dequantize=expected.merge == "dequantize")
    delta = lora.get_delta_weight("default").float()
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], dense + delta)


def _cpu_notice(flags):
    return pytest.warns(UserWarning, match="CPU backend") if flags else contextlib.nullcontext()

"""A weight format registered from outside (`fastft.weight_formats.register`) flows through the VRAM
estimator's bytes with no edit to the estimator: its bits per weight, its scales and its dense view's
transient bytes."""

from __future__ import annotations

import dataclasses

import pytest

import fastft.weight_formats as weight_formats
from fastft.vram import estimate_vram
from fastft.vram.inventory import inventory_of

DENSE_VIEW_BYTES = 3 * 2**30  # far above anything tiny-llama's step allocates: the peak must show it


@pytest.fixture
def three_bit():
    record = dataclasses.replace(
        weight_formats.INT8,
        name="fake3",
        label="3-bit fake",
        choice="3-bit",
        aliases=("3bit-fake",),
        load_flag="load_in_3bit",
        bits_per_weight=3,
        constant_bytes=lambda numel, rows: 2 * rows + 5,
        constants_note="one fp16 scale a row and 5 bytes",
        dense_bytes=lambda numel, width: DENSE_VIEW_BYTES,
        parameter_types=("Params3bit",),
        storage_dtypes=(),
        model_flag="is_loaded_in_3bit",
    )
    weight_formats.register(record)
    yield record
    weight_formats.unregister(record.name)


def test_a_registered_format_flows_through_the_estimate(three_bit):
    inventory = inventory_of("tiny-llama")
    fake = estimate_vram("tiny-llama", precision="3bit-fake", seq_len=64)
    nf4 = estimate_vram("tiny-llama", precision="nf4", seq_len=64)
    assert fake.settings.precision == "fake3"
    linear = inventory.linear_params
    weights = fake.component("weights").own_bytes - nf4.component("weights").own_bytes
    assert weights == int(linear * 3 / 8) - int(linear * 4 / 8)  # the 16-bit rest is the same in both
    constants = sum(2 * lin.out_features + 5 for lin in inventory.linears)
    assert fake.component("quant_constants").own_bytes == constants
    assert fake.component("quant_constants").note.startswith(three_bit.constants_note)
    assert fake.total_bytes > DENSE_VIEW_BYTES > nf4.total_bytes  # its dense view is at the peak
    assert "3bit-fake" not in weight_formats.quantized_names() and "fake3" in weight_formats.quantized_names()


def test_an_unregistered_format_is_refused_by_name():
    with pytest.raises(ValueError, match="precision='fake3'.*'nf4'"):
        estimate_vram("tiny-llama", precision="fake3", seq_len=64)

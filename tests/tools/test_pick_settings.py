"""A notebook's parameters cell: `pick_settings` for each card picks a model, precision, context and micro-batch
that the estimator says fit, in the dtype the card computes in, and says what it picked."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import fastft
from fastft.vram import GPUS, estimate_vram, max_context
from fastft.vram.pick import LADDER, pick_settings

CARDS = ("t4", "rtx3090", "rtx4090", "l4", "a10g", "a100-40gb", "a100-80gb", "h100")


@pytest.mark.parametrize("card", CARDS)
def test_each_card_gets_settings_the_estimator_says_fit(card, capsys):
    picked = pick_settings(card)
    precision = "nf4" if picked.load_in_4bit else picked.dtype
    tokens = picked.max_seq_length * picked.micro_batch_bins
    estimate = estimate_vram(picked.model, picked.max_seq_length, tokens, precision=precision, gpu=card)
    assert estimate.fits and picked.max_seq_length == 2048
    # the largest model that fits: every model above it in the ladder does not reach the context
    above = LADDER[: LADDER.index((picked.model, picked.load_in_4bit))]
    for model, four_bit in above:
        assert max_context(model, card, precision="nf4" if four_bit else picked.dtype) < 2048
    # one more bin would not fit (or the cap of 8 is reached)
    if picked.micro_batch_bins < 8:
        more = 2 * tokens
        assert not estimate_vram(
            picked.model, picked.max_seq_length, more, precision=precision, gpu=card
        ).fits
    assert picked.dtype == ("fp16" if card == "t4" else "bf16")
    said = capsys.readouterr().out
    assert said.strip() == picked.why and picked.model in said and GPUS[card].label in said


def test_a_bigger_card_never_gets_a_smaller_model_nor_a_shorter_max_context():
    by_size = sorted(CARDS, key=lambda card: GPUS[card].capacity_bytes)
    rungs = [LADDER.index((p.model, p.load_in_4bit)) for p in (pick_settings(c, say=False) for c in by_size)]
    assert rungs == sorted(rungs, reverse=True)
    contexts = [max_context("meta-llama/Llama-3.1-8B-Instruct", card, precision="nf4") for card in by_size]
    assert contexts == sorted(contexts) and contexts[0] > 0  # the T4 trains Llama-3.1-8B QLoRA too


def test_the_card_s_memory_can_be_given_and_a_small_one_gets_the_longest_context_that_fits():
    small = pick_settings("t4", memory_gib=2, say=False)
    assert small.model == LADDER[-1][0] and 0 < small.max_seq_length < 2048
    assert small.max_seq_length == max_context(small.model, small.card, precision="fp16")
    assert "this is the longest that does" in small.why
    with pytest.raises(ValueError, match=r"No model of the ladder fits .* even at 128 tokens"):
        pick_settings("t4", memory_gib=1.5, say=False)
    assert pick_settings(memory_gib=80, say=False).model == pick_settings("h100", say=False).model


def test_without_a_gpu_the_embedded_preset_trains_in_fp32(monkeypatch):
    import fastft.vram.pick as pick

    monkeypatch.setattr(pick, "detect_gpu", lambda: None)
    picked = fastft.pick_settings(say=False)
    assert (picked.model, picked.dtype, picked.load_in_4bit, picked.gpus) == ("tiny-llama", "fp32", False, 0)


def test_two_t4s_say_each_rank_trains_the_settings():
    picked = pick_settings("t4", gpus=2, say=False)
    assert "on each of 2 GPUs (fastft launch --gpus 2)" in picked.why and "no bf16: fp16" in picked.why


def test_an_unknown_card_is_refused_with_the_presets():
    with pytest.raises(ValueError, match="Unknown GPU 'gtx9999'"):
        pick_settings("gtx9999")


def test_a_gpu_that_only_emulates_bf16_loads_in_fp16(monkeypatch):
    """torch.cuda.is_bf16_supported() answers True on a T4 (emulated bf16): fastft asks for real bf16 compute,
    so a T4 loads and trains in fp16, as the estimator and pick_settings assume."""
    import torch

    import fastft.models.loading as loading
    from fastft.models.loading import default_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(loading, "_SAID_FP16", False)
    with pytest.warns(UserWarning, match="has no bf16 compute: fastft loads and trains in fp16"):
        assert default_dtype("cuda") == torch.float16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_dtype("cuda") == torch.float16  # said once


# -- the notebooks' parameters cells, run as on each card ----------------------------------------------------

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _parameters(path: Path) -> str:
    import nbformat

    cells = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    return next(c.source for c in cells if "parameters" in c.metadata.get("tags", []))


PICKING = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb") if "pick_settings(" in _parameters(p))


def _on_card(monkeypatch, card: str, gpus: int) -> None:
    """This process as one with `gpus` of `card` visible: what the parameters cell sees of the GPU (its name,
    memory and bf16 as `detect_gpu` and `torch.cuda.get_device_properties` report them)."""
    import types

    import torch

    import fastft.vram.pick as pick
    from fastft.vram.gpus import GpuSpec

    spec = GPUS[card]
    seen = GpuSpec("detected", spec.label, spec.capacity_bytes, bf16=spec.bf16, source="test")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    props = types.SimpleNamespace(
        name=spec.label, total_memory=spec.capacity_bytes, major=7 if not spec.bf16 else 9
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    monkeypatch.setattr(pick, "detect_gpu", lambda: seen)


def test_every_notebook_picks_its_settings():
    """Every tutorial's parameters cell picks its model and settings on a GPU with `pick_settings`."""
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == PICKING and len(PICKING) == 7


@pytest.mark.parametrize("notebook", PICKING)
@pytest.mark.parametrize("card", (*CARDS, "2×t4"))
def test_a_notebook_s_parameters_cell_picks_settings_the_estimator_says_fit_on_each_card(
    notebook, card, monkeypatch, capsys
):
    """The parameters cell, run as on that card (its name and memory; "2×t4": Kaggle's two T4s, each rank of
    ``fastft launch`` training the settings), picks a model, context and micro-batch whose estimate fits the
    card (per GPU), in the card's dtype, sets the notebook's variables from them and says what it picked."""
    gpus = 2 if card.startswith("2×") else 1
    card = card.removeprefix("2×")
    _on_card(monkeypatch, card, gpus)
    namespace: dict = {}
    exec(_parameters(NOTEBOOKS / notebook), namespace)
    picked = namespace["SETTINGS"]
    assert picked.gpus == gpus and picked.dtype == ("bf16" if GPUS[card].bf16 else "fp16")
    assert namespace["MODEL"] == picked.model and namespace["MAX_SEQ_LENGTH"] == picked.max_seq_length
    bins = namespace.get("MICRO_BATCH_BINS", picked.micro_batch_bins)
    assert bins == picked.micro_batch_bins
    estimate = estimate_vram(
        picked.model,
        picked.max_seq_length,
        picked.max_seq_length * bins,
        precision="nf4" if picked.load_in_4bit else picked.dtype,
        gpu=picked.card,
        world_size=gpus,
    )
    assert estimate.fits and picked.card.capacity_bytes <= GPUS[card].capacity_bytes
    assert capsys.readouterr().out.strip() == picked.why

"""The shipped inventories of presets and catalog models (`fastft.vram.catalog_cache`): one per model, current
with its spec, equal to the inventory built on the meta device, and ignored once the spec changes."""

from __future__ import annotations

import dataclasses

import pytest

from fastft.models.catalog import CATALOG, architectures
from fastft.models.presets import PRESETS, load_preset_tokenizer
from fastft.vram import catalog_cache, estimate_vram
from fastft.vram.inventory import _inventory_of_config, _inventory_of_name


def test_every_preset_and_catalog_model_has_a_current_entry():
    names = catalog_cache.known_models()
    assert names == [*PRESETS, *(spec.hub_id for spec in architectures())]
    missing = [name for name in [*PRESETS, *CATALOG] if catalog_cache.cached_inventory(name) is None]
    assert not missing, f"run `python -m fastft.vram.catalog_cache` (stale or missing: {missing})"


@pytest.mark.parametrize("name", ["meta-llama/Llama-3.1-8B", "Qwen/Qwen3-8B-Base"])
def test_a_variant_is_served_from_its_entry_and_equals_its_own_meta_build(name):
    """A base or instruct variant has no entry of its own: its architecture entry's, under its name and
    with its own stated context (Qwen3-8B-Base's 32,768 positions, not Qwen3-8B's 40,960)."""
    cached = catalog_cache.cached_inventory(name)
    assert cached == catalog_cache.build_inventory(name)
    assert cached.name == name
    assert cached.max_position_embeddings == CATALOG[name].config["max_position_embeddings"]


@pytest.mark.parametrize("name", catalog_cache.known_models())
def test_stored_inventory_equals_the_meta_built_one(name):
    assert catalog_cache.cached_inventory(name) == catalog_cache.build_inventory(name)


@pytest.mark.parametrize("name", [name for name in PRESETS if PRESETS[name].chat])
def test_a_family_preset_is_estimated_with_its_family_tokens(name):
    """tiny-qwen3's <think> / </think>, tiny-llama3's Llama-3 tokens, …: rows of the embedding and the head."""
    assert _inventory_of_name(name).vocab_size == len(load_preset_tokenizer(name)) > 512


def test_an_entry_whose_spec_changed_is_not_used(monkeypatch):
    hub_id = "meta-llama/Llama-3.2-1B-Instruct"
    stored = catalog_cache.cached_inventory(hub_id)
    changed = dataclasses.replace(CATALOG[hub_id], config={**CATALOG[hub_id].config, "num_hidden_layers": 3})
    monkeypatch.setitem(CATALOG, hub_id, changed)
    assert catalog_cache.cached_inventory(hub_id) is None
    rebuilt = _inventory_of_config(changed.to_config(), hub_id)
    assert rebuilt.num_layers == 3 != stored.num_layers
    _inventory_of_name.cache_clear()  # names resolved earlier in this process hold the catalog's spec
    try:
        estimate = estimate_vram(hub_id, 512, gpu=None)
    finally:
        _inventory_of_name.cache_clear()
    assert estimate.total_bytes == estimate_vram(rebuilt, 512, gpu=None).total_bytes


def test_round_trip_keeps_every_field():
    inventory = catalog_cache.build_inventory("tiny-moe")
    assert catalog_cache.inventory_from_dict(catalog_cache.inventory_to_dict(inventory)) == inventory

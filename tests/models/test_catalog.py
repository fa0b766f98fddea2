"""The model catalog: its data and parameter formula against real `transformers` modules and published sizes.

Every architecture is built on the meta device (shapes only, no memory, no download).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from fastft.models.catalog import CATALOG, VARIANT_FIELDS, ModelSpec, architectures, find_model, get_spec

SPECS = architectures()  # each architecture once: a base or instruct variant shares its entry's
IDS = [spec.short_name for spec in SPECS]

REQUIRED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
    "rope_theta",
)

# Sizes the publishers state (model cards, release posts), and the relative tolerance each is held to.
# Active counts include the embedding table except gpt-oss, whose card leaves the input embedding out.
PUBLISHED_TOTAL = {
    "meta-llama/Llama-3.2-1B-Instruct": 1.23e9,
    "meta-llama/Llama-3.2-3B-Instruct": 3.21e9,
    "meta-llama/Llama-3.1-8B-Instruct": 8.03e9,
    "mistralai/Mistral-7B-Instruct-v0.3": 7.25e9,
    "mistralai/Mixtral-8x7B-Instruct-v0.1": 46.7e9,
    "Qwen/Qwen2.5-0.5B-Instruct": 0.49e9,
    "Qwen/Qwen2.5-1.5B-Instruct": 1.54e9,
    "Qwen/Qwen2.5-7B-Instruct": 7.61e9,
    "Qwen/Qwen2.5-14B-Instruct": 14.7e9,
    "Qwen/Qwen3-0.6B": 0.6e9,
    "Qwen/Qwen3-4B": 4.0e9,
    "Qwen/Qwen3-8B": 8.2e9,
    "Qwen/Qwen3-14B": 14.8e9,
    "Qwen/Qwen3-32B": 32.8e9,
    "Qwen/Qwen3-30B-A3B": 30.5e9,
    "Qwen/Qwen1.5-MoE-A2.7B-Chat": 14.3e9,
    "openai/gpt-oss-20b": 20.9e9,
    "google/gemma-3-1b-it": 1.0e9,
}
PUBLISHED_ACTIVE = {
    # (published, include_embedding, relative tolerance)
    "mistralai/Mixtral-8x7B-Instruct-v0.1": (12.9e9, True, 0.01),
    # Qwen states "3.3B activated"; the exact count is 3.353e9, so the figure is truncated, not rounded.
    "Qwen/Qwen3-30B-A3B": (3.3e9, True, 0.02),
    "Qwen/Qwen1.5-MoE-A2.7B-Chat": (2.7e9, True, 0.01),
    "openai/gpt-oss-20b": (3.6e9, False, 0.01),
}


# Regression pins: the exact totals the catalog data gives (a one-unit edit to a shape field changes
# them, which the 1 % checks above cannot see). Where well known they equal the published checkpoints'
# counts, e.g. Llama-3.1-8B 8,030,261,248, Mistral-7B-v0.3 7,248,023,552, gemma-3-1b 999,885,952.
EXACT_TOTAL = {
    "meta-llama/Llama-3.2-1B-Instruct": 1_235_814_400,
    "meta-llama/Llama-3.2-3B-Instruct": 3_212_749_824,
    "meta-llama/Llama-3.1-8B-Instruct": 8_030_261_248,
    "mistralai/Mistral-7B-Instruct-v0.3": 7_248_023_552,
    "mistralai/Mixtral-8x7B-Instruct-v0.1": 46_702_792_704,
    "Qwen/Qwen2.5-0.5B-Instruct": 494_032_768,
    "Qwen/Qwen2.5-1.5B-Instruct": 1_543_714_304,
    "Qwen/Qwen2.5-7B-Instruct": 7_615_616_512,
    "Qwen/Qwen2.5-14B-Instruct": 14_770_033_664,
    "Qwen/Qwen3-0.6B": 596_049_920,
    "Qwen/Qwen3-1.7B": 1_720_574_976,
    "Qwen/Qwen3-4B": 4_022_468_096,
    "Qwen/Qwen3-8B": 8_190_735_360,
    "Qwen/Qwen3-14B": 14_768_307_200,
    "Qwen/Qwen3-32B": 32_762_123_264,
    "Qwen/Qwen3-30B-A3B": 30_532_122_624,
    "Qwen/Qwen1.5-MoE-A2.7B-Chat": 14_315_784_192,
    "openai/gpt-oss-20b": 20_914_757_184,
    "google/gemma-3-1b-it": 999_885_952,
    "google/gemma-3-4b-it": 3_880_263_168,
}


def _meta_model(spec: ModelSpec) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(spec.to_config())


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_formula_matches_the_transformers_model(spec):
    model = _meta_model(spec)
    assert _numel(model) == spec.parameter_count()
    assert model.config.model_type == spec.model_type
    assert model.config.num_hidden_layers == spec.num_layers
    assert model.config.hidden_size == spec.hidden_size


@pytest.mark.parametrize("spec", [s for s in SPECS if s.is_moe], ids=lambda s: s.short_name)
def test_active_count_matches_top_k_of_the_built_experts(spec):
    model = _meta_model(spec)
    expert_numel = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    experts, top_k = spec.num_experts, spec.config["num_experts_per_tok"]
    assert expert_numel > 0 and expert_numel % experts == 0
    inactive = expert_numel // experts * (experts - top_k)
    assert spec.active_parameter_count() == _numel(model) - inactive
    embedding = model.get_input_embeddings().weight.numel()
    assert spec.active_parameter_count(include_embedding=False) == _numel(model) - inactive - embedding


@pytest.mark.parametrize(
    ("hub_id", "changes"),
    [
        ("Qwen/Qwen3-30B-A3B", dict(mlp_only_layers=[0, 5], decoder_sparse_step=2)),
        ("meta-llama/Llama-3.2-1B-Instruct", dict(attention_bias=True, mlp_bias=True)),
        ("Qwen/Qwen3-8B", dict(tie_word_embeddings=True, head_dim=64)),
    ],
)
def test_formula_follows_shape_fields(hub_id, changes):
    spec = CATALOG[hub_id]
    variant = dataclasses.replace(spec, config=dict(spec.config, **changes))
    assert variant.parameter_count() != spec.parameter_count()
    assert _numel(_meta_model(variant)) == variant.parameter_count()


@pytest.mark.parametrize("hub_id", PUBLISHED_TOTAL)
def test_total_matches_published_size(hub_id):
    assert get_spec(hub_id).parameter_count() == pytest.approx(PUBLISHED_TOTAL[hub_id], rel=0.01)


def test_exact_totals_are_pinned():
    assert {spec.hub_id: spec.parameter_count() for spec in SPECS} == EXACT_TOTAL


def test_every_family_has_a_base_and_an_instruct_model_sharing_one_architecture_entry():
    variants = [spec for spec in CATALOG.values() if spec.variant_of]
    assert variants and {s.hub_id for s in SPECS} | {s.hub_id for s in variants} == set(CATALOG)
    for variant in variants:
        entry = CATALOG[variant.variant_of]
        assert not entry.variant_of and variant.hub_id != entry.hub_id
        assert (variant.family, variant.model_type, variant.gated) == (
            entry.family,
            entry.model_type,
            entry.gated,
        )
        changed = {
            k for k in {*variant.config, *entry.config} if variant.config.get(k) != entry.config.get(k)
        }
        assert changed <= VARIANT_FIELDS, variant.hub_id
        if not changed:
            assert variant.config is entry.config  # shared, not copied
        assert variant.parameter_count() == entry.parameter_count()
    paired = {spec.family for spec in variants}
    assert paired == {spec.family for spec in SPECS} - {"gpt-oss"}  # released post-trained only
    assert get_spec("meta-llama/Llama-3.1-8B").variant_of == "meta-llama/Llama-3.1-8B-Instruct"
    assert get_spec("Qwen/Qwen3-8B-Base").variant_of == "Qwen/Qwen3-8B"


@pytest.mark.parametrize("hub_id", PUBLISHED_ACTIVE)
def test_active_matches_published_size(hub_id):
    published, include_embedding, rel = PUBLISHED_ACTIVE[hub_id]
    active = get_spec(hub_id).active_parameter_count(include_embedding=include_embedding)
    assert active == pytest.approx(published, rel=rel)


def test_dense_models_are_fully_active():
    for spec in SPECS:
        assert spec.is_moe == (spec.model_type in {"mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"})
        if not spec.is_moe:
            assert spec.active_parameter_count() == spec.parameter_count()


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_entry_is_complete_and_consistent(spec):
    assert CATALOG[spec.hub_id] is spec
    missing = [name for name in REQUIRED_FIELDS if name not in spec.config]
    assert not missing, f"{spec.hub_id} lacks {missing}"
    assert spec.short_name == spec.hub_id.split("/")[1]
    assert spec.vocab_size == spec.config["vocab_size"]
    assert spec.config["num_attention_heads"] % spec.config["num_key_value_heads"] == 0
    if spec.is_moe:
        assert 0 < spec.config["num_experts_per_tok"] < spec.num_experts


def test_required_models_are_listed():
    required = [
        "meta-llama/Llama-3.2-1B-Instruct",
        "meta-llama/Llama-3.2-3B-Instruct",
        "meta-llama/Llama-3.1-8B-Instruct",
        "mistralai/Mistral-7B-Instruct-v0.3",
        *(f"Qwen/Qwen2.5-{size}-Instruct" for size in ("0.5B", "1.5B", "7B", "14B")),
        *(f"Qwen/Qwen3-{size}" for size in ("0.6B", "1.7B", "4B", "8B", "14B", "32B", "30B-A3B")),
        "mistralai/Mixtral-8x7B-Instruct-v0.1",
        "openai/gpt-oss-20b",
        "google/gemma-3-1b-it",
        "google/gemma-3-4b-it",
    ]
    assert [hub_id for hub_id in required if hub_id not in CATALOG] == []


def test_known_details():
    assert get_spec("meta-llama/Llama-3.1-8B-Instruct").gated
    assert get_spec("google/gemma-3-1b-it").gated
    assert not get_spec("Qwen/Qwen3-8B").gated
    assert not get_spec("openai/gpt-oss-20b").gated
    gemma4b = get_spec("google/gemma-3-4b-it")
    assert gemma4b.model_type == "gemma3_text" and "vision" in gemma4b.notes
    assert get_spec("Qwen/Qwen3-30B-A3B").family == "qwen3"
    assert get_spec("Qwen/Qwen3-0.6B").config["tie_word_embeddings"] is True
    assert get_spec("Qwen/Qwen3-8B").config["tie_word_embeddings"] is False


def test_to_config_builds_the_real_config_and_leaves_the_data_alone():
    spec = get_spec("openai/gpt-oss-20b")
    before = repr(spec.config)
    config = spec.to_config()
    assert type(config).__name__ == "GptOssConfig"
    assert config.num_local_experts == 32 and config.num_experts_per_tok == 4
    assert config.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert config.rope_parameters["rope_type"] == "yarn"
    assert config.rope_parameters["rope_theta"] == 150000.0
    assert get_spec("Qwen/Qwen3-30B-A3B").to_config().head_dim == 128  # not hidden / heads (64)
    assert get_spec("mistralai/Mistral-7B-Instruct-v0.3").to_config().sliding_window is None
    assert repr(spec.config) == before


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_spec("Qwen/Qwen3-8B").hub_id = "x"


def test_find_model_searches_ids_and_families_case_insensitively():
    qwen3 = {spec.short_name for spec in find_model("QWEN3") if not spec.variant_of}
    assert qwen3 == {
        "Qwen3-0.6B",
        "Qwen3-1.7B",
        "Qwen3-4B",
        "Qwen3-8B",
        "Qwen3-14B",
        "Qwen3-32B",
        "Qwen3-30B-A3B",
    }
    assert [s.short_name for s in find_model("llama")] == [
        "Llama-3.2-1B-Instruct",
        "Llama-3.2-1B",
        "Llama-3.2-3B-Instruct",
        "Llama-3.2-3B",
        "Llama-3.1-8B-Instruct",
        "Llama-3.1-8B",
    ]
    assert [s.hub_id for s in find_model("gpt-oss")] == ["openai/gpt-oss-20b"]
    assert [s.hub_id for s in find_model("Mixtral")] == [
        "mistralai/Mixtral-8x7B-Instruct-v0.1",
        "mistralai/Mixtral-8x7B-v0.1",
    ]
    assert {s.short_name for s in find_model("gemma3")} == {  # by family
        "gemma-3-1b-it",
        "gemma-3-1b-pt",
        "gemma-3-4b-it",
        "gemma-3-4b-pt",
    }
    assert {s.family for s in find_model("mistralai/")} == {"mistral", "mixtral"}
    assert find_model("no-such-model") == []
    assert find_model("") == list(CATALOG.values())


def test_get_spec_returns_the_entry():
    assert get_spec("Qwen/Qwen3-8B") is CATALOG["Qwen/Qwen3-8B"]


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("Qwen/Qwen3-8b", "Qwen/Qwen3-8B"),
        ("meta-llama/Llama-3.1-8", "meta-llama/Llama-3.1-8B-Instruct"),
        ("Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-Instruct-v0.3"),
        ("google/gemma-3-1b", "google/gemma-3-1b-it"),
    ],
)
def test_get_spec_error_names_close_matches(query, expected):
    with pytest.raises(KeyError) as error:
        get_spec(query)
    message = str(error.value)
    assert repr(query) in message and "close matches" in message and expected in message


def test_get_spec_error_without_close_matches():
    with pytest.raises(KeyError, match="none close"):
        get_spec("acme/zzzzzz")

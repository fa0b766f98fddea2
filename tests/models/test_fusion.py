"""fastft.models.fusion: one fusion plan per config, pinned for every preset and several catalog models, and
the three readers -- `patch`, the VRAM estimator and the studio's picker -- agreeing with it.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

import fastft
from fastft.models.facts import model_facts
from fastft.models.fusion import FusionPlan, plan
from fastft.models.patch import UnfusedWarning, patch
from fastft.vram import activation_bytes as act
from fastft.vram import estimate_vram
from fastft.vram.inventory import inventory_of

DENSE = ("RMSNorm", "RoPE", "LoRA-fused Q/K/V/O projections", "gated MLP with LoRA", "linear cross-entropy")
COVERED = "llama, mistral, qwen2, qwen3, qwen2_moe, qwen3_moe, mixtral, gpt_oss"


def _moe(experts: int) -> tuple[str, ...]:
    return (
        "RMSNorm",
        "RoPE",
        "LoRA-fused Q/K/V/O projections",
        f"MoE expert blocks ({experts} experts per layer: routing plan + grouped GEMM)",
        "linear cross-entropy",
    )


GPT_OSS_NOT_FUSED = ("the attention and RMSNorm of gpt_oss (transformers' modules)",)

GEMMA3 = (
    "none",
    None,
    False,
    0,
    (),
    (
        f"the gemma3_text architecture: it trains on transformers' own modules (fused kernels cover {COVERED})",
    ),
)

# name: (scope, activation, moe, experts, fused, not_fused)
EXPECTED = {
    "tiny-llama": ("decoder", "swiglu", False, 0, DENSE, ()),
    "tiny-llama3": ("decoder", "swiglu", False, 0, DENSE, ()),
    "tiny-qwen3": ("decoder", "swiglu", False, 0, DENSE, ()),
    "tiny-mistral": ("decoder", "swiglu", False, 0, DENSE, ()),
    "tiny-moe": ("decoder", "swiglu", True, 8, _moe(8), ()),
    "tiny-mixtral": ("decoder", "swiglu", True, 4, _moe(4), ()),
    "tiny-gpt-oss": (
        "moe_blocks",
        None,
        True,
        4,
        ("MoE expert blocks (4 experts per layer: routing plan + grouped GEMM)",),
        GPT_OSS_NOT_FUSED,
    ),
    "meta-llama/Llama-3.1-8B-Instruct": ("decoder", "swiglu", False, 0, DENSE, ()),
    "Qwen/Qwen2.5-7B-Instruct": ("decoder", "swiglu", False, 0, DENSE, ()),
    "Qwen/Qwen3-30B-A3B": ("decoder", "swiglu", True, 128, _moe(128), ()),
    "Qwen/Qwen1.5-MoE-A2.7B-Chat": ("decoder", "swiglu", True, 60, _moe(60), ()),
    "mistralai/Mixtral-8x7B-Instruct-v0.1": ("decoder", "swiglu", True, 8, _moe(8), ()),
    "openai/gpt-oss-20b": (
        "moe_blocks",
        None,
        True,
        32,
        ("MoE expert blocks (32 experts per layer: routing plan + grouped GEMM)",),
        GPT_OSS_NOT_FUSED,
    ),
    "google/gemma-3-1b-it": GEMMA3,
    "tiny-gemma3": GEMMA3,
}


def _config_fields(name: str) -> dict:
    """The config fields the studio's picker reads, with the model type (nothing downloaded)."""
    if name in fastft.PRESETS:
        preset = fastft.PRESETS[name]
        return {**preset.config, "model_type": preset.model_type}
    spec = fastft.CATALOG[name]
    return {**spec.config, "model_type": spec.model_type}


def _real_config(name: str):
    if name in fastft.PRESETS:
        return fastft.PRESETS[name].make_config(vocab_size=512)
    return fastft.CATALOG[name].to_config()


def test_every_preset_is_pinned():
    assert set(fastft.PRESETS) <= set(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_plan_is_pinned_and_the_same_from_the_fields_and_the_real_config(name):
    scope, activation, moe, experts, fused, not_fused = EXPECTED[name]
    fields = plan(_config_fields(name))
    assert (fields.scope, fields.activation, fields.moe, fields.experts) == (scope, activation, moe, experts)
    assert fields.fused == fused and fields.not_fused == not_fused
    assert fields.fuses_decoder == (scope == "decoder")
    assert plan(_real_config(name)) == fields


@pytest.mark.parametrize("name", [*fastft.PRESETS, *fastft.CATALOG])
def test_studio_picker_shows_the_plan(name):
    facts = model_facts(name)
    fusion = plan(_config_fields(name))
    assert (facts.fused, facts.not_fused) == (list(fusion.fused), list(fusion.not_fused))


def _tiny(model_type: str, **fields):
    config = AutoConfig.for_model(
        model_type,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=2,
        vocab_size=64,
        **fields,
    )
    return AutoModelForCausalLM.from_config(config)


def test_an_unsupported_activation_leaves_the_mlps_unfused_and_patch_says_why():
    model = _tiny("llama", hidden_act="relu")
    fusion = plan(model.config)
    assert (fusion.scope, fusion.activation, fusion.moe) == ("decoder", None, False)
    assert fusion.fused == ("RMSNorm", "RoPE", "LoRA-fused Q/K/V/O projections", "linear cross-entropy")
    assert fusion.not_fused == ("the MLPs (activation 'relu' has no fused kernel)",)
    with pytest.warns(UnfusedWarning) as caught:
        report = patch(model)
    assert "mlp" not in report.fused and report.fused["attention"] == 2
    assert report.not_fused == list(fusion.not_fused) and len(caught) == 1
    profile = act.Profile.of("bf16", fused=True, model_type="llama", hidden_act="relu")
    assert profile.fused_norms and profile.fused_projections and not profile.fused_mlp


def test_an_unsupported_activation_on_qwen2_moe_leaves_its_shared_expert_unfused():
    model = _tiny(
        "qwen2_moe",
        hidden_act="relu",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    fusion = plan(model.config)
    assert fusion.moe and fusion.activation is None
    assert fusion.not_fused == ("the MLPs (activation 'relu' has no fused kernel)",)
    with pytest.warns(UnfusedWarning):
        report = patch(model)
    assert report.fused["moe"] == 2 and "mlp" not in report.fused
    assert report.not_fused == list(fusion.not_fused)


def test_an_unsupported_architecture_is_left_whole_as_its_plan_says():
    model = _tiny("gemma3_text")
    fusion = plan(model.config)
    assert fusion.scope == "none" and fusion.fused == () and fusion.activation is None
    with pytest.warns(UnfusedWarning, match="transformers' own modules") as caught:
        report = patch(model)
    assert report.fused == {} and fusion.scope_reason in str(caught[0].message)
    estimate = estimate_vram(model.config, 256, gpu=None)
    assert estimate.settings.kernels == "transformers + peft" and estimate.settings.loss == "eager"


@pytest.mark.parametrize("name", list(fastft.PRESETS))
def test_patch_fuses_what_the_plan_says(name):
    model, _ = fastft.load_model(name)
    fusion = plan(model.config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = patch(model)
    layers = model.config.num_hidden_layers
    assert bool(report.fused.get("attention")) == bool(report.fused.get("rms_norm")) == fusion.fuses_decoder
    assert report.fused.get("moe", 0) == (layers if fusion.moe else 0)
    assert report.fused.get("mlp", 0) == (layers if fusion.activation and not fusion.moe else 0)
    assert report.fused.get("cross_entropy", 0) == (0 if fusion.scope == "none" else 1)
    assert (
        bool(report.not_fused)
        == bool(fusion.not_fused)
        == any(issubclass(w.category, UnfusedWarning) for w in caught)
    )
    if fusion.scope == "moe_blocks":
        assert report.not_fused == [
            f"the attention and RMSNorm of gpt_oss ({fusion.scope_reason}: transformers' modules)"
        ]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_the_estimator_assumes_the_kernels_of_the_plan(name):
    fusion = plan(_real_config(name))
    inventory = inventory_of(name)
    profile = act.Profile.of(
        "bf16", fused=True, model_type=inventory.model_type, hidden_act=inventory.hidden_act
    )
    # the estimator counts fastft's kernels where the whole decoder is fused; gpt-oss's fused MoE blocks
    # (and its fused loss) are approximated by the transformers path, as its estimate's note says
    assert profile.fused_norms == profile.fused_projections == profile.fused_loss == fusion.fuses_decoder
    assert profile.fused_mlp == (fusion.fuses_decoder and fusion.activation is not None)
    estimate = estimate_vram(inventory, 512, gpu=None)
    assert estimate.settings.loss == ("fused" if fusion.fuses_decoder else "eager")
    assert estimate.settings.kernels == (
        "fastft fused kernels" if fusion.fuses_decoder else "transformers + peft"
    )
    unfused = estimate_vram(inventory, 512, gpu=None, fused=False)
    assert unfused.settings.kernels == "transformers + peft"


def test_the_activation_table_is_the_kernels_and_the_plan_needs_no_triton():
    from fastft.kernels import activations, swiglu

    assert swiglu.HIDDEN_ACT_TO_KIND is activations.HIDDEN_ACT_TO_KIND
    assert set(activations.HIDDEN_ACT_TO_KIND.values()) == set(swiglu.KINDS)
    code = (
        "import sys; sys.modules['triton'] = None\n"  # `import triton` now fails, as where it is not installed
        "from fastft.models.fusion import plan\n"
        "p = plan({'model_type': 'qwen3', 'hidden_act': 'gelu_python'})\n"
        "assert p.activation == 'geglu' and p.fuses_decoder, p\n"
        "assert 'triton' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_plan_is_a_frozen_value():
    fusion = plan({"model_type": "llama"})
    assert isinstance(fusion, FusionPlan) and fusion == plan({"model_type": "llama", "hidden_act": "silu"})
    with pytest.raises(AttributeError):
        fusion.scope = "none"

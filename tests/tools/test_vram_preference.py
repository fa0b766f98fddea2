"""The VRAM estimator on preference runs: pairs in every micro-batch, the per-sequence log-probs, DPO's
reference pass; `fits` and `max_context` take the method."""

import pytest

from fastft.vram import VramEstimateError, estimate_vram, fits, max_context

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _component(estimate, key):
    return next((c for c in estimate.components if c.key == key), None)


@pytest.mark.parametrize("method", ["dpo", "orpo", "simpo"])
def test_a_pair_is_twice_the_tokens_of_one_side(method):
    """seq_len is one side: a preference micro-batch holds both, so it stores what SFT stores at 2 × seq_len;
    the loss phase adds the per-target log-probs (16 B a trained target) to the same fused head's buffers."""
    pair = estimate_vram(MODEL, 1024, precision="nf4", gpu="h200", method=method)
    sft = estimate_vram(MODEL, 2048, precision="nf4", gpu="h200")
    assert pair.settings.batch_tokens == 2048 and pair.settings.method == method
    assert _component(pair, "activations").own_bytes == _component(sft, "activations").own_bytes
    extra = _component(pair, "logits").own_bytes - _component(sft, "logits").own_bytes
    assert extra == 16 * pair.settings.trained_tokens
    assert (_component(pair, "reference") is not None) == (method == "dpo")


def test_dpo_reference_pass_is_counted_and_precomputing_removes_it():
    """The reference forward saves nothing and runs before the policy's: it grows with the tokens, stays
    below the policy's loss phase (stored activations and the head), and precompute_reference drops it."""
    dpo = estimate_vram(MODEL, 1024, precision="nf4", gpu="h200", method="dpo", checkpointing="none")
    reference = _component(dpo, "reference")
    assert reference.phase == "reference" and reference.own_bytes > 0
    longer = _component(estimate_vram(MODEL, 4096, precision="nf4", gpu="h200", method="dpo"), "reference")
    assert longer.own_bytes > reference.own_bytes
    policy_loss = _component(dpo, "activations").own_bytes + _component(dpo, "logits").own_bytes
    assert reference.own_bytes < policy_loss and dpo.peak_phase != "reference" and reference.bytes == 0
    cached = estimate_vram(
        MODEL,
        1024,
        precision="nf4",
        gpu="h200",
        method="dpo",
        checkpointing="none",
        precompute_reference=True,
    )
    assert _component(cached, "reference") is None and cached.settings.precompute_reference
    assert cached.total_bytes == dpo.total_bytes  # the reference was not the peak, so it costs nothing there


def test_fits_and_max_context_take_the_method():
    sft = max_context(MODEL, "rtx4090", precision="nf4", checkpointing="offload")
    dpo = max_context(MODEL, "rtx4090", precision="nf4", checkpointing="offload", method="dpo")
    assert 0 < dpo < sft and dpo <= sft // 2 + 128  # a pair of two sides in the budget of one sequence
    verdict = fits(MODEL, 2 * dpo + 1024, "rtx4090", precision="nf4", checkpointing="offload", method="dpo")
    assert not verdict
    assert verdict.fixes and all(
        estimate_vram(
            MODEL,
            fix.changes.get("seq_len", 2 * dpo + 1024),
            gpu="rtx4090",
            method="dpo",
            **{
                "precision": "nf4",
                "checkpointing": "offload",
                **{k: v for k, v in fix.changes.items() if k != "seq_len"},
            },
        ).fits
        for fix in verdict.fixes
    )
    assert fits(MODEL, dpo, "rtx4090", precision="nf4", checkpointing="offload", method="dpo")


def test_preference_settings_are_checked():
    with pytest.raises(VramEstimateError, match="one pair"):
        estimate_vram(MODEL, 1024, batch_tokens=1536, gpu=None, method="dpo")
    with pytest.raises(VramEstimateError, match="method='dpo' only"):
        estimate_vram(MODEL, 1024, gpu=None, method="simpo", precompute_reference=True)
    with pytest.raises(VramEstimateError, match="not one of"):
        estimate_vram(MODEL, 1024, gpu=None, method="ppo")

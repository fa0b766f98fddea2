"""The VRAM estimator on GRPO runs: the rollout's KV cache and sampling as a phase of their own, the update
over the step's completions, the reference pass a KL adds, and `fits` naming GRPO's own fixes."""

import pytest

from fastft.vram import VramEstimateError, estimate_vram, fits
from fastft.vram.gpus import GiB

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
KV_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B: layers × (K, V) × KV heads × head dim × bf16


def _component(estimate, key):
    return next((c for c in estimate.components if c.key == key), None)


def _grpo(**settings):
    shape = dict(precision="nf4", gpu="h200", method="grpo", generations=8, prompts_per_step=1)
    return estimate_vram(MODEL, 256 + 512, completion_tokens=512, **(shape | settings))


def test_the_rollout_holds_a_kv_cache_of_every_row_and_the_update_trains_the_completions():
    one = _grpo()
    rollout = _component(one, "rollout")
    assert rollout.phase == "rollout" and rollout.own_bytes > 8 * 768 * KV_BYTES_PER_TOKEN
    assert one.settings.batch_tokens == 8 * 768 and one.settings.trained_tokens == 8 * 512
    doubled = _component(_grpo(generations=16), "rollout").own_bytes
    assert doubled - rollout.own_bytes >= 8 * 768 * KV_BYTES_PER_TOKEN  # eight more rows of cache
    chunked = _component(_grpo(prompts_per_step=4, generation_batch_size=1), "rollout").own_bytes
    assert chunked == rollout.own_bytes  # one prompt's group per generate call: one group's cache
    assert _component(one, "reference") is None
    assert _component(_grpo(kl_coef=0.04), "reference").own_bytes > 0
    assert _component(_grpo(num_iterations=2), "reference").own_bytes > 0  # the old policy's pass


def test_the_estimate_is_near_the_measured_grpo_step():
    """`fastft bench grpo` on an H200 (BENCHMARKS.md, "GRPO step and rollout generation"; the 2026-12-02
    runs in docs/journal.md): one GRPO step of the Llama-3.1-8B shape in NF4, G=8, 256-token prompt, 512-token completions peaked at 6.98 GiB allocated in the full run, and at
    8.18 GiB in a later fastft-only run after the decoder's noise moved out of the graph (unexplained: the
    noise buffer is 4 MiB). The estimate (7.18 GiB) lies between them: 12 % under the later one, an open
    gap, so the bound here is 15 % of it."""
    estimate = _grpo()
    assert estimate.allocated_bytes / GiB == pytest.approx(8.18, rel=0.15)


def test_a_long_rollout_peaks_in_the_rollout_and_fits_names_grpos_fixes():
    settings = dict(
        precision="nf4", method="grpo", generations=16, prompts_per_step=4, completion_tokens=2048
    )
    verdict = fits(MODEL, 256 + 2048, "rtx4090", **settings)
    assert not verdict and verdict.estimate.peak_phase == "rollout"
    described = " | ".join(fix.description for fix in verdict.fixes)
    assert "generation_batch_size=1" in described
    assert "num_generations=" in described and "max_new_tokens=" in described
    for fix in verdict.fixes:  # each fix was estimated, and fits
        changes = {**settings, **fix.changes}
        seq_len = changes.pop("seq_len", 256 + 2048)
        assert estimate_vram(MODEL, seq_len, gpu="rtx4090", **changes).fits, fix.description


def test_a_completion_as_long_as_the_sequence_is_refused_with_the_fix():
    with pytest.raises(VramEstimateError, match="pass seq_len=prompt tokens \\+ completion_tokens"):
        estimate_vram(MODEL, 512, method="grpo", completion_tokens=512)
    with pytest.raises(VramEstimateError, match="generations=0"):
        estimate_vram(MODEL, 512, method="grpo", generations=0)

"""`max_context` against long-context runs it was not tuned on (issue 24's held-out set).

`benchmarks/results/long-context/several_bf16+nf4_h100_2026-12-05_heldout.json` records, for four configurations the estimator's constants
were never fitted to, `max_context`'s answer and the answer + 5 % trained on a GPU under the cap
(`fastft.bench.long_context`), with PyTorch's default caching allocator and with expandable segments; and
the configuration it was tuned on (Llama-3.1-8B QLoRA under 24 GiB) beside them. The held-out four:

- Llama-3.2-1B bf16 under 8 GiB;
- Llama-3.2-3B NF4 under 10 GiB;
- Qwen3-4B NF4 under 8 GiB;
- Qwen3-8B NF4 under 12 GiB.

`benchmarks/results/long-context/several_bf16+nf4_h100_2026-12-06_heldout.json` is the same set re-run after two fixes, with the default
allocator only. `benchmarks/results/long-context/several_bf16+nf4_h100_2026-12-06_tiled.json` holds that re-run's failing answers recorded
step by step (`--snapshot`), then the same four at the answers after the MLP tiled from 256 MiB and the
allocator slack grew to the step's largest block, and two configurations new to the estimator:

- Qwen3-1.7B bf16 under 8 GiB;
- Qwen2.5-1.5B NF4 under 6 GiB.

`benchmarks/results/long-context/several_nf4_h100_2026-12-06_heldout-c.json` and `…heldout-d.json` hold the later runs: the held-out answers
with the adapter copies off, Qwen2.5's failures under the default allocator, and what caused them (the bench
quantised its random model where the 16-bit weights had lain on the device; fixed in
`fastft.models.random_model.build_random_model`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastft.vram import capped_gpu, max_context

GiB = 2**30
RECORD = json.loads(
    (
        Path(__file__).resolve().parents[2]
        / "benchmarks/results/long-context/several_bf16+nf4_h100_2026-12-05_heldout.json"
    ).read_text()
)


@pytest.fixture(autouse=True)
def copies_as_measured(monkeypatch):
    """Every run recorded here kept the adapters' 16-bit compute copies, as fastft then did; the answers it
    gave are reproduced with them on (`fastft.kernels.tiling.ADAPTER_COMPUTE_COPIES`, off since)."""
    from fastft.kernels import tiling

    monkeypatch.setattr(tiling, "ADAPTER_COMPUTE_COPIES", True)


# what the device machines (128 GiB of RAM) let offloading pin; "auto" would read the machine running the
# tests, and a CI machine with 23 GiB answers the 8B with 92,160 tokens (its layer inputs cannot all be pinned)
DEVICE_HOST_PIN_BYTES = 96 * GiB


def answer(config: dict, multiple_of: int = 1024) -> int:
    return max_context(
        config["model"],
        capped_gpu(int(config["cap_gib"] * GiB)),
        precision=config["precision"],
        lora_r=config["lora_r"],
        checkpointing="auto",
        multiple_of=multiple_of,
        host_memory=DEVICE_HOST_PIN_BYTES,
    )


def shortest_failure(trials: list[dict]) -> int | None:
    return min((t["length"] for t in trials if not t["trained"]), default=None)


def longest_success(trials: list[dict]) -> int:
    return max((t["length"] for t in trials if t["trained"]), default=0)


def test_the_record_holds_four_held_out_configurations_each_run_both_ways():
    configs = RECORD["heldout"]
    assert [(c["model"], c["precision"], c["cap_gib"]) for c in configs] == [
        ("meta-llama/Llama-3.2-1B-Instruct", "bf16", 8),
        ("meta-llama/Llama-3.2-3B-Instruct", "nf4", 10),
        ("Qwen/Qwen3-4B", "nf4", 8),
        ("Qwen/Qwen3-8B", "nf4", 12),
    ]
    for config in configs:
        for allocator in ("default_allocator", "expandable_segments"):
            assert [t["length"] for t in config[allocator]][0] == config["predicted"]


def test_the_tuned_on_8b_trains_at_max_contexts_answer_under_the_default_allocator():
    """Llama-3.1-8B NF4 r=32 under 24 GiB, H200, 2026-12-05: the answer (to 2,048 tokens) trained two full
    steps at 22.43 GiB allocated."""
    tuned = RECORD["tuned_on"]
    trials = tuned["default_allocator"]
    predicted = answer(tuned, multiple_of=2048)
    assert tuned["predicted"] == 159_744
    assert predicted <= longest_success(trials) == 159_744  # today's answer: the same length


AFTER_FIXES = json.loads(
    (
        Path(__file__).resolve().parents[2]
        / "benchmarks/results/long-context/several_bf16+nf4_h100_2026-12-06_heldout.json"
    ).read_text()
)


def test_the_rerun_after_the_fixes_holds_the_same_four_and_tried_their_answers_first():
    """The 2026-12-06 re-run tried the same configurations, each at that day's answer first."""
    configs = AFTER_FIXES["heldout"]
    assert [(c["model"], c["precision"], c["cap_gib"]) for c in configs] == [
        (c["model"], c["precision"], c["cap_gib"]) for c in RECORD["heldout"]
    ]
    for config in configs:
        assert config["trials"][0]["length"] == config["predicted"]


def test_the_fixes_brought_the_allocated_estimate_to_the_measured_peak():
    """Where a held-out length trained after the fixes, the allocated estimate is within 0.1 GiB (1 %) of the
    measured peak; before them it was 0.16-0.36 GiB under it."""
    trained = [t for c in AFTER_FIXES["heldout"] for t in c["trials"] if t["trained"]]
    assert len(trained) == 2
    for trial in trained:
        peak = max(step["peak_gib"] for step in trial["steps"])
        assert abs(peak - trial["estimated_gib"]) <= 0.1


TILED = json.loads(
    (
        Path(__file__).resolve().parents[2]
        / "benchmarks/results/long-context/several_bf16+nf4_h100_2026-12-06_tiled.json"
    ).read_text()
)


def test_the_rerun_s_failures_were_allocator_fragments_at_the_mlp_s_untiled_blocks():
    """The snapshots of the re-run's three failing answers (step 1 of a fresh process): each ran out asking
    for one untiled ``[N, I]`` block of the fused MLP, 0.58-0.92 GiB, while the allocated estimate left
    0.33-0.47 GiB under the cap: the free memory was there only as smaller fragments."""
    runs = TILED["snapshots_before_the_change"]["runs"]
    assert [(r["model"], r["trials"][0]["length"]) for r in runs] == [
        ("meta-llama/Llama-3.2-1B-Instruct", 50_176),
        ("meta-llama/Llama-3.2-3B-Instruct", 60_416),
        ("Qwen/Qwen3-4B", 31_744),
    ]
    for run in runs:
        trial = run["trials"][0]
        request = trial["live_at_peak"]["out_of_memory"]["request_bytes"]
        failing = [
            row["site"] for row in trial["live_at_peak"]["sites"] if row["site"].startswith("(the request")
        ]
        assert not trial["trained"] and trial["failed_step"] == 1
        assert 0.55 * GiB < request < 0.95 * GiB and len(failing) == 1
        assert "lora.py" in failing[0] or "swiglu.py" in failing[0]  # the MLP's backward or its activation
        assert run["cap_gib"] - trial["estimated_gib"] < request / GiB  # headroom smaller than the block


def test_the_held_out_four_train_at_today_s_answers_which_are_35_to_55_percent_longer():
    before = {c["model"]: c["predicted"] for c in AFTER_FIXES["heldout"]}
    configs = TILED["heldout_after_the_change"]
    assert [c["model"] for c in configs] == list(before)
    for config in configs:
        first, above = config["trials"]
        assert first["length"] == config["predicted"] == answer(config)
        assert first["trained"], config["model"]
        assert 1.35 <= config["predicted"] / before[config["model"]] <= 1.55
        assert above["length"] >= config["predicted"] * 1.05
    # where the answer + 5 % ran out, the answer is within 5 % of the longest that trains
    assert [c["trials"][1]["trained"] for c in configs] == [True, False, False, False]


def test_the_estimate_is_within_half_a_gib_of_every_measured_peak_in_the_tiled_runs():
    trained = [
        t
        for c in TILED["heldout_after_the_change"] + TILED["new_heldout"]
        for t in c["trials"]
        if t["trained"]
    ]
    assert len(trained) == 7
    for trial in trained:
        peak = max(step["peak_gib"] for step in trial["steps"])
        assert abs(peak - trial["estimated_gib"]) <= 0.45, trial["length"]


def test_the_mlp_s_lower_tiling_threshold_costs_no_speed_and_saves_memory():
    """One H100, the same call: the old threshold (1 GiB) through a shim, then today's (256 MiB)."""
    runs = {k: v["trials"][0] for k, v in TILED["tiling_ab"].items()}
    for model in ("1b", "8b"):
        old, new = runs[f"{model}_old"], runs[f"{model}_new"]
        assert new["tokens_per_s"] >= 0.99 * old["tokens_per_s"]
        assert max(s["peak_gib"] for s in new["steps"]) < max(s["peak_gib"] for s in old["steps"]) - 0.4


def test_the_8b_qlora_trains_two_full_steps_at_163840_tokens_under_24_gib():
    run = TILED["llama8b_24gib"]
    (trial,) = run["trials"]
    assert run["cap_gib"] == 24 and run["precision"] == "nf4" and run["lora_r"] == 32
    assert trial["length"] == 163_840 and trial["trained"] and len(trial["steps"]) == 2
    assert max(step["peak_gib"] for step in trial["steps"]) < 24


def test_max_context_never_promises_a_new_held_out_length_that_ran_out_of_memory(monkeypatch):
    """Qwen3-1.7B as `TILED` measured it (adapter copies on); Qwen2.5-1.5B as `FIXED_BUILD` did (copies off,
    the model quantised as loading does). Qwen2.5's earlier failures, at lengths down to 81,920, were the
    bench's model build: see `test_qwen25_s_failures_were_the_bench_quantising_where_its_16_bit_model_lay`."""
    from fastft.kernels import tiling

    qwen3 = next(c for c in TILED["new_heldout"] if c["model"] == "Qwen/Qwen3-1.7B")
    assert shortest_failure(qwen3["trials"]) is None or answer(qwen3) < shortest_failure(qwen3["trials"])
    monkeypatch.setattr(tiling, "ADAPTER_COMPUTE_COPIES", False)
    qwen25 = FIXED_BUILD["qwen25_after_build_fix"]
    assert answer(qwen25) < shortest_failure(FIXED_BUILD["qwen25_above"]["trials"])


LATER = json.loads(
    (
        Path(__file__).resolve().parents[2]
        / "benchmarks/results/long-context/several_nf4_h100_2026-12-06_heldout-c.json"
    ).read_text()
)


def test_without_the_adapter_copies_the_answers_grow_and_train(monkeypatch):
    """The compute copies off (the default since the third session of 2026-12-06), `max_context` answers longer
    for Qwen3-8B and Qwen3-4B, and those lengths trained two steps on an H100, each estimate above its peak.
    Qwen3-8B's 40,960 had run out of memory with the copies (`TILED`, its answer + 5 %)."""
    from fastft.kernels import tiling

    monkeypatch.setattr(tiling, "ADAPTER_COMPUTE_COPIES", False)
    for key, before in (("qwen3_8b", 38912), ("qwen3_4b", 43008)):
        config = LATER["answers_without_copies"][key]
        (trial,) = config["trials"]
        assert trial["length"] == answer(config) > before
        assert trial["trained"]
        assert max(step["peak_gib"] for step in trial["steps"]) < trial["estimated_gib"] < config["cap_gib"]
    eight = next(c for c in TILED["heldout_after_the_change"] if c["model"] == "Qwen/Qwen3-8B")
    assert shortest_failure(eight["trials"]) == 40960  # what the copies cost


def test_qwen25_fails_only_under_the_default_allocator_at_an_estimate_above_its_peak():
    """That record's model was quantised where its 16-bit weights had lain on the device (see below)."""
    expandable = LATER["qwen25_expandable"]
    (trial,) = expandable["trials"]
    assert trial["trained"] and trial["length"] == LATER["qwen25_answer"]["predicted"] == 105472
    assert max(step["peak_gib"] for step in trial["steps"]) < trial["estimated_gib"]
    default = [LATER[key]["trials"] for key in ("qwen25_answer", "qwen25_90112", "qwen25_81920")]
    assert all(not t["trained"] and t["failed_step"] == 1 for trials in default for t in trials)
    snapshot = LATER["qwen25_snapshot"]["trials"][0]["live_at_peak"]
    assert snapshot["out_of_memory"]["request_bytes"] < 2**28  # an MLP tile, not a whole [N, I] block
    assert snapshot["segments"]["segments"] > 200 and snapshot["segments"]["reserved_bytes"] < 6 * GiB


FIXED_BUILD = json.loads(
    (
        Path(__file__).resolve().parents[2]
        / "benchmarks/results/long-context/several_nf4_h100_2026-12-06_heldout-d.json"
    ).read_text()
)


def test_qwen25_s_failures_were_the_bench_quantising_where_its_16_bit_model_lay(monkeypatch):
    """The out-of-memory observer at Qwen2.5's failure (H100, the model built on the device in 16 bits, then
    quantised in place): 1.16 GiB of the cap free, in no piece above 0.05 GiB, for a 0.22 GiB request; the
    freest segments were 28 MiB, each a freed 16-bit projection (26.25 MiB) with a persistent tensor in its
    tail. Built as loading builds (each projection quantised from a host copy), the setup leaves almost
    nothing reserved and unallocated, the length that failed trains two steps under the default allocator
    with its estimate above its peak, and 111,616 tokens (the answer + 3.8 %) run out of memory."""
    from fastft.kernels import tiling

    before = FIXED_BUILD["qwen25_snapshot_device_built"]["trials"][0]
    at_failure = before["live_at_peak"]["segments_at_out_of_memory"]
    request = before["live_at_peak"]["out_of_memory"]["request_bytes"]
    assert not before["trained"] and before["length"] == 105_472
    assert at_failure["free_bytes"] > GiB and at_failure["largest_free_block_bytes"] < 0.06 * GiB < request
    assert all(seg["size_mib"] == 28 for seg in at_failure["most_free"][1:])
    fixed = FIXED_BUILD["qwen25_after_build_fix"]
    (trial,) = fixed["trials"]
    assert fixed["free_in_pinned_segments_after_setup_gib"] < 0.05
    assert trial["length"] == 105_472 and trial["trained"] and len(trial["steps"]) == 2
    assert max(step["peak_gib"] for step in trial["steps"]) < trial["estimated_gib"]
    (above,) = FIXED_BUILD["qwen25_above"]["trials"]
    assert above["length"] == 111_616 and not above["trained"]
    monkeypatch.setattr(tiling, "ADAPTER_COMPUTE_COPIES", False)  # today's default, as measured
    # today's answer (107,520, not run) lies between the two: within 5 % of the longest length that trains
    assert trial["length"] < answer(fixed) == fixed["predicted"] < above["length"] <= 1.05 * answer(fixed)


def test_llama32_3b_trains_at_today_s_answer_with_its_estimate_above_its_peak(monkeypatch):
    from fastft.kernels import tiling

    monkeypatch.setattr(tiling, "ADAPTER_COMPUTE_COPIES", False)
    config = FIXED_BUILD["llama32_3b_answer"]
    (trial,) = config["trials"]
    assert trial["length"] == answer(config) == 84_992 and trial["trained"] and len(trial["steps"]) == 2
    assert max(step["peak_gib"] for step in trial["steps"]) < trial["estimated_gib"] < config["cap_gib"]


def test_max_context_no_longer_promises_the_re_run_s_failed_lengths_on_the_held_out_four():
    for config in TILED["heldout_after_the_change"]:
        failed = shortest_failure(config["trials"])
        assert failed is None or answer(config) < failed


T4_STAND_IN = json.loads(
    (
        Path(__file__).resolve().parents[2]
        / "benchmarks"
        / "results"
        / "long-context"
        / "llama3.1-8b_nf4-fp16_h100_2026-12-07_t4-standin.json"
    ).read_text()
)
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


def _nf4_r32(gpu, host_memory: int = DEVICE_HOST_PIN_BYTES) -> int:
    """Llama-3.1-8B NF4 r=32's answer as today's fastft trains it (no adapter compute copies)."""
    from fastft.kernels import tiling

    tiling.ADAPTER_COMPUTE_COPIES = False  # `copies_as_measured` puts it back after the test
    return max_context(
        LLAMA_8B,
        gpu,
        precision="nf4",
        lora_r=32,
        checkpointing="auto",
        multiple_of=1024,
        host_memory=host_memory,
    )


def test_the_8b_qlora_in_fp16_under_15_gib_trains_at_the_answer_and_5_percent_above_it():
    """H100, fp16 compute, the allocator capped at 15 GiB (2026-12-07): the cap's answer (a GPU without bf16)
    trained two steps with its estimate above its peak, and so did the answer + 5 %: at this cap the answer
    is more than 5 % short. Each estimate was 0.23-0.85 GiB above the measured peak, and on top of it the
    allocator slack (one [tokens, hidden] block, 0.58-0.61 GiB) was about what the allocator did hold: 0.57
    GiB reserved above the peak at the answer + 5 %."""
    from dataclasses import replace

    config = T4_STAND_IN
    assert config["precision"] == "nf4-fp16" and config["lora_r"] == 32 and config["cap_gib"] == 15
    answer = _nf4_r32(replace(capped_gpu(int(config["cap_gib"] * GiB)), bf16=False))
    assert answer == config["predicted"]
    trials = {t["length"]: t for t in config["trials"]}
    assert trials[answer]["trained"] and config["prediction_trains"]
    assert config["above_5pct"] >= 1.05 * answer and config["above_5pct_trains"]
    for trial in trials.values():
        peak = max(step["peak_gib"] for step in trial["steps"])
        assert trial["trained"] and peak < trial["estimated_gib"] < config["cap_gib"]
    above = trials[config["above_5pct"]]
    reserved = max(step["reserved_gib"] for step in above["steps"])
    assert 0.5 < reserved - max(step["peak_gib"] for step in above["steps"]) < 0.6


def test_a_t4_s_answer_is_the_answer_for_its_allocator_room_and_depends_on_the_host_memory_to_pin():
    """Why `max_context(..., "t4")` (65,536 where BENCHMARKS first quoted it) sat 17 % under a length the 15 GiB
    stand-in trained: a T4 leaves the allocator 14.24 GiB, not 15, and the answer was asked on a machine with
    16 GiB to pin, where offloading cannot hold every layer's input and some layers recompute instead. On the
    device's host the answer is longer; a cap at the card's allocator room answers the same as the card."""
    from dataclasses import replace

    from fastft.vram import GPUS

    t4 = GPUS["t4"]
    on_the_device_host = _nf4_r32("t4")
    assert on_the_device_host == _nf4_r32(replace(capped_gpu(t4.usable_bytes), bf16=False))
    assert on_the_device_host < T4_STAND_IN["predicted"] and t4.usable_bytes < T4_STAND_IN["cap_gib"] * GiB
    assert _nf4_r32("t4", host_memory=16 * GiB) < on_the_device_host

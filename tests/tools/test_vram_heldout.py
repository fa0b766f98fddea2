"""`max_context` against long-context runs it was not tuned on (issue 24's held-out set).

`benchmarks/long_context_heldout_2026-12-05.json` records, for four configurations the estimator's constants
were never fitted to, `max_context`'s answer and the answer + 5 % trained on a GPU under the cap
(`fastft.bench.long_context`), with PyTorch's default caching allocator and with expandable segments; and
the configuration it was tuned on (Llama-3.1-8B QLoRA under 24 GiB) beside them. The held-out four:

- Llama-3.2-1B bf16 under 8 GiB;
- Llama-3.2-3B NF4 under 10 GiB;
- Qwen3-4B NF4 under 8 GiB;
- Qwen3-8B NF4 under 12 GiB.

`benchmarks/long_context_heldout_2026-12-06.json` is the same set re-run after two fixes, with the default
allocator only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastft.vram import capped_gpu, max_context

GiB = 2**30
RECORD = json.loads(
    (Path(__file__).resolve().parents[2] / "benchmarks" / "long_context_heldout_2026-12-05.json").read_text()
)


def answer(config: dict, multiple_of: int = 1024) -> int:
    return max_context(
        config["model"],
        capped_gpu(int(config["cap_gib"] * GiB)),
        precision=config["precision"],
        lora_r=config["lora_r"],
        checkpointing="auto",
        multiple_of=multiple_of,
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
    assert predicted == tuned["predicted"] == 159_744
    assert predicted <= longest_success(trials)


AFTER_FIXES = json.loads(
    (Path(__file__).resolve().parents[2] / "benchmarks" / "long_context_heldout_2026-12-06.json").read_text()
)


def test_the_rerun_after_the_fixes_holds_the_same_four_and_answers():
    """The 2026-12-06 re-run tried the same configurations, and `max_context` still gives the answers it tried."""
    configs = AFTER_FIXES["heldout"]
    assert [(c["model"], c["precision"], c["cap_gib"]) for c in configs] == [
        (c["model"], c["precision"], c["cap_gib"]) for c in RECORD["heldout"]
    ]
    for config in configs:
        assert config["trials"][0]["length"] == config["predicted"] == answer(config)


def test_the_fixes_brought_the_allocated_estimate_to_the_measured_peak():
    """Where a held-out length trained after the fixes, the allocated estimate is within 0.1 GiB (1 %) of the
    measured peak; before them it was 0.16-0.36 GiB under it."""
    trained = [t for c in AFTER_FIXES["heldout"] for t in c["trials"] if t["trained"]]
    assert len(trained) == 2
    for trial in trained:
        peak = max(step["peak_gib"] for step in trial["steps"])
        assert abs(peak - trial["estimated_gib"]) <= 0.1


@pytest.mark.xfail(
    strict=True,
    reason="issue 24, open: re-run on an H100 on 2026-12-06 after both fixes (the embeddings' output dropped, "
    "AdamW's moments made at setup), three of the four held-out answers still ran out of memory, all in step 1 "
    "of the first length each process tried: Llama-3.2-1B (50,176 under 8 GiB), Llama-3.2-3B (60,416 under "
    "10 GiB) and Qwen3-4B (31,744 under 8 GiB, while 33,792 then trained at 7.90 GiB). Qwen3-8B's answer "
    "trained (11.55 GiB allocated, estimate 11.52) and its +5 % did not. No step-2 failure remains, and where a "
    "length trained the allocated estimate is within 0.08 GiB: what is missing is step 1's memory beyond "
    "the allocated estimate in a fresh process (one-time costs: autotuning, cuDNN plans, workspaces; "
    "fragmentation under the default allocator; below 32,768 tokens the ungrouped attention backward). "
    "No snapshot was taken: the next device call records one "
    "(`--snapshot`) at each failing answer.",
)
def test_max_context_never_promises_a_held_out_length_that_ran_out_of_memory():
    over = {}
    for config in AFTER_FIXES["heldout"]:
        failed = shortest_failure(config["trials"])
        predicted = answer(config)
        if failed is not None and predicted >= failed:
            over[config["model"]] = (predicted, failed)
    assert not over, over

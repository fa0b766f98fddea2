"""`max_context` against long-context runs it was not tuned on (issue 24's held-out set).

`benchmarks/long_context_heldout_2026-12-05.json` records, for four configurations the estimator's constants
were never fitted to, `max_context`'s answer and the answer + 5 % trained on a GPU under the cap
(`fastft.bench.long_context`), with PyTorch's default caching allocator and with expandable segments; and
the configuration it was tuned on (Llama-3.1-8B QLoRA under 24 GiB) beside them. The held-out four:

- Llama-3.2-1B bf16 under 8 GiB;
- Llama-3.2-3B NF4 under 10 GiB;
- Qwen3-4B NF4 under 8 GiB;
- Qwen3-8B NF4 under 12 GiB.
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


@pytest.mark.xfail(
    strict=True,
    reason="issue 24, open: under PyTorch's default allocator every held-out answer ran out of memory "
    "(Llama-3.2-1B and 3B in step 1, Qwen3-4B and 8B in step 2 with the allocator's reserved memory at "
    "the cap, 0.65-0.91 GiB above what was allocated). With expandable segments all four trained and each "
    "+5 % did not, but then the tuned-on 8B ran out of memory at its answer. The measured peaks stood one "
    "[tokens, hidden] 16-bit tensor above the estimate: the embeddings' output, which fastft held needlessly "
    "until `drop_input_gradients`. The step-2 failures had the cap reserved but not allocated: AdamW's moments, "
    "made in step 1 out of the activations' freed segments, until `fastft.training.optimizer` made them at "
    "setup. The record predates both fixes. Re-run the set, record it, and drop the mark.",
)
def test_max_context_never_promises_a_held_out_length_that_ran_out_of_memory():
    over = {}
    for config in RECORD["heldout"]:
        failed = shortest_failure(config["default_allocator"])
        predicted = answer(config)
        if failed is not None and predicted >= failed:
            over[config["model"]] = (predicted, failed)
    assert not over, over

"""`fastft bench grpo` on the CPU (a tiny preset, short prompts): the path the H200 run takes, end to end."""

import json

from fastft.bench import BENCHMARKS
from fastft.bench.grpo import main, summarise


def test_grpo_bench_measures_fastft_and_plain_generate_on_the_same_batch(tmp_path):
    out = tmp_path / "grpo.json"
    code = main(
        [
            "--model", "tiny-llama", "--device", "cpu", "--workload", "bf16", "--systems", "fastft,generate",
            "--prompt-tokens", "12", "--completion-tokens", "6", "--generations", "4", "--prompts", "2",
            "--folder", str(tmp_path / "checkpoints"), "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0 and BENCHMARKS["grpo"] == "fastft.bench.grpo"
    record = json.loads(out.read_text())
    results = {r["system"]: r for r in record["results"]}
    assert not any("error" in r for r in results.values()), results
    assert 0 < results["fastft"]["generated_tokens"] <= 2 * 4 * 6
    assert results["generate"]["generated_tokens"] == 2 * 4 * 6  # plain generate pads to the longest
    assert results["fastft"]["step_s"] > 0 and results["fastft"]["loss"] == results["fastft"]["loss"]
    speed = record["summary"]["generation_speed_vs_generate"]
    fastft, plain = (
        results["fastft"]["generation_tokens_per_s"],
        results["generate"]["generation_tokens_per_s"],
    )
    assert speed == fastft / plain
    assert record["summary"]["peak_memory_vs_trl"] is None  # no TRL run, no CUDA peak
    assert "generation vs plain generate" in out.with_suffix(".md").read_text()


def test_the_summary_reads_the_two_bars_from_the_systems_results():
    results = [
        {"system": "fastft", "peak_gib": 12.0, "generation_tokens_per_s": 900.0},
        {"system": "trl", "peak_gib": 30.0},
        {"system": "generate", "generation_tokens_per_s": 300.0},
    ]
    assert summarise(results) == {"peak_memory_vs_trl": 0.4, "generation_speed_vs_generate": 3.0}
    assert (
        summarise([*results[:2], {"system": "generate", "error": "timed out"}])[
            "generation_speed_vs_generate"
        ]
        is None
    )

"""`fastft demo --method dpo`: DPO on pairs made from the bundled skills data, measured before and after."""

from __future__ import annotations

import json

from fastft.cli import main
from fastft.demo import DemoConfig, run_demo, skills_pairs

SEEDS = (3407, 1, 2)


def test_skills_pairs_choose_the_bare_right_answer_over_a_wordy_or_wrong_one():
    from fastft.data.loading import load_dataset

    rows = list(load_dataset("bundled:skills-eval"))[:20]
    pairs = skills_pairs(rows, seed=0)
    assert len(pairs) == 20
    for index, (row, pair) in enumerate(zip(rows, pairs, strict=True)):
        assert pair["prompt"] == row["messages"][:-1] and pair["prompt"][-1]["role"] == "user"
        chosen, rejected = pair["chosen"][0]["content"], pair["rejected"][0]["content"]
        assert chosen == row["answer"] and rejected != chosen
        if index % 2 == 0:
            assert row["answer"] in rejected and len(rejected) > len(chosen)  # wordy
    assert (
        sum(row["answer"] not in p["rejected"][0]["content"] for row, p in zip(rows, pairs, strict=True)) > 5
    )


def test_dpo_demo_raises_pair_accuracy_and_exact_answers_beyond_seed_noise(tmp_path):
    """Three seeds of the default DPO demo (40 steps, 400 pairs, 64 held-out questions). The starting point is
    the preset itself (LoRA B = 0), the same for every seed. Measured (Dec 2026, seeds 3407, 1, 2):
    chosen-over-rejected 48.4 % → 100 / 98.4 / 100 % (gain ≥ 50 points, seed spread 1.6) and exact answers
    0 % → 31.3 / 23.4 / 25.0 % (gain ≥ 23.4 points, spread 7.8); the test asks that the smallest gain exceed
    the spread (and 5 points). Content accuracy (right answer, any wording) does not rise: 31.3 % → 31.3 /
    23.4 / 25.0 %, the pairs reward the format. Alone on the CPU the three runs take about 20 s."""
    results = []
    for seed in SEEDS:
        config = DemoConfig(
            method="dpo",
            seed=seed,
            eval_samples=64,
            output_dir=str(tmp_path),
            name=f"s{seed}",
            progress=False,
        )
        results.append(run_demo(config, log=lambda message: None).summary)
    for before_key, after_key in (
        ("chosen_over_rejected_before", "chosen_over_rejected_after"),
        ("accuracy_before", "accuracy_after"),
    ):
        starts = {s[before_key] for s in results}
        assert len(starts) == 1  # the untrained preset: no seed changes it
        after = [s[after_key] for s in results]
        noise = max(after) - min(after)
        assert min(after) - starts.pop() > max(noise, 0.05), (before_key, after)
    saved = json.loads((tmp_path / f"s{SEEDS[0]}" / "summary.json").read_text())
    assert saved["method"] == "dpo" and saved["steps"] == 40 and saved["final_eval"]["accuracy"] > 0.9
    assert (tmp_path / f"s{SEEDS[0]}" / "adapter" / "adapter_config.json").exists()


def test_demo_cli_takes_the_method(tmp_path, capsys):
    code = main(
        ["demo", "--method", "dpo", "--dpo-steps", "3", "--eval-samples", "4", "--output-dir", str(tmp_path)]
        + ["--name", "cli", "--no-progress"]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "chosen over rejected" in out and "3 steps" in out

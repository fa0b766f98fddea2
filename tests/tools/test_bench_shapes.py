"""`fastft bench sft`'s data shapes (`fastft.bench.chat_shapes`) and the bench over several shapes."""

import json

import numpy as np
import pytest

from fastft.bench.chat_shapes import SHAPES, parse_shapes, row_stats, shape_rows, shape_texts, shape_tokenizer


def _same(rows, again) -> bool:
    return len(rows) == len(again) and all(
        np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(rows, again, strict=True)
    )


# (shape, rows, median bounds, p90 bounds), tokens of the tiny-llama3 tokenizer: the shapes' stated lengths
BOUNDS = [
    ("short", 600, (750, 950), (1450, 1850)),  # today's chats: rows of median about 850 tokens
    ("multi-turn", 600, (500, 640), (1250, 1700)),  # issue 57's: median 500+, p90 about 1,500
    ("documents", 60, (2700, 3300), (3400, 4096)),  # 2,048 to 4,000 tokens
]


@pytest.mark.parametrize(("name", "count", "median", "p90"), BOUNDS)
def test_each_shape_is_seeded_and_meets_its_length_stats(name, count, median, p90):
    few = max(2, count // 6)
    assert _same(shape_rows(name, few, 4096, seed=0), shape_rows(name, few, 4096, seed=0))
    assert not _same(shape_rows(name, few, 4096, seed=0), shape_rows(name, few, 4096, seed=1))
    rows = shape_rows(name, count, 4096, seed=0)
    stats = row_stats(rows, 4096)
    assert stats["rows"] == len(rows) >= 0.98 * count  # a chat cut before its first answer is left out
    assert median[0] <= stats["row_tokens_median"] <= median[1]
    assert p90[0] <= stats["row_tokens_p90"] <= p90[1]
    lengths = [len(ids) for ids, _ in rows]
    assert max(lengths) <= 4096
    if name == "documents":
        assert min(lengths) >= 2000 and stats["segments_per_pack"] == 1.0 and stats["trained_share"] > 0.99
    else:
        assert 2 < stats["segments_per_pack"] < 12 and stats["tokens_per_pack"] > 0.95 * 4096


@pytest.mark.parametrize("name", ["short", "multi-turn"])
def test_chat_shapes_are_real_text_in_llama3_s_template_trained_on_the_answers_only(name):
    tokenizer = shape_tokenizer()
    chats = shape_texts(SHAPES[name], 12, 3, tokenizer)
    rows = shape_rows(name, 12, 4096, seed=3)
    assert len(rows) == len(chats)
    turns = []
    for chat, (ids, labels) in zip(chats, rows, strict=True):
        trained = labels != -100
        assert np.array_equal(labels[trained], ids[trained])
        text = tokenizer.decode(ids)
        assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
        answers = [m["content"] for m in chat["messages"] if m["role"] == "assistant"]
        turns.append(len(answers))
        assert all(len(m["content"].split()) >= 1 for m in chat["messages"])
        # each run of trained tokens is one answer and its end of turn, nothing of the prompts or headers
        edges = np.flatnonzero(np.diff(trained.astype(int))) + 1
        runs = [
            tokenizer.decode(part)
            for part, kept in zip(np.split(ids, edges), np.split(trained, edges), strict=True)
            if kept[0]
        ]
        expected = [answer + "<|eot_id|>" for answer in answers][: len(runs)]
        if len(ids) == 4096:  # a chat cut at the pack length: its last trained run is cut too
            assert expected[-1].startswith(runs[-1])
            runs, expected = runs[:-1], expected[:-1]
        assert runs == expected
    assert set(turns) <= {1, 2, 3} and len(set(turns)) > 1


def test_documents_train_every_token_after_the_first():
    (ids, labels), *_ = shape_rows("documents", 2, 4096, seed=0)
    tokenizer = shape_tokenizer()
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert labels[0] == -100 and np.array_equal(labels[1:], ids[1:])


def test_row_stats_counts_tokens_and_segments_per_best_fit_pack():
    rows = [(np.arange(n), np.full(n, -100)) for n in (3000, 1000, 96, 2000, 2000)]
    rows[0][1][:30] = 1  # 30 trained tokens
    stats = row_stats(rows, 4096)
    # best fit, longest first: [3000, 1000, 96] and [2000, 2000] (or the 96 beside the two 2000s)
    assert stats["packs"] == 2 and stats["segments_per_pack"] == 2.5
    assert stats["tokens_per_pack"] == 8096 / 2 and stats["row_tokens_median"] == 2000
    assert stats["trained_share"] == 30 / 8096


def test_parse_shapes_names_the_choices():
    assert parse_shapes("short, documents") == ["short", "documents"]
    with pytest.raises(ValueError, match="short, multi-turn, documents"):
        parse_shapes("short,long")


def test_the_ratio_table_gives_fastft_over_each_baseline_per_shape_and_the_range():
    from fastft.bench.sft_report import ratio_table, ratios, results_table

    def run(system, shape, tokens_per_s):
        return dict(system=system, shape=shape, workload="bf16", tokens_per_s=tokens_per_s)

    results = [
        run("fastft", "short", 12000.0),
        run("fastft", "documents", 9000.0),
        run("unsloth", "short", 6000.0),
        run("unsloth", "documents", 6000.0),
        run("unsloth-defaults", "short", 8000.0),
        dict(run("unsloth-defaults", "documents", 0.0), error="timed out after 300 s"),
    ]
    by_baseline = {r["baseline"]: r for r in ratios(results)}
    assert set(by_baseline) == {"unsloth", "unsloth-defaults"}
    assert by_baseline["unsloth"]["per_shape"] == {"short": 2.0, "documents": 1.5}
    assert (by_baseline["unsloth"]["low"], by_baseline["unsloth"]["high"]) == (1.5, 2.0)
    assert by_baseline["unsloth-defaults"]["per_shape"] == {"short": 1.5}  # the failed run gives no ratio
    table = ratio_table(list(by_baseline.values()), ["short", "documents"])
    assert "| bf16 | fastft | Unsloth (matched) | 2.00x | 1.50x | 1.50x–2.00x |" in table
    assert "| bf16 | fastft | Unsloth (own defaults) | 1.50x | – | 1.50x |" in table
    assert "vs Unsloth (own defaults)" in results_table(results) and "timed out" in results_table(results)


def test_sft_bench_runs_every_shape_into_one_record(tmp_path):
    """The CLI end to end on the CPU: one fastft process runs each shape in turn, and the record holds each
    shape's row and packing stats beside its result."""
    from fastft.bench import sft

    out = tmp_path / "sft.json"
    code = sft.main(
        [
            "--model", "tiny-llama3", "--systems", "fastft", "--workloads", "bf16", "--device", "cpu",
            "--shapes", "short,multi-turn,documents", "--chats", "12", "--documents", "2", "--user-median", "20",
            "--assistant-median", "30", "--max-seq-length", "192", "--warmup", "0", "--steps", "1",
            "--folder", str(tmp_path / "checkpoints"), "--scratch", str(tmp_path / "scratch"), "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    record = json.loads(out.read_text())
    assert record["settings"]["shapes"] == "short,multi-turn,documents"
    assert list(record["shapes"]) == ["short", "multi-turn", "documents"]
    for stats in record["shapes"].values():
        assert stats["row_tokens_median"] <= 192 and stats["segments_per_pack"] >= 1 and stats["description"]
    results = record["results"]
    assert [(r["system"], r["shape"]) for r in results] == [
        ("fastft", shape) for shape in ("short", "multi-turn", "documents")
    ]
    assert not any("error" in r for r in results) and all(r["tokens_per_s"] > 0 for r in results)


def test_sft_bench_refuses_a_model_whose_vocabulary_the_shapes_overflow(tmp_path):
    from fastft.bench import sft

    with pytest.raises(SystemExit, match="tiny-llama3"):
        sft.main(
            [
                "--model", "tiny-llama", "--systems", "fastft", "--device", "cpu", "--chats", "4", "--shape", "multi-turn",
                "--max-seq-length", "128", "--folder", str(tmp_path / "checkpoints"),
                "--scratch", str(tmp_path / "scratch"), "--out", str(tmp_path / "sft.json"),
            ]
        )  # fmt: skip


def test_own_defaults_leave_the_optimizer_and_checkpointing_to_the_library():
    """`unsloth-defaults` and `hf-defaults` give TRL's `SFTConfig` only the workload; their matched twins
    pin fastft's optimizer and the checkpointing switch (Unsloth's own checkpointing: TRL's off)."""
    import argparse

    from trl import SFTConfig

    from fastft.bench.sft import TRL_OPTIMIZER, _trl_settings

    args = argparse.Namespace(
        scratch="/tmp/x", warmup=1, steps=2, max_seq_length=4096, trl_gradient_checkpointing="on"
    )
    matched = {system: _trl_settings(system, args, cuda=True) for system in ("unsloth", "hf", "fastft-trl")}
    assert all(settings["optim"] == TRL_OPTIMIZER for settings in matched.values())
    assert not matched["unsloth"]["gradient_checkpointing"] and matched["hf"]["gradient_checkpointing"]
    for system in ("unsloth-defaults", "hf-defaults"):
        own = _trl_settings(system, args, cuda=True)
        assert not {"optim", "gradient_checkpointing", "gradient_checkpointing_kwargs"} & set(own)
        # the workload is the same: one pack of the pack length a micro-batch
        assert {k: v for k, v in matched["hf"].items() if k in own} == own
        assert own["packing"] and own["per_device_train_batch_size"] == 1 and own["max_length"] == 4096
    default = SFTConfig(output_dir="/tmp/x", use_cpu=True, bf16=False)
    assert default.gradient_checkpointing  # what hf-defaults gets from TRL


def test_the_loss_table_compares_fp16_and_fp8_runs_with_the_16_bit_run_on_the_same_shape():
    from fastft.bench.sft_report import loss_table

    def run(workload, shape, losses, system="fastft"):
        return dict(system=system, shape=shape, workload=workload, tokens_per_s=1.0, losses=losses)

    results = [
        run("bf16", "short", [10.0, 9.0, 8.0]),
        run("fp16", "short", [10.0, 9.09, 8.0]),
        run("fp8", "short", [10.02, 9.0, 7.96]),
        run("fp8", "documents", [10.0, 9.0]),  # no bf16 run on this shape: not compared
        run("nf4-fp16", "short", [10.0]),  # no nf4 run: not compared
        run("bf16", "short", [11.0, 9.0, 8.0], system="unsloth"),  # another system: not a reference
    ]
    table = loss_table(results)
    assert "| fp16 | short | fastft | bf16 | 3 | 10.0000 / 10.0000 | 8.0000 / 8.0000 | 1.00 % |" in table
    assert "| fp8 | short | fastft | bf16 | 3 | 10.0200 / 10.0000 | 7.9600 / 8.0000 | 0.50 % |" in table
    assert "documents" not in table and "nf4-fp16" not in table and "unsloth" not in table
    assert loss_table([run("bf16", "short", [1.0])]) is None

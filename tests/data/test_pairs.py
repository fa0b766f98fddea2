"""Preference rows: detected by load_dataset, malformed ones named, packed pair by pair with answer-only labels."""

import json
import warnings

import pytest

import fastft
from fastft.data.errors import MalformedRowError
from fastft.data.loading import dataset_kind
from fastft.data.pairs import pack_pairs

ULTRAFEEDBACK_STYLE = {
    "prompt": "Name a primary colour.",
    "chosen": [
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Blue."},
    ],
    "rejected": [
        {"role": "user", "content": "Name a primary colour."},
        {"role": "assistant", "content": "Green, I believe."},
    ],
    "messages": [{"role": "user", "content": "Name a primary colour."}],  # such sets carry one too
    "score_chosen": 8.0,
}


@pytest.fixture(scope="module")
def tokenizer():
    return fastft.load_model("tiny-llama")[1]


def test_load_dataset_detects_pairs_of_strings_of_chats_and_without_a_prompt():
    rows = [
        ULTRAFEEDBACK_STYLE,
        {"prompt": "2 + 2?", "chosen": "4", "rejected": "5", "score_chosen": 1.0},
        {  # no prompt: the shared leading messages are the prompt
            "chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
            "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away."}],
            "score_chosen": 2.0,
        },
    ]
    data = fastft.load_dataset(rows)
    assert dataset_kind(data) == "pairs"
    first, second, third = (row["pair"] for row in data)
    assert first == {
        "prompt": [{"role": "user", "content": "Name a primary colour."}],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "Green, I believe."}],
    }
    assert second["prompt"] == [{"role": "user", "content": "2 + 2?"}]
    assert second["rejected"] == [{"role": "assistant", "content": "5"}]
    assert third["prompt"] == [{"role": "user", "content": "Hi"}]
    assert third["chosen"] == [{"role": "assistant", "content": "Hello!"}]
    assert data["score_chosen"] == [8.0, 1.0, 2.0]  # extra columns are kept


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"prompt": "q", "chosen": "a", "rejected": 3}, "'rejected' is a number"),
        ({"prompt": "q", "chosen": "", "rejected": "b"}, "'chosen' is an empty string"),
        ({"prompt": "q", "chosen": "a"}, "no 'rejected' field"),
        (
            {
                "chosen": [{"role": "assistant", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "b"}],
            },
            "share no leading messages",
        ),
        (
            {"prompt": [{"role": "assistant", "content": "q"}], "chosen": "a", "rejected": "b"},
            "must end with a user",
        ),
    ],
)
def test_a_malformed_pair_names_its_file_and_line(tmp_path, row, reason):
    path = tmp_path / "pairs.jsonl"
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path.write_text("\n".join(json.dumps(r) for r in (good, good, row)) + "\n")
    with pytest.raises(MalformedRowError, match=reason) as caught:
        fastft.load_dataset(str(path))
    assert caught.value.line == 3 and "pairs.jsonl" in str(caught.value)


def test_pairs_pack_whole_chosen_first_with_only_the_answers_trained(tokenizer):
    rows = [
        {
            "prompt": [
                {"role": "user", "content": "Say one."},
                {"role": "assistant", "content": "one"},  # an earlier turn of the prompt: never trained
                {"role": "user", "content": "Say two."},
            ],
            "chosen": "two",
            "rejected": "three",
        },
        {"prompt": "2 + 2?", "chosen": "4", "rejected": "The answer is 5."},
        {"prompt": "Capital of France?", "chosen": "Paris", "rejected": "Lyon"},
    ]
    pairs = pack_pairs(fastft.load_dataset(rows), tokenizer, 96)
    assert pairs.pairs == 3 and pairs.pair_stats.cut_prompt == 0
    for members in pairs.bins:
        assert len(members) % 2 == 0
        assert all(
            members[i] % 2 == 0 and members[i + 1] == members[i] + 1 for i in range(0, len(members), 2)
        )
        assert sum(pairs.data.lengths[members]) <= 96
    answers = []
    for ids, labels in zip(pairs.data.input_ids, pairs.data.labels, strict=True):
        trained = [int(t) for t in labels if t != -100]
        answers.append(tokenizer.decode(trained).strip())
        assert list(ids[-len(trained) :]) == trained  # the answer is the end of the sequence
    assert [a.split("<")[0] for a in answers] == ["two", "three", "4", "The answer is 5.", "Paris", "Lyon"]
    batch = pairs.batch(range(len(pairs)))
    assert batch.num_sequences == 6


def test_an_overlong_pair_is_cut_prompt_first_and_counted(tokenizer):
    long_prompt = " ".join(["word"] * 60)
    rows = [{"prompt": long_prompt, "chosen": "yes indeed", "rejected": "no"}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pairs = pack_pairs(rows, tokenizer, 48)
    stats = pairs.pair_stats
    assert stats.cut_prompt == 1 and stats.cut_answer == 0 and stats.cut_tokens > 0
    assert sum(pairs.data.lengths) <= 48
    assert any("prompts cut from the left" in str(w.message) for w in caught)
    chosen_labels = [int(t) for t in pairs.data.labels[0] if t != -100]
    assert tokenizer.decode(chosen_labels).startswith("yes indeed")  # the answers stay whole


def test_sft_packing_refuses_pairs_and_names_the_way(tokenizer):
    with pytest.raises(ValueError, match="method='dpo'"):
        fastft.pack(fastft.load_dataset([{"prompt": "q", "chosen": "a", "rejected": "b"}]), tokenizer, 64)
    with pytest.raises(ValueError, match="pack_pairs"):
        fastft.pack([{"prompt": "q", "chosen": "a", "rejected": "b"}], tokenizer, 64)


def test_pairs_whose_chosen_equals_rejected_are_left_out_and_named(tokenizer):
    """Issue 53: such a pair gives DPO no signal; it packed silently. Now it is left out and the warning
    counts and names the rows; a set of nothing else is refused."""
    rows = [
        {"prompt": "2 + 2?", "chosen": "4", "rejected": "5"},
        {"prompt": "3 + 3?", "chosen": "6", "rejected": "6"},
        {"prompt": "Capital of France?", "chosen": "Paris", "rejected": "Lyon"},
        {"prompt": "1 + 1?", "chosen": "2", "rejected": "2"},
    ]
    with pytest.warns(
        UserWarning, match=r"2 of 4 pairs have a chosen answer equal.*rows 1, 3, counting from 0"
    ):
        pairs = pack_pairs(rows, tokenizer, 96)
    assert pairs.pairs == 2 and pairs.pair_stats.identical_rows == (1, 3)
    assert sorted(set(pairs.data.source_rows)) == [0, 2]
    with pytest.raises(
        ValueError, match=r"No trainable pairs.*row 0, counting from 0.*differs from its chosen"
    ):
        pack_pairs(rows[1:2], tokenizer, 96)

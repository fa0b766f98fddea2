"""Tokenisation: response-only labels from the chat template, text rows, overlong and skipped rows, errors."""

from __future__ import annotations

import numpy as np
import pytest

from fastft.data.tokenize import (
    IGNORE_INDEX,
    ChatTemplateError,
    TokenizedData,
    render_chat,
    tokenize_rows,
)
from fastft.models.presets import CHATML_TEMPLATE, load_preset_tokenizer

EOT = "<|im_end|>"

# A template that renders every assistant turn but the last with its content dropped.
DROP_EARLIER_ANSWERS = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\n<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3-like: the last assistant turn gets an (empty) reasoning block, earlier ones are rendered
# without it, so an earlier turn renders differently once later turns follow it.
REASONING_ON_LAST_ONLY = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture()
def tokenizer():
    return load_preset_tokenizer()


def chat(*pairs: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in pairs]}


MULTI_TURN = chat(
    ("system", "Answer briefly."),
    ("user", "Say hi"),
    ("assistant", "Hello! 42"),
    ("user", "Again, with 7 apples?"),
    ("assistant", "Yes, again: 7 apples."),
)


def labelled_runs(tokenizer, ids: np.ndarray, labels: np.ndarray) -> list[str]:
    """The decoded text of each maximal run of consecutive labelled tokens."""
    runs, current = [], []
    for token, label in zip(ids.tolist(), labels.tolist(), strict=True):
        if label != IGNORE_INDEX:
            assert label == token  # labels are unshifted: a labelled token's label is its own id
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def total_accounted(stats) -> int:
    return stats.kept + stats.dropped_overlong + stats.skipped_empty + stats.skipped_no_labels


# --- response-only labels ---------------------------------------------------------------------------


def test_response_only_labels_are_each_assistant_answer_with_its_end_of_turn(tokenizer):
    data = tokenize_rows([MULTI_TURN], tokenizer, max_seq_length=512)
    assert len(data) == 1 and data.source_rows == [0]
    ids, labels = data.input_ids[0], data.labels[0]
    assert ids.dtype == np.int32 and labels.dtype == np.int32 and ids.shape == labels.shape
    # The ids are exactly the templated conversation.
    assert tokenizer.decode(ids.tolist()) == tokenizer.apply_chat_template(
        MULTI_TURN["messages"], tokenize=False
    )
    assert labelled_runs(tokenizer, ids, labels) == [
        f"Hello! 42{EOT}\n",
        f"Yes, again: 7 apples.{EOT}\n",
    ]
    assert labels[0] == IGNORE_INDEX
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    # Five turns, five end-of-turn tokens; only the two assistant ones are labelled.
    assert int((ids == eot_id).sum()) == 5
    assert int((labels == eot_id).sum()) == 2


def test_response_labels_survive_multibyte_and_whitespace_contents(tokenizer):
    answer = "  ünïcödé ✓ 🙂\n\nsecond line\t"
    row = chat(("user", "Décris ça — s'il te plaît 🙂"), ("assistant", answer))
    data = tokenize_rows([row], tokenizer, max_seq_length=512)
    assert labelled_runs(tokenizer, data.input_ids[0], data.labels[0]) == [answer + EOT + "\n"]


def test_train_on_all_labels_every_token_except_the_first(tokenizer):
    data = tokenize_rows([MULTI_TURN], tokenizer, max_seq_length=512, train_on="all")
    ids, labels = data.input_ids[0], data.labels[0]
    assert labels[0] == IGNORE_INDEX
    np.testing.assert_array_equal(labels[1:], ids[1:])
    responses = tokenize_rows([MULTI_TURN], tokenizer, max_seq_length=512)
    np.testing.assert_array_equal(responses.input_ids[0], ids)  # same tokens, only the labels differ


def test_train_on_all_keeps_a_chat_without_an_assistant_turn(tokenizer):
    row = chat(("system", "Be kind."), ("user", "Hello there"))
    assert len(tokenize_rows([row], tokenizer, 64)) == 0
    data = tokenize_rows([row], tokenizer, 64, train_on="all")
    assert len(data) == 1 and int((data.labels[0] != IGNORE_INDEX).sum()) == len(data.input_ids[0]) - 1


def test_text_rows_are_labelled_whole_with_an_eos_appended(tokenizer):
    texts = ["The quick brown fox jumps over 13 lazy dogs.", "x"]
    for train_on in ("responses", "all"):
        data = tokenize_rows([{"text": t} for t in texts], tokenizer, 512, train_on=train_on)
        assert data.source_rows == [0, 1]
        for text, ids, labels in zip(texts, data.input_ids, data.labels, strict=True):
            assert tokenizer.decode(ids.tolist()) == text + EOT
            assert ids[-1] == tokenizer.eos_token_id
            assert labels[0] == IGNORE_INDEX
            np.testing.assert_array_equal(labels[1:], ids[1:])
    # A one-character text is 2 tokens (char + eos): the eos is its only label.
    assert len(data.input_ids[1]) == 2 and data.labels[1].tolist() == [IGNORE_INDEX, tokenizer.eos_token_id]


def test_text_rows_need_no_chat_template(tokenizer):
    tokenizer.chat_template = None
    data = tokenize_rows([{"text": "plain text"}], tokenizer, 64)
    assert len(data) == 1


# --- overlong, empty and unlabelled rows ------------------------------------------------------------


def long_chat(prompt_words: int, answer_words: int) -> dict:
    return chat(
        ("user", " ".join(["apple"] * prompt_words)),
        ("assistant", " ".join(["mango"] * answer_words)),
    )


def test_overlong_truncate_cuts_to_max_seq_length_and_counts(tokenizer):
    max_len = 37
    rows = [
        long_chat(3, 100),  # 0: answer starts inside the cut, runs past it → truncated, kept
        long_chat(3, 2),  # 1: fits → kept whole
        {"text": "lemon " * 80},  # 2: long text → truncated, kept
        long_chat(100, 2),  # 3: the answer lies beyond the cut → no labels left, skipped
    ]
    full = tokenize_rows(rows, tokenizer, 10_000)
    data = tokenize_rows(rows, tokenizer, max_len, overlong="truncate")
    assert data.source_rows == [0, 1, 2]
    assert [len(ids) for ids in data.input_ids] == [max_len, len(full.input_ids[1]), max_len]
    for cut, whole in zip(data.input_ids, full.input_ids[:3], strict=True):
        np.testing.assert_array_equal(cut, whole[: len(cut)])  # a prefix, not re-tokenised
    np.testing.assert_array_equal(data.labels[0], full.labels[0][:max_len])
    s = data.stats
    assert (s.rows, s.kept, s.dropped_overlong, s.skipped_empty, s.skipped_no_labels) == (4, 3, 0, 0, 1)
    # Every row that was cut is counted, including the one later skipped for having no labels left.
    assert s.truncated == 3
    assert total_accounted(s) == s.rows
    assert data.lengths.dtype == np.int64 and data.lengths.tolist() == [len(i) for i in data.input_ids]


def test_overlong_rows_keep_their_answer_by_default_the_prompt_cut_from_the_left(tokenizer):
    """Issue 26: right truncation cut the answer off a long prompt and the row was skipped "without labels".
    By default the prompt loses its start instead; where the prompt is too short for that, the end goes."""
    max_len = 37
    rows = [long_chat(100, 2), long_chat(3, 100), long_chat(3, 2), {"text": "lemon " * 80}]
    full = tokenize_rows(rows, tokenizer, 10_000)
    data = tokenize_rows(rows, tokenizer, max_len)  # overlong="cut_prompt", the default
    assert data.source_rows == [0, 1, 2, 3]  # nothing skipped for lack of labels
    np.testing.assert_array_equal(
        data.input_ids[0], full.input_ids[0][-max_len:]
    )  # the prompt's end + answer
    kept_answer = data.labels[0][data.labels[0] != IGNORE_INDEX]
    np.testing.assert_array_equal(kept_answer, full.labels[0][full.labels[0] != IGNORE_INDEX])  # all of it
    np.testing.assert_array_equal(data.input_ids[1], full.input_ids[1][:max_len])  # answer longer: end cut
    np.testing.assert_array_equal(data.input_ids[3], full.input_ids[3][:max_len])  # text: end cut
    s = data.stats
    assert (s.truncated, s.cut_prompts, s.skipped_no_labels) == (3, 1, 0)
    lost = sum(len(full.input_ids[i]) - max_len for i in (0, 1, 3))
    assert s.truncated_tokens == lost
    assert total_accounted(s) == s.rows


def test_pack_warns_how_many_rows_were_cut_and_the_summary_says_so(tokenizer):
    from fastft.data.packing import pack

    rows = [long_chat(100, 2), long_chat(3, 2), long_chat(3, 2)]
    with pytest.warns(
        UserWarning, match=r"1 of 3 rows are longer than max_seq_length=37: 1 lost the start of their prompt"
    ) as caught:
        packed = pack(rows, tokenizer, 37)
    lost = packed.stats.tokenize.truncated_tokens
    assert lost > 0 and f"{lost} tokens cut in all" in str(caught[0].message)
    assert f"truncated 1 ({lost} tokens lost; 1 cut in the prompt, answer kept)" in packed.stats.summary()
    truncating = pack(rows, tokenizer, 37, overlong="truncate")  # the old behaviour, still an option
    assert truncating.stats.tokenize.cut_prompts == 0 and truncating.stats.sequences == 2


def test_overlong_drop_leaves_long_rows_out_and_counts_them(tokenizer):
    max_len = 37
    rows = [long_chat(3, 100), long_chat(3, 2), {"text": "lemon " * 80}, long_chat(100, 2)]
    data = tokenize_rows(rows, tokenizer, max_len, overlong="drop")
    assert data.source_rows == [1]
    s = data.stats
    assert (s.rows, s.kept, s.truncated, s.dropped_overlong, s.skipped_empty, s.skipped_no_labels) == (
        4,
        1,
        0,
        3,
        0,
        0,
    )
    assert total_accounted(s) == s.rows


def test_a_row_of_exactly_max_seq_length_is_neither_cut_nor_dropped(tokenizer):
    row = long_chat(2, 5)
    n = len(tokenize_rows([row], tokenizer, 10_000).input_ids[0])
    for overlong in ("cut_prompt", "truncate", "drop"):
        data = tokenize_rows([row], tokenizer, n, overlong=overlong)
        assert len(data.input_ids[0]) == n and data.stats.truncated == data.stats.dropped_overlong == 0
    assert tokenize_rows([row], tokenizer, n - 1, overlong="drop").stats.dropped_overlong == 1


def test_empty_and_unlabelled_rows_are_skipped_and_counted(tokenizer):
    rows = [
        {"messages": []},  # 0 empty
        {"text": ""},  # 1 empty
        {"text": "  \n\t "},  # 2 empty (whitespace)
        chat(("user", "  "), ("assistant", "\n")),  # 3 empty (all contents blank)
        {"messages": None, "text": None},  # 4 empty
        {},  # 5 empty
        chat(("system", "Be kind."), ("user", "No answer here.")),  # 6 no assistant → no labels
        chat(("user", "What is 2 + 3?"), ("assistant", "5")),  # 7 kept
        {"messages": None, "text": "fallback text"},  # 8 kept as text
    ]
    data = tokenize_rows(rows, tokenizer, 128)
    assert data.source_rows == [7, 8]
    s = data.stats
    assert (s.rows, s.kept, s.truncated, s.dropped_overlong, s.skipped_empty, s.skipped_no_labels) == (
        9,
        2,
        0,
        0,
        6,
        1,
    )
    assert total_accounted(s) == s.rows
    assert tokenizer.decode(data.input_ids[1].tolist()) == "fallback text" + EOT


def test_an_empty_assistant_answer_still_trains_the_end_of_turn(tokenizer):
    data = tokenize_rows([chat(("user", "Say nothing."), ("assistant", ""))], tokenizer, 64)
    assert labelled_runs(tokenizer, data.input_ids[0], data.labels[0]) == [EOT + "\n"]


def test_results_do_not_depend_on_the_encoding_batch_size(tokenizer):
    rows = [
        chat(("user", f"What is {i} + {2 * i}?"), ("assistant", str(3 * i))) if i % 3 else {"text": "w" * i}
        for i in range(23)
    ]  # row 0 is an empty text
    reference = tokenize_rows(rows, tokenizer, 19, batch_size=1024)
    for batch_size in (1, 4, 7, 22):
        data = tokenize_rows(rows, tokenizer, 19, batch_size=batch_size)
        assert data.source_rows == reference.source_rows
        assert data.stats == reference.stats
        for a, b in zip(data.input_ids + data.labels, reference.input_ids + reference.labels, strict=True):
            np.testing.assert_array_equal(a, b)
    assert reference.stats.skipped_empty == 1 and reference.source_rows[0] == 1
    assert isinstance(reference, TokenizedData) and len(reference) == 22


# --- templates --------------------------------------------------------------------------------------


def test_a_tokenizer_without_a_chat_template_raises_naming_the_fix(tokenizer):
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template") as info:
        tokenize_rows([{"text": "fine"}, MULTI_TURN], tokenizer, 128)
    message = str(info.value)
    assert "tokenizer.chat_template" in message and "format='text'" in message and "Instruct" in message
    assert isinstance(info.value, ValueError)


def test_render_chat_spans_cover_each_answer_and_its_end_of_turn(tokenizer):
    text, spans = render_chat(tokenizer, MULTI_TURN["messages"])
    assert [text[a:b] for a, b in spans] == [f"Hello! 42{EOT}\n", f"Yes, again: 7 apples.{EOT}\n"]


def test_a_template_that_drops_earlier_answers_still_labels_the_final_answer(tokenizer):
    tokenizer.chat_template = DROP_EARLIER_ANSWERS
    # The second user turn quotes the first answer, which the template has dropped: the quote
    # must not be mistaken for the answer.
    row = chat(
        ("user", "Say hi"),
        ("assistant", "Hello! 42"),
        ("user", "You said Hello! 42?"),
        ("assistant", "Yes, again."),
    )
    text, spans = render_chat(tokenizer, row["messages"])
    assert "Hello! 42<" not in text
    assert [text[a:b] for a, b in spans] == [f"Yes, again.{EOT}\n"]
    data = tokenize_rows([row], tokenizer, 256)
    assert labelled_runs(tokenizer, data.input_ids[0], data.labels[0]) == [f"Yes, again.{EOT}\n"]


def test_a_template_that_rewrites_earlier_turns_labels_them_where_they_are_rendered(tokenizer):
    tokenizer.chat_template = REASONING_ON_LAST_ONLY
    row = chat(
        ("user", "Repeat after me: good morning"),
        ("assistant", "good morning"),
        ("user", "Again"),
        ("assistant", "Yes."),
    )
    data = tokenize_rows([row], tokenizer, 256)
    # The earlier answer falls back to its content (found in its own turn, not in the user's
    # request); the last turn is labelled as the template renders it, reasoning block included.
    assert labelled_runs(tokenizer, data.input_ids[0], data.labels[0]) == [
        "good morning",
        f"<think>\n\n</think>\n\nYes.{EOT}\n",
    ]


def test_the_preset_template_renders_chatml(tokenizer):
    assert tokenizer.chat_template == CHATML_TEMPLATE
    text = tokenizer.apply_chat_template([{"role": "user", "content": "a"}], tokenize=False)
    assert text == f"<|im_start|>user\na{EOT}\n"


# --- arguments --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(train_on="assistant"), r"train_on='assistant'.*'responses', 'all'"),
        (dict(train_on="ALL"), r"train_on='ALL'.*'responses', 'all'"),
        (dict(overlong="wrap"), r"overlong='wrap'.*'truncate', 'drop'"),
        (dict(max_seq_length=1), r"max_seq_length must be at least 2, got 1"),
        (dict(max_seq_length=0), r"at least 2, got 0"),
    ],
)
def test_bad_arguments_raise_naming_the_valid_values(tokenizer, kwargs, pattern):
    kwargs = dict(dict(max_seq_length=64), **kwargs)
    with pytest.raises(ValueError, match=pattern):
        tokenize_rows([MULTI_TURN], tokenizer, **kwargs)


def test_max_seq_length_two_is_the_shortest_allowed(tokenizer):
    data = tokenize_rows([{"text": "abcdef"}], tokenizer, 2)
    assert [len(ids) for ids in data.input_ids] == [2] and data.stats.truncated == 1

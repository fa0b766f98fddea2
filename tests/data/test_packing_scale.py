"""Packing at scale: batched chat rendering, tokenising a Dataset in several processes, packing in shards."""

from __future__ import annotations

import functools
import inspect
import json
import math
import weakref

import datasets
import numpy as np
import pytest

from fastft.data import packing
from fastft.data.packing import PackedDataset, pack, pack_shards
from fastft.data.skills import BUNDLED_DIR
from fastft.data.tokenize import TokenizedData, render_chat, render_chats, tokenize_dataset, tokenize_rows
from fastft.models.presets import load_preset_tokenizer

EOT = "<|im_end|>"


@functools.cache
def bundled_rows() -> tuple[dict, ...]:
    with open(BUNDLED_DIR / "skills.jsonl", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f)


@pytest.fixture()
def tokenizer():
    return load_preset_tokenizer()


def chat(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": role, "content": content} for role, content in pairs]


def assert_same_data(got: TokenizedData, want: TokenizedData) -> None:
    assert got.source_rows == want.source_rows
    assert got.stats == want.stats
    assert len(got.input_ids) == len(got.labels) == len(want.input_ids)
    for a, b in zip(got.input_ids + got.labels, want.input_ids + want.labels, strict=True):
        assert a.dtype == b.dtype == np.int32
        np.testing.assert_array_equal(a, b)


# --- batched rendering gives what one conversation at a time gave -----------------------------------


def render_chat_one_call_per_prefix(tokenizer, messages):
    """The original `render_chat`: three template calls per assistant turn, one conversation at a time."""
    full = tokenizer.apply_chat_template(list(messages), tokenize=False)
    spans, search_from = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(list(messages[:i]), tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(list(messages[: i + 1]), tokenize=False)
        if through.startswith(prompt) and full.startswith(through) and len(through) > len(prompt):
            spans.append((len(prompt), len(through)))
            search_from = len(through)
            continue
        lo, hi = search_from, len(full)
        if full.startswith(prompt):
            lo, hi = max(search_from, len(prompt)), len(through)
        start = full.find(message["content"], lo, hi)
        if start >= 0 and message["content"]:
            spans.append((start, start + len(message["content"])))
            search_from = start + len(message["content"])
    return full, spans


CONVERSATIONS = [
    chat(("system", "Answer briefly."), ("user", "Say hi"), ("assistant", "Hello! 42")),
    chat(("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d")),
    chat(("user", "Only a question?")),
    chat(("user", "Repeat: good morning"), ("assistant", "good morning"), ("user", "Again")),
    chat(("user", "Say nothing."), ("assistant", "")),
]
REWRITING_TEMPLATE = (  # the last assistant turn gets a reasoning block, earlier ones do not
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", ["preset", "rewriting"])
def test_batched_rendering_equals_rendering_each_prefix_on_its_own(tokenizer, template):
    if template == "rewriting":
        tokenizer.chat_template = REWRITING_TEMPLATE
    conversations = CONVERSATIONS + [row["messages"] for row in bundled_rows()[:40]]
    expected = [render_chat_one_call_per_prefix(tokenizer, c) for c in conversations]
    assert render_chats(tokenizer, conversations) == expected
    assert [render_chat(tokenizer, c) for c in conversations] == expected
    assert render_chats(tokenizer, []) == []


def test_a_chat_that_opens_with_an_assistant_turn_is_labelled(tokenizer):
    # One template call per prefix refused the empty prompt before this turn; batched, it renders.
    text, spans = render_chat(tokenizer, chat(("assistant", "Hi there"), ("user", "ok")))
    assert text == f"<|im_start|>assistant\nHi there{EOT}\n<|im_start|>user\nok{EOT}\n"
    assert [text[a:b] for a, b in spans] == [f"Hi there{EOT}\n"]


# --- tokenising a datasets.Dataset in several processes -----------------------------------------------


def awkward_chat_rows(n: int) -> list[dict]:
    """Bundled chats plus rows that are empty, unlabelled, null or far too long."""
    rows = [{"messages": row["messages"]} for row in bundled_rows()[:n]]
    rows[3] = {"messages": []}
    rows[7] = {"messages": chat(("user", "No answer here."))}
    rows[11] = {"messages": None}
    rows[15] = {"messages": chat(("user", "apple " * 60), ("assistant", "mango"))}  # answer beyond the cut
    rows[19] = {"messages": chat(("user", "Count."), ("assistant", "one two " * 40))}  # cut, still trained
    rows[-1] = {"messages": chat(("user", "  "), ("assistant", "\n"))}
    return rows


@pytest.mark.parametrize(
    ("column", "train_on", "overlong"),
    [
        ("messages", "responses", "truncate"),
        ("messages", "responses", "cut_prompt"),
        ("messages", "all", "drop"),
        ("text", "responses", "truncate"),
    ],
)
def test_tokenising_in_two_processes_equals_the_serial_result(tokenizer, column, train_on, overlong):
    if column == "messages":
        rows = awkward_chat_rows(300)
    else:
        rows = [{"text": "lemon " * (i % 50)} for i in range(300)]  # every 50th empty, most cut
    dataset = datasets.Dataset.from_list(rows)
    serial = tokenize_rows(rows, tokenizer, 40, train_on, overlong)
    s = serial.stats
    assert s.skipped_empty >= 1 and s.kept > 250  # the awkward rows are there
    assert s.truncated + s.dropped_overlong >= 1
    # Batches of 64 rows: several per process, and the process boundary inside a batch of the serial run.
    parallel = tokenize_dataset(dataset, tokenizer, 40, train_on, overlong, num_proc=2, batch_size=64)
    assert_same_data(parallel, serial)
    assert all(array.flags.writeable for array in parallel.input_ids + parallel.labels)

    packed_parallel = pack(dataset, tokenizer, 40, train_on, overlong, num_proc=2)
    packed_serial = pack(dataset, tokenizer, 40, train_on, overlong, num_proc=1)
    assert packed_parallel.bins == packed_serial.bins
    assert packed_parallel.stats == packed_serial.stats
    assert_same_data(packed_parallel.data, serial)


def test_tokenising_a_shuffled_selection_in_two_processes_follows_its_order(tokenizer):
    rows = awkward_chat_rows(200)
    dataset = datasets.Dataset.from_list(rows).shuffle(seed=3).select(range(150))
    serial = tokenize_rows(list(dataset), tokenizer, 40)  # the rows in the selection's order
    assert serial.stats.skipped_empty >= 1
    assert_same_data(tokenize_dataset(dataset, tokenizer, 40, num_proc=2, batch_size=32), serial)


def test_pack_picks_several_processes_only_for_large_datasets(tokenizer, monkeypatch):
    calls = []

    def spy(dataset, tokenizer, max_seq_length, train_on, overlong, num_proc):
        calls.append(num_proc)
        return tokenize_rows(packing.dataset_rows(dataset), tokenizer, max_seq_length, train_on, overlong)

    monkeypatch.setattr(packing, "tokenize_dataset", spy)
    monkeypatch.setattr(packing, "AUTO_NUM_PROC_ROWS", 100)
    monkeypatch.setattr(packing, "_cpu_count", lambda: 12)
    rows = [{"messages": row["messages"]} for row in bundled_rows()[:120]]
    dataset = datasets.Dataset.from_list(rows)

    pack(dataset, tokenizer, 64)
    assert calls == [8]  # min(cores, 8)
    pack(dataset.select(range(99)), tokenizer, 64)  # under the threshold: serial
    pack(rows, tokenizer, 64)  # not a Dataset: serial
    pack(dataset, tokenizer, 64, num_proc=1)
    assert calls == [8]
    pack(dataset.select(range(10)), tokenizer, 64, num_proc=3)  # asked for: honoured
    assert calls == [8, 3]
    monkeypatch.setattr(packing, "_cpu_count", lambda: 1)
    pack(dataset, tokenizer, 64)
    assert calls == [8, 3]  # one core: serial


def test_num_proc_for_a_list_warns_and_runs_serially_and_bad_values_raise(tokenizer):
    rows = [{"messages": row["messages"]} for row in bundled_rows()[:30]]
    with pytest.warns(UserWarning, match="num_proc=2 applies to a datasets.Dataset; this list"):
        packed = pack(rows, tokenizer, 64, num_proc=2)
    assert packed.bins == pack(rows, tokenizer, 64).bins
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"num_proc must be at least 1, got {bad}"):
            pack(datasets.Dataset.from_list(rows), tokenizer, 64, num_proc=bad)


def test_a_dataset_is_read_in_batches_whatever_its_format(tokenizer):
    rows = [{"messages": row["messages"], "task": row["task"]} for row in bundled_rows()[:50]]
    reference = pack(rows, tokenizer, 64)
    dataset = datasets.Dataset.from_list(rows).with_format("numpy")
    packed = pack(dataset, tokenizer, 64)
    assert packed.bins == reference.bins and packed.stats == reference.stats


# --- pack_shards ----------------------------------------------------------------------------------------


class CountingRows:
    """A one-shot generator of bundled chat rows that counts how many have been read."""

    def __init__(self, n: int):
        self.n, self.read = n, 0
        self.rows = self._generate()

    def _generate(self):
        source = bundled_rows()
        for i in range(self.n):
            self.read += 1
            yield source[i % len(source)]


def test_pack_shards_reads_a_generator_lazily_one_shard_at_a_time(tokenizer):
    source = CountingRows(2_500)
    shards = pack_shards(source.rows, tokenizer, 256, shard_rows=1_000)
    assert source.read == 0  # nothing is read before the first shard is asked for
    first = next(shards)
    assert source.read == 1_000  # exactly one shard's rows, no read-ahead
    assert inspect.getgeneratorstate(source.rows) == inspect.GEN_SUSPENDED  # not exhausted
    assert isinstance(first, PackedDataset) and first.stats.tokenize.rows == 1_000
    # The generator keeps no reference to a shard it has handed over: dropped, it is freed.
    first_ref = weakref.ref(first)
    del first
    second = next(shards)
    assert first_ref() is None
    assert source.read == 2_000 and second.data.source_rows[0] == 1_000
    assert [s.stats.tokenize.rows for s in shards] == [500]
    assert inspect.getgeneratorstate(source.rows) == inspect.GEN_CLOSED


def test_pack_shards_puts_every_row_in_exactly_one_shard_and_packs_them_well(tokenizer):
    n, shard_rows, max_len = 2_500, 1_000, 256
    rows = (bundled_rows()[i] for i in range(n))
    shards = list(pack_shards(rows, tokenizer, max_len, shard_rows=shard_rows))
    assert len(shards) == math.ceil(n / shard_rows) == 3
    assert [s.stats.tokenize.rows for s in shards] == [1_000, 1_000, 500]
    assert sum(s.stats.sequences for s in shards) == n
    # source_rows are positions in the whole input: together, each row exactly once.
    assert sorted(r for s in shards for r in s.data.source_rows) == list(range(n))
    whole = pack(list(bundled_rows()[:n]), tokenizer, max_len)
    for shard in shards:
        assert shard.stats.efficiency > 0.9
        assert shard.stats.efficiency > whole.stats.efficiency - 0.02
        flat = sorted(i for b in shard.bins for i in b)
        assert flat == list(range(len(shard.data)))  # every sequence of the shard in one bin
        assert all(int(shard.data.lengths[b].sum()) <= max_len for b in shard.bins)
    # Same tokens as packing everything at once; the shard edges cost at most a bin or two per shard.
    assert sum(s.stats.tokens for s in shards) == whole.stats.tokens
    assert sum(s.stats.trained_tokens for s in shards) == whole.stats.trained_tokens
    assert whole.stats.bins <= sum(s.stats.bins for s in shards) <= whole.stats.bins + 2 * len(shards)
    by_row = {
        r: (s.data.input_ids[k], s.data.labels[k]) for s in shards for k, r in enumerate(s.data.source_rows)
    }
    for k, r in enumerate(whole.data.source_rows):
        np.testing.assert_array_equal(by_row[r][0], whole.data.input_ids[k])
        np.testing.assert_array_equal(by_row[r][1], whole.data.labels[k])
    # A batch of a shard is a normal PackedBatch.
    assert shards[2].batch([0]).num_tokens <= max_len


def test_pack_shards_takes_lists_datasets_and_streaming_datasets_alike(tokenizer, tmp_path):
    rows = [dict(row) for row in bundled_rows()[:700]]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    sources = {
        "list": rows,
        "dataset": datasets.Dataset.from_list(rows),
        "iterable": datasets.Dataset.from_list(rows).to_iterable_dataset(),
        "streaming": datasets.load_dataset("json", data_files=str(path), split="train", streaming=True),
    }
    results = {name: list(pack_shards(src, tokenizer, 128, shard_rows=350)) for name, src in sources.items()}
    reference = results.pop("list")
    assert len(reference) == 2  # 700 rows in shards of 350: no empty third shard
    for name, shards in results.items():
        assert [s.bins for s in shards] == [s.bins for s in reference], name
        assert [s.stats for s in shards] == [s.stats for s in reference], name
        assert [s.data.source_rows for s in shards] == [s.data.source_rows for s in reference], name


def test_pack_shards_reports_skipped_rows_per_shard_and_raises_when_nothing_trains(tokenizer):
    empty = {"messages": chat(("user", "No answer here."))}
    rows = [empty] * 4 + [dict(r) for r in bundled_rows()[:4]]
    shards = list(pack_shards(rows, tokenizer, 64, shard_rows=4))
    assert [len(s) for s in shards][0] == 0 and len(shards[1]) > 0  # an untrainable shard is still yielded
    assert shards[0].stats.tokenize.skipped_no_labels == 4 and shards[0].stats.efficiency == 0.0
    assert shards[1].data.source_rows == [4, 5, 6, 7]

    untrainable = pack_shards([empty] * 5, tokenizer, 64, shard_rows=2)
    assert len(next(untrainable)) == 0
    with pytest.raises(ValueError, match=r"No trainable rows.*rows=5.*skipped_no_labels=5"):
        list(untrainable)
    with pytest.raises(ValueError, match="No trainable rows"):
        list(pack_shards(iter([]), tokenizer, 64))


def test_pack_shards_checks_its_arguments_when_called(tokenizer):
    rows = CountingRows(10)
    for kwargs, pattern in [
        (dict(shard_rows=0), "shard_rows must be at least 1, got 0"),
        (dict(train_on="assistant"), "train_on='assistant'"),
        (dict(overlong="wrap"), "overlong='wrap'"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            pack_shards(rows.rows, tokenizer, 64, **kwargs)  # raised at the call, before any iteration
    with pytest.raises(ValueError, match="pass max_seq_length"):
        pack_shards(rows.rows, tokenizer)
    with pytest.raises(ValueError, match=r"columns \['prompt'\]; expected 'messages' or 'text'"):
        pack_shards(datasets.Dataset.from_dict({"prompt": ["a"]}), tokenizer, 64)
    assert rows.read == 0

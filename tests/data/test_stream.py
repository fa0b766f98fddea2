"""Training on packed shards streamed from data larger than memory (`PackedStream`)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import fastft
from fastft.data.skills import generate
from fastft.data.stream import PackedStream, StreamCursor, batch_of
from fastft.training.trainer import TrainConfig, Trainer

ROWS = list(generate(90, seed=31))
SEQ = 128


@pytest.fixture(scope="module")
def tokenizer():
    return fastft.load_model("tiny-llama", max_seq_length=SEQ)[1]


def _stream(tokenizer, shard_rows=25, reads=None):
    def rows():
        if reads is not None:
            reads.append(1)
        yield from ROWS

    return PackedStream(rows, tokenizer, SEQ, shard_rows=shard_rows)


def test_cursor_reads_every_bin_of_every_shard_once_per_epoch_in_a_seeded_order(tokenizer):
    reads = []
    stream = _stream(tokenizer, reads=reads)
    shards = list(stream.shards())
    assert len(shards) == 4  # 90 rows in shards of 25
    total = sum(len(shard) for shard in shards)
    cursor = StreamCursor(stream, seed=7)
    first = cursor.bins(0, total)
    second = cursor.bins(total, total)  # the next epoch reads the rows again
    assert len(reads) == 3 and stream.bins_per_pass == total and cursor.epoch_progress == pytest.approx(2.0)
    key = [(id(shard), index) for shard, index in first]
    assert len(set(key)) == total  # each bin once
    sizes = [len(shard) for shard in shards]
    assert [sum(1 for _ in group) for group in _runs(first)] == sizes  # shards front to back
    assert [i for _, i in first] != [i for _, i in second]  # reshuffled per epoch
    again = StreamCursor(_stream(tokenizer), seed=7).bins(0, total)
    assert [i for _, i in again] == [i for _, i in first]  # a pure function of the seed
    other = StreamCursor(_stream(tokenizer), seed=8).bins(0, total)
    assert [i for _, i in other] != [i for _, i in first]


def _runs(bins):
    current, run = None, []
    for shard, index in bins:
        if shard is not current and run:
            yield run
            run = []
        current = shard
        run.append(index)
    if run:
        yield run


def test_a_micro_batch_may_span_a_shard_edge(tokenizer):
    stream = _stream(tokenizer)
    first_shard = next(iter(stream.shards()))
    cursor = StreamCursor(stream, seed=0)
    edge = cursor.bins(len(first_shard) - 1, 2)
    assert edge[0][0] is not edge[1][0]
    batch = batch_of(edge)
    expected = sum(len(shard.data.input_ids[row]) for shard, index in edge for row in shard.bins[index])
    assert batch.num_tokens == expected and batch.num_sequences == sum(len(s.bins[i]) for s, i in edge)


def test_the_cursor_holds_one_shard_at_a_time(tokenizer):
    cursor = StreamCursor(_stream(tokenizer), seed=0)
    shard, _ = cursor.bins(0, 1)[0]
    alive = weakref.ref(shard)
    del shard
    cursor.bins(1, 40)  # well past the first shard's bins
    gc.collect()
    assert alive() is None


def _trainer(tokenizer, stream, **config):
    model, _ = fastft.load_model("tiny-llama", max_seq_length=SEQ)
    model = fastft.add_lora(model, r=4, alpha=8, seed=3)
    config = {"max_steps": 6, "micro_batch_bins": 3, "learning_rate": 1e-3, "profile": False} | config
    return Trainer(model, tokenizer, stream, config=TrainConfig(**config))


def test_training_on_a_stream_is_deterministic_and_resumes_exactly(tokenizer, tmp_path):
    # 20 steps of 3 bins: more than two passes over the 25 bins
    whole = _trainer(tokenizer, _stream(tokenizer), max_steps=20).train()
    losses = [event.loss for event in whole.steps]
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
    assert whole.steps[-1].epoch > 1.0  # read the rows a second time
    again = _trainer(tokenizer, _stream(tokenizer), max_steps=20).train()
    assert [event.loss for event in again.steps] == losses

    out = str(tmp_path / "run")
    first = _trainer(tokenizer, _stream(tokenizer), max_steps=20, output_dir=out, save_every=8)
    first.train(steps=8)
    first.close()  # as if killed: the paused run frees the folder
    resumed = _trainer(tokenizer, _stream(tokenizer), max_steps=20, output_dir=out, resume_from="latest")
    result = resumed.train()
    assert [event.loss for event in result.steps][8:] == pytest.approx(losses[8:], rel=1e-6)


def test_a_stream_needs_max_steps_and_a_rereadable_source(tokenizer):
    with pytest.raises(ValueError, match="max_steps"):
        _trainer(tokenizer, _stream(tokenizer), max_steps=None)
    with pytest.raises(ValueError, match="pack a held-out set"):
        model, _ = fastft.load_model("tiny-llama", max_seq_length=SEQ)
        model = fastft.add_lora(model, r=4)
        Trainer(model, tokenizer, _stream(tokenizer), _stream(tokenizer), TrainConfig(max_steps=2))
    with pytest.raises(TypeError, match="function that returns a new one"):
        PackedStream(iter(ROWS), tokenizer, SEQ)
    listed = PackedStream(ROWS, tokenizer, SEQ, shard_rows=40)  # a list can be read again
    cursor = StreamCursor(listed, seed=0)
    total = sum(len(shard) for shard in listed.shards())
    assert len(cursor.bins(0, 2 * total + 1)) == 2 * total + 1

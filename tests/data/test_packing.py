"""Packing: best-fit decreasing, `PackedBatch` metadata, and packed losses equal to per-sequence losses."""

from __future__ import annotations

import functools
import json
import math
import time

import datasets
import numpy as np
import pytest
import torch

from fastft.data.batch import PackedBatch
from fastft.data.packing import PackedDataset, best_fit_decreasing, pack
from fastft.data.skills import BUNDLED_DIR
from fastft.data.tokenize import IGNORE_INDEX, tokenize_rows
from fastft.models.loading import load_model
from fastft.models.presets import load_preset_tokenizer
from fastft.training.loss import causal_lm_loss_sum

PRESET_NAMES = ("tiny-llama", "tiny-qwen3", "tiny-mistral", "tiny-moe", "tiny-mixtral")
MOE_PRESETS = ("tiny-moe", "tiny-mixtral")
# Awkward lengths; 97 is longer than tiny-mistral's sliding window of 64.
RAGGED_LENGTHS = (7, 31, 64, 3, 97)


@pytest.fixture(autouse=True)
def _one_thread():
    # The models are tiny: one thread is several times faster than two on a busy 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def bundled_rows() -> tuple[dict, ...]:
    with open(BUNDLED_DIR / "skills.jsonl", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f)


@functools.cache
def preset(name: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) on the CPU; whether tiny-llama has warm-start weights does not matter."""
    model, tokenizer = load_model(name, max_seq_length=256, dtype=dtype, device="cpu")
    model.eval()  # no dropout: the presets have none, but be explicit
    return model, tokenizer


# --- best_fit_decreasing ----------------------------------------------------------------------------


def check_bins(bins: list[list[int]], lengths: np.ndarray, capacity: int) -> None:
    """Every index exactly once, no bin over capacity, each bin longest first."""
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    for b in bins:
        assert b, "an empty bin"
        sizes = lengths[b]
        assert int(sizes.sum()) <= capacity
        assert np.all(sizes[:-1] >= sizes[1:])


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[int]:
    """Reference FFD: each item (longest first) into the first opened bin with room. Returns bin loads."""
    rooms = np.empty(len(lengths), dtype=np.int64)
    opened = 0
    for need in np.sort(lengths)[::-1]:
        fits = np.flatnonzero(rooms[:opened] >= need)
        if len(fits):
            rooms[fits[0]] -= need
        else:
            rooms[opened] = capacity - need
            opened += 1
    return sorted((capacity - rooms[:opened]).tolist())


def naive_best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[int]:
    """Reference BFD: each item (longest first) into the bin with the least room that fits. Returns bin loads.

    Which of several equally full bins is picked does not change later choices, so the loads do not
    depend on tie-breaking.
    """
    rooms = np.empty(len(lengths), dtype=np.int64)
    opened = 0
    for need in np.sort(lengths)[::-1]:
        room = rooms[:opened]
        candidates = np.where(room >= need, room, np.iinfo(np.int64).max)
        best = int(np.argmin(candidates)) if opened else 0
        if opened and candidates[best] != np.iinfo(np.int64).max:
            rooms[best] -= need
        else:
            rooms[opened] = capacity - need
            opened += 1
    return sorted((capacity - rooms[:opened]).tolist())


def test_best_fit_decreasing_on_a_small_case_worked_by_hand():
    lengths = [5, 3, 8, 2, 7, 1, 4, 6]
    # 8→new, 7→new, 6→new, 5→new, 4→bin of 6, 3→bin of 7, 2→bin of 8, 1→bin of 5.
    assert best_fit_decreasing(lengths, 10) == [[2, 3], [4, 1], [7, 6], [0, 5]]


def test_best_fit_decreasing_keeps_the_original_order_among_equal_lengths():
    assert best_fit_decreasing([5] * 7, 10) == [[0, 1], [2, 3], [4, 5], [6]]
    assert best_fit_decreasing([4, 2, 4, 4], 14) == [[0, 2, 3, 1]]


def test_best_fit_decreasing_edge_cases():
    assert best_fit_decreasing([], 8) == []
    assert best_fit_decreasing(np.array([], dtype=np.int64), 8) == []
    assert best_fit_decreasing([8, 8, 1], 8) == [[0], [1], [2]]  # exactly full bins stay closed
    assert best_fit_decreasing([1, 1, 1], 2) == [[0, 1], [2]]


def test_best_fit_decreasing_raises_on_an_item_larger_than_the_capacity():
    with pytest.raises(ValueError, match="a sequence of 4100 tokens does not fit a bin of 4099"):
        best_fit_decreasing([12, 4100, 7], 4099)


@pytest.mark.parametrize(
    ("seed", "low", "high", "n", "capacity"),
    [
        (0, 1, 4097, 5_000, 4099),  # uniform lengths up to the capacity
        (1, 1, 300, 4_999, 4099),  # many short items
        (2, 2000, 2100, 3_001, 4099),  # items just under half a bin: at most two per bin
        (3, 1, 257, 2_017, 256),  # lengths up to and including the capacity
    ],
)
def test_best_fit_decreasing_on_random_lengths(seed, low, high, n, capacity):
    lengths = np.random.default_rng(seed).integers(low, high, n)
    bins = best_fit_decreasing(lengths, capacity)
    check_bins(bins, lengths, capacity)
    assert len(bins) >= math.ceil(int(lengths.sum()) / capacity)
    assert len(bins) <= len(first_fit_decreasing(lengths, capacity))
    loads = sorted(int(lengths[b].sum()) for b in bins)
    assert loads == naive_best_fit_decreasing(lengths, capacity)
    # Deterministic, and the same for a list or an array.
    assert best_fit_decreasing(lengths, capacity) == bins
    assert best_fit_decreasing(lengths.tolist(), capacity) == bins


def test_best_fit_decreasing_packs_a_million_lengths_quickly():
    lengths = np.random.default_rng(11).integers(1, 4097, 1_000_000)
    start = time.perf_counter()
    bins = best_fit_decreasing(lengths, 4099)
    seconds = time.perf_counter() - start
    print(f"\nbest_fit_decreasing: 1,000,000 lengths → {len(bins)} bins in {seconds:.2f} s")
    assert seconds < 20
    lower_bound = math.ceil(int(lengths.sum()) / 4099)
    assert lower_bound <= len(bins) <= 1.01 * lower_bound  # within 1% of optimal
    assert sum(len(b) for b in bins) == len(lengths)


# --- PackedBatch ------------------------------------------------------------------------------------


def random_sequences(lengths, seed: int = 0, vocab: int = 512, p_label: float = 0.6):
    """Random tokens and random labels (not the tokens themselves), each sequence's last token trained."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, vocab, n).astype(np.int32) for n in lengths]
    labels = []
    for n in lengths:
        lab = np.where(rng.random(n) < p_label, rng.integers(0, vocab, n), IGNORE_INDEX).astype(np.int32)
        lab[-1] = rng.integers(0, vocab)
        labels.append(lab)
    return ids, labels


def test_packed_batch_metadata():
    lengths = (7, 31, 1, 64, 3)
    ids, labels = random_sequences(lengths, seed=3)
    labels[1][0] = 99  # a label on a first token must be dropped: nothing predicts it
    before = [lab.copy() for lab in labels]
    batch = PackedBatch.from_sequences(ids, labels)
    total = sum(lengths)

    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == [0, 7, 38, 39, 103, 106]
    for tensor in (
        batch.input_ids,
        batch.labels,
        batch.position_ids,
        batch.target_positions,
        batch.target_ids,
    ):
        assert tensor.dtype == torch.int64
    assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (1, total)
    assert batch.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    assert batch.input_ids[0].tolist() == np.concatenate(ids).tolist()
    assert (batch.num_sequences, batch.num_tokens, batch.max_seqlen) == (5, total, 64)
    assert batch.sequence_lengths == tuple(lengths)

    expected_labels = np.concatenate(labels).astype(np.int64)
    expected_labels[[0, 7, 38, 39, 103]] = IGNORE_INDEX
    assert batch.labels[0].tolist() == expected_labels.tolist()
    for lab, original in zip(labels, before, strict=True):
        np.testing.assert_array_equal(lab, original)  # inputs untouched

    targets = [t for t in range(total - 1) if expected_labels[t + 1] != IGNORE_INDEX]
    assert batch.target_positions.tolist() == targets
    assert batch.target_ids.tolist() == [int(expected_labels[t + 1]) for t in targets]
    assert batch.num_trained_tokens == len(targets) == int((expected_labels != IGNORE_INDEX).sum())
    # No position predicts the first token of the next sequence.
    assert not set(targets) & {6, 37, 38, 102}


def test_packed_batch_needs_a_sequence():
    with pytest.raises(ValueError, match="at least one sequence"):
        PackedBatch.from_sequences([], [])


def test_packed_batch_to_the_same_device_is_a_no_op():
    ids, labels = random_sequences((5, 9))
    batch = PackedBatch.from_sequences(ids, labels)
    assert batch.to("cpu") is batch


# --- packed loss equals the sum of per-sequence losses ----------------------------------------------


def bundled_sequences(tokenizer, n: int = 9):
    data = tokenize_rows(bundled_rows()[100 : 100 + n], tokenizer, 256)
    assert len(data) == n
    return data.input_ids, data.labels


def loss_and_grads(model, batches: list[PackedBatch]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        loss = causal_lm_loss_sum(model, batch)
        loss.backward()
        total += loss.item()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total, grads


def assert_gradients_close(got: dict, expected: dict, model, rel: float) -> None:
    """Same parameters; each gradient within `rel` of its tensor's largest entry."""
    assert got.keys() == expected.keys()
    assert len(got) == sum(p.requires_grad for p in model.parameters())
    for param, want in expected.items():
        scale = want.abs().max().item()
        if scale == 0:  # e.g. experts no token was routed to
            assert torch.equal(got[param], want), param
        else:
            assert (got[param] - want).abs().max().item() <= rel * scale, param


def packed_and_single_batches(tokenizer, source: str):
    if source == "bundled":
        ids, labels = bundled_sequences(tokenizer)
    else:
        ids, labels = random_sequences(RAGGED_LENGTHS, seed=5, vocab=len(tokenizer))
    packed = PackedBatch.from_sequences(ids, labels)
    singles = [PackedBatch.from_sequences([i], [lab]) for i, lab in zip(ids, labels, strict=True)]
    assert packed.num_trained_tokens == sum(s.num_trained_tokens for s in singles) > 0
    return packed, singles


@pytest.mark.parametrize("source", ["bundled", "random"])
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_packed_loss_and_gradients_equal_the_per_sequence_sums(name, source):
    model, tokenizer = preset(name)
    packed, singles = packed_and_single_batches(tokenizer, source)
    packed_loss, packed_grads = loss_and_grads(model, [packed])
    summed_loss, summed_grads = loss_and_grads(model, singles)
    assert math.isfinite(packed_loss) and packed_loss > 0
    assert packed_loss == pytest.approx(summed_loss, rel=1e-5)
    # fp32 summation order differs (one matmul over all tokens vs. gradients accumulated per
    # sequence): seen up to 1.4e-5 of a tensor's largest entry on the warm-started tiny-llama.
    assert_gradients_close(packed_grads, summed_grads, model, rel=5e-5)


@pytest.mark.parametrize("source", ["bundled", "random"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_packed_gradients_are_exact_in_float64(name, source):
    """In fp64 the fp32 rounding above vanishes: packing changes nothing but the summation order."""
    model, tokenizer = preset(name, torch.float64)
    packed, singles = packed_and_single_batches(tokenizer, source)
    packed_loss, packed_grads = loss_and_grads(model, [packed])
    summed_loss, summed_grads = loss_and_grads(model, singles)
    assert packed_loss == pytest.approx(summed_loss, rel=1e-6)  # the loss itself is taken in fp32
    assert_gradients_close(packed_grads, summed_grads, model, rel=1e-11)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_perturbing_one_packed_sequence_leaves_the_others_logits_unchanged(name):
    """Bit for bit for the dense presets (attention is exact). In the MoE presets each expert's matmul
    (transformers' grouped_mm experts) runs over the tokens routed to it, so changing one sequence's
    routing changes the matmul shapes the other sequences go through and their logits can move in the
    last bits (seen: up to 7.5e-8 on tiny-moe, from its MoE block); there the bound is 1e-6."""
    model, tokenizer = preset(name)
    ids, labels = random_sequences(RAGGED_LENGTHS, seed=9, vocab=len(tokenizer))
    perturbed = [x.copy() for x in ids]
    changed = 2
    perturbed[changed] = (
        np.random.default_rng(10).integers(3, len(tokenizer), len(ids[changed])).astype(np.int32)
    )
    cu = PackedBatch.from_sequences(ids, labels).cu_seqlens.tolist()

    def logits(sequences):
        batch = PackedBatch.from_sequences(sequences, labels)
        with torch.no_grad():
            return model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[
                0
            ]

    before, after = logits(ids), logits(perturbed)
    for k in range(len(ids)):
        a, b = cu[k], cu[k + 1]
        if k == changed:
            assert not torch.allclose(before[a:b], after[a:b])
        elif name in MOE_PRESETS:
            torch.testing.assert_close(before[a:b], after[a:b], rtol=0, atol=1e-6)
        else:
            assert torch.equal(before[a:b], after[a:b]), f"sequence {k} changed"

    # And each packed sequence sees what it would see alone.
    for k in (0, 4):
        alone = torch.from_numpy(ids[k].astype(np.int64))[None]
        with torch.no_grad():
            single = model(input_ids=alone, use_cache=False).logits[0]
        torch.testing.assert_close(before[cu[k] : cu[k + 1]], single, rtol=0, atol=1e-5)


# --- pack -------------------------------------------------------------------------------------------


@functools.cache
def packed_bundled() -> PackedDataset:
    return pack(datasets.Dataset.from_list(list(bundled_rows())), load_preset_tokenizer(), 256)


def test_pack_on_the_bundled_data_reports_its_stats():
    packed = packed_bundled()
    data, stats = packed.data, packed.stats
    rows = len(bundled_rows())
    assert stats.sequences == len(data) == rows and stats.tokenize.kept == rows
    assert stats.tokenize.truncated == stats.tokenize.skipped_empty == stats.tokenize.skipped_no_labels == 0
    assert stats.bins == len(packed) == len(packed.bins)
    assert stats.max_seq_length == packed.max_seq_length == 256
    assert stats.tokens == int(data.lengths.sum())
    assert stats.trained_tokens == sum(int((lab != IGNORE_INDEX).sum()) for lab in data.labels)
    assert stats.efficiency == pytest.approx(stats.tokens / (stats.bins * 256))
    assert stats.efficiency > 0.9
    assert stats.sequences_per_bin == pytest.approx(rows / stats.bins)
    assert stats.bins >= math.ceil(stats.tokens / 256)
    check_bins(packed.bins, data.lengths, 256)
    summary = stats.summary()
    assert f"{rows} sequences → {stats.bins} bins of 256 tokens" in summary
    assert f"{stats.trained_tokens} trained tokens" in summary
    assert summary in repr(packed)


def test_pack_accepts_a_plain_list_of_rows_with_the_same_result():
    rows = list(bundled_rows()[:300])
    tokenizer = load_preset_tokenizer()
    from_list = pack(rows, tokenizer, 100)
    from_dataset = pack(datasets.Dataset.from_list(rows), tokenizer, 100)
    assert from_list.bins == from_dataset.bins
    assert from_list.stats == from_dataset.stats


def test_batch_concatenates_the_given_bins_in_order():
    packed = packed_bundled()
    i, j = 3, len(packed) - 1
    batch = packed.batch([i, j])
    members = packed.bins[i] + packed.bins[j]
    assert batch.num_sequences == len(members)
    assert batch.sequence_lengths == tuple(len(packed.data.input_ids[m]) for m in members)
    assert batch.input_ids[0].tolist() == np.concatenate([packed.data.input_ids[m] for m in members]).tolist()
    expected = PackedBatch.from_sequences(
        [packed.data.input_ids[m] for m in members], [packed.data.labels[m] for m in members]
    )
    for field in ("input_ids", "labels", "position_ids", "cu_seqlens", "target_positions", "target_ids"):
        assert torch.equal(getattr(batch, field), getattr(expected, field)), field
    assert batch.num_tokens <= 2 * 256
    # A bin alone fits the bin length.
    assert all(packed.batch([b]).num_tokens <= 256 for b in range(len(packed)))


def test_pack_raises_when_nothing_is_trainable():
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(5)]
    tokenizer = load_preset_tokenizer()
    with pytest.raises(ValueError, match="No trainable rows.*skipped_no_labels=5.*train_on='all'"):
        pack(rows, tokenizer, 64)
    assert len(pack(rows, tokenizer, 64, train_on="all").data) == 5
    with pytest.raises(ValueError, match="No trainable rows"):
        pack(datasets.Dataset.from_dict({"text": ["", "  "]}), tokenizer, 64)


def test_pack_raises_when_the_dataset_has_neither_messages_nor_text():
    dataset = datasets.Dataset.from_dict({"prompt": ["a", "b"], "completion": ["c", "d"]})
    with pytest.raises(
        ValueError, match=r"columns \['prompt', 'completion'\]; expected 'messages' or 'text'"
    ):
        pack(dataset, load_preset_tokenizer(), 64)


def test_pack_uses_text_when_a_dataset_has_no_messages_column():
    dataset = datasets.Dataset.from_dict({"text": ["one two three", "four"], "other": [1, 2]})
    packed = pack(dataset, load_preset_tokenizer(), 64)
    assert packed.stats.sequences == 2 and packed.bins == [[0, 1]]


def test_pack_defaults_max_seq_length_to_the_tokenizer_model_max_length():
    rows = list(bundled_rows()[:50])
    _, tokenizer = load_model("tiny-moe", max_seq_length=97, dtype=torch.float32, device="cpu")
    assert tokenizer.model_max_length == 97
    packed = pack(rows, tokenizer)
    assert packed.max_seq_length == packed.stats.max_seq_length == 97
    assert packed.bins == pack(rows, tokenizer, 97).bins
    # A tokenizer that does not know its length must be told.
    with pytest.raises(ValueError, match="pass max_seq_length"):
        pack(rows, load_preset_tokenizer())


def test_pack_truncates_or_drops_overlong_rows_as_asked():
    long_text = {"text": "ocean " * 200}
    rows = [long_text, *bundled_rows()[:20]]
    tokenizer = load_preset_tokenizer()
    cut = pack(rows, tokenizer, 61)
    assert cut.stats.tokenize.truncated == 1 and cut.stats.sequences == 21
    assert int(cut.data.lengths.max()) == 61 and cut.bins[0] == [0]
    dropped = pack(rows, tokenizer, 61, overlong="drop")
    assert dropped.stats.tokenize.dropped_overlong == 1 and dropped.stats.sequences == 20
    assert "dropped 1" in dropped.stats.summary()

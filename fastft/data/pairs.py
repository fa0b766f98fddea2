"""Preference pairs: a prompt with a chosen and a rejected answer, tokenised and packed for DPO-family training.

`pack_pairs(rows, tokenizer, max_seq_length)` renders each side as ``prompt + answer`` with the tokenizer's
chat template and labels the answer's tokens only (the prompt, earlier assistant turns of the prompt
included, trains nothing). A pair's two sequences always share one bin, chosen first, so every micro-batch
holds whole pairs, chosen and rejected alternating, padding-free with one boundary tensor built once per
batch (`PackedBatch.from_sequences`). Bins are filled best-fit by the pairs' total lengths.

A pair longer than `max_seq_length` (both sides together) is cut, and counted in `PairStats`: first the
shared prompt from the left (both sides lose the same tokens, one prompt token always stays), then the longer
answer from the right until the two fit. A pair whose chosen and rejected sides are the same tokens (the same
answer, or answers that differ only beyond the cut) gives DPO no signal: it is left out, and a warning counts
and names those rows (`PairStats.identical_rows`). Rows come from `fastft.load_dataset` (format
``preference``) or as dicts with ``prompt`` / ``chosen`` / ``rejected`` (strings or messages); a malformed row
raises `MalformedRowError` naming the row.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import replace

import numpy as np

from fastft.data.errors import FastftDataError, MalformedRowError
from fastft.data.formats import from_preference
from fastft.data.packing import PackedPairs, PairStats, _max_seq_length, best_fit_decreasing, row_list
from fastft.data.tokenize import IGNORE_INDEX, TokenizedData, _check_template, _render_batch, render_chats

__all__ = ["PackedPairs", "PairStats", "pack_pairs"]


def _pair_of(row, index: int) -> dict:
    if isinstance(row, dict) and isinstance(row.get("pair"), dict):
        return row["pair"]
    if not isinstance(row, dict):
        raise MalformedRowError("the data", f"the row is a {type(row).__name__}, not a dict", row=index)
    try:
        return from_preference(row)["pair"]
    except FastftDataError as error:
        raise MalformedRowError("the data", str(error), row=index) from None


def _cut_pair(prompt_tokens: int, chosen: tuple, rejected: tuple, max_seq_length: int):
    """Both sides cut so their lengths add up to at most `max_seq_length`; (chosen, rejected, prompt cut?,
    answer cut?, tokens cut)."""
    (c_ids, c_labels), (r_ids, r_labels) = chosen, rejected
    excess = len(c_ids) + len(r_ids) - max_seq_length
    if excess <= 0:
        return chosen, rejected, False, False, 0
    cut = 0
    prompt_cut = min(-(-excess // 2), prompt_tokens - 1)
    if prompt_cut > 0:
        c_ids, c_labels, r_ids, r_labels = (x[prompt_cut:] for x in (c_ids, c_labels, r_ids, r_labels))
        cut += 2 * prompt_cut
    answer_cut = False
    while len(c_ids) + len(r_ids) > max_seq_length:
        over = len(c_ids) + len(r_ids) - max_seq_length
        if len(c_ids) >= len(r_ids):
            keep = max(len(r_ids), len(c_ids) - over)
            cut += len(c_ids) - keep
            c_ids, c_labels = c_ids[:keep], c_labels[:keep]
        else:
            keep = max(len(c_ids), len(r_ids) - over)
            cut += len(r_ids) - keep
            r_ids, r_labels = r_ids[:keep], r_labels[:keep]
        answer_cut = True
    return (c_ids, c_labels), (r_ids, r_labels), prompt_cut > 0, answer_cut, cut


def pack_pairs(rows: Iterable, tokenizer, max_seq_length: int | None = None) -> PackedPairs:
    """Tokenise preference `rows` and pack them pair by pair (see the module docstring).

    `max_seq_length` bounds a pair's two sides together (a bin holds at least one whole pair); it defaults to
    the tokenizer's ``model_max_length``."""
    max_seq_length = _max_seq_length(tokenizer, max_seq_length)
    if max_seq_length < 4:
        raise ValueError(
            f"max_seq_length={max_seq_length} cannot hold a pair: use at least a few hundred tokens"
        )
    if getattr(rows, "column_names", None) is not None and "pair" not in rows.column_names:
        raise ValueError(
            f"these rows have columns {rows.column_names} and no 'pair': load preference data with "
            "fastft.load_dataset(...) (rows with 'chosen' and 'rejected')"
        )
    pairs = [_pair_of(row, index) for index, row in enumerate(rows)]
    if not pairs:
        raise ValueError("no preference rows: pass rows with 'prompt', 'chosen' and 'rejected'")
    _check_template(tokenizer)
    prompts = _render_batch(tokenizer, [pair["prompt"] for pair in pairs], add_generation_prompt=True)
    conversations = [pair["prompt"] + pair[side] for pair in pairs for side in ("chosen", "rejected")]
    rendered = render_chats(tokenizer, conversations)
    texts = [text for text, _ in rendered]
    encoded = tokenizer(
        texts, add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False
    )
    input_ids, labels, sources, identical = [], [], [], []
    cut_prompt = cut_answer = cut_tokens = dropped = 0
    for index, prompt in enumerate(prompts):
        sides = []
        prompt_tokens = None
        for j in (2 * index, 2 * index + 1):
            text, spans = rendered[j]
            if not text.startswith(prompt):
                raise MalformedRowError(
                    "the data",
                    "the chat template renders the prompt differently once an answer follows it, so the "
                    "answer's tokens cannot be told apart",
                    row=index,
                    fix="Use a chat template whose rendering of a conversation starts with its rendered prompt.",
                )
            ids = np.asarray(encoded["input_ids"][j], dtype=np.int32)
            starts = np.asarray(encoded["offset_mapping"][j], dtype=np.int64).reshape(-1, 2)[:, 0]
            trained = np.zeros(len(ids), dtype=bool)
            for lo, hi in spans:
                if lo >= len(prompt):  # the answer's assistant turns, never the prompt's earlier ones
                    trained |= (starts >= lo) & (starts < hi)
            side_labels = np.where(trained, ids, IGNORE_INDEX).astype(np.int32)
            in_prompt = int((starts < len(prompt)).sum())
            prompt_tokens = in_prompt if prompt_tokens is None else min(prompt_tokens, in_prompt)
            sides.append((ids, side_labels))
        chosen, rejected, prompt_was_cut, answer_was_cut, tokens = _cut_pair(
            prompt_tokens, sides[0], sides[1], max_seq_length
        )
        if np.array_equal(chosen[0], rejected[0]):  # no preference to learn: both log-ratios are equal
            identical.append(index)
            continue
        cut_prompt += prompt_was_cut
        cut_answer += answer_was_cut
        cut_tokens += tokens
        for _, side_labels in (chosen, rejected):
            side_labels[0] = IGNORE_INDEX  # a sequence's first token is never predicted
        if any(not (side_labels != IGNORE_INDEX).any() for _, side_labels in (chosen, rejected)):
            dropped += 1
            continue
        for ids, side_labels in (chosen, rejected):
            input_ids.append(ids)
            labels.append(side_labels)
            sources.append(index)
    stats = PairStats(
        len(pairs), len(input_ids) // 2, cut_prompt, cut_answer, cut_tokens, dropped, tuple(identical)
    )
    if not input_ids:
        fix = "Give each pair a rejected answer that differs from its chosen one." if identical else ""
        raise ValueError(f"No trainable pairs: {stats}. {fix or 'Raise max_seq_length.'}")
    if cut_prompt or cut_answer or dropped:
        cuts = replace(stats, identical_rows=())
        warnings.warn(f"pack_pairs: {cuts} to fit max_seq_length={max_seq_length}.", stacklevel=2)
    if identical:
        warnings.warn(
            f"pack_pairs: {len(identical)} of {len(pairs)} pairs have a chosen answer equal to the rejected one "
            f"({row_list(stats.identical_rows)}): they give DPO no signal and were left out. Fix or remove those "
            "rows.",
            stacklevel=2,
        )
    data = TokenizedData(input_ids=input_ids, labels=labels, source_rows=sources)
    pair_lengths = data.lengths[0::2] + data.lengths[1::2]
    bins = [
        [2 * p + side for p in pair_bin for side in (0, 1)]
        for pair_bin in best_fit_decreasing(pair_lengths, max_seq_length)
    ]
    return PackedPairs(data, bins, max_seq_length, stats)

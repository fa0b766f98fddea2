"""Data shapes for `fastft bench sft`: chats and documents of realistic lengths, made offline from local text.

A packed step's speed depends on how long its rows are: a system that runs attention once per packed segment
(Unsloth on torch < 2.12) gains as segments grow. So the headline is measured on three shapes, each a
length distribution of real text rendered with a real chat template, tokenised with the ``tiny-llama3``
preset's tokenizer (Llama-3.1's special tokens and chat template on the presets' byte-level BPE) and the
same rows handed to every system:

* ``short``      -- the turn lengths of the bench's random-token chats until 2026-12-07: 1 to 3 turns, user
  turns log-normal with median 120 tokens, answers 220 (sigma 0.7); trained on the answers. Rows: median
  about 880 tokens, p90 about 1,640 (the random-token chats of the same turn lengths: 816 and 1,594).
* ``multi-turn`` -- 1 to 3 turns with short questions and answers of widely spread length (medians 45 and
  115, sigma 1.2): rows of median about 570 tokens and p90 about 1,480, as in the independent measurement of
  issue 57 (row median 522, p90 1,497); trained on the answers. Its rows are shorter than ``short``'s but
  spread wider: more, shorter segments per pack.
* ``documents``  -- plain documents of 2,048 to 4,000 tokens (uniform), BOS first and EOS last, every token
  trained (continued pre-training on long text).

The text is the docstrings of fastft's own modules, classes and functions (read from the installed package's
sources with `ast`, in path order), so it travels with the package and needs no download; a user turn is a
question framing an excerpt, an answer an excerpt of its drawn length. The same seed gives the same rows
on every machine running the same fastft. `row_stats` summarises a shape's rows and their best-fit packing.
"""

from __future__ import annotations

import ast
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOKENIZER_PRESET = "tiny-llama3"  # its tokenizer renders and tokenises every shape


@dataclass(frozen=True)
class Shape:
    """A length distribution: chats (`turns` inclusive range, log-normal user and answer tokens) or documents
    (`document_tokens`: a uniform range of tokens)."""

    name: str
    kind: str  # "chat" or "documents"
    turns: tuple[int, int] = (1, 3)
    user_median: float = 0.0
    assistant_median: float = 0.0
    sigma: float = 0.0
    document_tokens: tuple[int, int] = (0, 0)

    def describe(self) -> str:
        if self.kind == "documents":
            lo, hi = self.document_tokens
            return f"documents of {lo:,}-{hi:,} tokens (uniform), every token trained"
        lo, hi = self.turns
        return (
            f"chats of {lo}-{hi} turns, user turns log-normal median {self.user_median:g} tokens, answers "
            f"{self.assistant_median:g} (sigma {self.sigma:g}), trained on the answers"
        )


SHAPES = {
    "short": Shape("short", "chat", (1, 3), 120.0, 220.0, 0.7),
    "multi-turn": Shape("multi-turn", "chat", (1, 3), 45.0, 115.0, 1.2),
    "documents": Shape("documents", "documents", document_tokens=(2048, 4000)),
}

# A user turn frames an excerpt; the first turn of a chat opens it, later turns follow up.
_OPENERS = (
    "I'm reading the documentation of a fine-tuning library and got stuck on this passage:\n\n{}\n\n"
    "Can you explain it in plain words?",
    "What does this mean?\n\n{}",
    "Summarise the following for a colleague who has not used the library:\n\n{}",
    "{}\n\nIs that right, and why does it matter for training speed?",
    "Could you walk me through this part of the docs?\n\n{}",
)
_FOLLOW_UPS = (
    "Thanks. And this part?\n\n{}",
    "How does that fit with this?\n\n{}",
    "One more question: {}",
    "Then what happens here?\n\n{}",
)


def parse_shapes(text: str) -> list[str]:
    """The shape names of a comma-separated list, checked against `SHAPES`."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SHAPES]
    if unknown or not names:
        raise ValueError(f"--shapes {text!r}: give a comma-separated list from {', '.join(SHAPES)}")
    return names


@functools.cache
def corpus() -> tuple[str, ...]:
    """The paragraphs (8 words or more, whitespace folded) of every docstring in fastft's sources."""
    package = Path(__file__).resolve().parents[1]  # fastft/
    paragraphs = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                for paragraph in (ast.get_docstring(node) or "").split("\n\n"):
                    words = paragraph.split()
                    if len(words) >= 8:
                        paragraphs.append(" ".join(words))
    if not paragraphs:
        raise RuntimeError(f"no docstrings found under {package}: the shapes' text")
    return tuple(paragraphs)


class _Excerpts:
    """Runs of consecutive corpus paragraphs cut to about a number of tokens."""

    def __init__(self, tokenizer):
        self.paragraphs = corpus()
        counts = tokenizer(list(self.paragraphs), add_special_tokens=False)["input_ids"]
        self.tokens = [len(ids) for ids in counts]
        self.count = functools.cache(lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))

    def take(self, rng: np.random.Generator, tokens: int) -> str:
        index = int(rng.integers(len(self.paragraphs)))
        parts, left = [], max(1, tokens)
        while left > 0:
            paragraph, size = self.paragraphs[index], self.tokens[index]
            if size > left:  # the last paragraph cut at a word, in proportion
                words = paragraph.split()
                paragraph = " ".join(words[: max(1, round(len(words) * left / size))])
            parts.append(paragraph)
            left -= size + 1  # the paragraph break
            index = (index + 1) % len(self.paragraphs)
        return "\n\n".join(parts)


def _lognormal(rng: np.random.Generator, median: float, sigma: float) -> int:
    return max(1, int(rng.lognormal(math.log(median), sigma)))


def shape_texts(shape: Shape, count: int, seed: int, tokenizer) -> list[dict]:
    """`count` rows of `shape` before tokenisation: ``{"messages": [...]}`` chats or ``{"text": ...}``."""
    rng = np.random.default_rng(seed)
    excerpts = _Excerpts(tokenizer)
    rows = []
    for _ in range(count):
        if shape.kind == "documents":
            lo, hi = shape.document_tokens
            # BOS first (the chat template writes it for chats; a text row gets EOS from the tokenisation)
            text = excerpts.take(rng, int(rng.integers(lo, hi + 1)) - 2)
            rows.append({"text": (tokenizer.bos_token or "") + text})
            continue
        messages = []
        for turn in range(int(rng.integers(shape.turns[0], shape.turns[1] + 1))):
            frames = _FOLLOW_UPS if turn else _OPENERS
            frame = frames[int(rng.integers(len(frames)))]
            user = _lognormal(rng, shape.user_median, shape.sigma)
            answer = _lognormal(rng, shape.assistant_median, shape.sigma)
            excerpt = excerpts.take(rng, user - excerpts.count(frame.format("")))
            messages.append({"role": "user", "content": frame.format(excerpt)})
            messages.append({"role": "assistant", "content": excerpts.take(rng, answer)})
        rows.append({"messages": messages})
    return rows


@functools.cache
def shape_tokenizer():
    """The tokenizer every shape is rendered and tokenised with (`TOKENIZER_PRESET`'s)."""
    from fastft.models.presets import load_preset_tokenizer

    return load_preset_tokenizer(TOKENIZER_PRESET)


def shape_rows(
    name: str, count: int, max_length: int, seed: int = 0, **overrides
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`count` rows of shape `name` as (input_ids, labels) int64 arrays, labels -100 where not trained (a chat's
    prompts and template headers; a document's first token), each cut to `max_length` tokens (a chat cut
    before its first answer is left out). `overrides` replace the shape's fields (``user_median=...``)."""
    import dataclasses

    from fastft.data.tokenize import tokenize_rows

    shape = dataclasses.replace(SHAPES[name], **overrides)
    tokenizer = shape_tokenizer()
    data = tokenize_rows(
        shape_texts(shape, count, seed, tokenizer),
        tokenizer,
        max_length,
        train_on="responses",
        overlong="truncate",
    )
    return [
        (ids.astype(np.int64), labels.astype(np.int64))
        for ids, labels in zip(data.input_ids, data.labels, strict=True)
    ]


def row_stats(rows: list[tuple[np.ndarray, np.ndarray]], max_length: int) -> dict:
    """A shape's rows in numbers: their token lengths (median, p90, mean, max), the trained share, and their
    best-fit packing into `max_length`-token micro-batches (real tokens and segments per pack)."""
    from fastft.data.packing import best_fit_decreasing

    lengths = np.array([len(ids) for ids, _ in rows], dtype=np.int64)
    trained = sum(int((labels != -100).sum()) for _, labels in rows)
    packs = best_fit_decreasing(lengths, max_length)
    segments = np.array([len(pack) for pack in packs])
    filled = np.array([int(lengths[list(pack)].sum()) for pack in packs])
    return dict(
        rows=len(rows),
        row_tokens_median=float(np.median(lengths)),
        row_tokens_p90=float(np.percentile(lengths, 90)),
        row_tokens_mean=float(lengths.mean()),
        row_tokens_max=int(lengths.max()),
        trained_share=trained / int(lengths.sum()),
        pack_length=max_length,
        packs=len(packs),
        tokens_per_pack=float(filled.mean()),
        segments_per_pack=float(segments.mean()),
        segments_per_pack_median=float(np.median(segments)),
        segments_per_pack_p90=float(np.percentile(segments, 90)),
        tokenizer=TOKENIZER_PRESET,
    )

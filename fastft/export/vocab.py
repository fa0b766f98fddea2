"""The tokenizer as GGUF metadata (``tokenizer.ggml.*``): the model kind, every token with its type, the BPE
merges, the special token ids and the chat template.

A byte-level BPE tokenizer (GPT-2 style: Llama 3, Qwen, the presets) is written as llama.cpp's ``gpt2`` model
with its merges; a SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Gemma) goes through the `gguf`
package's ``LlamaHfVocab`` as the ``llama`` model. llama.cpp tokenizes such a model by merging, at each step,
the adjacent pair whose joined piece has the highest score, where the Hugging Face BPE merges the pair of
lowest merge rank: each piece's score is minus the rank of the merge that makes it (``LlamaHfVocab`` gives every
piece -1000, and llama.cpp then merges left to right, another tokenization). Whether a space is put before the
text (``add_space_prefix``) follows the tokenizer: Llama 2's ``Prepend`` normaliser and Mistral's ``Metaspace``
do, Gemma's tokenizer does not. (A text that already starts with a space differs: ``Metaspace`` then adds none,
llama.cpp one.) Merges and the chat template are read by the
`gguf` package's ``SpecialVocab`` from the tokenizer as it saves itself; the special ids come from the
tokenizer object, the one the model was trained with.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import gguf

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class TokenizerExportError(ValueError):
    """The tokenizer cannot be written faithfully; the message says why and what to do."""


@dataclass
class Vocab:
    """Everything written under ``tokenizer.ggml.*`` (and ``tokenizer.chat_template``)."""

    model: str  # "gpt2" or "llama"
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] = field(default_factory=list)
    special_ids: dict[str, int] = field(default_factory=dict)  # bos, eos, pad, unk
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None  # the llama model's; None: not written (gpt2)
    chat_template: str | None = None

    def entries(self) -> list[tuple[str, object, str]]:
        """(key, value, gguf value type name) of every metadata entry."""
        items: list[tuple[str, object, str]] = [("tokenizer.ggml.model", self.model, "STRING")]
        if self.pre is not None:
            items.append(("tokenizer.ggml.pre", self.pre, "STRING"))
        items += [
            ("tokenizer.ggml.tokens", self.tokens, "ARRAY"),
            ("tokenizer.ggml.token_type", self.token_types, "ARRAY"),
        ]
        if self.scores is not None:
            items.append(("tokenizer.ggml.scores", self.scores, "ARRAY"))
        if self.merges:
            items.append(("tokenizer.ggml.merges", self.merges, "ARRAY"))
        for kind, token_id in self.special_ids.items():
            items.append((f"tokenizer.ggml.{kind}_token_id", int(token_id), "UINT32"))
        items += [
            ("tokenizer.ggml.add_bos_token", self.add_bos, "BOOL"),
            ("tokenizer.ggml.add_eos_token", self.add_eos, "BOOL"),
        ]
        if self.add_space_prefix is not None:
            items.append(("tokenizer.ggml.add_space_prefix", self.add_space_prefix, "BOOL"))
        if self.chat_template:
            items.append(("tokenizer.chat_template", self.chat_template, "STRING"))
        return items


def build_vocab(tokenizer, vocab_size: int, model_type: str) -> Vocab:
    """The `Vocab` of a Hugging Face fast tokenizer, padded to the model's `vocab_size` (embedding rows the
    tokenizer never produces get ``[PAD{i}]`` tokens of type UNUSED, as llama.cpp's converter writes them)."""

    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise TokenizerExportError(
            f"GGUF export needs a fast (tokenizers-backed) tokenizer; got {type(tokenizer).__name__}. Load it "
            "with AutoTokenizer.from_pretrained(name, use_fast=True)."
        )
    spec = json.loads(backend.to_str())
    kind = spec.get("model", {}).get("type")
    if kind != "BPE":
        raise TokenizerExportError(
            f"GGUF export supports BPE tokenizers (byte-level or with byte fallback); this one is {kind}. Save "
            "the merged model (fastft.save_merged) and convert it with llama.cpp's convert_hf_to_gguf.py."
        )
    byte_level = _has_byte_level(spec.get("pre_tokenizer")) or _has_byte_level(spec.get("decoder"))
    if not byte_level and not spec["model"].get("byte_fallback"):
        raise TokenizerExportError(
            "GGUF export: this BPE tokenizer is neither byte-level nor byte-fallback, which llama.cpp cannot "
            "reproduce."
        )
    with tempfile.TemporaryDirectory(prefix="fastft-vocab-") as folder:
        tokenizer.save_pretrained(folder)
        special = gguf.SpecialVocab(Path(folder), load_merges=byte_level, n_vocab=vocab_size)
        if byte_level:
            tokens, types = _byte_level_tokens(tokenizer, vocab_size)
            scores = None
            model, pre = "gpt2", _pre_tokenizer_name(spec, model_type, len(tokenizer))
        else:
            hf_vocab = gguf.LlamaHfVocab(Path(folder))
            ranks = _merge_ranks(spec["model"].get("merges") or [])
            tokens, scores, types = [], [], []
            for text, _, token_type in hf_vocab.all_tokens():
                tokens.append(text.decode("utf-8") if isinstance(text, bytes) else text)
                scores.append(-float(ranks.get(tokens[-1], 0)))
                types.append(int(token_type))
            for i in range(len(tokens), vocab_size):
                tokens.append(f"[PAD{i}]")
                scores.append(-1000.0)
                types.append(UNUSED)
            model, pre = "llama", "default"
    ids = {}
    for kind_name in ("bos", "eos", "pad", "unk"):
        token_id = getattr(tokenizer, f"{kind_name}_token_id", None)
        if token_id is not None:
            ids[kind_name] = int(token_id)
    probe = tokenizer("a")["input_ids"]
    add_bos = bool(probe) and ids.get("bos") is not None and probe[0] == ids["bos"]
    add_eos = bool(probe) and ids.get("eos") is not None and probe[-1] == ids["eos"] and len(probe) > 1
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: llama.cpp reads the default one
        template = template.get("default") or next(iter(template.values()))
    return Vocab(
        add_space_prefix=None if byte_level else _adds_space_prefix(spec),
        model=model,
        pre=pre,
        tokens=tokens,
        token_types=types,
        scores=scores,
        merges=list(special.merges),
        special_ids=ids,
        add_bos=add_bos,
        add_eos=add_eos,
        chat_template=template,
    )


def _merge_ranks(merges: list) -> dict[str, int]:
    """Each piece a merge makes, with the 1-based rank of the first merge that makes it (merges are "a b"
    strings or [a, b] pairs)."""
    ranks: dict[str, int] = {}
    for rank, merge in enumerate(merges, start=1):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        ranks.setdefault(left + right, rank)
    return ranks


def _adds_space_prefix(spec: dict) -> bool:
    """Whether the tokenizer puts "▁" before a text: a ``Prepend`` normaliser (Llama 2) or a ``Metaspace``
    pre-tokenizer that prepends (Mistral); Gemma's has neither."""

    def parts(part, key):
        if not part:
            return []
        return [part, *[p for child in part.get(key, []) or [] for p in parts(child, key)]]

    for normalizer in parts(spec.get("normalizer"), "normalizers"):
        if normalizer.get("type") == "Prepend" and normalizer.get("prepend") == "\u2581":
            return True
    for pre in parts(spec.get("pre_tokenizer"), "pretokenizers"):
        if pre.get("type") == "Metaspace":
            return (
                pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never")
                != "never"
            )
    return False


def _byte_level_tokens(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    by_id = {token_id: token for token, token_id in tokenizer.get_vocab().items()}
    if len(by_id) > vocab_size:
        raise TokenizerExportError(
            f"the tokenizer has {len(by_id)} tokens but the model's embedding only {vocab_size} rows: they "
            "belong to different models."
        )
    added = {token_id: added for token_id, added in tokenizer.added_tokens_decoder.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(added[i].content)
            types.append(CONTROL if added[i].special else USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL)
    return tokens, types


def _has_byte_level(part) -> bool:
    if not part:
        return False
    if part.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(p) for p in part.get("pretokenizers", part.get("decoders", [])) or [])


def _pre_tokenizer_name(spec: dict, model_type: str, size: int) -> str:
    """llama.cpp's name of the pre-tokenizer's split regex (its converter fingerprints the tokenizer; these are
    the cases fastft sees)."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # ByteLevel's own split is GPT-2's regex (llama.cpp's name: "gpt-2", not "gpt2")
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        return "qwen2"
    if model_type in ("llama", "mistral", "mixtral") and size >= 128000:
        return "llama-bpe"
    return "default"

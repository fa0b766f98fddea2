"""The tokenizer a GGUF file carries tokenizes as the Hugging Face tokenizer did.

SentencePiece-style BPE tokenizers (byte fallback, "▁" for spaces: Llama 2, Mistral, Gemma) are written as
llama.cpp's ``llama`` model, which merges the adjacent pair of highest score: the scores must follow the merge
ranks, and ``add_space_prefix`` must say whether the tokenizer puts "▁" before a text. `spm_tokenize` is
llama.cpp's SPM tokenizer (``llm_tokenizer_spm_session`` in ``src/llama-vocab.cpp``) written in Python, run
on the file's own metadata; where llama-cpp-python is installed, llama.cpp itself tokenizes and runs the
files (`test_llama_cpp_tokenizes_and_computes_as_transformers`)."""

from __future__ import annotations

import heapq
import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import fastft
from fastft.data.skills import BUNDLED_DIR
from fastft.export.reference import read_metadata
from fastft.export.writer import write_gguf

TEXTS = [
    "Hello world, 12 cats and über-straße!",
    "What is 7 plus 5? Answer with the result only.",
    "two spaces  inside\nand a newline\n\n",
    "日本語 and emoji 🙂 ok",
]
SPECIALS = ["<unk>", "<s>", "</s>"]


def spm_tokenizer(style: str) -> PreTrainedTokenizerFast:
    """A byte-fallback BPE over "▁"-joined text as the three families ship it: ``llama2`` (a ``Prepend``
    normaliser), ``metaspace`` (Mistral's pre-tokenizer), ``gemma`` (no space put before the text); the 256
    byte pieces are ordinary pieces after the specials, as in those vocabularies."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if style == "llama2":
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    elif style == "metaspace":
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first", split=False
        )
    else:
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )

    def texts():
        for file in sorted(BUNDLED_DIR.glob("*.jsonl"))[:3]:
            with open(file, encoding="utf-8") as f:
                for line in f:
                    yield from (m["content"] for m in json.loads(line)["messages"])

    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    spec = json.loads(tokenizer.to_str())
    learnt = [p for p, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]) if p not in SPECIALS]
    pieces = SPECIALS + [f"<0x{i:02X}>" for i in range(256)] + learnt
    spec["model"]["vocab"] = {piece: i for i, piece in enumerate(pieces)}
    spec["added_tokens"] = [dict(a, id=pieces.index(a["content"])) for a in spec["added_tokens"]]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="</s>",
    )


def spm_tokenize(meta: dict, text: str) -> list[int]:
    """llama.cpp's SPM tokenization of `text` (no special tokens) from a file's ``tokenizer.ggml.*``."""
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    ids = {token: i for i, token in enumerate(tokens)}
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        text = " " + text
    symbols = list(text.replace(" ", "▁"))
    alive = [True] * len(symbols)
    nxt, prv = list(range(1, len(symbols))) + [-1], list(range(-1, len(symbols) - 1))
    queue, split = [], {}

    def bigram(left, right):
        if left != -1 and right != -1 and (symbols[left] + symbols[right]) in ids:
            joined = symbols[left] + symbols[right]
            heapq.heappush(queue, (-scores[ids[joined]], left, right, len(joined)))
            split[joined] = (symbols[left], symbols[right])

    for i in range(1, len(symbols)):
        bigram(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not (alive[left] and alive[right]) or len(symbols[left]) + len(symbols[right]) != size:
            continue
        symbols[left] += symbols[right]
        alive[right] = False
        nxt[left] = nxt[right]
        if nxt[right] != -1:
            prv[nxt[right]] = left
        bigram(prv[left], left)
        bigram(left, nxt[left])

    out = []

    def resegment(piece):
        if piece in ids:
            out.append(ids[piece])
        elif piece in split:
            resegment(split[piece][0])
            resegment(split[piece][1])
        else:
            out.extend(ids[f"<0x{byte:02X}>"] for byte in piece.encode())

    i = 0
    while i != -1:
        resegment(symbols[i])
        i = nxt[i]
    return out


def _model_for(tokenizer):
    model, _ = fastft.load_model("tiny-mistral", dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    return model.eval()


@pytest.mark.parametrize("style", ["llama2", "metaspace", "gemma"])
def test_sentencepiece_style_vocab_tokenizes_in_llama_cpp_as_in_transformers(style, tmp_path):
    tokenizer = spm_tokenizer(style)
    path = write_gguf(_model_for(tokenizer), tmp_path / "m.gguf", tokenizer, "f32").path
    meta = read_metadata(path)
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.add_space_prefix"] == (style != "gemma")
    for text in TEXTS:
        assert spm_tokenize(meta, text) == tokenizer(text, add_special_tokens=False)["input_ids"], text


def test_byte_level_presets_name_a_pre_tokenizer_llama_cpp_knows(tmp_path):
    model, tokenizer = fastft.load_model("tiny-llama")
    meta = read_metadata(write_gguf(model, tmp_path / "m.gguf", tokenizer, "f32").path)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"  # not "gpt2"
    assert "tokenizer.ggml.add_space_prefix" not in meta


@pytest.mark.parametrize(
    "name", ["tiny-llama", "tiny-llama3", "tiny-qwen3", "tiny-gemma3", "tiny-moe", "spm-llama2"]
)
def test_llama_cpp_tokenizes_and_computes_as_transformers(name, tmp_path):
    """llama.cpp itself (llama-cpp-python) reads the file: the same tokens for plain and chat text, and the
    same next-token logits as transformers (f32, 40 tokens)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    if name.startswith("spm-"):
        tokenizer = spm_tokenizer(name[4:])
        tokenizer.chat_template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
        model = _model_for(tokenizer)
    else:
        model, tokenizer = fastft.load_model(name, dtype=torch.float32)
    path = write_gguf(model, tmp_path / "m.gguf", tokenizer, "f32").path
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=1)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": TEXTS[1]}], tokenize=False)
    for text, special in [*((t, False) for t in TEXTS), (chat, True)]:
        want = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert llm.tokenize(text.encode(), add_bos=False, special=special) == want, text
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.eval(ids)
    got = torch.tensor(llm.scores[: len(ids)], dtype=torch.float32)
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0]
    assert (got.argmax(-1) == want.argmax(-1)).all()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * want.abs().max().item())

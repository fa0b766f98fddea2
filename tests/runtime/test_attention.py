"""Packed attention: every backend against SDPA run per sequence; patched models are exact, isolated,
instance-local and never rebuild packing metadata."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, masking_utils

import fastft
from fastft.data.batch import PackedBatch
from fastft.data.skills import BUNDLED_DIR
from fastft.runtime import attention
from fastft.runtime.attention import (
    IMPLEMENTATION,
    AttentionBackendError,
    available_backends,
    choose_backend,
    packed_attention,
    patch_packed_attention,
    unpatch_packed_attention,
)
from fastft.runtime.model_state import model_state
from fastft.training.loss import causal_lm_loss_sum

LENGTHS = (7, 31, 64, 3, 97)  # ragged, one longer than the window below
PRESETS = ("tiny-llama", "tiny-qwen3", "tiny-mistral", "tiny-moe", "tiny-mixtral")
CPU_BACKENDS = ("sdpa_masked", "sdpa_segments")

with open(BUNDLED_DIR / "skills.jsonl", encoding="utf-8") as _f:
    ROWS = [json.loads(line) for _, line in zip(range(120), _f, strict=False)]


def _batch(lengths=LENGTHS, vocab: int = 500, seed: int = 0) -> PackedBatch:
    generator = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=generator).numpy() for n in lengths]
    return PackedBatch.from_sequences(ids, [i.copy() for i in ids])


def _reference(q, k, v, lengths, window):
    """SDPA run on each sequence alone (GQA by repeating heads; the mask written out by hand)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    outputs, start = [], 0
    for n in lengths:
        i = torch.arange(n)
        mask = i[None, :] <= i[:, None]
        if window:
            mask &= i[:, None] - i[None, :] < window
        s = slice(start, start + n)
        outputs.append(F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], attn_mask=mask))
        start += n
    return torch.cat(outputs, dim=2).transpose(1, 2)


def _qkv(total: int, heads: int = 4, kv_heads: int = 2, dim: int = 24, dtype=torch.float32, device="cpu"):
    generator = torch.Generator(device=device).manual_seed(1)
    make = lambda h: torch.randn(1, h, total, dim, generator=generator, dtype=dtype, device=device)  # noqa: E731
    return [t.requires_grad_() for t in (make(heads), make(kv_heads), make(kv_heads))]


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backend_equals_sdpa_per_sequence_forward_and_backward(backend, window):
    batch = _batch()
    q, k, v = _qkv(batch.num_tokens)
    out = packed_attention(q, k, v, batch, backend, sliding_window=window)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected = _reference(q2, k2, v2, LENGTHS, window)
    expected_grads = torch.autograd.grad(expected, (q2, k2, v2), upstream)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):  # sums of ~100 terms of size ~1
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 16])
def test_flex_backend_forward_equals_sdpa_per_sequence_on_cpu(window):
    batch = _batch()
    q, k, v = (t.detach() for t in _qkv(batch.num_tokens))
    with torch.no_grad():  # flex has no CPU backward; the GPU test covers it
        out = packed_attention(q, k, v, batch, "flex", sliding_window=window)
    torch.testing.assert_close(out, _reference(q, k, v, LENGTHS, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lengths, window", [((32, 32, 32), None), ((96,), None), ((48, 48), 48)])
def test_uniform_bins_run_as_one_causal_batch_equal_to_per_sequence(lengths, window):
    """Equal-length bins skip varlen for one batched causal SDPA call (cuDNN on Hopper): same numbers."""
    batch = _batch(lengths)
    assert attention._uniform_length(batch) == lengths[0]
    q, k, v = _qkv(batch.num_tokens)
    out = attention._sdpa_uniform(q, k, v, lengths[0], None)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected = _reference(q2, k2, v2, lengths, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, torch.autograd.grad(expected, (q2, k2, v2), upstream), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert attention._uniform_length(_batch((32, 31))) is None


def test_token_major_view_has_no_index_backward():
    """``t[0]`` would make autograd zero-fill and copy the whole q / k / v gradient in every layer."""
    q = torch.randn(1, 4, 10, 8, requires_grad=True)
    view = attention._token_major(q, q.dtype)
    assert view.shape == (10, 4, 8) and view.data_ptr() == q.data_ptr()
    names, stack = set(), [view.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.add(type(node).__name__)
            stack.extend(fn for fn, _ in node.next_functions)
    assert not any("Select" in n for n in names), names


def test_artefacts_are_built_once_per_batch():
    batch = _batch()
    q, k, v = _qkv(batch.num_tokens)
    packed_attention(q, k, v, batch, "sdpa_masked")
    mask = batch._artifacts["dense_mask:None"]
    packed_attention(q, k, v, batch, "sdpa_masked")
    assert batch._artifacts["dense_mask:None"] is mask
    assert batch.to("cpu") is batch  # same device: same object, same cache


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_patched_packed_loss_equals_per_sequence_loss(name, backend):
    model, tokenizer = fastft.load_model(name)
    data = fastft.pack(ROWS, tokenizer, 256)
    bins = [0, 1, 2]
    alone = sum(
        causal_lm_loss_sum(model, PackedBatch.from_sequences([data.data.input_ids[i]], [data.data.labels[i]]))
        for b in bins
        for i in data.bins[b]
    )
    patch_packed_attention(model, backend)
    packed = causal_lm_loss_sum(model, data.batch(bins))
    assert float(packed) == pytest.approx(float(alone), rel=1e-5)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_patched_gradients_equal_per_sequence_gradients(backend):
    model, tokenizer = fastft.load_model("tiny-qwen3")
    model = fastft.add_lora(model, r=4, alpha=8, gradient_checkpointing=True)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.02)
    data = fastft.pack(ROWS, tokenizer, 256)
    lora = [p for n, p in model.named_parameters() if p.requires_grad]

    def grads(loss):
        return torch.autograd.grad(loss, lora)

    expected = grads(
        sum(
            causal_lm_loss_sum(
                model, PackedBatch.from_sequences([data.data.input_ids[i]], [data.data.labels[i]])
            )
            for i in data.bins[0]
        )
    )
    patch_packed_attention(model, backend)
    got = grads(causal_lm_loss_sum(model, data.batch([0])))  # with recompute: artefacts reused
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral"])
def test_perturbing_one_sequence_leaves_the_others_bit_identical(name):
    model, _ = fastft.load_model(name)
    patch_packed_attention(model, "sdpa_masked")
    batch = _batch(vocab=model.config.vocab_size)
    ids = batch.input_ids.clone()
    ids[0, 7 + 31 : 7 + 31 + 64] = torch.randint(3, 400, (64,), generator=torch.Generator().manual_seed(9))
    changed = PackedBatch(**{**batch.__dict__, "input_ids": ids, "_artifacts": {}})
    positions = torch.arange(batch.num_tokens)

    def logits(b):
        with torch.no_grad():
            return model(
                input_ids=b.input_ids,
                position_ids=b.position_ids,
                use_cache=False,
                fastft_batch=b,
                attention_mask=torch.ones(1, 1, 0, 0, dtype=torch.bool),
            ).logits[0]

    a, c = logits(batch), logits(changed)
    others = (positions < 38) | (positions >= 102)
    assert torch.equal(a[others], c[others])
    assert not torch.equal(a[~others], c[~others])


def test_packed_step_builds_no_mask_and_detects_no_packing(monkeypatch):
    model, tokenizer = fastft.load_model("tiny-qwen3")
    patch_packed_attention(model, "sdpa_segments")
    batch = fastft.pack(ROWS, tokenizer, 256).batch([0, 1])

    def forbidden(*args, **kwargs):
        raise AssertionError("transformers rebuilt packing metadata")

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", forbidden)
    monkeypatch.setattr(masking_utils, "sdpa_mask", forbidden)
    causal_lm_loss_sum(model, batch).backward()


def test_generation_is_unchanged_by_the_patch():
    model, tokenizer = fastft.load_model("tiny-llama")
    prompts = [
        [{"role": "user", "content": "Convert 3 km to m."}],
        [{"role": "user", "content": "Add 2 and 9."}],
    ]
    before = fastft.generate_answers(model, tokenizer, prompts, max_new_tokens=8)
    patch_packed_attention(model, "sdpa_masked")
    assert fastft.generate_answers(model, tokenizer, prompts, max_new_tokens=8) == before


def test_patch_is_per_instance_idempotent_and_reversible(tmp_path):
    patched, tokenizer = fastft.load_model("tiny-llama")
    other, _ = fastft.load_model("tiny-llama")
    patch_packed_attention(patched, "sdpa_masked")
    patch_packed_attention(patched, "sdpa_masked")  # a re-run notebook cell
    assert patched.config._attn_implementation == IMPLEMENTATION
    assert other.config._attn_implementation == "sdpa"
    patched.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert IMPLEMENTATION not in json.dumps(saved)
    AutoModelForCausalLM.from_pretrained(tmp_path)  # plain transformers reads what a patched model saves
    unpatch_packed_attention(patched)
    assert patched.config._attn_implementation == "sdpa" and model_state(patched).attention is None


def test_auto_picks_sdpa_on_the_cpu_and_rejects_unknown_backends():
    model, tokenizer = fastft.load_model("tiny-llama")
    patch_packed_attention(model)
    batch = fastft.pack(ROWS, tokenizer, 256).batch([0])
    assert attention.describe_backend(model) is None  # patched, not resolved yet
    assert choose_backend(model, batch) == "sdpa_masked" == model_state(model).attention.resolved
    assert attention.describe_backend(model).startswith("sdpa_masked (SDPA with a block-diagonal")
    assert set(attention.BACKEND_KERNELS) == set(attention.BACKENDS) == set(attention._BACKEND_FUNCTIONS)
    assert available_backends("cpu") == ["sdpa_masked", "sdpa_segments"]
    with pytest.raises(AttentionBackendError, match="unknown attention backend"):
        patch_packed_attention(model, "flashy")
    with pytest.raises(AttentionBackendError, match="dropout"):
        q, k, v = _qkv(batch.num_tokens)
        attention._varlen(q, k, v, batch, None, 0.1, None)


def test_trainer_trains_through_packed_attention():
    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=4, alpha=8)
    result = fastft.train(model, tokenizer, fastft.pack(ROWS, tokenizer, 256), max_steps=3, progress=False)
    assert model_state(model).attention.resolved == "sdpa_masked" and len(result.steps) == 3


# ---------------------------------------------------------------- long sequences: backward per head group


def _graph_names(tensor, depth: int = 6) -> set[str]:
    names, frontier = set(), [tensor.grad_fn]
    for _ in range(depth):
        frontier = [f for node in frontier if node is not None for f, _ in node.next_functions]
        names.update(type(node).__name__ for node in frontier if node is not None)
    return names | {type(tensor.grad_fn).__name__}


@pytest.mark.parametrize("kv_heads", [2, 4, 1])
def test_grouped_backward_equals_the_whole_backward(kv_heads):
    """Attention's backward one key/value head group at a time (`grouped_backward`) gives the whole call's
    gradients bit for bit: heads never interact (CPU flash kernel, 2 sequences of 37 tokens)."""
    from fastft.runtime.attention import _sdpa_flash_cpu, grouped_backward

    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 37, 16, generator=generator)
    k, v = (torch.randn(2, kv_heads, 37, 16, generator=generator) for _ in range(2))
    grad = torch.randn(2, 4, 37, 16, generator=generator)
    kernel = _sdpa_flash_cpu(0.25)
    out, lse, state = kernel.forward(q, k, v)
    whole = kernel.backward(grad, q, k, v, out, lse, state)
    grouped = grouped_backward(kernel, grad, q, k, v, out, lse, state)
    for a, b in zip(grouped, whole, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_long_sequences_take_the_grouped_backward_and_match_sdpa(monkeypatch):
    """From `GROUPED_BACKWARD_FROM` tokens a single-sequence bin runs `_LongAttention` (here lowered to 16):
    output and gradients equal plain SDPA's (fp32, 1e-5); shorter bins keep plain SDPA."""
    from fastft.runtime import attention

    monkeypatch.setattr(attention, "GROUPED_BACKWARD_FROM", 16)
    generator = torch.Generator().manual_seed(4)
    # token-major projections as the model hands them: [1, heads, tokens, dim] views
    query = torch.randn(1, 41, 4, 16, generator=generator).transpose(1, 2).requires_grad_()
    key = torch.randn(1, 41, 2, 16, generator=generator).transpose(1, 2).requires_grad_()
    value = torch.randn(1, 41, 2, 16, generator=generator).transpose(1, 2).requires_grad_()
    weight = torch.randn(1, 41, 4, 16, generator=generator)
    out = attention._sdpa_uniform(query, key, value, 41, 0.25)
    assert "_LongAttentionBackward" in _graph_names(out)
    grads = torch.autograd.grad((out * weight).sum(), (query, key, value))
    expected_out = F.scaled_dot_product_attention(
        query, key, value, is_causal=True, scale=0.25, enable_gqa=True
    )
    expected_out = expected_out.transpose(1, 2).reshape(1, 41, 4, 16)
    expected = torch.autograd.grad((expected_out * weight).sum(), (query, key, value))
    assert torch.allclose(out, expected_out, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, expected, strict=True):
        assert float((a - b).norm() / b.norm()) <= 1e-5
    monkeypatch.setattr(attention, "GROUPED_BACKWARD_FROM", 42)
    short = attention._sdpa_uniform(query, key, value, 41, 0.25)
    assert "_LongAttentionBackward" not in _graph_names(short)


@pytest.mark.gpu
def test_gpu_grouped_backward_bf16_long_sequence_matches_and_saves_memory():
    """Llama-3.1-8B's attention shape (32 query heads, 8 key/value heads, dim 128) at 40,960 tokens in bf16:
    the grouped backward equals the whole-call backward (to 1e-2: FlashAttention's dq accumulates with atomics,
    so two whole calls differ too) and its peak is lower by at least two [tokens, hidden] 16-bit tensors."""
    from fastft.runtime.attention import _sdpa_kernel, grouped_backward

    tokens, heads, kv_heads, dim = 40960, 32, 8, 128
    q = torch.randn(1, tokens, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (
        torch.randn(1, tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        for _ in range(2)
    )
    grad = torch.randn_like(q)
    kernel = _sdpa_kernel(q.requires_grad_(), k, v, dim**-0.5)
    assert kernel is not None
    q = q.detach()
    out, lse, state = kernel.forward(q, k, v)
    peaks, results = [], []
    for run in (
        lambda: kernel.backward(grad, q, k, v, out, lse, state),
        lambda: grouped_backward(kernel, grad, q, k, v, out, lse, state),
    ):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        results.append(run())
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
    for a, b in zip(
        results[1], results[0], strict=True
    ):  # FlashAttention's dq sums with atomics: not bitwise
        assert float((a.float() - b.float()).norm() / b.float().norm()) <= 1e-2
    assert peaks[1] <= peaks[0] - 2 * tokens * heads * dim * 2

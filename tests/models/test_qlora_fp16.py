"""An fp16 QLoRA model (what a T4 trains) keeps its frozen non-quantised weights in fp16, as a bf16 one keeps
bf16: fp32 adapters only, a 16-bit residual stream, the trainer's fp16 path (loss scaling) trains it, and the
VRAM estimate's per-token bytes are what autograd saves. On the CPU (bitsandbytes' CPU backend)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch

import fastft
from fastft.data.skills import generate
from fastft.training.trainer import TrainConfig, Trainer
from fastft.vram import activation_bytes as act
from fastft.vram.settings import resolve_run

pytest.importorskip("bitsandbytes")


def _fp16_qlora(**lora):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*4-bit .* on the CPU")
        model, tokenizer = fastft.load_model(
            "tiny-llama", max_seq_length=128, dtype=torch.float16, load_in_4bit=True, device="cpu"
        )
    return fastft.add_lora(model, r=8, seed=2, **lora), tokenizer


def _dtypes(model, trainable: bool) -> dict[str, torch.dtype]:
    return {
        name: p.dtype
        for name, p in model.named_parameters()
        if p.requires_grad == trainable and p.dtype != torch.uint8  # the packed 4-bit weights
    }


def test_an_fp16_qlora_model_keeps_fp16_weights_and_trains_under_loss_scaling(monkeypatch):
    model, tokenizer = _fp16_qlora()
    frozen, trained = _dtypes(model, False), _dtypes(model, True)
    # embeddings, 9 norms, head: fp16 as loaded (no fp32 residual stream); the adapters fp32 master weights
    assert len(frozen) == 11 and set(frozen.values()) == {torch.float16}
    assert trained and all("lora_" in name for name in trained) and set(trained.values()) == {torch.float32}
    # the trainer's fp16 path (autocast in fp16, the device loss scaler, the fused AdamW) on the CPU
    monkeypatch.setattr(Trainer, "_autocast_dtype", lambda self: torch.float16)
    rows = list(generate(24, seed=7))
    trainer = Trainer(model, tokenizer, fastft.pack(rows, tokenizer, 128), config=TrainConfig(max_steps=2))
    assert trainer.loss_scaler is not None
    before = [p.detach().clone() for p in trainer.parameters]
    result = trainer.train()
    assert len(result.steps) == 2
    assert all(math.isfinite(e.loss) and math.isfinite(e.grad_norm) for e in result.steps)
    assert any(not torch.equal(p, b) for p, b in zip(trainer.parameters, before, strict=True))
    assert _dtypes(model, False) == frozen  # nothing was cast on the way


def test_modules_trained_whole_in_fp16_qlora_are_fp32():
    """A module trained whole is a PEFT copy of a 16-bit one, which fp16 cannot train (AdamW's second moment
    underflows): there add_lora still runs PEFT's k-bit preparation, so the copy is fp32."""
    model, _ = _fp16_qlora(modules_to_save=["lm_head"])
    trained = _dtypes(model, True)
    assert any("lm_head" in name for name in trained) and set(trained.values()) == {torch.float32}


def test_the_estimate_of_an_fp16_qlora_layer_is_what_autograd_saves():
    """The layer bytes the estimator assumes for this loaded model, and for the named model in 4-bit on a T4
    (fp16 compute), equal the bytes autograd saves in one decoder layer under fp16 autocast."""
    tokens, index = 61, 1  # tokens is prime: see _saved_bytes_of_layer in tests/tools/test_vram.py
    model, _ = _fp16_qlora(gradient_checkpointing=False, fused=False)
    from fastft.data.batch import PackedBatch
    from fastft.runtime.attention import patch_packed_attention
    from fastft.training.loss import causal_lm_loss_sum

    patch_packed_attention(model, "sdpa_segments")
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    inside, seen, saved = {"now": False}, set(), [0]
    block = model.get_base_model().model.layers[index]
    block.register_forward_pre_hook(lambda *_: inside.update(now=True))
    block.register_forward_hook(lambda *_: inside.update(now=False))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters | seen and tensor.numel() % tokens == 0:
            seen.add(storage.data_ptr())
            saved[0] += storage.nbytes() if inside["now"] else 0
        return tensor

    ids = np.random.default_rng(0).integers(3, 500, size=tokens)
    batch = PackedBatch.from_sequences([ids], [ids])
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.float16),
    ):
        causal_lm_loss_sum(model, batch)

    settings = dict(
        seq_len=tokens,
        batch_tokens=None,
        lora_r=8,
        targets=None,
        checkpointing="none",
        optimizer="adamw",
        fused=False,
        loss="auto",
        trained_fraction=1.0,
        keep_attention=None,
    )
    loaded = resolve_run(model, precision=None, gpu=None, **settings)
    named = resolve_run("tiny-llama", precision="nf4", gpu="t4", **settings)
    for run in (loaded, named):
        assert run.profile.residual == 2 and run.profile.param == 2
        profile = dataclasses.replace(run.profile, fused_norms=False)
        layer = run.inventory.layers[index]
        estimated = act.layer_bytes(layer, run.inventory, profile, set(run.targets), 8) * tokens
        assert estimated == saved[0]

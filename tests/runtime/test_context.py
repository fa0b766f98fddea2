"""Per-layer runtime state: tensors kept by name, one `LayerContext` per decoder layer, one `ModelState` per
model; two models, one trained on a background thread, never see each other's state."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from copy_stand_ins import DeferredCopies, SyncCopies

import fastft
from fastft.runtime import offload
from fastft.runtime.attention import patch_packed_attention
from fastft.runtime.context import (
    KEEPS,
    KeptTensors,
    attach_layer_contexts,
    decoder_layers,
    keep_names,
    layer_context,
)
from fastft.runtime.model_state import model_state, state_of
from fastft.training.loss import causal_lm_loss_sum


def test_kept_tensors_come_back_by_name_whatever_order_they_are_taken_in():
    stored = []
    forward = KeptTensors.recording_into(
        frozenset(KEEPS), lambda name, tensors: stored.extend(tensors) or True
    )
    out, lse, projected, order = torch.ones(3), torch.zeros(2), torch.full((4,), 2.0), torch.arange(5)
    assert forward.recording and forward.keep("attention", (out, lse), "kernel")
    assert forward.kept("attention") and not forward.kept("o_proj")
    assert forward.keep("o_proj", (projected,)) and forward.keep("routing", (order,))
    with pytest.raises(RuntimeError, match="twice"):
        forward.keep("o_proj", (projected,))
    with pytest.raises(ValueError, match="unknown kept-tensor name"):
        forward.keep("attn", (out,))

    replay = KeptTensors.replaying(forward, stored)
    assert not replay.recording
    (got,), what = replay.take("o_proj")  # taken in another order than kept
    assert got is projected and what is None
    (got_out, got_lse), what = replay.take("attention")
    assert got_out is out and got_lse is lse and what == "kernel"
    assert replay.take("routing")[0][0] is order
    assert replay.take("attention") is None  # taken once: a second take computes
    with pytest.raises(RuntimeError, match="keep in the forward"):
        replay.keep("attention", (out,))


def test_a_declined_or_unwanted_keep_leaves_nothing_to_take():
    declined = KeptTensors.recording_into(frozenset({"attention"}), lambda name, tensors: False)
    assert declined.wants("attention") and not declined.wants("o_proj")
    assert not declined.keep("attention", (torch.ones(2),))  # the offloader declined (host budget)
    assert not declined.keep("o_proj", (torch.ones(2),))  # not a name this call keeps
    replay = KeptTensors.replaying(declined, [])
    assert replay.take("attention") is None and replay.take("o_proj") is None
    assert keep_names(True) == frozenset(KEEPS) and keep_names(False) == frozenset()
    with pytest.raises(ValueError, match="unknown kept-tensor name"):
        keep_names(["attention", "mlp"])


def test_each_decoder_layer_has_one_context_that_its_modules_share_and_models_do_not():
    a, _ = fastft.load_model("tiny-llama")
    b, _ = fastft.load_model("tiny-llama")
    assert state_of(a) is None  # nothing installed yet, nothing created by asking
    patch_packed_attention(a, "sdpa_masked")
    patch_packed_attention(b, "sdpa_segments")
    layers = decoder_layers(a)
    assert len(layers) == a.config.num_hidden_layers
    for layer in layers:
        context = layer_context(layer)
        assert context.model_state is model_state(a) and context.kept is None
        assert all(layer_context(module) is context for module in layer.modules())
    assert len({id(layer_context(layer)) for layer in layers}) == len(layers)
    assert attach_layer_contexts(a) == [layer_context(layer) for layer in layers]  # idempotent
    assert model_state(a) is not model_state(b)
    assert (model_state(a).attention.resolved, model_state(b).attention.resolved) == (
        "sdpa_masked",
        "sdpa_segments",
    )
    assert not hasattr(a.config, "_fastft_attention_backend")
    assert {layer_context(layer).model_state for layer in decoder_layers(b)} == {model_state(b)}


def _batch(lengths, seed=0):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, 500, n) for n in lengths]
    return fastft.PackedBatch.from_sequences(ids, [i.copy() for i in ids])


def _offloaded(name, copies, keep):
    model, _ = fastft.load_model(name)
    model = fastft.add_lora(model, r=4, alpha=8, gradient_checkpointing="offload", seed=1, fused=True)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(11)
        for parameter_name, parameter in model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    offload.enable_offload(model, copies=copies, keep_attention=keep)
    if name == "tiny-moe":
        model.get_base_model().config.output_router_logits = True  # the load-balancing loss, collected
    patch_packed_attention(model, "varlen")  # equal-length bins: one SDPA batch, kept on the CPU too
    model.train()
    return model


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss_sum(model, batch)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _same(result, reference):
    (loss, grads), (want_loss, want) = result, reference
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for name, grad in want.items():
        assert float((grads[name] - grad).norm() / grad.norm().clamp_min(1e-30)) <= 1e-6, name


def test_two_offloaded_models_one_on_a_background_thread_keep_their_own_tensors(monkeypatch):
    """A dense model keeping attention and o_proj outputs, and an MoE model keeping its routing order and
    collecting router logits for its load-balancing loss, each step on its own thread at the same time:
    every loss, gradient and kept byte is what the model gives alone. One intra-op thread: with more, a matmul's
    summation order depends on how many pool threads each caller gets when two step at once (on a busy 2-core CI
    machine a LoRA gradient moved 5e-5 relative that way), which is not what this test is about."""
    from fastft.runtime import attention

    monkeypatch.setattr(attention, "KEEP_FROM_LENGTH", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _two_models_on_two_threads()
    finally:
        torch.set_num_threads(threads)


def _two_models_on_two_threads() -> None:
    batch = _batch((16, 16))
    dense = _offloaded("tiny-llama", SyncCopies(), keep=True)
    moe = _offloaded("tiny-moe", DeferredCopies(), keep=True)
    for model in (dense, moe):  # one context per layer, though the decoder holding them checkpoints too
        contexts = [layer_context(layer) for layer in decoder_layers(model)]
        assert len({id(c) for c in contexts}) == model.config.num_hidden_layers
        assert layer_context(model.get_base_model().model) is None
    alone = {"dense": _step(dense, batch), "moe": _step(moe, batch)}
    kept = {
        name: offload.offload_stats(m, reset=True).bytes_kept for name, m in (("dense", dense), ("moe", moe))
    }
    assert kept["dense"] > 0 and kept["moe"] > 0

    results, errors, start = {}, [], threading.Barrier(2)

    def train(name, model):
        try:
            start.wait()
            results[name] = _step(model, batch)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    background = threading.Thread(target=train, args=("moe", moe), name="fastft-run")
    background.start()
    train("dense", dense)
    background.join()
    assert not errors, errors
    for name, model in (("dense", dense), ("moe", moe)):
        _same(results[name], alone[name])
        assert offload.offload_stats(model).bytes_kept == kept[name]
        assert all(layer_context(layer).kept is None for layer in decoder_layers(model))  # emptied after


def test_without_the_o_proj_keep_the_recompute_runs_o_proj_and_stays_exact(monkeypatch):
    """The o_proj keep is part of the offloader's keep setting: without it, layers keep their attention
    output only and the recompute computes o_proj's output again, with the same gradients."""
    from fastft.runtime import attention

    monkeypatch.setattr(attention, "KEEP_FROM_LENGTH", 1)
    batch = _batch((16, 16))
    every = _offloaded("tiny-llama", SyncCopies(), keep=True)
    reference = _step(every, batch)
    without = _offloaded("tiny-llama", SyncCopies(), keep=("attention", "routing"))
    assert offload.offloader_of(without).keeps == {"attention", "routing"}
    _same(_step(without, batch), reference)
    config = every.config
    o_proj_outputs = config.num_hidden_layers * batch.num_tokens * config.hidden_size * 4
    kept_every, kept_without = (offload.offload_stats(m).bytes_kept for m in (every, without))
    assert kept_without > 0 and kept_every - kept_without == o_proj_outputs

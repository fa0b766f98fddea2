"""Padded Hugging Face batches (TRL's trainers without packing: 2 rows, each padded to the batch's longest)
run unpadded through fastft's packed attention: the same loss and gradients as transformers' padded path,
no padding computed, one host sync per forward where transformers' mask builder made two."""

from __future__ import annotations

import pytest
import torch
from host_syncs import SyncTrap

from fastft import add_lora, load_model
from fastft.runtime.attention import patch_packed_attention, unpatch_packed_attention


def _model(preset: str):
    torch.manual_seed(0)
    model, _ = load_model(preset, dtype=torch.float32)
    model = add_lora(model, r=8, gradient_checkpointing="recompute")
    with torch.no_grad():  # adapters that change the output, so their gradients differ between paths
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.02)
    model.train()
    return model


@pytest.fixture(scope="module")
def model():
    return _model("tiny-llama")


def _batch(lengths, side: str = "right", length: int | None = None):
    generator = torch.Generator().manual_seed(1)
    length = length or max(lengths)
    ids = torch.randint(5, 200, (len(lengths), length), generator=generator)
    mask = torch.zeros(len(lengths), length, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    if side == "left":
        mask = mask.flip(1)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _step(model, ids, mask, labels):
    model.zero_grad()
    with SyncTrap(tolist=True) as trap:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, trap


def _assert_same(result, expected):
    torch.testing.assert_close(result[0], expected[0], rtol=1e-5, atol=1e-5)
    assert result[1].keys() == expected[1].keys() and len(result[1]) > 0
    for name, grad in result[1].items():
        torch.testing.assert_close(grad, expected[1][name], rtol=1e-5, atol=1e-5, msg=name)


def _transformers_path(model, batch):
    unpatch_packed_attention(model)
    try:
        return _step(model, *batch)
    finally:
        patch_packed_attention(model)


@pytest.mark.parametrize("lengths", [(37, 29), (41, 7, 41)])
def test_right_padded_batch_trains_unpadded_with_transformers_loss_and_gradients(model, lengths):
    batch = _batch(lengths, length=max(lengths) + 3)
    result, reference = _step(model, *batch), _transformers_path(model, batch)
    _assert_same(result, reference)
    trap, reference = result[2], reference[2]
    # transformers' mask builder read the mask twice; the unpadded path reads the lengths once, in fastft
    assert reference.syncs.count("aten._local_scalar_dense") == 2
    assert trap.syncs == ["Tensor.tolist"]
    assert any("runtime/unpadding.py" in frame and "unpad" in frame for frame in trap.where[0])


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-mistral"])
def test_unpadded_parity_with_qk_norm_and_sliding_window(preset):
    """Qwen3's q/k norms ride the fused RoPE; Mistral's sliding window is longer than every row here."""
    model = _model(preset)
    batch = _batch((29, 18))
    result = _step(model, *batch)
    assert result[2].syncs == ["Tensor.tolist"]
    _assert_same(result, _transformers_path(model, batch))


def test_rows_longer_than_the_sliding_window_keep_transformers_path():
    """tiny-mistral's window is 64 tokens: a batch padded to 70 stays on transformers' path (the packed
    backends would count the window along the kept tokens), loss for loss."""
    model = _model("tiny-mistral")
    batch = _batch((70, 50))
    result = _step(model, *batch)
    assert "Tensor.tolist" not in result[2].syncs
    _assert_same(result, _transformers_path(model, batch))


def test_unpadded_parity_under_offloaded_checkpointing(model):
    """Offloaded checkpointing (the CUDA default, "unsloth") on the CPU copy stand-ins: each layer's
    unpadded input goes to host memory and back; same loss and gradients."""
    from copy_stand_ins import DeferredCopies

    from fastft.runtime.offload import disable_offload, enable_offload, offload_stats

    batch = _batch((37, 22), length=40)
    expected = _step(model, *batch)
    enable_offload(model, copies=DeferredCopies())
    try:
        result = _step(model, *batch)
        assert offload_stats(model).layers_offloaded > 0
    finally:
        disable_offload(model)
    assert result[2].syncs == ["Tensor.tolist"]
    _assert_same(result, expected)


def test_left_padding_keeps_transformers_path(model):
    """Left padding: the position before a row's first token is padding and predicts that token, so the
    padded positions count; it stays on transformers' path, loss for loss."""
    batch = _batch((37, 29), side="left")
    loss, _, _ = _step(model, *batch)
    expected, _, _ = _transformers_path(model, batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_neftune_keeps_the_padded_rows(model):
    """NEFTune's noise is scaled by the embeddings' sequence length: its batches keep their padded rows."""
    try:  # where transformers keeps it moved between releases
        from transformers.integrations.neftune import neftune_post_forward_hook
    except ImportError:
        from transformers.trainer_utils import neftune_post_forward_hook

    embeddings = model.get_input_embeddings()
    embeddings.neftune_noise_alpha = 5.0
    handle = embeddings.register_forward_hook(neftune_post_forward_hook)
    try:
        _, _, trap = _step(model, *_batch((12, 9)))
    finally:
        handle.remove()
        del embeddings.neftune_noise_alpha
    assert "Tensor.tolist" not in trap.syncs


def test_evaluation_forward_is_not_unpadded(model):
    """Outside training (evaluation, generation) the decoder's outputs at the padding stay transformers'."""
    ids, mask, _ = _batch((12, 9))
    model.eval()
    try:
        with torch.no_grad(), SyncTrap(tolist=True) as trap:
            hidden = model.get_base_model().model(input_ids=ids, attention_mask=mask).last_hidden_state
    finally:
        model.train()
    assert "Tensor.tolist" not in trap.syncs
    assert hidden[1, 9:].abs().sum() > 0  # transformers' values at the padding, not the unpadded path's zeros

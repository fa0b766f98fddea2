"""Padded Hugging Face batches (TRL's trainers without packing: 2 rows, each padded to the batch's longest)
run unpadded through fastft's packed attention: the same loss and gradients as transformers' padded path,
no padding computed, one host sync per forward where transformers' mask builder made two."""

from __future__ import annotations

import pytest
import torch
from host_syncs import SyncTrap

from fastft import add_lora, load_model
from fastft.runtime.attention import patch_packed_attention, unpatch_packed_attention


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model, _ = load_model("tiny-llama", dtype=torch.float32)
    model = add_lora(model, r=8, gradient_checkpointing="recompute")
    with torch.no_grad():  # adapters that change the output, so their gradients differ between paths
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.02)
    model.train()
    return model


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


def _transformers_path(model, batch):
    unpatch_packed_attention(model)
    try:
        return _step(model, *batch)
    finally:
        patch_packed_attention(model)


@pytest.mark.parametrize("lengths", [(37, 29), (33, 33), (41, 7, 26)])
def test_right_padded_batch_trains_unpadded_with_transformers_loss_and_gradients(model, lengths):
    batch = _batch(lengths, length=max(lengths) + 3)
    loss, grads, trap = _step(model, *batch)
    expected, expected_grads, reference = _transformers_path(model, batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    assert grads.keys() == expected_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    # transformers' mask builder read the mask twice; the unpadded path reads the lengths once, in fastft
    assert reference.syncs.count("aten._local_scalar_dense") == 2
    assert trap.syncs == ["Tensor.tolist"]
    assert any("runtime/attention.py" in frame and "_unpad" in frame for frame in trap.where[0])


def test_left_padding_keeps_transformers_path(model):
    """Left padding: the position before a row's first token is padding and predicts that token, so the
    padded positions count; it stays on transformers' path, loss for loss."""
    batch = _batch((37, 29), side="left")
    loss, _, _ = _step(model, *batch)
    expected, _, _ = _transformers_path(model, batch)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)


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

"""Offloaded checkpointing: exact gradients in every mode, the double-buffer protocol, fallbacks.

On the CPU the protocol runs on CPU tensors through two stand-ins for the copy stream, injected as
``copies=`` (tests/copy_stand_ins.py): "sync" copies at once (a prefetch into the buffer a layer is
reading would corrupt its gradients) and "deferred" copies only when an event after them is waited for (a
missing wait reads stale data).
GPU tests (`gpu` marker) check bf16 bit-identity with plain recompute and that device memory does not
grow with depth beyond the two buffers.
"""

from __future__ import annotations

import functools
import json
import sys

import numpy as np
import pytest
import torch
from copy_stand_ins import DeferredCopies, SyncCopies, copies
from transformers import AutoModelForCausalLM

import fastft
from fastft.models.lora import is_checkpointing, set_gradient_checkpointing
from fastft.models.presets import PRESETS
from fastft.runtime import host_memory, offload, offload_layer
from fastft.runtime.attention import patch_packed_attention, unpatch_packed_attention
from fastft.runtime.context import KEEPS
from fastft.training.loss import causal_lm_loss_sum

LENGTHS = (37, 5, 61, 23)  # awkward sizes, one bin
FORCED = [
    ("offload", "sync"),
    ("offload", "deferred"),
    ("offload-single", "sync"),
    ("offload-single", "deferred"),
]


def _batch(lengths=LENGTHS, seed=0, device="cpu") -> fastft.PackedBatch:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, 500, n) for n in lengths]
    labels = [i.copy() for i in ids]
    for lab in labels:
        lab[: len(lab) // 3] = -100  # prompts are not trained
    return fastft.PackedBatch.from_sequences(ids, labels).to(device)


def _randomise_lora_b(model) -> None:
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)


def _checkpointing(mode):
    """The tests' "offload-single" (the one-buffer ablation) is checkpointing "offload" with
    ``enable_offload(double_buffer=False)``."""
    return "offload" if mode == "offload-single" else mode


def _model(name="tiny-llama", mode=False, dropout=0.0, fused=False, force=None, **load):
    model, _ = fastft.load_model(name, **load)
    model = fastft.add_lora(
        model, r=4, alpha=8, dropout=dropout, gradient_checkpointing=_checkpointing(mode), seed=1, fused=fused
    )
    _randomise_lora_b(model)
    if force is not None:
        offload.enable_offload(model, double_buffer=mode == "offload", copies=copies(force))
    patch_packed_attention(model, "sdpa_masked")
    model.train()
    return model


def _step(model, batch, seed=5):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss_sum(model, batch)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _max_relative_error(grads, reference) -> float:
    assert grads.keys() == reference.keys()
    return max(float((grads[n] - reference[n]).norm() / reference[n].norm()) for n in reference)


@functools.cache
def _reference(name: str, dropout: float = 0.0):
    return _step(_model(name, False, dropout), _batch())


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("mode,force", [(True, None), ("offload", None), *FORCED])
def test_gradients_in_every_mode_equal_the_unchekpointed_gradients(name, mode, force):
    loss, grads = _step(_model(name, mode, force=force), _batch())
    reference_loss, reference = _reference(name)
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    assert _max_relative_error(grads, reference) <= 1e-6


def test_double_buffering_prefetches_all_but_the_first_backward_and_holds_two_buffers():
    model = _model(mode="offload", force="sync")
    batch = _batch()
    layer_bytes = batch.num_tokens * model.config.hidden_size * 4
    layers = model.config.num_hidden_layers
    _step(model, batch)
    stats = offload.offload_stats(model, reset=True)
    assert stats.layers_offloaded == layers and stats.fallback_calls == 0
    assert stats.bytes_offloaded == stats.bytes_loaded == layers * layer_bytes
    assert (stats.loaded_on_demand, stats.prefetched) == (1, layers - 1)
    assert stats.device_buffer_bytes == 2 * layer_bytes
    pinned = stats.pinned_bytes
    _step(model, batch)  # the second step reuses every buffer
    again = offload.offload_stats(model)
    assert (again.loaded_on_demand, again.prefetched) == (1, layers - 1)
    assert again.pinned_bytes == pinned and again.device_buffer_bytes == 2 * layer_bytes

    single = _model(mode="offload-single", force="sync")
    _step(single, batch)
    stats = offload.offload_stats(single)
    assert (stats.loaded_on_demand, stats.prefetched) == (layers, 0)
    assert stats.device_buffer_bytes == layer_bytes


def test_the_recompute_frees_its_output_before_the_layer_backward(monkeypatch):
    """The layer output a recompute makes (the residual add's ``[tokens, hidden]``) is the root of the layer's
    gradients and nothing reads its values: it is freed before the backward runs, and every gradient stays
    what it was (the tests above)."""
    seen = []
    grad = torch.autograd.grad

    def watching(outputs, *args, **kwargs):
        seen.extend((o.shape, o.untyped_storage().nbytes()) for o in outputs)
        return grad(outputs, *args, **kwargs)

    monkeypatch.setattr(offload_layer.torch.autograd, "grad", watching)
    model = _model(mode="offload", force="sync")
    batch = _batch()
    loss, grads = _step(model, batch)
    hidden = model.config.hidden_size
    assert len(seen) == model.config.num_hidden_layers
    assert all(shape[-1] == hidden and nbytes == 0 for shape, nbytes in seen)
    reference_loss, reference = _reference("tiny-llama")
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    assert _max_relative_error(grads, reference) <= 1e-6


def test_an_output_the_backward_reads_keeps_its_memory():
    """An output some op saved for backward (here ``exp``, which saves its result) is not freed."""
    saved: set[int] = set()
    x = torch.randn(8, 4, requires_grad=True)
    with offload_layer._recording_saved(saved):
        kept = x.exp()
        freed = x * 2.0
    offload_layer._free_unread_outputs([kept, freed, x[:2]], saved)
    assert kept.untyped_storage().nbytes() == kept.numel() * 4
    assert freed.untyped_storage().nbytes() == 0
    assert x.untyped_storage().nbytes() == x.numel() * 4  # a view into a larger storage stays
    (g,) = torch.autograd.grad([kept, freed], [x], [torch.ones_like(kept), torch.ones_like(freed)])
    torch.testing.assert_close(g, x.detach().exp() + 2.0)


def test_device_buffers_stay_constant_as_depth_grows():
    def run(layers: int):
        preset = PRESETS["tiny-llama"]
        config = preset.make_config(512)
        config.num_hidden_layers = layers
        torch.manual_seed(0)
        model = fastft.add_lora(
            AutoModelForCausalLM.from_config(config),
            r=4,
            gradient_checkpointing="offload",
            fused=False,
        )
        offload.enable_offload(model, copies=DeferredCopies())
        patch_packed_attention(model, "sdpa_masked")
        model.train()
        _step(model, _batch())
        return offload.offload_stats(model)

    shallow, deep = run(2), run(6)
    assert deep.device_buffer_bytes == shallow.device_buffer_bytes
    assert deep.bytes_offloaded == 3 * shallow.bytes_offloaded


def test_switching_modes_is_idempotent_and_never_stacks():
    model = _model(mode="offload")
    layers = list(model.get_base_model().model.layers)
    first = offload.offloader_of(model)
    assert first is not None and first.mode == "offload"
    set_gradient_checkpointing(model, "offload")
    assert offload.offloader_of(model) is first  # same settings: same offloader, same buffers
    assert all(layer._gradient_checkpointing_func is first for layer in layers)

    runs = {"count": 0}
    handle = layers[0].mlp.register_forward_pre_hook(lambda *_: runs.__setitem__("count", runs["count"] + 1))
    for mode, expected_runs in [
        (True, 2),
        ("offload", 2),
        ("offload", 2),
        ("offload-single", 2),
        (False, 1),
        ("unsloth", 2),
    ]:
        set_gradient_checkpointing(model, _checkpointing(mode))
        if mode not in (True, False):
            offload.enable_offload(model, double_buffer=mode != "offload-single", copies=SyncCopies())
        runs["count"] = 0
        _, grads = _step(model, _batch())
        assert runs["count"] == expected_runs, mode  # forward (+ one recompute), never more
        assert _max_relative_error(grads, _reference("tiny-llama")[1]) <= 1e-6, mode
        offloader = offload.offloader_of(model)
        if mode in (True, False):
            assert offloader is None
            assert all(
                not isinstance(layer._gradient_checkpointing_func, offload.ActivationOffloader)
                for layer in layers
            )
        else:
            assert all(layer._gradient_checkpointing_func is offloader for layer in layers)
        assert is_checkpointing(model) == (mode is not False)
    handle.remove()
    set_gradient_checkpointing(model, "auto")  # no CUDA here: plain recompute
    assert offload.offloader_of(model) is None and is_checkpointing(model)
    with pytest.raises(ValueError, match="not a mode"):
        set_gradient_checkpointing(model, "offlaod")


def test_hugging_face_checkpointing_switches_keep_fastft_mode_on_this_instance_only():
    """HF Trainer and TRL (gradient_checkpointing=True, its default) call these on the model: an enable keeps
    the offloader instead of resetting the layers to transformers' recompute; a disable turns it off."""
    model = _model(mode="offload", force="sync")
    other = _model(mode=False)
    layers = list(model.get_base_model().model.layers)
    first = offload.offloader_of(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert offload.offloader_of(model) is first
    assert all(layer._gradient_checkpointing_func is first for layer in layers)
    _, grads = _step(model, _batch())
    assert _max_relative_error(grads, _reference("tiny-llama")[1]) <= 1e-6
    assert not is_checkpointing(other)  # the other model's switches are its class's, untouched

    model.gradient_checkpointing_disable()
    assert offload.offloader_of(model) is None and not is_checkpointing(model)
    model.gradient_checkpointing_enable()  # after a disable: the mode it turned off, offload again
    assert offload.offloader_of(model) is not None and is_checkpointing(model)
    assert all(layer._gradient_checkpointing_func is offload.offloader_of(model) for layer in layers)
    set_gradient_checkpointing(model, "none")  # a direct switch forgets the disabled mode
    model.gradient_checkpointing_enable()  # from "none": transformers' meaning, plain recompute
    assert offload.offloader_of(model) is None and is_checkpointing(model)
    other.gradient_checkpointing_enable()
    assert is_checkpointing(other) and offload.offloader_of(other) is None


def test_trl_dpo_reference_forwards_leave_the_offload_on():
    """TRL's DPOTrainer runs each reference forward inside ``disable_gradient_checkpointing``: a disable,
    then an enable. The run kept plain recompute from the first micro-batch on; it keeps the offload."""
    from trl.models.utils import disable_gradient_checkpointing

    model = _model(mode="offload", force="sync")
    with disable_gradient_checkpointing(model, {"use_reentrant": False}):
        assert offload.offloader_of(model) is None and not is_checkpointing(model)
    assert offload.offloader_of(model) is not None and is_checkpointing(model)
    _, grads = _step(model, _batch())
    assert _max_relative_error(grads, _reference("tiny-llama")[1]) <= 1e-6


def test_offload_on_cpu_is_plain_recompute():
    model = _model(mode="offload")  # not forced: CPU tensors take the plain recompute path
    _, grads = _step(model, _batch())
    _, recomputed = _step(_model(mode=True), _batch())
    for name, grad in grads.items():
        assert torch.equal(grad, recomputed[name]), name
    stats = offload.offload_stats(model)
    assert stats.layers_offloaded == 0 and stats.fallback_calls == model.config.num_hidden_layers
    assert stats.pinned_bytes == 0 and stats.device_buffer_bytes == 0


def test_dropout_masks_are_replayed_in_the_recompute():
    batch = _batch()
    _, reference = _reference("tiny-llama", 0.3)
    _, no_dropout = _reference("tiny-llama", 0.0)
    assert _max_relative_error(reference, no_dropout) > 1e-2  # dropout is really on
    for mode, force in [(True, None), ("offload", "deferred"), ("offload-single", "sync")]:
        model = _model(mode=mode, dropout=0.3, force=force)
        torch.manual_seed(5)
        _, grads = _step(model, batch)
        after = torch.get_rng_state()
        assert _max_relative_error(grads, reference) <= 1e-6, mode
        torch.manual_seed(5)
        _step(_model(dropout=0.3), batch)
        assert torch.equal(after, torch.get_rng_state())  # the recompute leaves the RNG where it was


def test_fused_kernels_under_offload_match_the_unfused_gradients():
    batch = _batch((13, 9, 18))  # short: the Triton interpreter runs the fused kernels on the CPU
    _, reference = _step(_model(), batch)
    model = _model(mode="offload", fused=True, force="deferred")
    from fastft.models.patch import is_fused

    assert is_fused(model)
    _, grads = _step(model, batch)
    assert offload.offload_stats(model).layers_offloaded == model.config.num_hidden_layers
    assert _max_relative_error(grads, reference) <= 1e-5


@pytest.mark.parametrize("mode,force", [(False, None), ("offload", "deferred"), (True, None)])
def test_the_mlp_in_sequence_tiles_trains_as_the_untiled_one(mode, force, monkeypatch):
    """Long-context MLP tiling (`fastft.kernels.tiling`) inside a whole model: with the tile threshold
    lowered so that a 40-token batch runs in 16-row tiles, the fused model's loss and every LoRA gradient
    equal the unfused model's, without checkpointing, offloaded (the recompute skips the MLP) and under
    plain recompute."""
    from fastft.kernels import lora, tiling

    monkeypatch.setattr(tiling, "TILE_FROM_BYTES", 0)
    monkeypatch.setattr(tiling, "TILE_ROW_MULTIPLE", 8)
    intermediate = PRESETS["tiny-llama"].config["intermediate_size"]
    monkeypatch.setattr(tiling, "TILE_BYTES", 16 * intermediate * 4)  # fp32: at most 16 rows per tile
    tiled_calls = []
    original = lora.LoraTiledMLPFunction.apply
    monkeypatch.setattr(
        lora.LoraTiledMLPFunction, "apply", lambda *a: tiled_calls.append(a[7]) or original(*a)
    )
    batch = _batch((13, 9, 18))
    reference_loss, reference = _step(_model(), batch)
    model = _model(mode=mode, fused=True, force=force)
    loss, grads = _step(model, batch)
    assert tiled_calls and set(tiled_calls) == {16}  # 40 rows: three tiles of 16, 16 and 8
    assert loss == pytest.approx(reference_loss, rel=1e-5)
    assert _max_relative_error(grads, reference) <= 1e-5


def test_torch_autograd_grad_sees_the_lora_gradients():
    model = _model(mode="offload", force="deferred")
    lora = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(5)
    grads = torch.autograd.grad(causal_lm_loss_sum(model, _batch()), lora)
    assert all(p.grad is None for p in lora)  # nothing accumulated behind autograd.grad's back
    reference = _reference("tiny-llama")[1]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert _max_relative_error(dict(zip(names, grads, strict=True)), reference) <= 1e-6


def test_pinned_budget_too_small_warns_once_and_falls_back_to_recompute():
    model = _model(mode="offload")
    offloader = offload.enable_offload(model, host_budget_bytes=4096, copies=SyncCopies())
    with pytest.warns(offload.OffloadBudgetWarning, match="pinned host memory") as caught:
        _, grads = _step(model, _batch())
        _step(model, _batch())
    assert len(caught) == 1
    assert "first 0 of 4 layers" in str(caught[0].message) and "plain recompute" in str(caught[0].message)
    stats = offloader.stats()
    assert not stats.disabled and stats.layers_offloaded == 0 and stats.fallback_calls == 8
    assert _max_relative_error(grads, _reference("tiny-llama")[1]) <= 1e-6


@pytest.mark.parametrize("held", [1, 2])
def test_a_budget_for_some_layers_offloads_those_and_recomputes_the_rest(held):
    """Pinned memory for `held` of 4 layers' inputs (as their slabs pin it: 2 MiB slots, power-of-two slabs):
    the first `held` layers offload theirs, the others keep theirs on the device (plain recompute), every
    step, with one warning; the gradients are the same."""
    from fastft.runtime.host_budget import pinned_bytes

    model = _model(mode="offload")
    probe = offload.enable_offload(model, copies=SyncCopies(), keep_attention=False)
    _step(model, _batch())
    per_layer = probe.stats().bytes_offloaded // 4
    offload.disable_offload(model)
    budget = pinned_bytes(per_layer, held) + 2**20
    assert pinned_bytes(per_layer, held + 1) > budget
    offloader = offload.enable_offload(
        model, host_budget_bytes=budget, copies=SyncCopies(), keep_attention=False
    )
    with pytest.warns(offload.OffloadBudgetWarning, match=f"first {held} of 4 layers") as caught:
        _, grads = _step(model, _batch())
        _step(model, _batch())
    assert len(caught) == 1
    stats = offloader.stats()
    assert (
        not stats.disabled and stats.layers_offloaded == 2 * held and stats.fallback_calls == 2 * (4 - held)
    )
    assert _max_relative_error(grads, _reference("tiny-llama")[1]) <= 1e-6


def test_pinning_failure_falls_back_with_one_warning(monkeypatch):
    def refuse(size, pin):
        raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")

    monkeypatch.setattr(host_memory, "_allocate_host", refuse)
    model = _model(mode="offload", force="sync")
    with pytest.warns(offload.OffloadBudgetWarning, match="pinning .* failed") as caught:
        _, grads = _step(model, _batch())
        _step(model, _batch())
    assert len(caught) == 1
    assert offload.offload_stats(model).layers_offloaded == 0
    assert _max_relative_error(grads, _reference("tiny-llama")[1]) <= 1e-6


def test_host_slots_come_from_few_slabs_without_power_of_two_waste():
    slabs = host_memory.HostSlabs(pin=False)
    nbytes = 5 * 2**20 + 1  # a 6 MiB slot; 40 of them pinned one by one would round to 8 MiB each
    taken = [slabs.take(nbytes, count=40 - i) for i in range(40)]
    assert len({slab for slab, _ in taken}) == 1 and slabs.bytes <= 1.1 * 40 * 6 * 2**20
    assert all(view.numel() >= nbytes for _, view in taken)
    assert len({view.data_ptr() for _, view in taken}) == 40  # disjoint slots
    for slot in taken:
        slabs.give(slot)
    bigger = slabs.take(8 * 2**20, count=2)  # nothing fits: the idle slab goes, a new one comes
    assert slabs.bytes == 16 * 2**20 and bigger[1].numel() == 8 * 2**20


def test_large_layer_inputs_share_power_of_two_slabs_instead_of_one_each():
    """PyTorch pins powers of two: a 1.25 GiB input (Llama-3.1-8B at 163,840 tokens) alone in a 2 GiB slab
    wastes 0.75 GiB; 4 GiB slabs of three hold 32 of them in 44 GiB instead of 64. The plan never pins less
    than the slots need, more slots never pin less, and `layers_that_fit` is the most within a budget."""
    from fastft.runtime.host_budget import layers_that_fit, pinned_bytes, slab_plan

    GiB = 2**30
    layer_input = 163_840 * 4096 * 2
    assert slab_plan(layer_input, 32) == (layer_input, 4 * GiB)
    assert pinned_bytes(layer_input, 32) == 44 * GiB
    for nbytes in (36_864, 6 * 2**20, 300_000 * 8192, layer_input):
        pinned = [pinned_bytes(nbytes, k) for k in range(40)]
        assert all(p >= k * nbytes for k, p in enumerate(pinned))
        assert all(a <= b for a, b in zip(pinned, pinned[1:], strict=False))
    for budget in (0, 3 * GiB, 20 * GiB, 44 * GiB, 100 * GiB):
        held = layers_that_fit(layer_input, 32, budget)
        assert pinned_bytes(layer_input, held) <= budget
        assert held == 32 or pinned_bytes(layer_input, held + 1) > budget


def test_host_memory_is_read_from_proc_meminfo_without_psutil(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now raises ImportError
    available = offload.host_memory_available()
    if sys.platform.startswith("linux"):
        assert available is not None and available > 2**20


def test_tuple_outputs_and_keyword_tensors_pass_through():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(6, 6)

        def forward(self, hidden, scale=None, extra=None):
            out = torch.tanh(self.linear(hidden)) * scale[0] + hidden
            return out, None, torch.tensor(3)

    torch.manual_seed(0)
    block = Block()
    hidden = torch.randn(2, 7, 6, dtype=torch.float64, requires_grad=True)
    block.double()
    scale = (torch.full((6,), 0.5, dtype=torch.float64),)
    out, none, count = block(hidden, scale=scale)
    out.square().sum().backward()
    expected = hidden.grad.clone(), block.linear.weight.grad.clone()
    hidden.grad = block.linear.weight.grad = block.linear.bias.grad = None

    offloader = offload.ActivationOffloader(layers=1, copies=DeferredCopies())
    result = offloader(functools.partial(Block.forward, block, scale=scale), hidden)
    assert isinstance(result, tuple) and result[1] is None and int(result[2]) == 3
    assert result[0].dtype == torch.float64
    result[0].square().sum().backward()
    assert torch.equal(hidden.grad, expected[0]) and torch.equal(block.linear.weight.grad, expected[1])
    assert offloader.stats().layers_offloaded == 1

    trainable = (scale[0].clone().requires_grad_(),)  # a tensor needing grad outside `hidden`: not offloaded
    offloader(functools.partial(Block.forward, block, scale=trainable), hidden)[0].sum().backward()
    assert trainable[0].grad is not None and offloader.stats().fallback_calls == 1


def test_a_forward_without_backward_gives_its_buffers_back():
    model = _model(mode="offload", force="deferred")
    offloader = offload.offloader_of(model)
    loss = causal_lm_loss_sum(model, _batch())
    assert offloader._live == model.config.num_hidden_layers
    del loss
    assert offloader._live == 0 and len(offloader._host._free) >= model.config.num_hidden_layers
    _, grads = _step(model, _batch())
    assert _max_relative_error(grads, _reference("tiny-llama")[1]) <= 1e-6


def test_the_deferred_stand_in_catches_a_missing_wait(monkeypatch):
    monkeypatch.setattr(DeferredCopies, "wait", lambda self, ready: None)
    _, grads = _step(_model(mode="offload", force="deferred"), _batch())
    assert not _max_relative_error(grads, _reference("tiny-llama")[1]) <= 1e-3  # wrong, or NaN


@pytest.fixture
def keep_short(monkeypatch):
    """Kept attention from the first token on (it starts at 2,048 tokens, where it pays)."""
    from fastft.runtime import attention

    monkeypatch.setattr(attention, "KEEP_FROM_LENGTH", 1)


def _keep_step(name, mode, force, keep, lengths=(24, 24, 24), budget=None, fused=False):
    """A step through the ``varlen`` backend, whose equal-length bins run as one SDPA batch (CPU too)."""
    model = _model(name, mode, fused=fused)
    offload.enable_offload(
        model,
        double_buffer=mode == "offload",
        copies=copies(force),
        keep_attention=keep,
        host_budget_bytes=budget,
    )
    patch_packed_attention(model, "varlen")
    return model, _step(model, _batch(lengths))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("mode,force", FORCED)
@pytest.mark.parametrize("fused", [False, True])
def test_kept_attention_gives_the_recomputed_gradients_bit_for_bit(
    name, mode, force, fused, keep_short, monkeypatch
):
    """The recompute hands the forward's attention output and log-sum-exp to the kernel's backward instead
    of running the attention again, and (fused) o_proj's output to o_proj's backward instead of its GEMM:
    same kernels, same numbers, every LoRA gradient bit-identical."""
    from fastft.kernels import lora

    projected = []
    original = lora._project
    monkeypatch.setattr(lora, "_project", lambda *a: projected.append(1) or original(*a))
    _, (reference_loss, reference) = _keep_step(name, mode, force, keep=False, fused=fused)
    recomputing = len(projected)
    projected.clear()
    model, (loss, grads) = _keep_step(name, mode, force, keep=True, fused=fused)
    assert loss == reference_loss
    assert all(torch.equal(grads[n], reference[n]) for n in reference)
    config, layers = model.config, model.config.num_hidden_layers
    # no o_proj GEMM in any layer's recompute (recomputing, a layer projects 7 times in the forward --
    # q, k, v, o, gate, up, down -- and 6 in the recompute, which skips down)
    assert recomputing == (13 * layers if fused else 0)
    assert len(projected) == recomputing - (layers if fused else 0)
    heads, dim, tokens = config.num_attention_heads, config.head_dim, 72
    # the output in the flash kernel's dtype (bf16: `_flash_dtype`), the fp32 log-sum-exp per head and token,
    # and (fused) o_proj's output in the model's fp32
    output = tokens * config.hidden_size * 4 if fused else 0
    kept = layers * (tokens * heads * dim * 2 + heads * tokens * 4 + output)
    stats = offload.offload_stats(model)
    assert stats.bytes_kept == kept and stats.bytes_loaded == stats.bytes_offloaded
    assert stats.bytes_offloaded == kept + layers * tokens * config.hidden_size * 4
    again = _step(model, _batch((24, 24, 24)))  # the second step reuses the buffers and host slots
    assert again[0] == reference_loss and all(torch.equal(again[1][n], reference[n]) for n in reference)


@pytest.mark.parametrize("layers_kept", [0, 2])
def test_a_short_host_budget_keeps_what_fits_and_stays_exact(layers_kept, keep_short):
    """Host memory goes to the layer inputs first; attention outputs (with o_proj's) are kept while room is
    left, and the layers past it recompute their attention."""
    _, (loss, reference) = _keep_step("tiny-llama", "offload", "sync", keep=False, fused=True)
    attention = 72 * 4 * 32 * 2 + 4 * 72 * 4  # output + lse
    from fastft.runtime.host_budget import pinned_bytes

    # 4 layers' inputs as their slabs pin them; what a layer keeps with o_proj's output
    inputs, per_layer = pinned_bytes(72 * 128 * 4, 4), attention + 72 * 128 * 4
    budget = inputs + layers_kept * per_layer + attention // 2
    model, (kept_loss, grads) = _keep_step(
        "tiny-llama", "offload", "sync", keep=True, budget=budget, fused=True
    )
    assert kept_loss == loss and all(torch.equal(grads[n], reference[n]) for n in reference)
    assert offload.offload_stats(model).bytes_kept == layers_kept * per_layer


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-mixtral", "tiny-gpt-oss"])
@pytest.mark.parametrize("force", ["sync", "deferred"])
@pytest.mark.parametrize("aux", [False, True])
def test_the_recompute_rebuilds_each_routing_plan_from_the_kept_order(name, force, aux, monkeypatch):
    """An offloaded MoE layer keeps its routing order (int32 sorted slots and the expert offsets) with its
    input; the recompute rebuilds the plan from it instead of a top-k and a sort: the plan is built once
    per layer, and the loss and every LoRA gradient (through the load-balancing loss too, `aux`) are
    bit-identical to building it again."""
    from fastft.models import moe

    built = []
    original = moe.build_routing_plan
    monkeypatch.setattr(moe, "build_routing_plan", lambda *a, **k: built.append(1) or original(*a, **k))

    def run(keep):
        built.clear()
        model = _model(name, "offload", fused=True)
        offload.enable_offload(model, double_buffer=True, copies=copies(force), keep_attention=keep)
        model.get_base_model().config.output_router_logits = aux
        if name == "tiny-gpt-oss":  # attention sinks: transformers' attention over the packed positions
            unpatch_packed_attention(model)
        return model, _step(model, _batch((24, 17, 31))), len(built)

    _, (reference_loss, reference), built_twice = run(keep=False)
    model, (loss, grads), built_once = run(keep=True)
    assert loss == reference_loss
    assert all(torch.equal(grads[n], reference[n]) for n in reference)
    assert built_once > 0 and built_twice == 2 * built_once  # forward and recompute, or the forward alone
    config = model.config
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    per_layer = 72 * config.num_experts_per_tok * 4 + experts * 4  # int32 sorted slots, int32 offsets
    assert offload.offload_stats(model).bytes_kept == built_once * per_layer


def test_quantised_bases_keep_attention_only_for_long_sequences_that_fit(monkeypatch):
    """Keeping is the default on 16-bit bases. A 4- or 8-bit base is the memory-first choice: it keeps the
    attention output (not o_proj's) only for layer calls of `KEEP_QUANTISED_FROM_LENGTH` tokens and more, and
    only where the VRAM estimate with it fits the device, asked once per token count; `keep_attention=True`
    keeps everything. The estimator follows the same default."""
    from fastft.runtime.activation_checkpointing import KEEP_QUANTISED_FROM_LENGTH as LONG

    model = _model(mode="offload")
    assert offload.enable_offload(model).policy.settings() == (frozenset(KEEPS), 0, False)
    model.get_base_model().is_loaded_in_4bit = True
    policy = offload.enable_offload(model).policy
    assert policy.settings() == (frozenset({"attention", "routing"}), LONG, True)
    asked = []

    def fits(model_, tokens, device):
        asked.append(tokens)
        return tokens < 2 * LONG

    monkeypatch.setattr(offload, "_fits_keeping", fits)
    assert policy.names_for(LONG - 1, None) == frozenset() and asked == []  # short: not even estimated
    assert policy.names_for(LONG, None) == {"attention", "routing"}
    assert policy.names_for(LONG, None) == {"attention", "routing"} and asked == [LONG]  # asked once
    assert policy.names_for(2 * LONG, None) == frozenset()  # does not fit: recompute as before
    assert offload.enable_offload(model, keep_attention=True).policy.settings() == (
        frozenset(KEEPS),
        0,
        False,
    )
    monkeypatch.undo()
    assert not offload._fits_keeping(model, 4 * LONG, torch.device("cpu"))  # no CUDA device: nothing kept


def test_the_keeping_answer_is_registered_from_above_and_keeps_nothing_without_one(monkeypatch):
    """The runtime never imports the estimator (tests/test_layers.py): ``import fastft`` registers it into
    `fastft.runtime.keep_fit`, and with nothing registered a conditional policy keeps nothing."""
    import fastft
    from fastft.runtime import keep_fit

    assert keep_fit._answer is fastft._keeping_fits
    seen = []
    monkeypatch.setattr(keep_fit, "_answer", lambda model, tokens, device: seen.append(tokens) or True)
    assert keep_fit.keeping_fits(None, 7, None) and seen == [7]
    keep_fit.register(None)
    assert not keep_fit.keeping_fits(None, 7, None)


def test_the_keeping_check_asks_the_estimator_with_the_room_the_device_has(monkeypatch):
    """`_fits_keeping` gives `estimate_vram` the device's room (its allocator cap, or the driver's free
    memory plus what PyTorch holds, whichever is less) and answers what the estimate with the attention
    kept says; nothing is kept while a CUDA graph is captured. The CUDA queries are faked: no GPU here."""
    from fastft.vram import capped_gpu, estimate_vram

    model = _model(mode="offload")
    GiB, total = 2**30, 80 * 2**30
    room = {"fraction": 0.3, "free": 60 * GiB, "reserved": 2 * GiB, "capturing": False}

    class Properties:
        total_memory = total

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", lambda device: room["fraction"])
    monkeypatch.setattr(cuda, "mem_get_info", lambda device: (room["free"], total))
    monkeypatch.setattr(cuda, "memory_reserved", lambda device: room["reserved"])
    monkeypatch.setattr(cuda, "is_current_stream_capturing", lambda: room["capturing"])
    seen = []

    def recording(*args, gpu, **settings):
        seen.append(gpu.capacity_bytes)
        return estimate_vram(*args, gpu=gpu, **settings)

    monkeypatch.setattr("fastft.vram.estimate_vram", recording)
    device, tokens = torch.device("cuda", 0), 4096
    kept = offload._fits_keeping(model, tokens, device)
    alone = estimate_vram(
        model, tokens, tokens, checkpointing="offload", keep_attention=None, gpu=capped_gpu(24 * GiB)
    )
    assert kept == alone.settings.keep_attention is True  # tiny-llama keeps, with room to spare
    room["free"] = 0  # the driver has nothing left beyond what PyTorch holds: 2 GiB
    room["reserved"] = alone.total_bytes // 2
    assert not offload._fits_keeping(model, tokens, device)
    assert seen == [24 * GiB, alone.total_bytes // 2]  # the cap, then free + reserved
    room["free"], room["capturing"] = 60 * GiB, True
    assert not offload._fits_keeping(model, tokens, device) and len(seen) == 2  # capturing: not asked


def test_the_estimate_of_a_quantised_base_keeps_attention_only_where_it_fits():
    from fastft.vram import capped_gpu, estimate_vram, max_context

    def estimate(precision, length, keep=None, gpu=capped_gpu(2**40)):  # noqa: B008 (one spec, read only)
        return estimate_vram(
            "Qwen/Qwen3-8B",
            length,
            precision=precision,
            checkpointing="offload",
            gpu=gpu,
            keep_attention=keep,
        )

    assert estimate("bf16", 4096)["activations"] > estimate("bf16", 4096, keep=False)["activations"]
    short = estimate("nf4", 4096)
    assert short["activations"] == estimate("nf4", 4096, keep=False)["activations"]
    assert not short.settings.keep_attention
    assert estimate("nf4", 4096, keep=True)["activations"] > short["activations"]
    long, recomputing = estimate("nf4", 65536), estimate("nf4", 65536, keep=False)
    assert long.settings.keep_attention and long.allocated_bytes > recomputing.allocated_bytes
    # o_proj's output is not kept on a quantised base: less than what keep_attention=True (everything) keeps
    assert long.allocated_bytes < estimate("nf4", 65536, keep=True).allocated_bytes
    # a cap between the two: the answer is the run that recomputes
    gpu = capped_gpu((long.total_bytes + recomputing.total_bytes) // 2)
    tight = estimate("nf4", 65536, gpu=gpu)
    assert tight.fits and not tight.settings.keep_attention
    assert tight.allocated_bytes == recomputing.allocated_bytes
    roomy = estimate("nf4", 65536, gpu=capped_gpu(long.total_bytes))
    assert roomy.fits and roomy.settings.keep_attention
    # the longest context is the recomputing run's: keeping never shortens it
    settings = {"precision": "nf4", "checkpointing": "offload", "multiple_of": 1024}
    assert max_context("Qwen/Qwen3-8B", gpu, **settings) == max_context(
        "Qwen/Qwen3-8B", gpu, keep_attention=False, **settings
    )


def test_sequences_shorter_than_the_threshold_keep_nothing():
    from fastft.runtime import attention

    assert attention.KEEP_FROM_LENGTH == 2048
    model, _ = _keep_step("tiny-llama", "offload", "sync", keep=True)
    assert offload.offload_stats(model).bytes_kept == 0


def test_a_packed_bin_keeps_attention_by_its_attended_length_not_its_longest_sequence(monkeypatch):
    """The varlen backend hands `_kept_attention` the bin's `attended_length`: a bin of short chats with one
    long answer (longest 2,100, attended 1,269) keeps nothing, as its attention is cheap to recompute."""
    from fastft.runtime import attention

    asked = []

    def kept_attention(q, k, v, scale, choose, longest, kept):
        asked.append(longest)
        return torch.zeros(q.shape, dtype=q.dtype)

    monkeypatch.setattr(attention, "_kept_attention", kept_attention)
    batch = _batch((2100, 300, 300, 300, 300, 300, 300))
    q = torch.zeros(1, 2, batch.num_tokens, 4)
    attention._varlen(q, q[:, :1], q[:, :1], batch, 0.5, 0.0, None)
    assert asked == [batch.attended_length] == [1269]
    assert batch.max_seqlen == 2100 >= attention.KEEP_FROM_LENGTH > 1269


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "varlen", "varlen-window"])
def test_the_cuda_kernels_ops_bind_their_arguments(kernel):
    """The CUDA kernels' ATen ops (private: their signatures move between torch releases) called on meta
    tensors, forward then backward, with GQA: shapes come back as each op's schema says."""
    from fastft.runtime import attention

    meta = {"device": "meta", "dtype": torch.bfloat16}
    if kernel.startswith("varlen"):
        q, kv = torch.empty(64, 4, 128, **meta), torch.empty(64, 2, 128, **meta)
        cu = torch.empty(3, device="meta", dtype=torch.int32)
        chosen = attention._varlen_kernel(cu, 40, 16 if kernel == "varlen-window" else None)(q, kv, kv, None)
    else:
        q, kv = torch.empty(2, 4, 64, 128, **meta), torch.empty(2, 2, 64, 128, **meta)
        chosen = (attention._sdpa_cudnn if kernel == "cudnn" else attention._sdpa_flash_cuda)(0.1)
    out, lse, state = chosen.forward(q, kv, kv)
    assert out.shape == q.shape and lse.numel() == q.numel() // 128
    grads = chosen.backward(out, q, kv, kv, out, lse, state)
    assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]


def test_a_kept_layout_comes_back_with_its_strides():
    transposed = torch.arange(24.0).reshape(2, 3, 4).transpose(0, 1)
    assert offload_layer.dense(transposed) and not offload_layer.dense(transposed[:, :, :2])
    saved = offload_layer.Saved(
        offload.ActivationOffloader(), offload_layer.Part(None, 0, 40, torch.uint8, (40,), (1,)), None
    )
    part = saved.add(None, transposed)
    assert part.offset == offload_layer.ALIGN and saved.nbytes == offload_layer.ALIGN + 96
    buffer = torch.zeros(saved.nbytes, dtype=torch.uint8)
    part.view(buffer).copy_(transposed)
    buffer[part.offset : part.offset + part.nbytes].view(torch.float32).copy_(
        offload_layer.storage_order(transposed)
    )
    back = part.view(buffer)
    assert torch.equal(back, transposed) and back.stride() == transposed.stride()
    saved.done = True


def test_offload_bench_reports_every_mode_and_keeps_to_its_time_budget(tmp_path):
    from fastft.cli import main

    args = ["bench", "offload", "--tokens", "256", "--warmup", "1", "--steps", "1", "--unfused"]
    assert main([*args, "--models", "tiny-llama", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "offload.json").read_text())["rows"]
    assert [row["mode"] for row in rows] == ["recompute", "offload-single", "offload", "none"]
    assert all(row["status"] == "ok" and row["tokens_per_s"] > 0 for row in rows)
    assert rows[0]["speed_vs_recompute"] == 1.0
    assert "× recompute" in (tmp_path / "offload.md").read_text()

    assert main([*args, "--models", "Qwen/Qwen3-32B", "--time-budget", "0", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "offload.json").read_text())["rows"]  # estimated first, never built
    assert len(rows) == 4 and all(row["status"] == "skipped (time budget)" for row in rows)


# -- CUDA ---------------------------------------------------------------------------------------
def _cuda_model(mode, dtype, fused=False, backend="sdpa_masked", config=None):
    if config is None:
        model, _ = fastft.load_model("tiny-llama", dtype=dtype, device="cuda")
    else:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = fastft.add_lora(
        model, r=16, alpha=16, gradient_checkpointing=_checkpointing(mode), seed=1, fused=fused
    )
    if mode == "offload-single":
        offload.enable_offload(model, double_buffer=False)
    _randomise_lora_b(model)
    patch_packed_attention(model, backend)
    model.train()
    return model


def _cuda_step(model, batch, dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    # the backward (and the recompute inside it) must see the same SDPA backend as the forward
    with sdpa_kernel(SDPBackend.MATH):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            loss = causal_lm_loss_sum(model, batch)
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_bf16_offload_gradients_are_bit_identical_to_recompute(fused):
    batch = _batch((700, 1500, 333, 2000), device="cuda")
    recompute = _cuda_step(_cuda_model(True, torch.bfloat16, fused), batch, torch.bfloat16)
    again = _cuda_step(_cuda_model(True, torch.bfloat16, fused), batch, torch.bfloat16)
    assert all(torch.equal(again[n], g) for n, g in recompute.items())  # the premise: deterministic kernels
    for mode in ("offload", "offload-single"):
        model = _cuda_model(mode, torch.bfloat16, fused)
        offload.enable_offload(model, double_buffer=mode == "offload", timing=True)
        for _ in range(2):  # the second step reuses the buffers
            grads = _cuda_step(model, batch, torch.bfloat16)
            for name, grad in grads.items():
                assert torch.equal(grad, recompute[name]), (mode, name)
        stats = offload.offload_stats(model)
        layers = model.config.num_hidden_layers
        assert stats.layers_offloaded == 2 * layers and stats.fallback_calls == 0
        assert stats.prefetched == (2 * (layers - 1) if mode == "offload" else 0)
        assert stats.h2d_ms > 0 and stats.d2h_ms > 0 and 0.0 <= stats.hidden_fraction <= 1.0


def _default_sdpa_step(model, batch):
    """`_cuda_step` with SDPA free to pick its kernel (cuDNN or FlashAttention-2, as in training)."""
    torch.manual_seed(5)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = causal_lm_loss_sum(model, batch)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(4096, 4096), (5000,), (700, 4100, 333, 2000)])
def test_cuda_kept_attention_matches_recomputing_it(lengths):
    """Equal-length bins keep SDPA's training kernel (cuDNN on Hopper), ragged ones FlashAttention-2 varlen;
    GQA and head dim 128 as in Llama-3.1-8B. Within bf16's 2e-2, not bit for bit as on the CPU: without
    keeping, the forward runs SDPA without grad, where PyTorch may pick another kernel than the recompute's
    (seen from 4,096 tokens on the H200), and FlashAttention-2's backward sums dq with atomics."""
    from transformers import LlamaConfig

    from fastft.runtime.attention import _sdpa_kernel

    config = LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
    )  # fmt: skip
    batch = _batch(lengths, device="cuda")
    results = {}
    for keep in (False, True):
        model = _cuda_model("offload", torch.bfloat16, fused=True, backend="varlen", config=config)
        offload.enable_offload(model, keep_attention=keep)
        results[keep] = [_default_sdpa_step(model, batch) for _ in range(2)]
        outputs = 2 * config.num_hidden_layers * sum(lengths) * 4 * 128 * 2  # two steps of bf16 outputs
        kept = offload.offload_stats(model).bytes_kept
        assert kept >= outputs if keep else kept == 0
    for step in range(2):
        assert _max_relative_error(results[True][step], results[False][step]) <= 2e-2, (lengths, step)
    if torch.cuda.get_device_capability() >= (9, 0) and len(set(lengths)) == 1:
        q = torch.zeros(2, 4, 1024, 128, device="cuda", dtype=torch.bfloat16)
        assert _sdpa_kernel(q, q[:, :2], q[:, :2], None).name == "cuDNN"


@pytest.mark.gpu
def test_cuda_fp32_offload_matches_no_checkpointing():
    batch = _batch((700, 1500, 333, 2000), device="cuda")
    reference = _cuda_step(_cuda_model(False, torch.float32), batch, torch.float32)
    for mode in ("offload", "offload-single", True):
        grads = _cuda_step(_cuda_model(mode, torch.float32), batch, torch.float32)
        assert _max_relative_error(grads, reference) <= 1e-6, mode


@pytest.mark.gpu
def test_cuda_qlora_offload_is_bit_identical_to_recompute():
    pytest.importorskip("bitsandbytes")
    batch = _batch((700, 1500, 333), device="cuda")

    def grads(mode):
        model, _ = fastft.load_model("tiny-llama", load_in_4bit=True)
        model = fastft.add_lora(model, r=8, gradient_checkpointing=mode, seed=1)
        _randomise_lora_b(model)
        patch_packed_attention(model, "sdpa_masked")
        model.train()
        return _cuda_step(model, batch, torch.bfloat16)

    recompute = grads(True)
    for name, grad in grads("offload").items():
        assert torch.equal(grad, recompute[name]), name


@pytest.mark.gpu
def test_cuda_peak_memory_does_not_grow_with_depth_beyond_two_buffers():
    from transformers import LlamaConfig

    batch = _batch((4096, 4096, 4096, 4096), device="cuda")
    hidden = 1024
    layer_input = batch.num_tokens * hidden * 2  # bf16

    def activation_peak(mode, layers):
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=hidden,
            intermediate_size=4096,
            num_hidden_layers=layers,
            num_attention_heads=8,
            num_key_value_heads=8,
        )
        model = _cuda_model(mode, torch.bfloat16, config=config, backend="sdpa_segments")
        _cuda_step(model, batch, torch.bfloat16)  # warm-up: buffers, pinned memory, kernels
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _cuda_step(model, batch, torch.bfloat16)
        torch.cuda.synchronize()
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        peak = torch.cuda.max_memory_allocated() - before - grads
        del model
        torch.cuda.empty_cache()
        return peak

    growth = {mode: activation_peak(mode, 8) - activation_peak(mode, 4) for mode in ("offload", True)}
    assert growth[True] > 3 * layer_input  # plain recompute keeps one input per layer on the GPU
    assert growth["offload"] < layer_input / 2, growth  # offload: two buffers whatever the depth


def _embedding_outputs(model) -> list:
    """Weak references to the embeddings' outputs of each forward (a hook on this instance)."""
    import weakref

    seen = []
    model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(weakref.ref(o)))
    return seen


@pytest.mark.parametrize("mode,force", [(True, None), ("offload", "sync")])
def test_the_embeddings_output_needs_no_gradient_and_offloading_does_not_hold_it(mode, force):
    """PEFT (wrapping a checkpointed model) and TRL's trainers (`enable_input_require_grads`) make the
    embeddings' output require a gradient, for reentrant checkpointing. fastft's checkpointing needs none,
    and with it that output became a leaf held to the end of backward: under offloading, one ``[tokens,
    hidden]`` tensor on the device through the step beside the two buffers (`drop_input_gradients`)."""
    import gc

    model = _model(mode=mode, force=force)
    model.enable_input_require_grads()  # what TRL's SFTTrainer calls: a no-op while fastft checkpoints
    seen = _embedding_outputs(model)
    loss = causal_lm_loss_sum(model, _batch())
    gc.collect()
    output = seen[0]()
    if mode == "offload":
        assert output is None  # in host memory only: the device tensor is gone before backward
    else:
        assert output is not None and not output.requires_grad  # the checkpoint's saved input of layer 0
    del output
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_gradients_do_not_change_without_the_embeddings_gradient_hook():
    """The same offloaded step with transformers' hook put back on the instance (the embeddings' output a
    leaf that requires grad, layer 0 computing its input gradient): every LoRA gradient identical."""
    batch = _batch()
    loss, grads = _step(_model(mode="offload", force="sync"), batch)
    hooked = _model(mode="offload", force="sync")
    base = hooked.get_base_model()
    type(base).enable_input_require_grads(base)
    required = []
    hooked.get_input_embeddings().register_forward_hook(lambda m, i, o: required.append(o.requires_grad))
    hooked_loss, hooked_grads = _step(hooked, batch)
    assert required == [True]  # the hook ran: the reference step had the leaf
    assert loss == hooked_loss
    assert grads.keys() == hooked_grads.keys()
    assert all(torch.equal(grads[name], hooked_grads[name]) for name in grads)

"""Packed attention: every layer reads one `PackedBatch`; nothing is rebuilt per layer or synced.

transformers rebuilds packing metadata from ``position_ids`` in each forward (a dense mask for
SDPA, ``cu_seqlens`` with a host sync per layer for flash-attention). fastft registers one new
attention implementation, ``"fastft_packed"``, and switches *model instances* to it (their own
config; no class or global function is rebound); the backend is the model's own
(``model_state(model).attention``), which each attention module reads through its decoder layer's
`fastft.runtime.context.LayerContext`. In a packed training step the loss passes
``fastft_batch=batch`` through the model's keyword arguments and a 4-D marker as the attention
mask, which makes transformers skip mask creation; each attention layer then runs one of the
backends below on the batch's ``cu_seqlens`` / host lengths / cached artefacts. Without a batch
(``generate``, a plain forward) the implementation is exactly transformers' SDPA path.

Backends (all causal within each sequence, sliding windows honoured, GQA without repeat):
- ``sdpa_masked``: SDPA with a block-diagonal causal boolean mask built once per batch (CPU default).
- ``sdpa_segments``: SDPA with ``is_causal`` per sequence, reading host lengths (no mask at all).
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 inside PyTorch; CUDA). A bin whose
  sequences all have one length (fixed-length blocks, or one long sequence) runs as a ``[n, heads, len, dim]``
  batch through SDPA's causal kernel instead, which PyTorch sends to cuDNN's fused attention on Hopper,
  faster than FlashAttention-2 (BENCHMARKS.md, "Attention kernels"); elsewhere PyTorch picks FlashAttention-2.
- ``flash_attn``: ``flash_attn_varlen_func`` when the flash-attn package is installed (CUDA).
- ``flex``: ``flex_attention`` with a document-causal BlockMask built once per batch.
``"auto"`` follows the whole-step measurements recorded in BENCHMARKS.md (`choose_backend`):
``varlen`` on CUDA, ``sdpa_masked`` on the CPU (``sdpa_segments`` once a dense mask would pass
64 Mi entries).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from fastft.data.batch import PackedBatch
from fastft.runtime.activation_checkpointing import KEEP_FROM_LENGTH
from fastft.runtime.context import ATTENTION, KeptTensors, attach_layer_contexts, layer_context
from fastft.runtime.model_state import PackedAttentionState, base_model, model_state, state_of
from fastft.runtime.unpadding import repad, takes_padded_batch, unpad

# Function-local imports: flash-attn is optional (one attention backend); torch and transformers submodules load
# where their feature is used (not every supported version has each, and each costs its import).


IMPLEMENTATION = "fastft_packed"
# Each backend and the kernels it runs (run summaries name them: `describe_backend`).
BACKEND_KERNELS = {
    "sdpa_masked": "SDPA with a block-diagonal causal mask",
    "sdpa_segments": "SDPA per sequence",
    "varlen": "FlashAttention-2 varlen; equal-length bins as one causal SDPA batch, cuDNN on Hopper",
    "flash_attn": "flash-attn varlen",
    "flex": "flex_attention with a document-causal mask",
}
BACKENDS = tuple(BACKEND_KERNELS)
# Backends that read only a batch's tensors and shape, never its host sequence lengths: a batch padded to a
# static shape (`fastft.data.batch.BatchShape`) replays one CUDA graph through them whatever its sequences.
SHAPE_ONLY_BACKENDS = ("sdpa_masked", "varlen", "flash_attn")
_DENSE_MASK_LIMIT = 64 * 2**20  # entries of a [T, T] mask before the CPU default switches to segments


class AttentionBackendError(ValueError):
    pass


# -- backends ------------------------------------------------------------------------------------
def _window(sliding_window: int | None) -> int | None:
    return int(sliding_window) if sliding_window else None


def _sequence_ids(batch: PackedBatch) -> torch.Tensor:
    """Which sequence each token belongs to, from cu_seqlens on the device (no host data, no sync)."""

    def build() -> torch.Tensor:
        tokens = torch.arange(batch.num_tokens, device=batch.device, dtype=batch.cu_seqlens.dtype)
        return torch.searchsorted(batch.cu_seqlens[1:], tokens, right=True)

    return batch.artifact("sequence_ids", build)


def _dense_mask(batch: PackedBatch, window: int | None) -> torch.Tensor:
    def build() -> torch.Tensor:
        sequence = _sequence_ids(batch)
        position = batch.position_ids[0]
        mask = (sequence[:, None] == sequence[None, :]) & (position[None, :] <= position[:, None])
        if window is not None:
            mask &= position[:, None] - position[None, :] < window
        return mask[None, None]

    return batch.artifact(f"dense_mask:{window}", build)


def _sdpa_masked(query, key, value, batch, scaling, dropout, window, kept=None):
    mask = _dense_mask(batch, window)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2)


def _sdpa_segments(query, key, value, batch, scaling, dropout, window, kept=None):
    outputs, start = [], 0
    for length in batch.sequence_lengths:
        end = start + length
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        if window is not None and length > window:
            i = torch.arange(length, device=query.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=True
            )
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=scaling, enable_gqa=True
            )
        outputs.append(out)
        start = end
    return torch.cat(outputs, dim=2).transpose(1, 2)


@functools.cache
def _varlen_takes_enable_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _flash_dtype(query: torch.Tensor) -> torch.dtype:
    """FlashAttention kernels take 16-bit inputs only; fp32 activations (a model whose norms are fp32, e.g. a
    QLoRA model prepared by PEFT's k-bit preparation) are computed in the autocast dtype, or bf16 outside
    autocast."""
    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16


def _token_major(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[1, heads, T, dim] -> [T, heads, dim]`` as a view of the projection's token-major output.

    ``squeeze``, not ``t[0]``: autograd answers an index with a zero-filled copy of the whole gradient,
    transposed into head-major memory, which the projection's backward then copies back (six copies and
    three fills per layer; docs/journal.md, "Measurements once quoted in code comments").
    """
    return t.squeeze(0).transpose(0, 1).to(dtype)


def _uniform_length(batch: PackedBatch) -> int | None:
    """The one sequence length of a bin made of equal-length sequences (host numbers), else None."""
    if batch.num_sequences and batch.max_seqlen * batch.num_sequences == batch.num_tokens:
        return batch.max_seqlen
    return None


def _sdpa_uniform(query, key, value, length, scaling, kept: KeptTensors | None = None):
    """Equal-length sequences as a batch ``[n, heads, length, dim]``: one causal SDPA call (views only)."""
    n, dim = query.shape[2] // length, query.shape[-1]
    q, k, v = (t.squeeze(0).unflatten(1, (n, length)).transpose(0, 1) for t in (query, key, value))
    out = _kept_attention(q, k, v, scaling, _sdpa_kernel, length, kept)
    if out is None and length >= GROUPED_BACKWARD_FROM and q.requires_grad:
        kernel = _sdpa_kernel(q, k, v, scaling)
        if kernel is not None:
            out = _LongAttention.apply(q, k, v, kernel)
    if out is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).reshape(1, n * length, query.shape[1], dim)


# -- attention kept for the recompute ------------------------------------------------------------
# What a layer keeps under offloaded checkpointing, and from which length (`KEEP_FROM_LENGTH`, with the
# measurements behind it), is written beside the checkpointing modes in `fastft.runtime.activation_checkpointing`.


@dataclass(frozen=True)
class _Kernel:
    """An attention kernel's forward (``(q, k, v) -> out, lse, state``) and backward
    (``(grad_out, q, k, v, out, lse, state) -> dq, dk, dv``); ``state``: its other outputs (RNG state,
    sequence offsets: small device tensors and ints), kept on the device by reference."""

    name: str
    forward: object
    backward: object


def _sdpa_flash_cpu(scale):
    op = torch.ops.aten

    def forward(q, k, v):
        out, lse = op._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return out, lse, ()

    def backward(grad, q, k, v, out, lse, state):
        return op._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, True, scale=scale
        )

    return _Kernel("flash (CPU)", forward, backward)


def _sdpa_flash_cuda(scale):
    op = torch.ops.aten

    def forward(q, k, v):
        out, lse, cum_q, cum_k, max_q, max_k, rng, unused, _ = op._scaled_dot_product_flash_attention(
            q, k, v, 0.0, True, False, scale=scale
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, rng, unused)

    def backward(grad, q, k, v, out, lse, state):
        cum_q, cum_k, max_q, max_k, rng, unused = state
        return op._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng, unused, scale=scale
        )

    return _Kernel("FlashAttention-2", forward, backward)


def _sdpa_cudnn(scale):
    op = torch.ops.aten

    def forward(q, k, v):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = op._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False, scale=scale
        )
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(grad, q, k, v, out, lse, state):
        cum_q, cum_k, max_q, max_k, seed, offset = state
        return op._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale
        )

    return _Kernel("cuDNN", forward, backward)


_FLASH, _CUDNN = 1, 3  # torch.nn.attention.SDPBackend values, as `_fused_sdp_choice` returns them


def _sdpa_kernel(q, k, v, scale) -> _Kernel | None:
    """The kernel causal SDPA would run on these ``[n, heads, length, dim]`` inputs in training (what
    `_fused_sdp_choice` picks for inputs that require grad), when it is one whose op fastft calls."""
    probe = q.detach().requires_grad_()
    choice = torch.ops.aten._fused_sdp_choice(probe, k, v, None, 0.0, True, scale=scale, enable_gqa=True)
    if choice == _FLASH:
        return _sdpa_flash_cpu(scale) if q.device.type == "cpu" else _sdpa_flash_cuda(scale)
    if choice == _CUDNN:
        return _sdpa_cudnn(scale)
    return None  # memory-efficient or math kernels: recomputed as before


def _varlen_kernel(cu_seqlens, max_seqlen, window):
    """FlashAttention-2 varlen through its ATen op, as `varlen_attn` runs it (token-major ``[T, heads, dim]``)."""
    op = torch.ops.aten
    sliding = {"window_size_left": window - 1, "window_size_right": 0} if window else {}
    # cu_seqlens and longest length of queries and keys, dropout 0, causal
    packing = (cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True)

    def choose(q, k, v, scale):
        def forward(q, k, v):
            out, lse, rng, unused, _ = op._flash_attention_forward(
                q, k, v, *packing, False, scale=scale, **sliding
            )
            return out, lse, (rng, unused)

        def backward(grad, q, k, v, out, lse, state):
            return op._flash_attention_backward(
                grad, q, k, v, out, lse, *packing, *state, scale=scale, **sliding
            )

        return _Kernel("FlashAttention-2 varlen", forward, backward)

    return choose


# From this sequence length on, attention's backward runs one key/value head group at a time
# (`grouped_backward`).
GROUPED_BACKWARD_FROM = 32768


def grouped_backward(kernel: _Kernel, grad, q, k, v, out, lse, state):
    """The kernel's backward on ``[n, heads, length, dim]`` inputs, one key/value head (and its group of query
    heads) at a time, written into whole ``dq``, ``dk``, ``dv``.

    Each call's workspace is a group's share of the whole call's: FlashAttention-2's backward holds an fp32
    ``dq`` accumulator and, under grouped-query attention, ``dk``/``dv`` expanded to every query head, about
    five ``[length, hidden]`` 16-bit tensors beside its outputs (Llama-3.1-8B at 131,072 tokens: 5.3 GB), an
    eighth of that in 8 groups. Heads never interact in attention, so every gradient is the one the whole
    call computes: each group runs the same kernel on the same values. At long context the extra launches
    and the copies into the whole gradients cost nothing beside the quadratic attention."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads or kv_heads == 1:
        return kernel.backward(grad, q, k, v, out, lse, state)
    group = heads // kv_heads
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for g in range(kv_heads):
        qs, ks = slice(g * group, (g + 1) * group), slice(g, g + 1)
        parts = kernel.backward(
            grad[:, qs], q[:, qs], k[:, ks], v[:, ks], out[:, qs], lse[:, qs].contiguous(), state
        )
        for whole, part in zip((dq[:, qs], dk[:, ks], dv[:, ks]), parts, strict=True):
            whole.copy_(part)
        del parts
    return dq, dk, dv


class _LongAttention(torch.autograd.Function):
    """Causal attention over long sequences: the kernel's forward, and its backward per head group
    (`grouped_backward`). ``apply(q, k, v, kernel)`` on ``[n, heads, length, dim]``."""

    @staticmethod
    def forward(ctx, query, key, value, kernel):
        out, lse, state = kernel.forward(query, key, value)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.kernel, ctx.state = kernel, state
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = grouped_backward(ctx.kernel, grad, query, key, value, out, lse, ctx.state)
        return dq, dk, dv, None


class _AttentionFromKept(torch.autograd.Function):
    """Attention whose forward ran in the layer's offloaded forward: hands back the kept output and runs
    the kernel's backward on it."""

    @staticmethod
    def forward(ctx, query, key, value, out, lse, kernel, state):
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.kernel, ctx.state = kernel, state
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        if query.dim() == 4 and query.shape[2] >= GROUPED_BACKWARD_FROM:
            dq, dk, dv = grouped_backward(ctx.kernel, grad, query, key, value, out, lse, ctx.state)
        else:
            dq, dk, dv = ctx.kernel.backward(grad, query, key, value, out, lse, ctx.state)
        return dq, dk, dv, None, None, None, None


def _kept_attention(q, k, v, scale, choose, longest: int, kept: KeptTensors | None) -> torch.Tensor | None:
    """Causal attention through a kept output (see above), or None where the caller computes it as usual:
    outside an offloaded layer (`kept` None), attention not kept, sequences shorter than
    `KEEP_FROM_LENGTH` (or the offloader's longer `KeptTensors.from_length`), a kernel fastft does not
    call, or where the forward kept nothing. `longest`: the sequences' length, for a packed bin its
    `PackedBatch.attended_length` (what the attention's cost grows with), not its longest sequence: a 4,096-token
    bin of short chats with one 2,100-token answer has little attention to save, and keeping it cost
    fastft's CUDA-graph runs two device buffers of 64 MiB more than its eager ones on Llama-3.1-8B (the graphed
    batches reported their padded length)."""
    if kept is None:
        return None
    if not kept.recording:
        entry = kept.take(ATTENTION)
        if entry is None:
            return None
        (out, lse), (kernel, state) = entry
        return _AttentionFromKept.apply(q, k, v, out, lse, kernel, state)
    if not kept.wants(ATTENTION):
        return None
    kernel = choose(q, k, v, scale) if longest >= max(KEEP_FROM_LENGTH, kept.from_length) else None
    if kernel is None:
        return None
    out, lse, state = kernel.forward(q, k, v)
    kept.keep(ATTENTION, (out, lse), (kernel, state))
    return out


def _varlen(query, key, value, batch, scaling, dropout, window, kept=None):
    from torch.nn.attention.varlen import varlen_attn

    if dropout:
        raise AttentionBackendError(
            "the varlen backend has no attention dropout: use sdpa_masked/sdpa_segments"
        )
    dtype = _flash_dtype(query)
    length = _uniform_length(batch)
    if length is not None and (window is None or window >= length):
        q, k, v = (t.to(dtype) for t in (query, key, value))
        return _sdpa_uniform(q, k, v, length, scaling, kept).to(query.dtype)
    q, k, v = (_token_major(t, dtype) for t in (query, key, value))
    choose = _varlen_kernel(batch.cu_seqlens, batch.max_seqlen, window)
    out = _kept_attention(q, k, v, scaling, choose, batch.attended_length, kept)
    if out is not None:
        return out.unsqueeze(0).to(query.dtype)
    extra = {"enable_gqa": True} if _varlen_takes_enable_gqa() else {}
    cu = batch.cu_seqlens
    out = varlen_attn(
        q,
        k,
        v,
        cu,
        cu,
        batch.max_seqlen,
        batch.max_seqlen,
        scale=scaling,
        window_size=(window - 1 if window else -1, 0),
        **extra,
    )
    return out.unsqueeze(0).to(query.dtype)


def _flash_attn(query, key, value, batch, scaling, dropout, window, kept=None):
    from flash_attn import flash_attn_varlen_func

    dtype = _flash_dtype(query)
    q, k, v = (_token_major(t, dtype) for t in (query, key, value))
    cu = batch.cu_seqlens
    out = flash_attn_varlen_func(
        q,
        k,
        v,
        cu,
        cu,
        batch.max_seqlen,
        batch.max_seqlen,
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=True,
        window_size=(window - 1 if window else -1, 0),
    )
    return out.unsqueeze(0).to(query.dtype)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _block_mask(batch: PackedBatch, window: int | None):
    from torch.nn.attention.flex_attention import create_block_mask

    def build():
        sequence = _sequence_ids(batch)
        position = batch.position_ids[0]

        def document_causal(b, h, q, kv):
            keep = (sequence[q] == sequence[kv]) & (kv <= q)
            return keep & (position[q] - position[kv] < window) if window is not None else keep

        compiled = batch.device.type == "cuda"
        return create_block_mask(
            document_causal,
            None,
            None,
            batch.num_tokens,
            batch.num_tokens,
            device=batch.device,
            _compile=compiled,
        )

    return batch.artifact(f"block_mask:{window}", build)


def _flex(query, key, value, batch, scaling, dropout, window, kept=None):
    if dropout:
        raise AttentionBackendError(
            "the flex backend has no attention dropout: use sdpa_masked/sdpa_segments"
        )
    from torch.nn.attention.flex_attention import flex_attention

    attend = _compiled_flex() if query.is_cuda else flex_attention
    out = attend(query, key, value, block_mask=_block_mask(batch, window), scale=scaling, enable_gqa=True)
    return out.transpose(1, 2)


# The built-in backends (read-only). Another backend is a function with their signature,
# ``function(query, key, value, batch, scaling, dropout, window, kept=None) -> [1, T, Hq, D]``, given to
# `patch_packed_attention` for one model (a benchmark's ablation); `kept` is the layer call's `KeptTensors`
# (None outside an offloaded layer), to hand on to `packed_attention`.
_BACKEND_FUNCTIONS = types.MappingProxyType(
    {
        "sdpa_masked": _sdpa_masked,
        "sdpa_segments": _sdpa_segments,
        "varlen": _varlen,
        "flash_attn": _flash_attn,
        "flex": _flex,
    }
)


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run on `device` in this environment."""
    device = torch.device(device)
    names = ["sdpa_masked", "sdpa_segments"]
    if device.type == "cuda":  # flex has no backward on the CPU; varlen and flash-attn are CUDA-only
        if importlib.util.find_spec("torch.nn.attention.varlen") is not None:
            names.append("varlen")
        if importlib.util.find_spec("flash_attn") is not None:
            names.append("flash_attn")
        names.append("flex")
    return names


def packed_attention(
    query,
    key,
    value,
    batch: PackedBatch,
    backend: str | Callable,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    kept: KeptTensors | None = None,
):
    """Causal attention within each sequence of `batch`, by `backend` (a name of `BACKENDS`, or a backend
    function). `kept`: the offloaded layer call's `KeptTensors`, whose attention output it keeps or reuses.

    query ``[1, Hq, T, D]``, key/value ``[1, Hkv, T, D]`` (Hq a multiple of Hkv); returns ``[1, T, Hq, D]``.
    """
    if backend is None:
        raise AttentionBackendError(
            "the packed-attention backend is not chosen yet: call choose_backend(model, batch) first "
            "(fastft's loss does), or patch with an explicit backend"
        )
    function = backend if callable(backend) else _BACKEND_FUNCTIONS.get(backend)
    if function is None:
        raise AttentionBackendError(f"unknown attention backend {backend!r}: use one of {BACKENDS} or 'auto'")
    return function(query, key, value, batch, scaling, dropout, _window(sliding_window), kept=kept)


# -- the transformers attention implementation --------------------------------------------------
def _attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    batch = kwargs.pop("fastft_batch", None)
    sliding_window = kwargs.pop("sliding_window", None)
    if batch is None:  # not a packed step (generate, plain forward): transformers' own SDPA path
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if kwargs.get("softcap"):
        raise AttentionBackendError(
            "attention logit soft-capping is not supported by fastft's packed attention yet"
        )
    if kwargs.get("s_aux") is not None:  # gpt-oss: dropping the sinks would silently change the model
        raise AttentionBackendError(
            "attention sinks (gpt-oss) are not supported by fastft's packed attention yet: train with "
            "TrainConfig(attention=None) (transformers' attention over the packed position_ids)"
        )
    context = layer_context(module)
    state = None if context is None else context.model_state.attention
    if state is None:
        raise AttentionBackendError(
            f"{type(module).__name__} runs fastft's packed attention outside a decoder layer that "
            "patch_packed_attention switched (a module added since?): call patch_packed_attention(model) again"
        )
    out = packed_attention(
        query, key, value, batch, state.function, scaling, dropout, sliding_window, kept=context.kept
    )
    return out, None


def _register() -> None:
    """Add the ``fastft_packed`` name to transformers' registries (a new name; nothing is replaced)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, _attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, sdpa_mask)


def _configs(model: torch.nn.Module):
    seen = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation"):
            seen.add(id(config))
            yield config


def patch_packed_attention(model: torch.nn.Module, backend: str | Callable = "auto") -> torch.nn.Module:
    """Switch this model instance to packed attention (idempotent; `unpatch_packed_attention` undoes it).

    `backend`: a name of `BACKENDS`, "auto" (`choose_backend` picks on the first batch), or a backend
    function with the built-in ones' signature (see `_BACKEND_FUNCTIONS`), for this model only, named by
    its ``__name__`` in `describe_backend`."""
    if not callable(backend) and backend != "auto" and backend not in _BACKEND_FUNCTIONS:
        raise AttentionBackendError(f"unknown attention backend {backend!r}: use one of {BACKENDS} or 'auto'")
    _register()
    models = model_state(model)
    state = models.attention
    if state is None:
        state = PackedAttentionState(backend, model.config._attn_implementation)
        models.attention = state
    state.requested = backend
    if backend == "auto":
        state.resolved = state.function = None
    else:
        _resolve(state, backend)
    attach_layer_contexts(model)
    for config in _configs(model):
        config._attn_implementation = IMPLEMENTATION
    if state.hook is None:
        decoder = _decoder(model)
        if decoder is not None:
            hook = functools.partial(_padding_free_hook, state)
            state.hook = decoder.register_forward_pre_hook(hook, with_kwargs=True)
            state.repad_hook = decoder.register_forward_hook(repad, with_kwargs=True)
    return model


def _decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    base = base_model(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    return decoder if decoder is not None and hasattr(decoder, "layers") else None


def _padding_free_hook(state: PackedAttentionState, decoder: torch.nn.Module, args: tuple, kwargs: dict):
    """Padding-free inputs the Hugging Face way (``[1, T]`` rows whose ``position_ids`` restart at each
    sequence and no attention mask: ``DataCollatorWithFlattening``, TRL's ``padding_free`` / packing) run
    through the packed attention: the batch's boundaries are read once here, before the first layer
    (`PackedBatch.from_position_ids`), instead of transformers building a ``[T, T]`` mask from them.
    A padded training batch (a 2-D attention mask) runs unpadded through it too (`fastft.runtime.unpadding`).
    Anything else (a KV cache, fastft's own packed steps) is left as it is."""
    if not args and takes_padded_batch(decoder, kwargs):
        unpadded = unpad(kwargs)
        if unpadded is None:
            return None
        batch, kwargs = unpadded
        if state.resolved is None:
            _resolve_for(state, batch)
        return (), dict(kwargs, fastft_batch=batch, attention_mask=mask_marker(batch))
    position_ids = kwargs.get("position_ids")
    if (
        position_ids is None
        or position_ids.dim() != 2
        or position_ids.shape[0] != 1
        or kwargs.get("attention_mask") is not None
        or kwargs.get("fastft_batch") is not None
        or kwargs.get("past_key_values") is not None
        or kwargs.get("use_cache")
    ):
        return None
    batch = PackedBatch.from_position_ids(position_ids, kwargs.get("input_ids"))
    if batch.num_sequences == 1:
        return None  # one causal sequence: transformers' own path needs no mask either
    if state.resolved is None:
        _resolve_for(state, batch)
    kwargs = dict(kwargs, fastft_batch=batch, attention_mask=mask_marker(batch))
    return args, kwargs


def mask_marker(batch: PackedBatch) -> torch.Tensor:
    """A 4-D attention mask with no entries: transformers skips building its own (and its packed-sequence
    detection, a host sync) and fastft's packed attention reads the `PackedBatch` instead."""
    return batch.artifact(
        "mask_marker", lambda: torch.ones(1, 1, 0, 0, dtype=torch.bool, device=batch.device)
    )


def unpatch_packed_attention(model: torch.nn.Module) -> torch.nn.Module:
    models = state_of(model)
    state = None if models is None else models.attention
    if state is not None:
        for config in _configs(model):
            config._attn_implementation = state.previous_implementation
        if state.hook is not None:
            state.hook.remove()
        if state.repad_hook is not None:
            state.repad_hook.remove()
        models.attention = None
    return model


def is_patched(model: torch.nn.Module) -> bool:
    models = state_of(model)
    return models is not None and models.attention is not None


def _resolve(state: PackedAttentionState, backend: str | Callable) -> None:
    if callable(backend):
        state.resolved, state.function = getattr(backend, "__name__", "custom"), backend
    else:
        state.resolved, state.function = backend, _BACKEND_FUNCTIONS[backend]


def describe_backend(model: torch.nn.Module) -> str | None:
    """The packed-attention backend this model resolved to and the kernels it runs, for run summaries:
    e.g. ``"varlen (FlashAttention-2 varlen; ...)"``. None when not patched or not resolved yet."""
    models = state_of(model)
    state = None if models is None else models.attention
    if state is None or state.resolved is None:
        return None
    kernels = BACKEND_KERNELS.get(state.resolved)
    return f"{state.resolved} ({kernels})" if kernels else state.resolved


def choose_backend(model: torch.nn.Module, batch: PackedBatch) -> str:
    """The backend this model uses for packed batches (resolved once, on the first batch).

    "auto" follows whole-training-step measurements (BENCHMARKS.md, "Packing: metadata once per batch";
    the backends' ranking: docs/journal.md, "Measurements once quoted in code comments"): ``varlen`` ran the step fastest, ``flex`` slowest (its BlockMask
    is rebuilt for every new bin length). Timing attention alone ranked them differently, so no per-run probe decides. Without ``varlen``: flash-attn, then
    SDPA with a dense mask while it stays small, else SDPA per sequence.
    """
    return _resolve_for(model_state(model).attention, batch)


def _resolve_for(state: PackedAttentionState, batch: PackedBatch) -> str:
    if state.resolved is not None:
        return state.resolved
    available = available_backends(batch.device)
    for name in ("varlen", "flash_attn"):
        if name in available:
            _resolve(state, name)
            return name
    dense = batch.num_tokens**2 <= _DENSE_MASK_LIMIT
    _resolve(state, "sdpa_masked" if dense else "sdpa_segments")
    return state.resolved

"""What each architecture becomes in GGUF: llama.cpp's architecture name, its hyperparameter keys, and each
Hugging Face tensor's GGUF name and layout.

The names come from the `gguf` package (``gguf.TensorNameMap``, ``gguf.MODEL_ARCH``), the table llama.cpp
itself maintains. Three layouts differ from the Hugging Face checkpoint, as in llama.cpp's
``convert_hf_to_gguf.py``:

- Llama, Mistral and Mixtral run llama.cpp's "normal" RoPE, which rotates adjacent pairs (x[2i], x[2i+1]);
  transformers rotates halves (x[i], x[i + d/2]). Their q_proj and k_proj rows are permuted per head so both
  compute the same thing. Qwen2, Qwen3 and Qwen3-MoE run the "neox" RoPE (halves) and keep their rows.
- Stacked experts (``experts.gate_up_proj`` [E, 2I, H]) are split into ``ffn_gate_exps`` and
  ``ffn_up_exps`` [E, I, H]; ``experts.down_proj`` [E, H, I] becomes ``ffn_down_exps``.
- Llama-3 RoPE scaling becomes a ``rope_freqs`` tensor of per-frequency divisors.
- Gemma 3's RMSNorm scales by ``1 + weight``; llama.cpp's by ``weight``, so every norm weight is written
  plus one (in fp32). Which layers slide is written per layer (``sliding_window_pattern``), with the
  sliding layers' own RoPE base.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import gguf
import torch


class UnsupportedArchitectureError(ValueError):
    """The model's architecture (or one of its settings) has no faithful GGUF form here; the message names it."""


@dataclass(frozen=True)
class Family:
    """How one transformers ``model_type`` is written: llama.cpp's architecture and its RoPE layout."""

    model_type: str
    arch: str  # gguf.MODEL_ARCH member name
    rope_pairs: bool  # llama.cpp's "normal" RoPE (adjacent pairs): q/k rows are permuted
    moe: bool = False
    norm_shift: float = 0.0  # added to every norm weight (Gemma's RMSNorm scales by 1 + weight)


FAMILIES = {
    f.model_type: f
    for f in (
        Family("llama", "LLAMA", rope_pairs=True),
        Family("mistral", "LLAMA", rope_pairs=True),
        Family("mixtral", "LLAMA", rope_pairs=True, moe=True),
        Family("qwen2", "QWEN2", rope_pairs=False),
        Family("qwen3", "QWEN3", rope_pairs=False),
        Family("qwen3_moe", "QWEN3MOE", rope_pairs=False, moe=True),
        Family("gemma3_text", "GEMMA3", rope_pairs=False, norm_shift=1.0),
    )
}

_REFUSED = {
    "gpt_oss": "gpt-oss: llama.cpp stores its experts in MXFP4 and runs attention sinks, biased experts and a "
    "clamped SwiGLU, and fastft's read-back check has no forward for them yet, so fastft does not write a "
    "file it cannot check. Save the merged 16-bit model (fastft.save_merged) and convert it with llama.cpp's "
    "convert_hf_to_gguf.py.",
}


def family_of(config) -> Family:
    """The `Family` of a transformers config, or `UnsupportedArchitectureError` naming it and what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type in _REFUSED:
        raise UnsupportedArchitectureError(f"GGUF export of {_REFUSED[model_type]}")
    if model_type not in FAMILIES:
        raise UnsupportedArchitectureError(
            f"GGUF export does not support the architecture {model_type!r}; fastft exports "
            f"{', '.join(sorted(FAMILIES))}. Save the merged model (fastft.save_merged) and convert it with "
            "llama.cpp's convert_hf_to_gguf.py."
        )
    family = FAMILIES[model_type]
    if model_type == "qwen3_moe":
        if not getattr(config, "norm_topk_prob", True):
            raise UnsupportedArchitectureError(
                "GGUF export of qwen3_moe with norm_topk_prob=False: llama.cpp's qwen3moe always renormalises "
                "the top-k router weights, so the file would answer differently."
            )
        if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
            raise UnsupportedArchitectureError(
                "GGUF export of qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step != 1): "
                "llama.cpp's qwen3moe expects experts in every layer."
            )
    if model_type == "gemma3_text":
        _check_gemma3(config)
    return family


def _check_gemma3(config) -> None:
    """Refuse a Gemma 3 setting llama.cpp's gemma3 graph does not compute (`UnsupportedArchitectureError`)."""
    refused = []
    if getattr(config, "attn_logit_softcapping", None) is not None:
        refused.append("attn_logit_softcapping (llama.cpp's gemma3 has none)")
    if getattr(config, "use_bidirectional_attention", False):
        refused.append("use_bidirectional_attention (an embedding model, llama.cpp's gemma-embedding)")
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if activation != "gelu_pytorch_tanh":
        refused.append(f"hidden_activation={activation!r} (llama.cpp runs the tanh GELU)")
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if scalar is not None and scalar != gemma3_query_scalar(config):
        refused.append(
            f"query_pre_attn_scalar={scalar} (llama.cpp scales queries by 1/sqrt({gemma3_query_scalar(config)}) "
            f"for a {config.num_hidden_layers}-layer model)"
        )
    for kind, params in _gemma3_rope(config).items():
        allowed = ("default", "linear") if kind == "full_attention" else ("default",)
        if params.get("rope_type", "default") not in allowed:
            refused.append(
                f"{kind} RoPE {params.get('rope_type')!r} (llama.cpp's gemma3 runs {' or '.join(allowed)})"
            )
    if refused:
        raise UnsupportedArchitectureError(
            f"GGUF export of gemma3_text with {'; '.join(refused)}: the file would answer differently. Save the "
            "merged model (fastft.save_merged) and convert it with llama.cpp's convert_hf_to_gguf.py."
        )


def gemma3_query_scalar(config) -> int:
    """What llama.cpp divides Gemma 3's queries by the root of: the head size, except for the 62-layer model
    (Gemma 3 27B), where it is hidden / heads (llama.cpp knows the model by its layer count)."""
    if config.num_hidden_layers == 62:
        return config.hidden_size // config.num_attention_heads
    return head_dim(config)


def _gemma3_rope(config) -> dict[str, dict]:
    """Gemma 3's RoPE per layer kind: ``{"full_attention": {...}, "sliding_attention": {...}}`` (transformers
    5 nests them in ``rope_parameters``; older versions give rope_theta, rope_local_base_freq, rope_scaling)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "full_attention" in params or "sliding_attention" in params:
        return {kind: dict(params.get(kind) or {}) for kind in ("full_attention", "sliding_attention")}
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    full = dict(scaling, rope_theta=getattr(config, "rope_theta", 1_000_000.0))
    full.setdefault("rope_type", scaling.get("type", "default"))
    local = {"rope_theta": getattr(config, "rope_local_base_freq", 10_000.0), "rope_type": "default"}
    return {"full_attention": full, "sliding_attention": local}


def _gemma3_hyperparameters(config, arch: str) -> list[tuple[str, object, str]]:
    """Gemma 3's keys beyond the common ones: both RoPE bases, the linear RoPE scaling of the full-attention
    layers, the sliding window and which layers slide, the final logit soft-cap."""
    rope = _gemma3_rope(config)
    full, local = rope["full_attention"], rope["sliding_attention"]
    items: list[tuple[str, object, str]] = [
        (f"{arch}.rope.freq_base", float(full.get("rope_theta", 1_000_000.0)), "FLOAT32"),
        (f"{arch}.rope.freq_base_swa", float(local.get("rope_theta", 10_000.0)), "FLOAT32"),
    ]
    if full.get("rope_type") == "linear":
        items += [
            (f"{arch}.rope.scaling.type", "linear", "STRING"),
            (f"{arch}.rope.scaling.factor", float(full["factor"]), "FLOAT32"),
        ]
    layer_types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    if window and "sliding_attention" in layer_types:
        items += [
            (f"{arch}.attention.sliding_window", int(window), "UINT32"),
            (
                f"{arch}.attention.sliding_window_pattern",
                [t == "sliding_attention" for t in layer_types],
                "ARRAY",
            ),
        ]
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap:
        items.append((f"{arch}.final_logit_softcapping", float(softcap), "FLOAT32"))
    return items


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters(config) -> dict:
    """RoPE settings (transformers 5 keeps them in ``rope_parameters``, older versions in rope_theta/scaling)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def rope_freq_factors(config) -> torch.Tensor | None:
    """Llama-3 RoPE scaling as llama.cpp's ``rope_freqs`` tensor: one divisor per frequency (None otherwise)."""
    params = rope_parameters(config)
    kind = params["rope_type"]
    if kind == "default":
        return None
    if kind != "llama3":
        raise UnsupportedArchitectureError(
            f"GGUF export of RoPE scaling {kind!r} is not supported (fastft writes the default RoPE and "
            "Llama-3's scaling)."
        )
    dim = head_dim(config)
    base = params["rope_theta"]
    factor, low, high = (
        params["factor"],
        params.get("low_freq_factor", 1.0),
        params.get("high_freq_factor", 4.0),
    )
    old_context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


def hyperparameters(config, family: Family) -> list[tuple[str, object, str]]:
    """(key, value, kind) of the architecture's metadata; kind is a `gguf.GGUFValueType` member name."""
    arch = _arch_name(family)
    heads = config.num_attention_heads
    dim = head_dim(config)
    items = [
        (f"{arch}.context_length", int(config.max_position_embeddings), "UINT32"),
        (f"{arch}.embedding_length", int(config.hidden_size), "UINT32"),
        (f"{arch}.block_count", int(config.num_hidden_layers), "UINT32"),
        (f"{arch}.feed_forward_length", int(config.intermediate_size), "UINT32"),
        (f"{arch}.attention.head_count", int(heads), "UINT32"),
        (f"{arch}.attention.head_count_kv", int(getattr(config, "num_key_value_heads", heads)), "UINT32"),
        (f"{arch}.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps), "FLOAT32"),
        (f"{arch}.attention.key_length", int(dim), "UINT32"),
        (f"{arch}.attention.value_length", int(dim), "UINT32"),
        (f"{arch}.rope.dimension_count", int(dim), "UINT32"),
        (f"{arch}.rope.freq_base", float(rope_parameters(config)["rope_theta"]), "FLOAT32"),
        (f"{arch}.vocab_size", int(config.vocab_size), "UINT32"),
    ]
    if family.moe:
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        items += [
            (f"{arch}.expert_count", int(experts), "UINT32"),
            (f"{arch}.expert_used_count", int(config.num_experts_per_tok), "UINT32"),
        ]
        if family.model_type == "qwen3_moe":
            items.append((f"{arch}.expert_feed_forward_length", int(config.moe_intermediate_size), "UINT32"))
    if family.arch == "GEMMA3":
        replaced = dict(
            (key, (key, value, kind)) for key, value, kind in _gemma3_hyperparameters(config, arch)
        )
        items = [replaced.pop(key, (key, value, kind)) for key, value, kind in items] + list(
            replaced.values()
        )
    window = getattr(config, "sliding_window", None)
    if family.arch == "LLAMA" and window and window < config.max_position_embeddings:
        warnings.warn(
            f"{family.model_type}'s sliding window ({window} tokens) has no place in llama.cpp's llama "
            "architecture: the GGUF model attends to the whole context, and answers differently beyond "
            f"{window} tokens.",
            stacklevel=3,
        )
    return items


def _arch_name(family: Family) -> str:
    return gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[family.arch]]


def arch_name(config) -> str:
    """llama.cpp's name of the config's architecture ("llama", "qwen3moe", …)."""
    return _arch_name(family_of(config))


def tensor_layout(
    config, family: Family, key: str, shape: tuple[int, ...]
) -> list[tuple[str, tuple[int, ...]]]:
    """The GGUF tensors (name, torch shape) that the Hugging Face tensor `key` becomes; [] if it is not written
    (a tied output head, rotary buffers)."""

    if key == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
        return []
    if key.endswith("rotary_emb.inv_freq"):
        return []
    if key.endswith("mlp.experts.gate_up_proj"):
        block = _block(key)
        half = (shape[0], shape[1] // 2, shape[2])
        return [(f"blk.{block}.ffn_gate_exps.weight", half), (f"blk.{block}.ffn_up_exps.weight", half)]
    if key.endswith("mlp.experts.down_proj"):
        return [(f"blk.{_block(key)}.ffn_down_exps.weight", tuple(shape))]
    names = gguf.TensorNameMap(gguf.MODEL_ARCH[family.arch], config.num_hidden_layers)
    name = names.get_name(key, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise UnsupportedArchitectureError(
            f"GGUF export of {family.model_type}: the tensor {key!r} has no GGUF name, so the file would miss it."
        )
    return [(name, tuple(shape))]  # get_name keeps the matched suffix (".weight" / ".bias")


def convert_tensor(
    config, family: Family, key: str, value: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF tensors of one Hugging Face tensor (see `tensor_layout`), in the file's layout and the
    tensor's own dtype (no copy where the layout is unchanged)."""
    layout = tensor_layout(config, family, key, tuple(value.shape))
    if not layout:
        return
    if key.endswith("mlp.experts.gate_up_proj"):
        gate, up = value.chunk(2, dim=1)
        yield layout[0][0], gate.contiguous()
        yield layout[1][0], up.contiguous()
        return
    if family.norm_shift and key.endswith("norm.weight"):
        value = value.float() + family.norm_shift
    if family.rope_pairs and key.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        heads = config.num_attention_heads
        if key.endswith("k_proj.weight"):
            heads = getattr(config, "num_key_value_heads", heads)
        value = pairs_from_halves(value, heads)
    yield layout[0][0], value


def pairs_from_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's output rows from transformers' half-split RoPE layout to llama.cpp's pairs:
    within a head, rows [0..d/2) and [d/2..d) interleave as 0, d/2, 1, d/2+1, …"""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    )


def _block(key: str) -> int:
    parts = key.split(".")
    return int(parts[parts.index("layers") + 1])

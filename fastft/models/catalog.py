"""A catalog of real model architectures, kept as data: nothing is downloaded.

Each :class:`ModelSpec` holds the published ``config.json`` fields of one hub model that decide its
architecture (shapes, biases, norms, experts, attention layout), so the model picker can list it and
the VRAM estimator can size it without touching the network. :meth:`ModelSpec.parameter_count`
derives the parameter count from those shapes, component by component; the tests pin it to the
modules `transformers` really builds (on the meta device) and to the totals the publishers state.

Each family has its base and its instruct model: one of the pair is an architecture entry, the other a
variant (`variant_of`) that shares the entry's config dict and states only what its own config.json
says differently (`VARIANT_FIELDS`: the context length), so the shapes are written once.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Function-local imports: the CLI's parser and light commands read this module without torch or transformers
# (tests/faces/test_cli.py).

# How alike a typed name and a known one must be (difflib's ratio) to be offered as "did you mean": 0.6
# offers "tiny-llama" for "tiny-lama" and nothing for "not-a/model" (0.53 to "tiny-moe").
CLOSE_MATCH_CUTOFF = 0.6

__all__ = [
    "CATALOG",
    "CLOSE_MATCH_CUTOFF",
    "VARIANT_FIELDS",
    "ModelSpec",
    "architectures",
    "close_names",
    "find_model",
    "get_spec",
]

# Per-head RMSNorm on queries and keys (a `head_dim` weight each).
_QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3_text"})
# Gemma 3 wraps attention and MLP in norms on both sides: four norms per layer instead of two.
_FOUR_NORM_TYPES = frozenset({"gemma3_text"})
# gpt-oss learns one attention-sink logit per query head.
_ATTENTION_SINK_TYPES = frozenset({"gpt_oss"})
# gpt-oss experts have biases on both projections, and its router has a bias.
_BIASED_MOE_TYPES = frozenset({"gpt_oss"})


@dataclass(frozen=True)
class ModelSpec:
    """A real hub model described by its architecture config, without its weights.

    ``config`` holds `transformers` config fields (the names used in the model's ``config.json``);
    ``to_config()`` turns it into the real config class, from which `transformers` builds the model.
    """

    hub_id: str
    family: str
    model_type: str
    config: dict
    gated: bool
    notes: str = ""
    variant_of: str = ""  # a base or instruct variant: the hub id of the entry whose architecture it shares

    @property
    def short_name(self) -> str:
        """The model name without its organisation, e.g. ``"Qwen3-8B"``."""
        return self.hub_id.rsplit("/", 1)[-1]

    @property
    def num_layers(self) -> int:
        """Number of decoder layers."""
        return int(self.config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        """Width of the residual stream."""
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding table (and of the LM head)."""
        return int(self.config["vocab_size"])

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``hidden_size // num_attention_heads`` unless set)."""
        head_dim = self.config.get("head_dim")
        return int(head_dim) if head_dim else self.hidden_size // int(self.config["num_attention_heads"])

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model)."""
        return int(self.config.get("num_experts") or self.config.get("num_local_experts") or 0)

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_experts > 0

    def parameter_count(self) -> int:
        """Total parameters, as ``sum(p.numel() for p in model.parameters())`` counts them.

        Tied input and output embeddings count once.
        """
        return self._count(experts_per_layer=self.num_experts, include_embedding=True)

    def active_parameter_count(self, include_embedding: bool = True) -> int:
        """Parameters used for one token: a MoE layer counts only its top-k routed experts.

        Everything else counts in full, including the router and shared experts. By default the
        input embedding table counts too, as Mistral and Qwen count "active" parameters; pass
        ``include_embedding=False`` for OpenAI's convention (a token reads one row of it), which
        its gpt-oss figures use. A tied table still counts once, as the LM head.
        """
        top_k = int(self.config.get("num_experts_per_tok", 0)) if self.is_moe else 0
        return self._count(experts_per_layer=top_k, include_embedding=include_embedding)

    def to_config(self) -> PretrainedConfig:
        """The real `transformers` config of this architecture (built locally, no download)."""
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **copy.deepcopy(self.config))

    # -- the formula, one component at a time ------------------------------------------------------

    def _count(self, experts_per_layer: int, include_embedding: bool) -> int:
        hidden, vocab = self.hidden_size, self.vocab_size
        tied = bool(self.config.get("tie_word_embeddings", False))
        embedding = vocab * hidden if include_embedding or tied else 0
        lm_head = 0 if tied else vocab * hidden
        final_norm = hidden
        layers = 0
        for index in range(self.num_layers):
            mlp = (
                self._moe_params(experts_per_layer)
                if self._is_sparse_layer(index)
                else self._dense_mlp_params(int(self.config["intermediate_size"]))
            )
            layers += self._attention_params() + mlp + self._layer_norm_params()
        return embedding + layers + final_norm + lm_head

    def _attention_biases(self) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o) of the attention projections."""
        if self.model_type == "qwen2":  # hard-wired in Qwen2Attention
            return True, False
        if self.model_type == "qwen2_moe":
            return bool(self.config.get("qkv_bias", True)), False
        bias = bool(self.config.get("attention_bias", False))
        return bias, bias

    def _attention_params(self) -> int:
        hidden, head_dim = self.hidden_size, self.head_dim
        heads = int(self.config["num_attention_heads"])
        q_width = heads * head_dim
        kv_width = int(self.config.get("num_key_value_heads") or heads) * head_dim
        qkv_bias, o_bias = self._attention_biases()
        q_proj = hidden * q_width + (q_width if qkv_bias else 0)
        k_proj = v_proj = hidden * kv_width + (kv_width if qkv_bias else 0)
        o_proj = q_width * hidden + (hidden if o_bias else 0)
        qk_norms = 2 * head_dim if self.model_type in _QK_NORM_TYPES else 0
        sinks = heads if self.model_type in _ATTENTION_SINK_TYPES else 0
        return q_proj + k_proj + v_proj + o_proj + qk_norms + sinks

    def _dense_mlp_params(self, intermediate: int) -> int:
        """Gated MLP: gate and up (hidden -> intermediate), down (intermediate -> hidden)."""
        biases = 2 * intermediate + self.hidden_size if self.config.get("mlp_bias", False) else 0
        return 3 * self.hidden_size * intermediate + biases

    def _moe_params(self, experts: int) -> int:
        """``experts`` routed experts, plus the router over all of them and any shared expert."""
        hidden = self.hidden_size
        intermediate = int(self.config.get("moe_intermediate_size") or self.config["intermediate_size"])
        per_expert = 3 * hidden * intermediate
        router = self.num_experts * hidden
        if self.model_type in _BIASED_MOE_TYPES:
            per_expert += 2 * intermediate + hidden  # gate_up bias + down bias
            router += self.num_experts
        shared = 0
        shared_intermediate = int(self.config.get("shared_expert_intermediate_size") or 0)
        if shared_intermediate:
            shared = self._dense_mlp_params(shared_intermediate) + hidden  # + its sigmoid gate (hidden -> 1)
        return experts * per_expert + router + shared

    def _is_sparse_layer(self, index: int) -> bool:
        if not self.is_moe or index in (self.config.get("mlp_only_layers") or ()):
            return False
        return (index + 1) % int(self.config.get("decoder_sparse_step", 1)) == 0

    def _layer_norm_params(self) -> int:
        return (4 if self.model_type in _FOUR_NORM_TYPES else 2) * self.hidden_size


def _layer_types(num_layers: int, full_every: int) -> list[str]:
    """Sliding-window layers with every ``full_every``-th layer on full attention."""
    return ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(num_layers)]


_LLAMA3 = dict(
    vocab_size=128256,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    attention_bias=False,
    mlp_bias=False,
)


def _llama3_rope(factor: float) -> dict:
    return dict(
        rope_type="llama3",
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


_QWEN25 = dict(
    max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False
)
_QWEN3 = dict(
    vocab_size=151936,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    attention_bias=False,
    use_sliding_window=False,
)
_MISTRAL = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=32768,
    rms_norm_eps=1e-5,
    rope_theta=1000000.0,
    sliding_window=None,
    tie_word_embeddings=False,
)
_GEMMA3 = dict(
    head_dim=256,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    query_pre_attn_scalar=256,
    attention_bias=False,
    tie_word_embeddings=True,
)

_ENTRIES: tuple[ModelSpec, ...] = (
    # --- Llama 3.x (Meta; licence acceptance on the hub) -------------------------------------
    ModelSpec(
        "meta-llama/Llama-3.2-1B-Instruct",
        "llama",
        "llama",
        dict(
            _LLAMA3,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            head_dim=64,
            tie_word_embeddings=True,
            rope_scaling=_llama3_rope(32.0),
        ),
        gated=True,
    ),
    ModelSpec(
        "meta-llama/Llama-3.2-3B-Instruct",
        "llama",
        "llama",
        dict(
            _LLAMA3,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            head_dim=128,
            tie_word_embeddings=True,
            rope_scaling=_llama3_rope(32.0),
        ),
        gated=True,
    ),
    ModelSpec(
        "meta-llama/Llama-3.1-8B-Instruct",
        "llama",
        "llama",
        dict(
            _LLAMA3,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            head_dim=128,
            tie_word_embeddings=False,
            rope_scaling=_llama3_rope(8.0),
        ),
        gated=True,
    ),
    # --- Mistral / Mixtral (contact-details agreement on the hub) -----------------------------
    ModelSpec(
        "mistralai/Mistral-7B-Instruct-v0.3",
        "mistral",
        "mistral",
        dict(_MISTRAL, vocab_size=32768),
        gated=True,
        notes="v0.3: vocabulary extended to 32768; no sliding window.",
    ),
    ModelSpec(
        "mistralai/Mixtral-8x7B-Instruct-v0.1",
        "mixtral",
        "mixtral",
        dict(_MISTRAL, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2),
        gated=True,
        notes="8 experts per layer, top-2 routing.",
    ),
    # --- Qwen2.5 (q/k/v projections carry biases) --------------------------------------------
    ModelSpec(
        "Qwen/Qwen2.5-0.5B-Instruct",
        "qwen2.5",
        "qwen2",
        dict(
            _QWEN25,
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            tie_word_embeddings=True,
        ),
        gated=False,
    ),
    ModelSpec(
        "Qwen/Qwen2.5-1.5B-Instruct",
        "qwen2.5",
        "qwen2",
        dict(
            _QWEN25,
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            head_dim=128,
            tie_word_embeddings=True,
        ),
        gated=False,
    ),
    ModelSpec(
        "Qwen/Qwen2.5-7B-Instruct",
        "qwen2.5",
        "qwen2",
        dict(
            _QWEN25,
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
        ),
        gated=False,
    ),
    ModelSpec(
        "Qwen/Qwen2.5-14B-Instruct",
        "qwen2.5",
        "qwen2",
        dict(
            _QWEN25,
            vocab_size=152064,
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=48,
            num_attention_heads=40,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
        ),
        gated=False,
    ),
    # --- Qwen3 (per-head q/k RMSNorm, head_dim 128 throughout) -------------------------------
    ModelSpec(
        "Qwen/Qwen3-0.6B",
        "qwen3",
        "qwen3",
        dict(
            _QWEN3,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            tie_word_embeddings=True,
        ),
        gated=False,
    ),
    ModelSpec(
        "Qwen/Qwen3-1.7B",
        "qwen3",
        "qwen3",
        dict(
            _QWEN3,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            tie_word_embeddings=True,
        ),
        gated=False,
    ),
    ModelSpec(
        "Qwen/Qwen3-4B",
        "qwen3",
        "qwen3",
        dict(
            _QWEN3,
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            tie_word_embeddings=True,
        ),
        gated=False,
    ),
    ModelSpec(
        "Qwen/Qwen3-8B",
        "qwen3",
        "qwen3",
        dict(
            _QWEN3,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            tie_word_embeddings=False,
        ),
        gated=False,
    ),
    ModelSpec(
        "Qwen/Qwen3-14B",
        "qwen3",
        "qwen3",
        dict(
            _QWEN3,
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=40,
            num_attention_heads=40,
            tie_word_embeddings=False,
        ),
        gated=False,
    ),
    ModelSpec(
        "Qwen/Qwen3-32B",
        "qwen3",
        "qwen3",
        dict(
            _QWEN3,
            hidden_size=5120,
            intermediate_size=25600,
            num_hidden_layers=64,
            num_attention_heads=64,
            tie_word_embeddings=False,
        ),
        gated=False,
    ),
    ModelSpec(
        "Qwen/Qwen3-30B-A3B",
        "qwen3",
        "qwen3_moe",
        dict(
            _QWEN3,
            num_key_value_heads=4,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=48,
            num_attention_heads=32,
            tie_word_embeddings=False,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        ),
        gated=False,
        notes="128 experts per layer, top-8 routing, no shared expert; every layer is MoE.",
    ),
    ModelSpec(
        "Qwen/Qwen1.5-MoE-A2.7B-Chat",
        "qwen1.5",
        "qwen2_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=24,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=128,
            max_position_embeddings=8192,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            use_sliding_window=False,
            qkv_bias=True,
            num_experts=60,
            num_experts_per_tok=4,
            moe_intermediate_size=1408,
            shared_expert_intermediate_size=5632,
            decoder_sparse_step=1,
            norm_topk_prob=False,
        ),
        gated=False,
        notes="60 routed experts (top-4) plus an always-on gated shared expert in every layer.",
    ),
    # --- gpt-oss (OpenAI; Apache-2.0) ---------------------------------------------------------
    ModelSpec(
        "openai/gpt-oss-20b",
        "gpt-oss",
        "gpt_oss",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=150000.0,
            rope_scaling=dict(
                rope_type="yarn",
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=4096,
            ),
            attention_bias=True,
            sliding_window=128,
            layer_types=_layer_types(24, full_every=2),
            tie_word_embeddings=False,
            num_local_experts=32,
            num_experts_per_tok=4,
            swiglu_limit=7.0,
        ),
        gated=False,
        notes=(
            "32 experts per layer, top-4; attention sinks; alternating 128-token sliding-window and "
            "full attention. Published weights are MXFP4 experts; shapes here are the bf16 ones."
        ),
    ),
    # --- Gemma 3 (Google; licence acceptance on the hub) --------------------------------------
    ModelSpec(
        "google/gemma-3-1b-it",
        "gemma3",
        "gemma3_text",
        dict(
            _GEMMA3,
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=32768,
            sliding_window=512,
            layer_types=_layer_types(26, full_every=6),
        ),
        gated=True,
        notes="Text-only model; 5 sliding-window (512) layers per full-attention layer.",
    ),
    ModelSpec(
        "google/gemma-3-4b-it",
        "gemma3",
        "gemma3_text",
        dict(
            _GEMMA3,
            vocab_size=262208,
            hidden_size=2560,
            intermediate_size=10240,
            num_hidden_layers=34,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=131072,
            rope_scaling=dict(rope_type="linear", factor=8.0),
            sliding_window=1024,
            layer_types=_layer_types(34, full_every=6),
        ),
        gated=True,
        notes=(
            "Text decoder only (the checkpoint's text_config): the SigLIP vision tower and the "
            "multimodal projector of this image-text model are excluded from shapes and counts."
        ),
    ),
)

# Fields a base or instruct variant may state differently from the entry whose architecture it shares: none
# of them changes a shape or a parameter count (the inventory cache serves a variant from its entry's).
VARIANT_FIELDS = frozenset({"max_position_embeddings"})

# The other half of each family's base / instruct pair (gpt-oss was released post-trained only): the entry
# it shares the architecture of, and what its own config.json states differently.
_VARIANTS: dict[str, tuple[str, dict]] = {
    "meta-llama/Llama-3.2-1B": ("meta-llama/Llama-3.2-1B-Instruct", {}),
    "meta-llama/Llama-3.2-3B": ("meta-llama/Llama-3.2-3B-Instruct", {}),
    "meta-llama/Llama-3.1-8B": ("meta-llama/Llama-3.1-8B-Instruct", {}),
    "mistralai/Mistral-7B-v0.3": ("mistralai/Mistral-7B-Instruct-v0.3", {}),
    "mistralai/Mixtral-8x7B-v0.1": ("mistralai/Mixtral-8x7B-Instruct-v0.1", {}),
    "Qwen/Qwen2.5-0.5B": ("Qwen/Qwen2.5-0.5B-Instruct", {}),
    "Qwen/Qwen2.5-1.5B": ("Qwen/Qwen2.5-1.5B-Instruct", {"max_position_embeddings": 131072}),
    "Qwen/Qwen2.5-7B": ("Qwen/Qwen2.5-7B-Instruct", {"max_position_embeddings": 131072}),
    "Qwen/Qwen2.5-14B": ("Qwen/Qwen2.5-14B-Instruct", {"max_position_embeddings": 131072}),
    **{
        f"Qwen/Qwen3-{size}-Base": (f"Qwen/Qwen3-{size}", {"max_position_embeddings": 32768})
        for size in ("0.6B", "1.7B", "4B", "8B", "14B", "30B-A3B")
    },
    "Qwen/Qwen1.5-MoE-A2.7B": ("Qwen/Qwen1.5-MoE-A2.7B-Chat", {}),
    "google/gemma-3-1b-pt": ("google/gemma-3-1b-it", {}),
    "google/gemma-3-4b-pt": ("google/gemma-3-4b-it", {}),
}


def _variant(spec: ModelSpec, hub_id: str, changes: dict) -> ModelSpec:
    """`hub_id`, the base or instruct variant of `spec`: its config is `spec`'s own (the same dict, not a
    copy) unless its config.json states a `VARIANT_FIELDS` value differently."""
    unknown = set(changes) - VARIANT_FIELDS
    if unknown:
        raise ValueError(
            f"{hub_id}: a variant shares {spec.hub_id}'s shapes; it cannot change {sorted(unknown)}"
        )
    return ModelSpec(
        hub_id,
        spec.family,
        spec.model_type,
        {**spec.config, **changes} if changes else spec.config,
        gated=spec.gated,
        notes=f"Same architecture as {spec.hub_id}. {spec.notes}".strip(),
        variant_of=spec.hub_id,
    )


def _with_variants(entries: tuple[ModelSpec, ...]) -> dict[str, ModelSpec]:
    """Every entry, each followed by its variants (the picker lists a family's base and instruct together)."""
    catalog: dict[str, ModelSpec] = {}
    for spec in entries:
        catalog[spec.hub_id] = spec
        for hub_id, (of, changes) in _VARIANTS.items():
            if of == spec.hub_id:
                catalog[hub_id] = _variant(spec, hub_id, changes)
    return catalog


CATALOG: dict[str, ModelSpec] = _with_variants(_ENTRIES)


def architectures() -> list[ModelSpec]:
    """The catalog's architecture entries: every entry that is not a variant of another."""
    return [spec for spec in CATALOG.values() if not spec.variant_of]


def find_model(query: str) -> list[ModelSpec]:
    """Catalog entries whose hub id or family contains ``query`` (case-insensitive), in catalog order."""
    needle = query.strip().lower()
    return [
        spec for spec in CATALOG.values() if needle in spec.hub_id.lower() or needle in spec.family.lower()
    ]


def get_spec(hub_id: str) -> ModelSpec:
    """The catalog entry for ``hub_id``; a ``KeyError`` naming the closest known ids if there is none."""
    try:
        return CATALOG[hub_id]
    except KeyError:
        pass
    by_short = {spec.short_name: spec.hub_id for spec in CATALOG.values()}
    close = close_names(hub_id, list(CATALOG), n=5)
    close += [by_short[m] for m in close_names(hub_id, list(by_short), n=5)]
    close += [spec.hub_id for spec in find_model(hub_id)] if hub_id.strip() else []
    close = list(dict.fromkeys(close))[:5]
    hint = (
        f"close matches: {', '.join(close)}" if close else f"none close among the {len(CATALOG)} known models"
    )
    raise KeyError(f"{hub_id!r} is not in the model catalog; {hint}") from None


def close_names(name: str, candidates: list[str], n: int = 3) -> list[str]:
    """The `candidates` near enough to `name` to suggest (case-insensitive, `CLOSE_MATCH_CUTOFF`), nearest
    first: every "did you mean" of fastft reads this, so a typo gets its fix and a far name no guess."""
    by_lower = {candidate.lower(): candidate for candidate in candidates}
    needle = name.strip().lower()
    return [
        by_lower[m] for m in difflib.get_close_matches(needle, list(by_lower), n=n, cutoff=CLOSE_MATCH_CUTOFF)
    ]

"""The fusion plan: which parts of a model get fastft's fused kernels, and why the rest does not.

Decided here once, from the model's config alone, and read by everything that needs the answer:
`fastft.models.patch` (what it swaps into an instance), `fastft.models.moe` (whether an MoE block and its
experts' activation are fused), the VRAM estimator (which code path's tensors a step keeps) and the
studio's model picker (what it shows before anything is downloaded).

Three scopes:

- ``"decoder"``: the whole decoder layer (RMSNorm, RoPE, LoRA-fused projections, the gated MLP or the MoE
  block) and the linear cross-entropy: Llama, Mistral, Qwen2, Qwen3, Qwen2/3-MoE, Mixtral;
- ``"moe_blocks"``: only the sparse-MoE blocks: gpt-oss, whose attention adds learned sinks to the softmax
  and whose RMSNorm keeps fp32 weights, neither of which the fused functions reproduce;
- ``"none"``: any other architecture, which trains on transformers' own modules.

The gated MLPs of a fused decoder (and MoE experts that use transformers' default ``act(gate) * up``) get
the fused activation kernel when ``hidden_act`` names one it computes (`fastft.kernels.activations`, a
table without Triton, so the plan is the same on a machine without it). The plan says what a config allows;
`patch` still checks each module as it finds it (an 8-bit base, an older transformers' experts class) and
reports what it could not fuse on top of the plan's parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fastft.kernels.activations import HIDDEN_ACT_TO_KIND

# Architectures whose decoder layers are fused whole.
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")
# Architectures of which only the MoE blocks are fused, with why the rest is not.
MOE_ONLY = {"gpt_oss": "attention sinks, fp32 norm weights"}
# Architectures whose sparse-MoE blocks the fused block (`fastft.models.moe`) reproduces.
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss")

SCOPES = ("decoder", "moe_blocks", "none")


@dataclass(frozen=True)
class FusionPlan:
    """What `fastft.patch` fuses in a model of this config, and why the rest stays as it is.

    ``scope``: ``"decoder"`` (every part of the decoder layers), ``"moe_blocks"`` (only the MoE blocks) or
    ``"none"``, with ``scope_reason``. ``activation``: the fused gated-activation kernel's kind
    (``"swiglu"``, ``"geglu"``, ``"geglu_tanh"``) for the MLPs, or None, with ``activation_reason``.
    ``moe``: whether the sparse-MoE blocks are fused (``experts`` routed experts per layer). ``fused``: the
    fused parts, named as the studio shows them; ``not_fused``: the parts left on transformers' modules,
    each with its reason.
    """

    model_type: str
    scope: str
    scope_reason: str
    activation: str | None
    activation_reason: str
    moe: bool
    experts: int
    fused: tuple[str, ...]
    not_fused: tuple[str, ...]

    @property
    def fuses_decoder(self) -> bool:
        """Whether the whole decoder layer (norms, attention, projections, MLP) and the loss are fused."""
        return self.scope == "decoder"


def plan(config) -> FusionPlan:
    """The `FusionPlan` of a model config: a `transformers` config, or a mapping of its fields (a
    ``config.json``, a catalog entry) that includes ``model_type``. A mapping without ``hidden_act`` means
    the architecture's default, SiLU for every architecture fused here."""
    model_type = str(_field(config, "model_type", "") or "")
    hidden_act = _field(config, "hidden_act", "silu" if isinstance(config, Mapping) else None)
    experts = int(_field(config, "num_experts", 0) or _field(config, "num_local_experts", 0) or 0)
    if model_type in SUPPORTED:
        scope, scope_reason = "decoder", f"fastft's kernels cover every part of a {model_type} decoder layer"
    elif model_type in MOE_ONLY:
        scope, scope_reason = "moe_blocks", MOE_ONLY[model_type]
    else:
        scope, scope_reason = "none", f"fused kernels cover {', '.join((*SUPPORTED, *MOE_ONLY))}"
    if scope == "none":
        activation, activation_reason = None, f"nothing of the {model_type} architecture is fused"
    elif scope == "moe_blocks":  # no gate/up/down MLP outside the experts, which apply their own gate
        activation, activation_reason = None, f"the {model_type} experts apply their own gate function"
    elif hidden_act in HIDDEN_ACT_TO_KIND:
        activation = HIDDEN_ACT_TO_KIND[hidden_act]
        activation_reason = f"hidden_act {hidden_act!r} is the {activation} kernel's activation"
    else:
        activation, activation_reason = None, f"activation {hidden_act!r} has no fused kernel"
    moe = scope != "none" and model_type in MOE_MODEL_TYPES and experts > 0

    fused: list[str] = []
    not_fused: list[str] = []
    moe_name = f"MoE expert blocks ({experts} experts per layer: routing plan + grouped GEMM)"
    if scope == "none":
        not_fused.append(
            f"the {model_type} architecture: it trains on transformers' own modules ({scope_reason})"
        )
    elif scope == "moe_blocks":
        fused.append(moe_name)
        not_fused.append(f"the attention and RMSNorm of {model_type} (transformers' modules)")
    else:
        fused += ["RMSNorm", "RoPE", "LoRA-fused Q/K/V/O projections"]
        if moe:
            fused.append(moe_name)
        elif activation is not None:
            fused.append("gated MLP with LoRA")
        if activation is None and _dense_mlps(config, model_type, moe):
            not_fused.append(f"the MLPs ({activation_reason})")
        fused.append("linear cross-entropy")
    return FusionPlan(
        model_type=model_type,
        scope=scope,
        scope_reason=scope_reason,
        activation=activation,
        activation_reason=activation_reason,
        moe=moe,
        experts=experts,
        fused=tuple(fused),
        not_fused=tuple(not_fused),
    )


def _field(config, name: str, default):
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _dense_mlps(config, model_type: str, moe: bool) -> bool:
    """Whether gate/up/down MLPs run outside the experts: every layer of a dense model, Qwen2-MoE's shared
    expert, and the dense layers a Qwen MoE config asks for (``mlp_only_layers``, ``decoder_sparse_step``)."""
    if not moe or model_type == "qwen2_moe":
        return True
    return (
        bool(_field(config, "mlp_only_layers", None))
        or int(_field(config, "decoder_sparse_step", 1) or 1) > 1
    )


__all__ = ["MOE_MODEL_TYPES", "MOE_ONLY", "SCOPES", "SUPPORTED", "FusionPlan", "plan"]

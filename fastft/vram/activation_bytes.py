"""The activation model: bytes autograd keeps per token, layer by layer, in a LoRA training step.

Two code paths run a decoder layer, and they keep different tensors:

**fastft's fused kernels** (``add_lora(fused=True)``, the default, for the architectures whose fusion plan
fuses the whole decoder, `fastft.models.fusion`; `fastft.kernels`):

- Triton RMSNorm saves its input itself (no copy) and ``rstd`` (one fp32 per row).
- `LoraLinearsFunction` (q/k/v in one call, o_proj in another) saves its input in the compute dtype and
  ``x @ [A_q; A_k; A_v]`` (the r-wide LoRA intermediates); o_proj's input is the attention output the
  attention already saved (varlen returns it token-major, so the reshape is a view): no extra bytes.
- Qwen3's fused q/k-norm + RoPE saves q and k before the norm; plain RoPE saves only cos/sin (shared).
- `LoraMLPFunction` saves its input, the gate and up outputs (``[N, I]`` each) and the LoRA intermediates;
  ``act(g) * u`` is recomputed in backward.
- 8-bit bases are not fused (bitsandbytes' 8-bit layers keep their own forward): their projections and
  MLP follow the transformers path below, their norms stay fused.

**transformers + peft** (``fused=False``, or an architecture `patch` does not cover):

- A frozen linear saves only its weight (PyTorch saves an input only when the other operand needs a
  gradient): a layer without LoRA keeps no copy of its input. bitsandbytes' 4-bit matmul keeps only the
  packed weight; its 8-bit matmul keeps its input and the input's outlier columns as ``ctx`` attributes,
  which checkpointing cannot drop and backward does not free (`int8_kept_bytes`).
- peft casts each LoRA'd layer's input to its fp32 adapters' dtype; autocast casts it back to bf16 for
  ``lora_A``, and that bf16 copy is saved: **one input copy per LoRA'd linear** (q, k, v each their own),
  plus ``x @ A`` for ``lora_B``. Autocast also keeps a bf16 copy of every adapter weight. peft's 8-bit
  layer skips the cast under autocast: its ``lora_A`` saves the input bitsandbytes keeps anyway.
- RMSNorm upcasts its input to fp32 and saves that and ``rsqrt``.
- The gated MLP saves the gate output, the up output and the activation output; the product only as
  ``down_proj``'s LoRA input copy.

**Both paths**: flash/varlen attention saves q and k after RoPE, v, the output (16-bit) and the
logsumexp (fp32 per head and row). MoE experts (transformers' grouped_mm, or fastft's fused block)
save per routed (token, expert) pair the gate/up output, the activation, the routing weight and three
int64 indices (transformers also the expert output, kept by the routing-weight product; fastft's fused
block computes that weight's gradient from the activation instead), and per token the router's fp32
softmax and top-k values/indices.

**QLoRA / 8-bit**: the non-quantised weights (embeddings, norms, head, fused MoE experts, which
bitsandbytes never quantises) stay in the dtype the model was loaded in, bf16 or fp16 (GPUs without bf16):
``add_lora`` does not run peft's ``prepare_model_for_kbit_training``, so the residual stream is 16-bit in
both. A quantised model whose other weights are fp32 (loaded in fp32, or prepared by peft outside fastft)
has an **fp32 residual stream**, and on the transformers path bitsandbytes returns each projection in its
input's dtype, so MLP intermediates are fp32 too; the fused kernels compute in the autocast dtype either way.

Checked on CPU against the saved tensors themselves (``torch.autograd.graph.saved_tensors_hooks``;
tests/tools/test_vram.py). All sizes are bytes per token of one micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import fastft.weight_formats as weight_formats
from fastft.kernels.tiling import dh_slice_rows, mlp_tile_bytes, mlp_tile_rows
from fastft.models.fusion import FusionPlan, plan
from fastft.vram.inventory import LayerInfo, LinearInfo, ModelInventory

# Linears that read the same input: under fp32 (no autocast copies) it is saved once per group.
_ATTENTION_INPUT = {"q_proj", "k_proj", "v_proj"}
_MLP_INPUT = {"gate_proj", "up_proj", "shared_expert_gate"}


def fusion_plan(model_type: str, hidden_act: str | None) -> FusionPlan:
    """The fusion plan (`fastft.models.fusion`) of a model with this architecture and activation: what
    ``add_lora(fused=True)`` puts on fastft's kernels."""
    return plan({"model_type": model_type, "hidden_act": hidden_act})


@dataclass(frozen=True)
class Profile:
    """Bytes per element of what a step keeps, and which code path runs each part of a layer."""

    precision: str  # "bf16", "fp16", "fp32", or a quantised weight format's name: "nf4", "int8"
    param: int  # bytes per non-quantised base parameter (4 for a quantised model's fp32 ones)
    residual: int  # residual stream (layer inputs and outputs)
    act: int  # projection outputs / MLP intermediates on the transformers path
    expert: int  # MoE expert activations (the expert weights' dtype)
    compute: int  # autocast compute dtype (fused kernels' saved inputs and intermediates)
    lora_copy: int  # transformers path: per-linear copy of a LoRA'd input (0: the input is saved as is)
    quantized: str | None  # the quantised weight format's name ("nf4", "int8", "fp8"), or None
    fused_norms: bool = False
    fused_projections: bool = False
    fused_mlp: bool = False
    fused_loss: bool = False

    @classmethod
    def of(
        cls,
        precision: str,
        *,
        fused: bool = False,
        model_type: str = "",
        hidden_act: str | None = None,
        residual: int | None = None,
        upcast: bool = False,
    ) -> Profile:
        """`upcast`: a quantised model whose non-quantised weights are fp32 (loaded so, or prepared by peft's
        ``prepare_model_for_kbit_training``; `add_lora` keeps bf16 and fp16 ones as they are)."""
        quantized = [record for record in weight_formats.quantized() if record.name == precision]
        if precision in ("bf16", "fp16"):
            sizes = dict(param=2, residual=2, act=2, expert=2, compute=2, lora_copy=2, quantized=None)
        elif precision == "fp32":
            sizes = dict(param=4, residual=4, act=4, expert=4, compute=4, lora_copy=0, quantized=None)
        elif quantized and upcast:
            sizes = dict(param=4, residual=4, act=4, expert=4, compute=2, lora_copy=2, quantized=precision)
        elif quantized:
            sizes = dict(param=2, residual=2, act=2, expert=2, compute=2, lora_copy=2, quantized=precision)
        else:
            names = ", ".join(
                repr(name) for name in ("bf16", "fp16", "fp32", *weight_formats.quantized_names())
            )
            raise ValueError(f"precision={precision!r}: use one of {names}.")
        if residual is not None:
            sizes["residual"] = residual
            if sizes["quantized"]:
                sizes["act"] = residual  # bitsandbytes returns its input's dtype
        fusion = fusion_plan(model_type, hidden_act)
        patched = fused and fusion.fuses_decoder
        projections = patched and (not quantized or quantized[0].fused)
        return cls(
            precision,
            **sizes,
            fused_norms=patched,
            fused_projections=projections,
            fused_mlp=projections and fusion.activation is not None,
            fused_loss=patched,
        )

    @property
    def path(self) -> str:
        """Which kernels the estimate assumes, in words."""
        if self.fused_projections:
            return "fastft fused kernels" + ("" if self.fused_mlp else " (MLP on transformers)")
        if self.fused_norms:
            return "fastft fused norms and loss; projections on transformers + peft (8-bit bases)"
        return "transformers + peft"


def norm_bytes(hidden: int, profile: Profile) -> int:
    """One RMSNorm: fused, its input itself and rstd; else its input upcast to fp32 and rsqrt."""
    return (profile.residual if profile.fused_norms else 4) * hidden + 4


def _width(layer: LayerInfo, short: str, default: int, out: bool = True) -> int:
    linear = layer.linear(short)
    if linear is None:
        return default
    return linear.out_features if out else linear.in_features


def _attention_widths(layer: LayerInfo, model: ModelInventory) -> tuple[int, int]:
    q = _width(layer, "q_proj", model.num_heads * model.head_dim)
    kv = _width(layer, "k_proj", model.num_kv_heads * model.head_dim)
    return q, kv


def _lora_linears(layer: LayerInfo, targets: set[str]) -> list[LinearInfo]:
    return [linear for linear in layer.linears if linear.lora_targetable and linear.short in targets]


def lora_input_bytes(linears: list[LinearInfo], profile: Profile) -> int:
    """transformers path: inputs the LoRA'd linears save — a bf16 copy each under autocast, else each
    distinct input once (fp32: the input itself)."""
    if profile.lora_copy:
        return sum(profile.lora_copy * linear.in_features for linear in linears)
    groups: dict[str, int] = {}
    for linear in linears:
        if linear.short in _ATTENTION_INPUT:
            key = linear.name.rsplit(".", 1)[0] + ":attention_input"
        elif linear.short in _MLP_INPUT:
            key = linear.name.split(".mlp", 1)[0] + ":mlp_input"
        else:
            key = linear.name
        groups[key] = linear.in_features * profile.residual
    return sum(groups.values())


def int8_shares_inputs(profile: Profile) -> bool:
    """8-bit bases under autocast: peft's `Linear8bitLt` skips its fp32 cast of the input when autocast is
    on (``requires_conversion = not torch.is_autocast_enabled()``), and the input already is in the
    autocast dtype, so ``lora_A`` saves the very tensor bitsandbytes keeps: no copy per linear. With an
    fp32 residual stream (fp32 non-quantised weights) autocast makes a 16-bit copy per ``lora_A`` call."""
    return (
        profile.quantized == "int8"
        and not profile.fused_projections
        and profile.residual == profile.compute == profile.act
    )


def _int8_input_width(linear: LinearInfo, profile: Profile) -> int:
    # the residual stream feeds the norms' outputs to q/k/v and gate/up; down_proj reads an MLP product
    return linear.in_features * (profile.act if linear.short == "down_proj" else profile.residual)


def int8_outlier_bytes(layer: LayerInfo, model: ModelInventory, profile: Profile) -> int:
    """The outlier sub-matrix bitsandbytes' 8-bit matmul keeps for backward, per token (worst case).

    ``MatMul8bitLt`` (threshold 6.0) finds the input columns holding any ``|x| >= 6`` and keeps
    ``subA = A[:, outlier_cols]`` (the input's dtype) in ``ctx.tensors`` beside ``A`` itself, even when the
    weight is frozen and backward never reads it. How many columns qualify depends on the data, and grows
    with the tokens (one outlier in any row marks the column). Counted as every column for the input no
    norm bounds, down_proj's ``act(g) * u``: a product of two projections, heavy-tailed (Mistral-7B's first
    MLP with the bench's random weights, std 0.02, over 2048 tokens, simulated on the CPU: 0.34 % of the
    elements and 14,319 of 14,336 columns). None for the normalised inputs of q/k/v and gate/up (trained
    models show a handful of outlier features there) nor for o_proj's, a convex mix of v rows.
    """
    if profile.quantized != "int8" or profile.fused_projections:
        return 0
    return sum(_int8_input_width(linear, profile) for linear in layer.linears if linear.short == "down_proj")


def _attention_terms(
    layer: LayerInfo, model: ModelInventory, profile: Profile, targets: set[str], r: int
) -> dict[str, int]:
    h = model.hidden_size
    q, kv = _attention_widths(layer, model)
    c = profile.compute
    lora = [
        linear for linear in _lora_linears(layer, targets) if linear.short in _ATTENTION_INPUT | {"o_proj"}
    ]
    xa = 2 if profile.lora_copy else 4  # x @ A: bf16 under autocast, else fp32
    terms: dict[str, int] = {}
    if profile.fused_projections:
        # q/k/v input once, in the compute dtype; o_proj reads the saved attention output; x @ A per LoRA
        terms["projection_inputs"] = c * h
        terms["lora_xa"] = c * r * len(lora)
    else:
        terms["projection_inputs"] = 0 if int8_shares_inputs(profile) else lora_input_bytes(lora, profile)
        terms["lora_xa"] = xa * r * len(lora)
    if profile.quantized == "int8" and not profile.fused_projections:
        # bitsandbytes keeps the q/k/v input (o_proj's is the attention output, counted below)
        terms["int8_inputs"] = h * profile.residual if any(layer.linear(s) for s in _ATTENTION_INPUT) else 0
    # q, k (after RoPE), v and the output in 16-bit; logsumexp in fp32 per query head
    terms["attention"] = 2 * (q + 2 * kv) + 2 * q + 4 * model.num_heads
    if layer.qk_norm:
        if profile.fused_projections and profile.fused_norms:  # fused q/k-norm + RoPE: q, k before the norm
            terms["qk_norms"] = c * (q + kv)
        else:  # RMSNorm per head: its fp32 input and one rsqrt per head
            terms["qk_norms"] = 4 * (q + kv) + 4 * (model.num_heads + model.num_kv_heads)
    return terms


def mlp_tiled(layer: LayerInfo, profile: Profile, tokens: int) -> bool:
    """Whether the fused MLP runs over `tokens` rows in sequence tiles (`fastft.kernels.tiling`): it then
    saves only its input, and its ``[tile, I]`` working set is a fixed size (`mlp_tile_workspace`)."""
    if layer.moe or not profile.fused_mlp or not tokens:
        return False
    return mlp_tile_rows(tokens, _width(layer, "gate_proj", 0), profile.compute) is not None


def mlp_tile_workspace(layer: LayerInfo, profile: Profile, tokens: int) -> int:
    """Bytes of a tiled MLP's working set (three ``[tile, I]`` tensors) while it runs; 0 untiled."""
    if not mlp_tiled(layer, profile, tokens):
        return 0
    return mlp_tile_bytes(tokens, _width(layer, "gate_proj", 0), profile.compute)


def mlp_block_bytes(layer: LayerInfo, profile: Profile, tokens: int) -> int:
    """Bytes of one ``[rows, I]`` tensor of a dense gated MLP over `tokens` rows: a tile's rows when it tiles
    (`mlp_tiled`), every row otherwise; 0 for an MoE layer (its experts' blocks are per routed pair)."""
    if layer.moe or not tokens:
        return 0
    width = _width(layer, "gate_proj", 0)
    rows = (mlp_tile_rows(tokens, width, profile.compute) if profile.fused_mlp else None) or tokens
    return rows * width * profile.compute


def _mlp_terms(
    layer: LayerInfo, model: ModelInventory, profile: Profile, targets: set[str], r: int, tokens: int = 0
) -> dict[str, int]:
    h = model.hidden_size
    c = profile.compute
    lora = [
        linear
        for linear in _lora_linears(layer, targets)
        if linear.short not in _ATTENTION_INPUT | {"o_proj"}
    ]
    xa = 2 if profile.lora_copy else 4
    shared = int8_shares_inputs(profile)
    terms: dict[str, int] = {}
    if layer.moe:
        terms["experts"] = moe_bytes(model, profile)
        if "experts" in targets:
            terms["expert_lora"] = expert_lora_bytes(model, profile, r)
        if layer.shared_expert_intermediate:
            # gate, up and activation outputs, the shared expert's output and its sigmoid gate
            terms["shared_expert"] = (
                3 * layer.shared_expert_intermediate * profile.act + (h + 2) * profile.act
            )
            terms["projection_inputs"] = 0 if shared else lora_input_bytes(lora, profile)
            terms["lora_xa"] = xa * r * len(lora)
    elif mlp_tiled(layer, profile, tokens):  # the input only: each tile recomputes the rest in backward
        terms["mlp"] = c * h
    elif profile.fused_mlp:
        # input (compute dtype), gate and up outputs; x @ [A_g; A_u] and h @ A_d
        terms["mlp"] = c * h + 2 * c * _width(layer, "gate_proj", 0)
        terms["lora_xa"] = c * r * len(lora)
    else:
        intermediate = _width(layer, "gate_proj", 0) or _width(layer, "up_proj", 0)
        terms["mlp"] = 3 * intermediate * profile.act  # gate output, up output, activation output
        terms["projection_inputs"] = 0 if shared else lora_input_bytes(lora, profile)
        terms["lora_xa"] = xa * r * len(lora)
    if profile.quantized == "int8" and not profile.fused_projections:
        inputs: dict[str, int] = {}  # each distinct input once: gate/up share theirs
        for linear in layer.linears:
            if linear.short in _ATTENTION_INPUT or linear.short == "o_proj":
                continue
            key = "mlp_input" if linear.short in _MLP_INPUT else linear.name
            inputs[key] = _int8_input_width(linear, profile)
        terms["int8_inputs"] = sum(inputs.values())
        terms["int8_outliers"] = int8_outlier_bytes(layer, model, profile)
    return terms


def layer_terms(
    layer: LayerInfo, model: ModelInventory, profile: Profile, targets: set[str], r: int, tokens: int = 0
) -> dict[str, int]:
    """Saved bytes per token of one decoder layer, by term (what a non-checkpointed layer keeps).

    8-bit bases (bitsandbytes, on the transformers path): ``int8_inputs`` are the distinct projection inputs
    the 8-bit matmuls keep in ``ctx.tensors`` (o_proj's is the attention output, already in ``attention``),
    which under autocast are also what ``lora_A`` saves; ``int8_outliers`` their outlier columns
    (`int8_outlier_bytes`). `tokens`: the micro-batch's rows, where the MLP's tiling depends on them
    (`mlp_tiled`; 0: untiled)."""
    terms = {"norms": layer.norms * norm_bytes(model.hidden_size, profile)}
    for side in (
        _attention_terms(layer, model, profile, targets, r),
        _mlp_terms(layer, model, profile, targets, r, tokens),
    ):
        for key, value in side.items():
            terms[key] = terms.get(key, 0) + value
    return terms


def mlp_side_bytes(
    layer: LayerInfo, model: ModelInventory, profile: Profile, targets: set[str], r: int, tokens: int = 0
) -> int:
    """What the MLP half of a layer saves, its norm included (per token): freed once the MLP's backward has
    run, before the attention's. bitsandbytes' ``ctx.tensors`` are not freed (see `int8_kept_bytes`)."""
    terms = _mlp_terms(layer, model, profile, targets, r, tokens)
    freed = sum(value for key, value in terms.items() if key not in ("int8_inputs", "int8_outliers"))
    return freed + (norm_bytes(model.hidden_size, profile) if layer.norms >= 2 else 0)


def first_norm_reads_stored_input(profile: Profile) -> bool:
    """Whether a layer's first norm saves the layer input itself (the tensor checkpointing stores): the
    fused RMSNorm does, and so does transformers' when the residual stream is already fp32 (its upcast
    ``.to(float32)`` is then no copy)."""
    return profile.fused_norms or profile.residual == 4


def moe_bytes(model: ModelInventory, profile: Profile) -> int:
    """Routed experts of one MoE layer, per token. transformers' grouped_mm path keeps each pair's expert
    output for the routing-weight product; fastft's fused block does not (its down projection and combine
    are one node whose backward needs only the activation)."""
    k, inter, h = model.experts_per_token, model.moe_intermediate, model.hidden_size
    expert_output = 0 if profile.fused_norms else h
    per_pair = (
        (2 * inter + inter + expert_output + 1)
        * profile.expert  # gate/up output, activation, (output), weight
        + 3 * 8  # int64: the gather index, the weight permutation, the inverse permutation
    )
    router = 4 * model.experts + 3 * 4 * k + 4  # fp32 softmax over experts; top-k values and indices, sum
    return k * per_pair + router


def expert_lora_bytes(model: ModelInventory, profile: Profile, r: int) -> int:
    """LoRA on every expert (the ``experts`` target), per token.

    fastft's fused MoE block runs the low-rank terms as grouped GEMMs and keeps ``x @ A`` of gate/up and
    ``h @ A`` of down per routed pair. Unfused, PEFT's ``ParamWrapper`` runs each expert with ``W + dW``, a
    weight that needs a gradient, so every expert matmul keeps its input: ``x`` and ``h`` per routed pair.
    """
    k = model.experts_per_token
    if profile.fused_norms:  # the fused architectures get the fused MoE block
        return k * 2 * r * profile.compute
    return k * (model.hidden_size + model.moe_intermediate) * profile.act


def layer_bytes(
    layer: LayerInfo, model: ModelInventory, profile: Profile, targets: set[str], r: int, tokens: int = 0
) -> int:
    return sum(layer_terms(layer, model, profile, targets, r, tokens).values())


def int8_kept_bytes(layer: LayerInfo, model: ModelInventory, profile: Profile) -> int:
    """What bitsandbytes' 8-bit matmuls keep per token, outside autograd's saved tensors.

    ``MatMul8bitLt.forward`` stores ``ctx.tensors = (CAt, subA, A)``: ``CAt`` is None for a frozen weight,
    ``A`` is the input itself (one per distinct input: attention input and output, MLP input and product),
    ``subA`` its outlier columns (`int8_outlier_bytes`). ``ctx`` attributes are neither packed by
    checkpointing's saved-tensor hooks nor released when the node runs its backward (autograd frees only
    ``save_for_backward``'s tensors), so with non-reentrant checkpointing every layer's live until the whole
    graph is freed after backward. Offloaded layers run their forward under no_grad: nothing is kept."""
    if profile.quantized != "int8" or profile.fused_projections:
        return 0
    kept: dict[str, int] = {}
    for linear in layer.linears:
        if linear.short in _ATTENTION_INPUT:
            key = "attention_input"
        elif linear.short in _MLP_INPUT:
            key = "mlp_input"
        else:
            key = linear.name
        kept[key] = _int8_input_width(linear, profile)
    return sum(kept.values()) + int8_outlier_bytes(layer, model, profile)


def int8_forward_transient_bytes(
    layer: LayerInfo, model: ModelInventory, profile: Profile, tokens: int
) -> int:
    """The largest transient of one 8-bit projection's forward (``MatMul8bitLt``, threshold 6.0), in bytes
    for `tokens` rows (weight-sized terms do not scale with tokens).

    For input ``A [N, in]`` with ``c`` outlier columns and weight ``[out, in]``, three moments:

    - quantising the input: its fp16 copy, ``|A|`` in fp16 and the ``|A| >= 6`` mask: 5 B per input element;
    - the outlier columns' weights, dequantised by bitsandbytes' default op as ``CB[:, cols] * SCB * (1/127)``:
      the int8 gather (1 B) and two fp32 products (4 + 4 B) per ``out × c`` element, beside the int8 ``CA``
      (1 B per input element);
    - the int8 GEMM: its int32 output and the fp16 and 16-bit copies it is converted through
      (4 + 2 + 2 B per ``N × out`` element), beside ``CA`` and the 16-bit outlier weights (2 B per ``out × c``).

    ``c`` is every column for down_proj (the worst case, see `int8_outlier_bytes`), none elsewhere.
    """
    if profile.quantized != "int8" or profile.fused_projections:
        return 0
    largest = 0
    for linear in layer.linears:
        n_in, n_out = tokens * linear.in_features, tokens * linear.out_features
        c = linear.in_features if linear.short == "down_proj" else 0
        weights = linear.out_features * c
        largest = max(largest, 5 * n_in, n_in + 9 * weights, n_in + 2 * weights + 8 * n_out)
    return largest


def _backward_moments(
    layer: LayerInfo, model: ModelInventory, profile: Profile, targets: set[str], r: int, tokens: int = 0
) -> tuple[int, int]:
    """``(mlp, attention)``: per token, the gradient buffers beyond the saved tensors at the two moments of
    one layer's backward (the MLP's runs first, the attention's after it). See `backward_workspace_bytes`."""
    h = model.hidden_size
    q, kv = _attention_widths(layer, model)
    attention = 2 * h * profile.residual + 4 * q + 2 * (q + 2 * kv) + 2 * q + 4 * model.num_heads
    if layer.moe:
        k, inter = model.experts_per_token, model.moe_intermediate
        mlp = (
            2 * h * profile.residual
            + k * (3 * inter + h) * profile.expert
            + 3 * layer.shared_expert_intermediate * profile.act
        )
    elif profile.fused_mlp:  # the incoming gradient and dx; dh's slice or the tiles are counted apart
        mlp = h * profile.residual + profile.compute * h
    else:
        mlp = (
            2 * h * profile.residual
            + 3 * (_width(layer, "gate_proj", 0) or _width(layer, "up_proj", 0)) * profile.act
        )
    return mlp, attention - mlp_side_bytes(layer, model, profile, targets, r, tokens)


def backward_workspace_bytes(
    layer: LayerInfo, model: ModelInventory, profile: Profile, targets: set[str], r: int, tokens: int = 0
) -> int:
    """Gradient buffers beyond the saved tensors while one layer runs backward, per token: the larger of
    two moments (the MLP's backward runs first, the attention's after it).

    MLP: the gradient arriving at the layer and the MLP's own buffers: fused, the MLP's ``dx`` (``dh`` is
    made in row slices of a fixed size, `fastft.kernels.tiling.dh_slice_rows`, and the other ``[N, I]``
    gradients are written over the saved ``g`` and ``u``; a tiled MLP's tiles are a fixed size too: both
    are added by `backward_workspace`); transformers, the gradient leaving the layer and the gradients of
    the gate, up and activation outputs. Attention: the gradients into and out of the layer,
    FlashAttention's fp32 dq accumulator, dq/dk/dv and d(out) in 16-bit, one fp32 per head and row -- by
    then the MLP's saved tensors and its norm's are freed (`mlp_side_bytes`), so they count against it.
    """
    return max(_backward_moments(layer, model, profile, targets, r, tokens))


def mlp_backward_fixed_bytes(layer: LayerInfo, profile: Profile, tokens: int) -> int:
    """The fused MLP's backward working set that does not grow with the tokens: a tiled MLP's three
    ``[tile, I]`` tensors (`mlp_tile_workspace`), or the untiled one's ``dh`` slice (``[slice, I]``)."""
    if layer.moe or not profile.fused_mlp or not tokens:
        return 0
    tile = mlp_tile_workspace(layer, profile, tokens)
    if tile:
        return tile
    width = _width(layer, "gate_proj", 0)
    return dh_slice_rows(tokens, width, profile.compute) * width * profile.compute


def backward_workspace(
    layer: LayerInfo, model: ModelInventory, profile: Profile, targets: set[str], r: int, tokens: int
) -> int:
    """`backward_workspace_bytes` for `tokens` rows, in bytes, with the fused MLP's fixed working set
    (`mlp_backward_fixed_bytes`) added to the MLP's moment."""
    mlp, attention = _backward_moments(layer, model, profile, targets, r, tokens)
    return max(mlp * tokens + mlp_backward_fixed_bytes(layer, profile, tokens), attention * tokens)


def layer_lora_params(layer: LayerInfo, model: ModelInventory, targets: set[str], r: int) -> int:
    """Adapter parameters of one decoder layer (its gradients appear when its backward runs)."""
    params = sum(r * (linear.in_features + linear.out_features) for linear in _lora_linears(layer, targets))
    if layer.moe and "experts" in targets and model.experts:
        params += r * model.experts * (2 * model.hidden_size + 3 * model.moe_intermediate)
    return params

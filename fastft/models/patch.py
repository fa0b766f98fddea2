"""`patch`: fastft's fused kernels swapped into one model instance, reversibly.

What a patched Llama / Mistral / Qwen2 / Qwen3 decoder layer runs (each line one autograd Function):

    input_layernorm           Triton RMSNorm                       (fastft.kernels.rms_norm)
    q/k/v_proj (+LoRA)        one LoRA-fused QKV projection        (fastft.kernels.lora.LoraLinearsFunction)
    (q/k norm +) RoPE         one launch for Q and K               (fastft.kernels.rope, fastft.kernels.qk_norm_rope)
    attention                 whatever the model's attention implementation is (SDPA, fastft_packed, ...)
    o_proj (+LoRA)            LoRA-fused projection (its output kept for the recompute, with a kept
                              attention output, under offloaded checkpointing)
    post_attention_layernorm  Triton RMSNorm
    mlp (+LoRA)               gate/up -> SwiGLU/GeGLU -> down in one function (fastft.kernels.lora.LoraMLPFunction)
    or sparse MoE (+LoRA)     router -> one routing plan -> grouped GEMMs, LoRA on experts as its own grouped
                              path (fastft.models.moe; Qwen2-MoE, Qwen3-MoE, Mixtral)

plus the final norm, and the fused linear cross-entropy over the output head: in `fastft.training.loss` for
fastft's own steps, and in the causal LM's forward when it is called the Hugging Face way, with ``labels=``
(HF `Trainer`, TRL, a plain loop): the loss comes back without the ``[tokens x vocab]`` logits, which the
output (`FusedLossOutput`) does not have; asking for them raises `LogitsNotComputedError`, naming the fix.

Only instances change: each patched submodule gets an instance attribute ``forward`` (the class is never
touched, so a patched and an unpatched model live side by side), and the original is kept for `unpatch`.
Where `fastft.kernels.tiling.ADAPTER_COMPUTE_COPIES` is on (off by default, for memory), the decoder gets a
forward pre-hook that, before each training forward, writes the 16-bit compute copies of every active
adapter in one multi-tensor copy (`fastft.kernels.lora.AdapterComputeCopies`). It is per instance too, and
`unpatch` removes it and the copies.
Patching twice is a no-op. The decoder layers themselves are left alone, so transformers' gradient
checkpointing and fastft's offloaded checkpointing wrap them as before.

Hub kernels (the `kernels` package) do not take the fused forwards away. transformers kernelizes a model
that ``from_pretrained`` loads with ``use_kernels`` on (its default in transformers >= 5.25 wherever
`kernels` is installed, though `load_model` turns it off; TRL's ``model_init_kwargs`` can pass it) or
that ``set_use_kernels(True)`` switches, and again on each ``train()`` / ``eval()`` that changes its mode.
Each time, `kernels.kernelize` gives every module whose class is a hub-kernel layer (the RMSNorms) the hub
kernel's forward or, where none applies (none for the device, as on any CPU, or none loadable), the class
forward, by deleting the instance ``forward``. The decoder's pre-hook gives such a module its fused forward
back before each forward (`_keep_fused_forwards`), and `patch` on a patched model does so at once. On the
modules fastft patched its forward wins over a hub kernel, as it does when `patch` runs on a kernelized
model: the user asked for it after loading, and it is what the `PatchReport` promises and the parity tests
check. Every other module keeps its hub kernel. Turning kernels off would take those from a user who asked
for them, and refusing would reject every plain ``from_pretrained`` model, where they are on by default.

gpt-oss gets its MoE blocks fused and nothing else: its attention adds learned sinks to the softmax and
its RMSNorm keeps fp32 weights, neither of which the fused attention and norm functions reproduce, so
those stay transformers' modules and the `UnfusedWarning` names them.

Each fused forward decides per call whether it applies, and otherwise runs the module's original forward:
a KV cache (generation), several or disabled adapters, DoRA, LoRA dropout while training, 8-bit bases or
trainable base weights all take the original path (an MoE block: several active adapters, an adapter PEFT
must unmerge, quantised expert weights, Mixtral's router jitter while training), so `model.disable_adapter()`, `merge_adapter()` and
`generate()` behave exactly as without fastft. What gets fused is the model config's `FusionPlan`
(`fastft.models.fusion`); architectures it does not cover keep every module as it is and get one warning
naming what was not fused.
"""

from __future__ import annotations

import sys
import types
import warnings
from dataclasses import dataclass, field

import torch
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fastft.kernels import tiling
from fastft.kernels.lora import AdapterComputeCopies, FrozenLinear, lora_linears, lora_mlp
from fastft.kernels.qk_norm_rope import apply_qk_norm_rope
from fastft.kernels.rope import apply_rope
from fastft.models import fusion
from fastft.models.moe import moe_block_forward, moe_block_info
from fastft.runtime.context import ATTENTION, OUTPUT_PROJECTION, attach_layer_contexts, layer_context
from fastft.runtime.model_state import base_model, model_state

# Function-local imports: peft imports bitsandbytes, which asks the hub for a kernel: peft loads first under
# `fastft.data.hub.hub_offline_while_importing` (fastft.models.lora); tests replace these names on their modules, so
# they are looked up when called.
from fastft.weight_formats import frozen_state

_ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # what the fused attention forward reads
_MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")  # and the fused MLP forward


class UnfusedWarning(UserWarning):
    """Part (or all) of a model runs on the reference path rather than fastft's fused kernels."""


_NO_LOGITS = (
    "this loss came from fastft's fused linear cross-entropy, which never builds the [tokens x vocab] logits. "
    "For logits, call the model without labels= (and compute the loss from them), or fastft.unpatch(model) "
    "first; with the Hugging Face Trainer, evaluate with prediction_loss_only=True."
)


class LogitsNotComputedError(AttributeError):
    """The output of a fused ``labels=`` forward was asked for logits it never computed."""


@dataclass
class FusedLossOutput(ModelOutput):
    """What a patched causal LM returns for a ``labels=`` call: the loss (and the decoder's hidden states and
    attentions when asked for), no logits."""

    loss: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None

    def __getattr__(self, name: str):
        if name == "logits":
            raise LogitsNotComputedError(f"outputs.logits: {_NO_LOGITS}")
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __getitem__(self, key):
        if key == "logits":
            raise KeyError(f"outputs['logits']: {_NO_LOGITS}")
        return super().__getitem__(key)


@dataclass
class PatchReport:
    """What `patch` did: ``fused`` lists the kinds of modules now on fused kernels, ``not_fused`` says what
    was left on the reference path and why."""

    model_type: str
    fused: dict[str, int] = field(default_factory=dict)
    not_fused: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        done = ", ".join(f"{count} {name}" for name, count in self.fused.items()) or "nothing"
        text = f"{self.model_type}: fused {done}"
        if self.not_fused:
            text += "; not fused: " + "; ".join(self.not_fused)
        return text


@dataclass
class _PatchState:
    report: PatchReport
    modules: list[torch.nn.Module]
    projections: list[torch.nn.Module] = field(default_factory=list)  # LoRA'd linears the fused forwards read
    copies: object | None = None  # fastft.kernels.lora.AdapterComputeCopies
    hook: object | None = None  # the decoder's pre-hook that refreshes them
    kernel_layers: list[torch.nn.Module] = field(default_factory=list)  # patched modules kernelize rewrites
    kernels_hook: object | None = None  # the decoder's pre-hook that gives them their fused forward back


# --------------------------------------------------------------------------------------------- projections


def _frozen_base(linear: torch.nn.Module):
    """`FrozenLinear` for an ``nn.Linear``, bitsandbytes NF4 or fastft FP8 layer whose weight is frozen, else
    None."""

    weight = getattr(linear, "weight", None)
    if weight is None or weight.requires_grad:
        return None
    bias = getattr(linear, "bias", None)
    if bias is not None and bias.requires_grad:
        return None
    weight_format, state = frozen_state(weight)
    if state is not None:
        if not weight_format.accepts(state):
            return None
        return FrozenLinear(weight, bias, state, weight_format)
    scale = getattr(linear, "weight_scale", None)
    if scale is not None and type(linear).__name__ == "FP8Linear":  # fastft.models.fp8: e4m3 + channel scales
        return FrozenLinear(weight, bias, scale=scale)
    if type(linear) is not torch.nn.Linear:  # 8-bit and other custom linears keep their own forward
        return None
    return FrozenLinear(weight, bias)


def _projection(module: torch.nn.Module):
    """``(base, A, B, scale)`` for a projection that the fused functions can run this call, or None."""
    from peft.tuners.lora import LoraLayer

    if not isinstance(module, LoraLayer):
        base = _frozen_base(module)
        return None if base is None else (base, None, None, 1.0)
    base = _frozen_base(module.get_base_layer())
    if base is None:
        return None
    if module.disable_adapters:  # PEFT unmerges a merged adapter first: leave that to its forward
        return None if module.merged else (base, None, None, 1.0)
    if module.merged:  # the adapter is already inside the base weight
        return (base, None, None, 1.0)
    active = [name for name in module.active_adapters if name in module.lora_A]
    if not active:
        return (base, None, None, 1.0)
    if len(active) > 1:
        return None
    name = active[0]
    if module.use_dora.get(name, False) or getattr(module, "lora_bias", {}).get(name, False):
        return None
    dropout = module.lora_dropout[name]
    if module.training and isinstance(dropout, torch.nn.Dropout) and dropout.p > 0:
        return None
    return base, module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]


def _projections(module: torch.nn.Module, names: tuple[str, ...]):
    parts = [_projection(getattr(module, name)) for name in names]
    return None if any(part is None for part in parts) else parts


def _split(parts):
    return [p[0] for p in parts], [p[3] for p in parts], [(p[1], p[2]) for p in parts]


# --------------------------------------------------------------------------------------------- forwards


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    from fastft.kernels.rms_norm import rms_norm

    return rms_norm(hidden_states, self.weight, self._fastft_eps)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    parts = _projections(self, _ATTENTION_PROJECTIONS)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if parts is None or cache is not None or args or position_embeddings is None:
        return self._fastft_original_forward(
            hidden_states, position_embeddings, attention_mask, *args, **kwargs
        )
    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)

    bases, scales, adapters = _split(parts)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = lora_linears(hidden_states, bases[:3], scales[:3], adapters[:3])
    query = query.view(hidden_shape).transpose(1, 2)
    key = key.view(hidden_shape).transpose(1, 2)
    value = value.view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    if self._fastft_qk_norm:
        query, key = apply_qk_norm_rope(
            query, key, self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.variance_epsilon
        )
    else:
        query, key = apply_rope(query, key, cos, sin)
    if self._fastft_sliding_window is not _NO_WINDOW:
        kwargs["sliding_window"] = self._fastft_sliding_window
    attn_output, attn_weights = _attention_interface(self)(
        self,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    kept = getattr(layer_context(self), "kept", None)  # the running offloaded layer call's, or None
    return _output_projection(attn_output, bases[3:], scales[3:], adapters[3:], kept), attn_weights


def _output_projection(attn_output, bases, scales, adapters, kept=None) -> torch.Tensor:
    """o_proj. Under offloaded checkpointing, a layer whose attention output was kept for its recompute
    (`fastft.runtime.attention`) keeps o_proj's output with it, so the recompute skips that GEMM as well:
    it has the input (the kept attention output) and the output, and computes only the rank-r ``x A^T`` its
    backward needs. The backward, and so every gradient, is the same as after recomputing it."""

    if kept is None:
        return lora_linears(attn_output, bases, scales, adapters)[0]
    if kept.recording:
        (output,) = lora_linears(attn_output, bases, scales, adapters)
        if kept.kept(ATTENTION):  # whether o_proj keeps at all is the offloader's `keep` setting
            kept.keep(OUTPUT_PROJECTION, (output,))
        return output
    entry = kept.take(OUTPUT_PROJECTION)
    return lora_linears(attn_output, bases, scales, adapters, known=None if entry is None else entry[0])[0]


_NO_WINDOW = object()


def _attention_interface(module):
    implementation = module.config._attn_implementation
    if implementation in (None, "eager"):
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[implementation]


def _mlp_forward(self, hidden_states):
    parts = _projections(self, _MLP_PROJECTIONS)
    if parts is None:
        return self._fastft_original_forward(hidden_states)

    bases, scales, adapters = _split(parts)
    return lora_mlp(
        hidden_states, *bases, scales, self._fastft_activation, adapters, self._fastft_output_only_added
    )


# --------------------------------------------------------------------------------------------- patching


def _causal_lm_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    """A causal LM's forward where a ``labels=`` call gets its loss from the fused linear cross-entropy over
    the decoder's hidden states (shifted as transformers shifts them, ``-100`` ignored, ``num_items_in_batch``
    honoured as the HF Trainer passes it); every other call (no labels, a KV cache, the MoE router loss, a
    head that is not a plain linear layer) runs the original forward."""
    head = self.get_output_embeddings()
    asks_router_loss = kwargs.get("output_router_logits", getattr(self.config, "output_router_logits", False))
    if past_key_values is not None:  # passed on only when given: transformers 5 names the cache `cache`
        kwargs["past_key_values"] = past_key_values  # and warns when both arrive
    if (
        labels is None
        or kwargs.get("past_key_values") is not None
        or kwargs.get("cache") is not None
        or use_cache
        or asks_router_loss
        or kwargs.get("return_dict") is False
        or type(head) is not torch.nn.Linear
    ):
        return self._fastft_original_forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )
    from fastft.kernels.fused_linear_ce import fused_linear_cross_entropy

    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = self.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=False,
        **kwargs,
    )
    hidden = outputs.last_hidden_state
    if shift_labels is None:
        hidden, targets = hidden[:, :-1], labels[:, 1:]
    else:
        targets = shift_labels
    loss = fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        targets.reshape(-1).to(hidden.device),
        bias=head.bias,
        softcap=getattr(self.config, "final_logit_softcapping", None),
        reduction="mean" if num_items is None else "sum",
    )
    if num_items is not None:
        loss = loss / num_items
    return FusedLossOutput(
        loss=loss,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )


def _hook_adapter_copies(state: _PatchState, decoder: torch.nn.Module) -> None:
    """Before each training forward of the decoder: every active adapter's weights in the compute dtype, in one
    multi-tensor copy (`fastft.kernels.lora.AdapterComputeCopies`), for the fused forwards, their recompute and
    their backward. Inference and frozen forwards keep casting where they use a weight."""

    def hook(module, args):
        if not (module.training and torch.is_grad_enabled()) or not state.projections:
            return
        weights = []
        for projection in state.projections:
            for name in projection.active_adapters:
                if name in projection.lora_A:
                    weights += [projection.lora_A[name].weight, projection.lora_B[name].weight]
        if not weights:
            return
        device = weights[0].device
        if torch.is_autocast_enabled(device.type):
            dtype = torch.get_autocast_dtype(device.type)
        else:
            dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), weights[0].dtype)
        state.copies.refresh(weights, dtype)

    state.copies = AdapterComputeCopies()
    state.hook = decoder.register_forward_pre_hook(hook)


def _install(module: torch.nn.Module, forward, state: _PatchState, **attributes) -> None:
    for name, value in attributes.items():
        setattr(module, "_fastft_" + name, value)
    module._fastft_forward = forward
    _take_fused_forward(module)
    state.modules.append(module)


def _take_fused_forward(module: torch.nn.Module) -> None:
    """Give `module` its fused forward; the forward it had becomes the original, run where the fused one does
    not apply and given back by `unpatch`."""
    module._fastft_original_forward = module.forward
    module._fastft_had_instance_forward = "forward" in module.__dict__
    module.forward = types.MethodType(module._fastft_forward, module)


def _runs_fused_forward(module: torch.nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is module._fastft_forward


def _keep_fused_forwards(state: _PatchState) -> None:
    """Give back their fused forward to the patched modules that `kernels.kernelize` rewrote since (it runs on
    every ``train()`` / ``eval()`` that changes a kernelized model's mode); the forward it chose becomes their
    original. A no-op where nothing was rewritten, so it runs before every decoder forward."""
    for module in state.kernel_layers:
        if not _runs_fused_forward(module):
            _take_fused_forward(module)


def _hook_kernel_layers(state: _PatchState, decoder: torch.nn.Module) -> None:
    """Before each decoder forward, `_keep_fused_forwards`: whatever kernelized the model since (a change of
    mode, ``set_use_kernels``, ``kernels.kernelize`` called directly), every fused module runs its fused forward
    again by the time the decoder reaches it. Only the modules whose class is a hub-kernel layer (its
    ``kernel_layer_name``, set by `kernels`' decorator) are looked at: kernelize rewrites no others. Without
    the `kernels` package there are none, and no hook."""
    state.kernel_layers = [module for module in state.modules if hasattr(type(module), "kernel_layer_name")]
    if state.kernel_layers:
        state.kernels_hook = decoder.register_forward_pre_hook(
            lambda module, args: _keep_fused_forwards(state)
        )


def _is_rms_norm(module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and getattr(module, "weight", None) is not None


def _sliding_window(attention, model_type: str, config):
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window
    if model_type in ("mistral", "mixtral"):
        return getattr(config, "sliding_window", None)
    return _NO_WINDOW


def patch(model: torch.nn.Module, *, warn: bool = True) -> PatchReport:
    """Swap fastft's fused kernels into `model` (a transformers causal LM or a PEFT model around one).

    Idempotent (a second call returns the first report, after giving back any fused forward a hub-kernel
    `kernelize` took since) and reversible with `unpatch`. Returns a `PatchReport`; when something stays on
    the reference path, one `UnfusedWarning` says what and why.
    """
    base = base_model(model)
    existing = model_state(base).kernels
    if existing is not None:
        _keep_fused_forwards(existing)
        return existing.report
    config = base.config
    model_type = getattr(config, "model_type", type(base).__name__)
    report = PatchReport(model_type)
    state = _PatchState(report, [])
    plan = fusion.plan(config)
    if plan.scope == "none":
        report.not_fused.append(
            f"the {model_type} architecture ({plan.scope_reason}); it trains on transformers' own modules"
        )
        model_state(base).kernels = state
        if warn:
            warnings.warn(f"fastft.patch: {report}", UnfusedWarning, stacklevel=2)
        return report

    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    kind = plan.activation
    dense = plan.fuses_decoder
    counts = {"rms_norm": 0, "attention": 0, "mlp": 0, "moe": 0}
    moe_blocks = dense_mlps = 0
    for layer in decoder.layers:
        if dense:
            _patch_attention_and_norms(layer, model_type, config, state, counts)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            info = moe_block_info(mlp, config)
            if info is None:
                moe_blocks += 1
                continue
            _install(mlp, moe_block_forward, state, moe=info)
            counts["moe"] += 1
            if info.shared_expert:
                dense_mlps += 1
                # its output is scaled by a gate, and the product saves it for backward
                counts["mlp"] += _patch_mlp(mlp.shared_expert, kind, state, output_only_added=False)
            continue
        dense_mlps += 1
        counts["mlp"] += _patch_mlp(mlp, kind, state, output_only_added=True)
    if dense and _is_rms_norm(getattr(decoder, "norm", None)):
        norm = decoder.norm
        _install(norm, _rms_norm_forward, state, eps=float(getattr(norm, "variance_epsilon", 1e-6)))
        counts["rms_norm"] += 1
    if not dense:
        report.not_fused.append(
            f"the attention and RMSNorm of {model_type} ({plan.scope_reason}: transformers' modules)"
        )
    if moe_blocks:
        report.not_fused.append(f"{moe_blocks} MoE expert blocks (they run transformers' experts)")
    if kind is None and dense_mlps:
        report.not_fused.append(f"the MLPs ({plan.activation_reason})")
    report.fused = {name: count for name, count in counts.items() if count}
    report.fused["cross_entropy"] = 1
    if type(base.get_output_embeddings()) is torch.nn.Linear and hasattr(base, "get_decoder"):
        _install(base, _causal_lm_forward, state)  # model(..., labels=...) the Hugging Face way
    state.projections = _lora_projections(state.modules)
    if tiling.ADAPTER_COMPUTE_COPIES:  # off by default: the trade is measured there
        _hook_adapter_copies(state, decoder)
    _hook_kernel_layers(state, decoder)
    attach_layer_contexts(base)  # the fused forwards reach their layer's kept tensors and router collector
    model_state(base).kernels = state
    if warn and report.not_fused:
        warnings.warn(f"fastft.patch: {report}", UnfusedWarning, stacklevel=2)
    return report


def _lora_projections(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """PEFT LoRA linears among the projections that the fused attention and MLP forwards read."""
    from peft.tuners.lora import LoraLayer

    found = []
    for module in modules:
        names = {_attention_forward: _ATTENTION_PROJECTIONS, _mlp_forward: _MLP_PROJECTIONS}.get(
            module.forward.__func__, ()
        )
        found += [getattr(module, n) for n in names if isinstance(getattr(module, n), LoraLayer)]
    return found


def _patch_attention_and_norms(layer, model_type: str, config, state: _PatchState, counts: dict) -> None:
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if _is_rms_norm(norm):
            eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
            _install(norm, _rms_norm_forward, state, eps=float(eps))
            counts["rms_norm"] += 1
    attention = layer.self_attn
    qk_norm = hasattr(attention, "q_norm") and _is_rms_norm(attention.q_norm)
    _install(
        attention,
        _attention_forward,
        state,
        qk_norm=qk_norm,
        sliding_window=_sliding_window(attention, model_type, config),
    )
    counts["attention"] += 1


def _patch_mlp(mlp: torch.nn.Module, kind: str | None, state: _PatchState, output_only_added: bool) -> int:
    """Install the fused MLP forward on a gate/up/down MLP; 1 if installed, else 0. `output_only_added`:
    the MLP's output only goes into the residual add, which saves nothing for backward, so a recompute may
    skip the down projection (`fastft.kernels.lora_mlp`); False where anything else reads it."""
    if kind is None or not all(hasattr(mlp, name) for name in _MLP_PROJECTIONS):
        return 0
    _install(mlp, _mlp_forward, state, activation=kind, output_only_added=output_only_added)
    return 1


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Give every patched module its original forward back; a model that is not patched is unchanged.
    A module that `kernels.kernelize` rewrote since its fused forward last ran keeps the forward kernelize
    chose: that is the model's current kernelization, which the original from before would undo."""
    base = base_model(model)
    state = model_state(base).kernels
    if state is None:
        return model
    if state.hook is not None:
        state.hook.remove()
        state.copies.release()
    if state.kernels_hook is not None:
        state.kernels_hook.remove()
    for module in state.modules:
        if _runs_fused_forward(module) and module._fastft_had_instance_forward:
            module.forward = module._fastft_original_forward
        elif _runs_fused_forward(module):
            del module.forward
        for name in [key for key in vars(module) if key.startswith("_fastft_")]:
            delattr(module, name)
    model_state(base).kernels = None
    return model


def patch_report(model: torch.nn.Module) -> PatchReport | None:
    """What `patch` fused on this model (a PEFT model or its base), None where it has not run."""
    state = model_state(base_model(model)).kernels
    return state.report if state is not None else None


def is_fused(model: torch.nn.Module) -> bool:
    """Whether `patch` has run on this model (and it was not undone)."""
    state = model_state(base_model(model)).kernels
    return state is not None and bool(state.modules)

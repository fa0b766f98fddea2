"""`add_lora`: PEFT LoRA adapters on a loaded model, with checked target names.

The result is a plain `peft.PeftModel`, so `save_pretrained`, `generate`, HF `Trainer` and TRL all
accept it. Re-running the same `add_lora` call on the returned model is a no-op, so a notebook
cell can be run twice.

Mixture-of-experts models list one more target, ``experts``: the stacked expert weights of every sparse
MoE block (not `nn.Linear` layers in transformers 5, but 3-D ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` parameters). Targeting it puts one adapter per expert on both (PEFT's
``target_parameters``, so the adapter saves and reloads with plain PEFT); the router is never a target.
fastft's fused MoE forward (`fastft.models.moe`) runs those adapters as grouped low-rank GEMMs.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import fastft.weight_formats as weight_formats
from fastft.checks import real_number, whole_number
from fastft.data.hub import hub_offline_while_importing
from fastft.models.moe import is_expert_module
from fastft.models.presets import PRESETS, TOKENIZER_VOCAB_SIZE
from fastft.runtime.activation_checkpointing import Checkpointing
from fastft.runtime.model_state import base_model, is_quantised, model_state
from fastft.runtime.offload import disable_offload, enable_offload

with hub_offline_while_importing("bitsandbytes"):  # peft imports it; it asks the hub for a kernel
    from peft import LoraConfig, PeftModel, get_peft_model

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # the stacked expert parameters an ``experts`` target adapts
EMBEDDINGS = ("embed_tokens", "lm_head")  # PEFT's embedding layer names (its EMBEDDING_LAYER_NAMES)


class LoraTargetError(ValueError):
    """Asked-for LoRA targets do not exist in the model; the message lists the ones that do."""


@dataclass(frozen=True)
class LoraSettings:
    r: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]
    bias: str
    use_rslora: bool
    gradient_checkpointing: Checkpointing
    fused: bool = True
    modules_to_save: tuple[str, ...] = ()
    use_dora: bool = False


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """Short names (e.g. ``q_proj``) of the model's linear layers that LoRA can target, then (on MoE
    models) the short name of the expert modules, ``experts``.

    The output head is left out (it is never a LoRA target here), as are MoE routers, which
    are not `nn.Linear` in transformers' MoE blocks or are named ``gate``/``router``/``shared_expert_gate``
    beside experts. bitsandbytes' 4/8-bit layers subclass `nn.Linear`, so quantised models list the same names.
    """
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names: list[str] = []
    for full_name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is output:
            continue
        parts = full_name.split(".")
        if any(part.startswith("lora_") for part in parts):  # adapters of an already wrapped model
            continue
        short = parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]
        if short in ("lm_head", "router") or (short in _GATES and _is_router(full_name, model)):
            continue
        if short not in names:
            names.append(short)
    for short in expert_module_names(model):
        if short not in names:
            names.append(short)
    return names


_GATES = ("gate", "shared_expert_gate")


def expert_module_names(model: torch.nn.Module) -> list[str]:
    """Short names (``experts``) of the modules holding stacked expert weights (`fastft.models.moe`)."""

    names: list[str] = []
    for full_name, module in model.named_modules():
        parts = [part for part in full_name.split(".") if part != "base_layer"]
        if not parts or any(part.startswith("lora_") for part in parts) or not is_expert_module(module):
            continue
        if parts[-1] not in names:
            names.append(parts[-1])
    return names


def _is_router(full_name: str, model: torch.nn.Module) -> bool:
    full_name = full_name.removesuffix(".base_layer")
    parent = model.get_submodule(full_name.rsplit(".", 1)[0]) if "." in full_name else model
    return hasattr(parent, "experts")


_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def mlp_targets_as_experts(model: torch.nn.Module, target_modules):
    """`target_modules` with the MLP projections (``gate_proj``, ``up_proj``, ``down_proj``, as Unsloth's
    notebooks list them) read as ``experts`` on a model whose MLPs are fused experts and have no linear layers
    of those names (as PEFT and Unsloth target the experts for them). Those three adapt the experts'
    ``gate_up_proj`` and ``down_proj`` together, so a list naming only some of them is refused."""
    if isinstance(target_modules, str) or not expert_module_names(model):
        return target_modules
    linear = set(linear_layer_names(model))
    asked = [name for name in target_modules if name in _MLP_NAMES and name not in linear]
    if not asked:
        return target_modules
    experts = expert_module_names(model)
    if set(asked) != set(_MLP_NAMES):
        raise LoraTargetError(
            f"LoRA target(s) {asked}: this model's MLPs are fused experts, whose gate/up and down weights are "
            f"adapted together. List all of {list(_MLP_NAMES)} (or {experts[0]!r}) to adapt the experts, or none."
        )
    warnings.warn(
        f"target_modules {list(_MLP_NAMES)}: this model's MLPs are fused experts, so the adapters go on the "
        f"experts' gate_up_proj and down_proj weights (target {experts[0]!r}, rank r per expert).",
        stacklevel=3,
    )
    kept = [name for name in target_modules if name not in asked]
    return kept + [name for name in experts if name not in kept]


def resolve_targets(model: torch.nn.Module, target_modules: str | list[str] | tuple[str, ...]) -> list[str]:
    """`target_modules` checked against the model's `linear_layer_names` (`check_targets`)."""
    return check_targets(target_modules, linear_layer_names(model))


def check_targets(
    targets: str | list[str] | tuple[str, ...], available: list[str], model: str = "this model"
) -> list[str]:
    """The LoRA targets `targets` names: "all-linear" (every one of `available`, a model's
    `linear_layer_names`), one short name or several. Raises `LoraTargetError` naming the valid ones for a
    name that is not among them. `add_lora` and the VRAM estimator both check their targets here."""
    if targets == "all-linear":
        return list(available)
    if isinstance(targets, str):
        targets = [targets]
    unknown = [name for name in targets if name not in available]
    if unknown:
        raise LoraTargetError(
            f"LoRA target(s) {unknown} are not linear layers of {model}. "
            f"Its linear layers are: {available}. Use some of these, or 'all-linear' for every one."
        )
    return list(targets)


def add_lora(
    model: torch.nn.Module,
    r: int = 16,
    alpha: float = 16,
    dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    gradient_checkpointing: Checkpointing | bool | str = "auto",
    bias: str = "none",
    use_rslora: bool = False,
    seed: int | None = 3407,
    fused: bool = True,
    modules_to_save: list[str] | tuple[str, ...] | None = None,
    use_dora: bool = False,
) -> PeftModel:
    """Wrap `model` with LoRA adapters of rank `r` and scale `alpha / r` and freeze the rest.

    `target_modules` is "all-linear" (every linear layer but the output head and MoE routers, and on
    MoE models the experts) or a list of short layer names such as ``["q_proj", "v_proj"]``; on MoE
    models ``"experts"`` adapts every expert's gate/up and down weights (rank `r` per expert).
    `gradient_checkpointing` is a `fastft.runtime.activation_checkpointing.Checkpointing` or what it parses: "auto"
    (default: "offload" on CUDA, "recompute" elsewhere), "offload", "recompute" (True), "none" (False), or
    Unsloth's "unsloth" (= "offload").
    `seed` makes the adapters' initialisation reproducible without touching the global RNG.
    `fused` swaps fastft's kernels into the model (`fastft.patch`: Triton RMSNorm, RoPE, SwiGLU,
    LoRA-fused projections, fused linear cross-entropy); ``fused=False`` keeps transformers' modules.
    `modules_to_save` names whole modules trained in full beside the adapters and saved with them, e.g.
    ``["embed_tokens", "lm_head"]`` for continued pretraining on new text (PEFT's option of that name).
    `use_dora` trains DoRA (weight-decomposed LoRA, PEFT's); its layers run PEFT's forward, not the fused
    kernels, and expert weights cannot take it.
    """
    gradient_checkpointing = Checkpointing.parse(gradient_checkpointing)
    check_lora_arguments(model, r, alpha, dropout, target_modules, bias, seed)

    base = base_model(model)
    target_modules = mlp_targets_as_experts(base, target_modules)
    targets = resolve_targets(base, target_modules)
    warn_rank_above_width(base, targets, r)
    targets, experts, saved_modules = _split_targets(
        base, target_modules, targets, dropout, modules_to_save, use_dora
    )
    settings = LoraSettings(
        r,
        float(alpha),
        float(dropout),
        tuple(targets),
        bias,
        use_rslora,
        gradient_checkpointing,
        fused,
        saved_modules,
        bool(use_dora),
    )

    if isinstance(model, PeftModel):
        existing = model_state(model).lora
        if existing == settings:
            return model
        raise ValueError(
            "This model already has LoRA adapters"
            + (f" ({_describe(existing)})" if existing else "")
            + ". Reload the base model with load_model(...) before adding different adapters."
        )

    # A quantised model keeps its frozen non-quantised weights (norms, embeddings, head) in the dtype it was
    # loaded in, fp16 as bf16 (as Unsloth does): PEFT's k-bit preparation would cast them to fp32, and the
    # residual stream and the head's matmul with them. The adapters PEFT creates are fp32 either way (its
    # `autocast_adapter_dtype`): the fp16 loss scaler updates fp32 master weights. Modules trained whole are
    # PEFT copies of 16-bit modules, which fp16 cannot train (AdamW's second moment underflows): there PEFT's
    # preparation still runs, so the copies are fp32 (and the rest with them, as before).
    fp16 = base.get_input_embeddings().weight.dtype == torch.float16
    if is_quantised(base) and fp16 and saved_modules:
        from peft import prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)

    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=[name for name in targets if name not in experts],
        target_parameters=[f"{name}.{weight}" for name in experts for weight in EXPERT_WEIGHTS] or None,
        bias=bias,
        use_rslora=use_rslora,
        modules_to_save=list(saved_modules) or None,
        use_dora=bool(use_dora),
        task_type="CAUSAL_LM",
        **_weight_tying(base, saved_modules),
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft 0.21 reads transformers' deprecated `is_gradient_checkpointing`; not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        if seed is not None:
            torch.manual_seed(seed)
        peft_model = get_peft_model(base, config)

    set_gradient_checkpointing(peft_model, gradient_checkpointing)
    if fused:
        _fuse(peft_model)
    model_state(peft_model).lora = settings
    _save_without_the_hub(peft_model)
    return peft_model


def _split_targets(base, target_modules, targets, dropout, modules_to_save, use_dora):
    """``(targets, experts, saved_modules)``: the resolved `targets` (of `target_modules`) that LoRA adapts,
    those of them that are stacked expert weights, and the checked `modules_to_save`. Warns (or raises) where
    a target cannot take the settings: dropout or DoRA on expert weights, a module both adapted and trained
    whole (called by `add_lora` only: the warning points at its caller)."""
    experts = [name for name in targets if name in expert_module_names(base)]
    if experts and dropout and target_modules == "all-linear":
        warnings.warn(
            f"LoRA dropout ({dropout}) cannot act on expert weights (the low-rank term is added per expert "
            f"after routing, and PEFT's expert adapters refuse dropout): 'all-linear' leaves {experts} out. "
            "Use dropout=0 to adapt the experts too.",
            stacklevel=3,
        )
        targets = [name for name in targets if name not in experts]
        experts = []
    if experts and dropout:
        raise ValueError(
            f"LoRA dropout ({dropout}) cannot act on expert weights {experts} (the low-rank term is added per "
            "expert after routing, and PEFT's expert adapters refuse dropout): use dropout=0, or leave "
            f"{experts} out of target_modules."
        )
    saved_modules = _check_modules_to_save(base, modules_to_save)
    if set(saved_modules) & set(targets):
        raise ValueError(
            f"{sorted(set(saved_modules) & set(targets))} are both LoRA targets and modules_to_save: a module is "
            "either adapted or trained whole. Leave them out of target_modules (or of modules_to_save)."
        )
    if use_dora and experts:
        raise ValueError(
            f"use_dora=True cannot adapt the expert weights {experts} (PEFT's expert adapters have no DoRA): "
            f"leave {experts} out of target_modules, or use plain LoRA (use_dora=False)."
        )
    return targets, experts, saved_modules


def _fuse(peft_model: PeftModel) -> None:
    """Swap fastft's kernels into the model (`fastft.patch`) and route padding-free batches through the packed
    attention where the patch fused attention."""
    from fastft.models.patch import patch
    from fastft.runtime.attention import is_patched, patch_packed_attention

    report = patch(peft_model)
    # padding-free Hugging Face batches (TRL's packing, DataCollatorWithFlattening) then run through the
    # packed attention; every other call keeps transformers' SDPA path (`fastft.runtime.attention`)
    if report.fused.get("attention") and not is_patched(peft_model):
        patch_packed_attention(peft_model, "auto")


def _save_without_the_hub(peft_model: PeftModel) -> None:
    """Give this model a ``save_pretrained`` that never reaches the network (on this instance only).

    PEFT's own, asked to decide whether to save the embeddings (``save_embedding_layers="auto"``, its default
    and what HF Trainer, TRL and the Unsloth layer's ``model.save_pretrained(dir)`` use), looks the recorded
    base up on the hub whenever it is not a local folder (a preset such as "tiny-llama", or a hub id), to
    compare vocabulary sizes: a connection, and two warnings offline. The same answer is made here from what
    is on this machine (`save_embedding_layers`); an explicit True or False goes to PEFT unchanged."""
    if "save_pretrained" not in peft_model.__dict__:
        object.__setattr__(
            peft_model, "save_pretrained", types.MethodType(save_pretrained_offline, peft_model)
        )


def save_pretrained_offline(self, *args, **kwargs):
    """PEFT's ``save_pretrained`` (same arguments), its ``save_embedding_layers="auto"`` answered here, without
    the hub."""
    original = type(self).save_pretrained
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    if bound.arguments.get("save_embedding_layers", "auto") == "auto":
        bound.arguments["save_embedding_layers"] = save_embedding_layers(self)
    return original(*bound.args, **bound.kwargs)


def save_embedding_layers(model: PeftModel) -> bool:
    """PEFT's ``save_embedding_layers="auto"`` decided without the network: True where the embedding layers
    are LoRA targets (and not as trainable tokens), or where the vocabulary was resized from the base's (its
    config.json read from the recorded folder, the local hub cache or the preset); False otherwise, as PEFT
    decides where the base's config cannot be found."""
    config = model.peft_config[model.active_adapter]
    trainable_tokens = getattr(config, "trainable_token_indices", None) is not None or str(
        getattr(config, "peft_type", "")
    ).endswith("TRAINABLE_TOKENS")
    if _embeddings_targeted(model, config) and not trainable_tokens:
        return True
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    base_vocab = _base_vocab_size(getattr(config, "base_model_name_or_path", None))
    return bool(vocab and base_vocab and vocab != base_vocab)


def _embeddings_targeted(model: PeftModel, config) -> bool:
    """PEFT's test of whether the adapters target ``embed_tokens`` / ``lm_head`` (a list, or a regex)."""
    targets = getattr(config, "target_modules", None)
    if isinstance(targets, str):
        if targets == "all-linear":
            return False
        names = (name for name, _ in model.get_base_model().named_modules())
        return any(re.fullmatch(targets, name) for name in names if name.rsplit(".", 1)[-1] in EMBEDDINGS)
    return bool(targets) and any(name in targets for name in EMBEDDINGS)


def _base_vocab_size(base: str | None) -> int | None:
    """The vocabulary size in the config.json of `base` (a preset, a folder, or a hub id in the local cache);
    None where none is on this machine. Never the network."""
    if not base:
        return None

    if base in PRESETS:
        return TOKENIZER_VOCAB_SIZE
    path = Path(base).expanduser() / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(base, "config.json")
        except Exception:  # noqa: BLE001 - not a hub id either: nothing to compare with
            return None
        if not isinstance(cached, str):
            return None
        path = Path(cached)
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    vocab = fields.get("vocab_size") or (fields.get("text_config") or {}).get("vocab_size")
    return int(vocab) if isinstance(vocab, int) else None


def _weight_tying(model: torch.nn.Module, saved_modules: tuple[str, ...]) -> dict:
    """On a model whose head is its embedding table (``tie_word_embeddings``), training either one whole
    trains the one shared table (PEFT's ``ensure_weight_tying``), so the head and the embeddings stay tied."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    if not (saved_modules and tied) or "ensure_weight_tying" not in LoraConfig.__dataclass_fields__:
        return {}
    return {"ensure_weight_tying": True}


def _check_modules_to_save(model: torch.nn.Module, names) -> tuple[str, ...]:
    """`modules_to_save` as a tuple of short module names, each naming a module of `model` (not a LoRA target:
    a module is either adapted or trained whole)."""
    if not names:
        return ()
    names = (names,) if isinstance(names, str) else tuple(names)
    present = {full.rsplit(".", 1)[-1] for full, _ in model.named_modules() if full}
    missing = [name for name in names if name not in present]
    if missing:
        embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
        found = {id(module): full.rsplit(".", 1)[-1] for full, module in model.named_modules()}
        hint = ", ".join(
            f"{what} '{found[id(module)]}'"
            for what, module in (("the embeddings", embedding), ("the head", head))
            if module is not None and id(module) in found
        )
        raise ValueError(
            f"modules_to_save={list(names)}: {missing} name no module of this model. Its trainable-in-full "
            f"candidates are {hint}, e.g. modules_to_save=['embed_tokens', 'lm_head'] on Llama-style models."
        )
    return names


def check_lora_arguments(model, r, alpha, dropout, target_modules, bias, seed) -> None:
    """Every `add_lora` argument's type and range, with the value and the fix; and no second set of adapters
    on a base whose layers already carry adapters (peft would re-initialise them, trained or not)."""
    whole_number("LoRA rank r", r, minimum=1, fix="Ranks are usually 8 to 64.")
    real_number(
        "alpha",
        alpha,
        low=0,
        low_open=True,
        fix="The adapter's scale is alpha / r; alpha = r or 2·r is usual.",
    )
    real_number("dropout", dropout, low=0, high=1, high_open=True, fix="0 to 0.1 is usual.")
    if seed is not None:
        whole_number("seed", seed, fix="Or seed=None to use the global RNG.")
    if bias not in ("none", "all", "lora_only"):
        raise ValueError(f"bias={bias!r}: use 'none', 'all' or 'lora_only'.")
    names = [target_modules] if isinstance(target_modules, str) else target_modules
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
        raise LoraTargetError(
            f"target_modules={target_modules!r}: give 'all-linear' or a non-empty list of layer names such as "
            "['q_proj', 'v_proj'] (fastft.linear_layer_names(model) lists them)."
        )
    if not isinstance(model, PeftModel):
        from peft.tuners.tuners_utils import BaseTunerLayer

        if any(isinstance(module, BaseTunerLayer) for module in model.modules()):
            raise ValueError(
                "This model's layers already carry LoRA adapters: it was passed to add_lora before, which wraps "
                "its layers in place, and a second call would re-initialise the (maybe trained) adapters. Use "
                "the model add_lora returned, or load the base again with load_model(...) for new adapters."
            )


def warn_rank_above_width(base: torch.nn.Module, targets: list[str], r: int) -> None:
    """Warn when `r` is above half of a targeted layer's narrower side: such a rank adds parameters without
    adding what a low-rank update is for (and at full width it is a full fine-tune with extra steps)."""
    widths = [
        min(module.in_features, module.out_features)
        for name, module in base.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    ]
    if widths and r > min(widths) / 2:
        warnings.warn(
            f"LoRA rank r={r} is above half the width of the narrowest targeted layer ({min(widths)}): the "
            f"adapters get as many parameters as the layers themselves. Use r <= {max(1, min(widths) // 4)}.",
            stacklevel=3,
        )


def set_gradient_checkpointing(model: torch.nn.Module, mode: Checkpointing | bool | str) -> None:
    """Switch how the model's decoder layers keep activations for backward (on this instance only).

    `mode` is a `Checkpointing` or what it parses. "none" (False): keep everything. "recompute" (True): keep
    each layer's input and recompute the layer in backward (non-reentrant checkpointing). "offload":
    recompute, and keep each layer's input in pinned host memory, copied back on a side stream into two
    alternating device buffers while the layer after it runs its backward (`fastft.runtime.offload`); on
    the CPU it is plain recompute. "auto": "offload" when CUDA is available, else "recompute". Idempotent;
    switching modes replaces the previous one, never stacks.
    """
    checkpointing = Checkpointing.parse(mode).resolved(cuda=torch.cuda.is_available())
    mode = checkpointing.checkpoints
    base = base_model(model)
    options = {"use_reentrant": False}
    for name in _ROUTED:  # transformers' own switches below (theirs call each other), then routed again
        base.__dict__.pop(name, None)
    if hasattr(base, "activation_checkpointing_enable"):  # transformers ≥ 5.2x renamed the API
        if mode:
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
        elif is_checkpointing(base):
            base.activation_checkpointing_disable()
    elif mode:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    elif is_checkpointing(base):
        base.gradient_checkpointing_disable()
    if mode:
        base.config.use_cache = False
        drop_input_gradients(base)
    if checkpointing.offloads:  # after transformers reset every layer's checkpoint function
        enable_offload(base)
    else:
        disable_offload(base)
    base._fastft_checkpointing = checkpointing
    base.__dict__.pop("_fastft_checkpointing_disabled", None)
    _route_checkpointing_calls(base)


def _route_checkpointing_calls(base: torch.nn.Module) -> None:
    """Make the Hugging Face switches of this instance go through `set_gradient_checkpointing`.

    HF `Trainer` and TRL's `SFTTrainer` call ``model.gradient_checkpointing_enable()`` whenever their
    config says ``gradient_checkpointing=True`` (TRL's default). transformers' own method would reset every
    decoder layer to its plain recompute, dropping fastft's offload. Routed here, an enable keeps the mode
    the model already checkpoints with ("offload" stays "offload"), and a disable turns checkpointing off, as
    it says. An enable after a disable brings back the mode the disable turned off: TRL's DPO trainer wraps
    every reference forward in a disable/enable pair, which would otherwise leave the rest of the run on
    plain recompute. A model that never checkpointed starts recomputing (transformers' meaning). A direct
    `set_gradient_checkpointing` forgets the disabled mode. Instance attributes, so other models are
    untouched; re-running is idempotent."""

    def enable(
        self, *args, **kwargs
    ):  # the caller's kwargs (reentrant, every_n_layers...) yield to fastft's mode
        current = getattr(self, "_fastft_checkpointing", Checkpointing("none"))
        if current.checkpoints and is_checkpointing(self):
            return  # already checkpointing in fastft's mode: the offloader and its settings stay
        if not current.checkpoints:
            current = self.__dict__.get("_fastft_checkpointing_disabled", Checkpointing("recompute"))
        set_gradient_checkpointing(self, current)

    def disable(self):
        current = getattr(self, "_fastft_checkpointing", Checkpointing("none"))
        set_gradient_checkpointing(self, Checkpointing("none"))
        if current.checkpoints:
            self._fastft_checkpointing_disabled = current  # for the enable that follows (TRL's DPO)

    for name in _ROUTED:
        if hasattr(type(base), name):
            setattr(base, name, types.MethodType(enable if name.endswith("enable") else disable, base))

    def enable_input_require_grads(self):
        # TRL's trainers call this before training a PEFT model with checkpointing (see drop_input_gradients)
        if getattr(self, "_fastft_checkpointing", Checkpointing("none")).checkpoints:
            return
        type(self).enable_input_require_grads(self)

    if hasattr(type(base), "enable_input_require_grads"):
        base.enable_input_require_grads = types.MethodType(enable_input_require_grads, base)


def drop_input_gradients(base: torch.nn.Module) -> None:
    """Remove the forward hooks that make the embeddings' output require a gradient (transformers'
    ``enable_input_require_grads``, which PEFT installs on a model it wraps with checkpointing on, and TRL's
    trainers again).

    The hook exists for reentrant checkpointing, whose backward never reaches a layer whose inputs need no
    gradient. fastft's checkpointing is non-reentrant or offloaded: the layers' LoRA weights build the graph.
    With the hook, the embeddings' output becomes a leaf of the graph, held to the end of backward: under
    offloading, where every other layer input lives in host memory, that is one ``[tokens, hidden]`` 16-bit
    tensor on the device through the whole step (the held-out long-context set's peaks stood this tensor
    above the estimate: docs/journal.md, "Long context as BENCHMARKS.md recorded it"), and the first layer
    computes an input gradient nothing reads."""
    for module in base.modules():
        if getattr(module, "_require_grads_hooks", None) or hasattr(module, "_require_grads_hook"):
            module.disable_input_require_grads()


_ROUTED = (
    "gradient_checkpointing_enable",
    "gradient_checkpointing_disable",
    "activation_checkpointing_enable",
    "activation_checkpointing_disable",
)


def is_checkpointing(model: torch.nn.Module) -> bool:
    base = base_model(model)
    flag = getattr(type(base), "is_activation_checkpointing", None)
    return bool(base.is_activation_checkpointing if flag is not None else base.is_gradient_checkpointing)


def trainable_parameter_count(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit weights count as their unpacked size."""
    trainable = total = 0
    for parameter in model.parameters():
        count = weight_formats.of_parameter(parameter).logical_numel(parameter)  # NF4: two per byte
        total += count
        if parameter.requires_grad:
            trainable += count
    return trainable, total


def _describe(settings: LoraSettings) -> str:
    fields = asdict(settings) | {"gradient_checkpointing": str(settings.gradient_checkpointing)}
    return ", ".join(f"{key}={value}" for key, value in fields.items())


def load_adapter(
    model: torch.nn.Module,
    folder,
    gradient_checkpointing: Checkpointing | bool | str = "auto",
    fused: bool = True,
) -> PeftModel:
    """Attach the adapter saved in `folder` (by `save_adapter` or PEFT) to the base `model`, trainable and set
    up as `add_lora` sets up new adapters (checkpointing, fastft's kernels, the model's LoRA settings), so a
    loaded adapter generates, trains on and saves again like one `add_lora` made."""
    config = LoraConfig.from_pretrained(str(folder))
    peft_model = PeftModel.from_pretrained(model, str(folder), is_trainable=True)
    checkpointing = Checkpointing.parse(gradient_checkpointing)
    set_gradient_checkpointing(peft_model, checkpointing)
    if fused:
        from fastft.models.patch import patch

        patch(peft_model)
    targets = sorted(config.target_modules or ()) if not isinstance(config.target_modules, str) else []
    model_state(peft_model).lora = LoraSettings(
        r=config.r,
        alpha=float(config.lora_alpha),
        dropout=float(config.lora_dropout),
        target_modules=tuple(targets),
        bias=config.bias,
        use_rslora=config.use_rslora,
        gradient_checkpointing=checkpointing,
        fused=fused,
        modules_to_save=tuple(config.modules_to_save or ()),
        use_dora=bool(config.use_dora),
    )
    _save_without_the_hub(peft_model)
    return peft_model

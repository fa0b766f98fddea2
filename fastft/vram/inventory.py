"""What the VRAM estimate needs to know about a model: its modules, shapes and dtypes, never its weights.

Every source (an embedded preset, a catalog hub id, a `transformers` config, a hub id fetched as a config,
or a loaded model) is turned into one `ModelInventory`. For everything but a loaded model the real
architecture is built on the meta device (`transformers` builds it, so shapes, biases, tied heads, fused
MoE experts and routers are exactly what training will see; nothing is allocated). A loaded model is
walked as it is, with its actual dtypes and bitsandbytes quantisation.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import fastft.weight_formats as weight_formats
from fastft.models.catalog import CATALOG, close_names
from fastft.models.errors import ModelLoadError, RemoteCodeError, UnknownModelError
from fastft.models.presets import PRESETS
from fastft.models.remote_code import from_pretrained

if TYPE_CHECKING:  # torch and transformers are imported where a model is built or walked: a catalog model's
    import torch  # inventory comes from the shipped cache (`cached_inventory`) without either

# Function-local imports: `import fastft.vram` and `fastft estimate` run without torch or transformers
# (tests/faces/test_cli.py).

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class LinearInfo:
    """One `nn.Linear` of the model (the output head excluded)."""

    name: str  # full module name, e.g. "model.layers.3.self_attn.q_proj"
    short: str  # the name a LoRA target uses, e.g. "q_proj"
    in_features: int
    out_features: int
    bias: bool
    layer: int | None  # decoder layer index, None outside the layers
    lora_targetable: bool  # listed by `fastft.linear_layer_names` (routers and the head are not)

    @property
    def weight_params(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class LayerInfo:
    """One decoder layer, as the activation model reads it."""

    index: int
    linears: tuple[LinearInfo, ...]
    norms: int  # hidden-width RMSNorms (2 in Llama-style layers, 4 in Gemma 3)
    qk_norm: bool  # per-head RMSNorm on queries and keys (Qwen3, Gemma 3)
    moe: bool  # the MLP is a mixture of experts
    shared_expert_intermediate: int  # width of an always-on shared expert (Qwen2-MoE), else 0

    def linear(self, short: str) -> LinearInfo | None:
        for linear in self.linears:
            if linear.short == short and ".shared_expert." not in linear.name:
                return linear
        return None


@dataclass(frozen=True)
class ModelInventory:
    """Shapes, parameter groups and dtypes of one model, enough to size training without building it.

    Parameter groups (counts of elements): ``linear_params`` are weights of `nn.Linear` layers other than
    the output head (what bitsandbytes quantises); ``head_params`` the untied output head; ``embedding_params``
    the input embedding table; ``expert_params`` fused MoE expert tensors (not `nn.Linear`, never quantised by
    bitsandbytes); ``other_params`` everything else (norms, routers, biases, attention sinks).
    ``loaded`` holds the actual bytes of a loaded model's base weights and constants (None when built on meta).
    """

    name: str
    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    tied_embeddings: bool
    experts: int
    experts_per_token: int
    moe_intermediate: int
    hidden_act: str | None
    linears: tuple[LinearInfo, ...]
    layers: tuple[LayerInfo, ...]
    linear_params: int
    head_params: int
    embedding_params: int
    expert_params: int
    other_params: int
    loaded: LoadedModelState | None = None

    @property
    def total_params(self) -> int:
        return (
            self.linear_params
            + sum(linear.out_features for linear in self.linears if linear.bias)
            + self.head_params
            + self.embedding_params
            + self.expert_params
            + self.other_params
        )

    def lora_target_names(self) -> list[str]:
        """The names ``target_modules="all-linear"`` resolves to, in model order (``experts`` last on MoE
        models with stacked expert weights, as `fastft.linear_layer_names` lists them)."""
        names: list[str] = []
        for linear in self.linears:
            if linear.lora_targetable and linear.short not in names:
                names.append(linear.short)
        if self.expert_params and self.experts:
            names.append("experts")
        return names

    def expert_lora_params(self, r: int) -> int:
        """Adapter parameters of LoRA rank `r` on every expert's gate/up ``[2I, H]`` and down ``[H, I]``
        weights (PEFT ``target_parameters``: ``r * E * (in + out)`` per stacked weight, per MoE layer)."""
        moe_layers = sum(1 for layer in self.layers if layer.moe)
        return r * self.experts * (2 * self.hidden_size + 3 * self.moe_intermediate) * moe_layers


@dataclass(frozen=True)
class LoadedModelState:
    """What a loaded model already holds on its device (its real dtypes), for the estimate to reuse."""

    quantization: str | None  # a quantised `fastft.weight_formats` name ("nf4", "int8", "fp8") or None
    compute_dtype: torch.dtype  # dtype of the 16/32-bit base weights (what autocast runs in)
    weight_bytes: int  # base weights as stored (packed 4-bit, int8, 16/32-bit), LoRA excluded
    quant_constant_bytes: int  # absmax / scales of quantised weights
    residual_bytes: int  # bytes per element of the residual stream (the embeddings' dtype)
    lora_params: int  # trainable parameters already attached (0 before add_lora)
    lora_bytes: int
    lora_r: int | None
    lora_targets: tuple[str, ...]
    fused: bool | None  # whether fastft's kernels are patched in (None: no LoRA yet, add_lora decides)
    # the checkpointing kind its training runs on a GPU (add_lora's mode, "auto" resolved); None: no LoRA yet
    checkpointing: str | None = None


# -- the shipped inventories of presets and catalog models (written by `fastft.vram.catalog_cache`) --------

CACHE_FILE = Path(__file__).parent / "assets" / "catalog_inventories.json.gz"
_LINEAR_FIELDS = [f.name for f in fields(LinearInfo)]
_LAYER_FIELDS = [f.name for f in fields(LayerInfo) if f.name != "linears"]
_SCALAR_FIELDS = [f.name for f in fields(ModelInventory) if f.name not in ("linears", "layers", "loaded")]


def fingerprint(name: str) -> str:
    """A digest of the spec of preset or catalog model `name`: what its inventory is built from."""

    if name in PRESETS:
        preset = PRESETS[name]
        spec = {"model_type": preset.model_type, "config": preset.config, "vocab": preset.vocab_size}
    else:
        spec = {"model_type": CATALOG[name].model_type, "config": CATALOG[name].config}
    text = json.dumps(spec, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def inventory_to_dict(inventory: ModelInventory) -> dict:
    """`inventory` as JSON-ready data; linears are rows of `LinearInfo`'s fields, stored once (a layer's
    linears are the rows with its index, in order, as `fastft.vram.inventory._layers` groups them)."""
    assert inventory.loaded is None, "only inventories built on the meta device are cached"
    return {
        **{name: getattr(inventory, name) for name in _SCALAR_FIELDS},
        "linears": [[getattr(linear, name) for name in _LINEAR_FIELDS] for linear in inventory.linears],
        "layers": [[getattr(layer, name) for name in _LAYER_FIELDS] for layer in inventory.layers],
    }


def inventory_from_dict(data: dict) -> ModelInventory:
    linears = tuple(LinearInfo(**dict(zip(_LINEAR_FIELDS, row, strict=True))) for row in data["linears"])
    by_layer: dict[int, list[LinearInfo]] = {}
    for linear in linears:
        if linear.layer is not None:
            by_layer.setdefault(linear.layer, []).append(linear)
    layers = []
    for row in data["layers"]:
        values = dict(zip(_LAYER_FIELDS, row, strict=True))
        layers.append(LayerInfo(linears=tuple(by_layer.get(values["index"], ())), **values))
    return ModelInventory(
        **{name: data[name] for name in _SCALAR_FIELDS}, linears=linears, layers=tuple(layers), loaded=None
    )


@functools.lru_cache(maxsize=1)
def _entries() -> dict:
    if not CACHE_FILE.exists():
        return {}
    with gzip.open(CACHE_FILE, "rt", encoding="utf-8") as f:
        return json.load(f)["models"]


def cached_inventory(name: str) -> ModelInventory | None:
    """The stored inventory of preset or catalog model `name`, or None when there is none for its spec. A
    catalog variant gets its entry's, under its own name and stated context (`VARIANT_FIELDS`)."""

    variant = CATALOG[name] if name in CATALOG and CATALOG[name].variant_of else None
    stored = variant.variant_of if variant is not None else name
    entry = _entries().get(stored)
    if entry is None or entry["fingerprint"] != fingerprint(stored):
        return None
    inventory = inventory_from_dict(entry["inventory"])
    if variant is not None:
        positions = variant.config.get("max_position_embeddings", inventory.max_position_embeddings)
        inventory = replace(inventory, name=name, max_position_embeddings=positions)
    return inventory


# -- resolving the model argument -----------------------------------------------------------------


def inventory_of(model, trust_remote_code: bool = False) -> ModelInventory:
    """The inventory of a preset name, catalog hub id, local folder, hub id, config or loaded model.

    A folder or hub id whose config needs its own Python code (``auto_map``) is refused
    (`RemoteCodeError`) unless `trust_remote_code` is True (`fastft estimate --trust-remote-code`)."""
    if isinstance(model, ModelInventory):
        return model
    if isinstance(model, (str, os.PathLike)):
        from fastft.models.remote_code import consent

        return _inventory_of_name(os.fspath(model), consent(trust_remote_code))
    import torch
    from transformers import PretrainedConfig

    if isinstance(model, torch.nn.Module):
        return _inventory_of_loaded(model)
    if isinstance(model, PretrainedConfig):
        return _inventory_of_config(model, getattr(model, "name_or_path", "") or model.model_type)
    raise TypeError(
        f"estimate_vram takes a model name, a transformers config or a loaded model, not {type(model).__name__}."
    )


@functools.lru_cache(maxsize=64)
def _inventory_of_name(name: str, trust_remote_code: bool = False) -> ModelInventory:
    if name in PRESETS:
        return cached_inventory(name) or _inventory_of_config(
            PRESETS[name].make_config(PRESETS[name].vocab_size), name
        )
    by_lower = {hub_id.lower(): hub_id for hub_id in CATALOG}
    if name.lower() in by_lower:  # hub ids are case-insensitive
        hub_id = by_lower[name.lower()]
        return cached_inventory(hub_id) or _inventory_of_config(CATALOG[hub_id].to_config(), hub_id)
    close = close_names(name, list(PRESETS) + list(CATALOG))
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    path = Path(name).expanduser()
    if path.is_dir() or _looks_like_hub_id(name):
        return _inventory_of_config(_fetch_config(name, path, hint, trust_remote_code), name)
    raise UnknownModelError(
        f"'{name}' is not an embedded preset, a catalog model, a local folder or a hub id of the form "
        f"'org/name'.{hint} Presets: {', '.join(PRESETS)}; `fastft models` lists the catalog."
    )


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _fetch_config(name: str, path: Path, hint: str = "", trust_remote_code: bool = False):
    from transformers import AutoConfig

    from fastft.data.hub import offline_fix, offline_reason

    source = str(path) if path.is_dir() else name
    offline = not path.is_dir() and offline_reason() is not None
    try:
        config = from_pretrained(AutoConfig, source, name, trust_remote_code, local_files_only=offline)
    except RemoteCodeError as error:
        raise RemoteCodeError(
            f"{error} In Python: estimate_vram(AutoConfig.from_pretrained({name!r}, trust_remote_code=True), ...)."
        ) from error
    except (OSError, ValueError) as error:
        if offline:
            raise ModelLoadError(f"{offline_fix(name, 'config.json')}{hint}") from error
        where = (
            "its folder has no readable config.json" if path.is_dir() else "its config could not be fetched"
        )
        raise ModelLoadError(
            f"'{name}' is not in fastft's catalog and {where} ({type(error).__name__}: {error}).{hint}\n"
            "Fix: go online (unset HF_HUB_OFFLINE) so only its config.json is downloaded, or pass a local "
            "folder holding config.json, or a config object: estimate_vram(AutoConfig.from_pretrained(...)). "
            "For a gated model accept its licence and log in (hf auth login). `fastft models` lists the "
            "architectures known offline."
        ) from error
    return config


@functools.lru_cache(maxsize=64)
def _inventory_of_config_json(model_type: str, config_json: str, name: str) -> ModelInventory:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **json.loads(config_json))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return _walk(model, config, name, loaded=None)


def _inventory_of_config(config, name: str) -> ModelInventory:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    fields = text_config.to_diff_dict() if hasattr(text_config, "to_diff_dict") else text_config.to_dict()
    fields = {
        k: v for k, v in fields.items() if k not in ("model_type", "transformers_version", "architectures")
    }
    fields.pop("quantization_config", None)
    try:
        return _inventory_of_config_json(
            text_config.model_type, json.dumps(fields, sort_keys=True, default=str), name
        )
    except ValueError as error:
        if type(text_config).__module__.startswith("transformers_modules"):
            # a config class of the model's own code, which its caller chose to run (trust_remote_code=True):
            # its model class comes from the same code
            return _inventory_of_own_code(text_config, name)
        raise UnknownModelError(
            f"'{name}' has model_type '{text_config.model_type}', which is not a causal language model this "
            f"transformers can build ({error}). Fix: upgrade transformers, or estimate a supported architecture."
        ) from error


def _inventory_of_own_code(config, name: str) -> ModelInventory:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=True, dtype=torch.bfloat16)
    except Exception as error:  # noqa: BLE001 - the model's own code, whatever it raises
        raise UnknownModelError(
            f"'{name}': its own modelling code could not build the model ({type(error).__name__}: {error}). "
            "Fix: check that code with AutoModelForCausalLM.from_config(config, trust_remote_code=True)."
        ) from error
    return _walk(model, config, name, loaded=None)


def _inventory_of_loaded(model: torch.nn.Module) -> ModelInventory:
    from fastft.runtime.model_state import base_model  # imports torch

    base = base_model(model)
    info = getattr(model, "fastft_info", None) or getattr(base, "fastft_info", None)
    name = getattr(info, "name", None) or getattr(base.config, "name_or_path", "") or base.config.model_type
    return _walk(base, base.config.get_text_config(), name, loaded=_loaded_state(model, base))


# -- walking modules --------------------------------------------------------------------------------


def _short_name(full_name: str) -> str:
    parts = full_name.split(".")
    return parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]


def _walk(model: torch.nn.Module, config, name: str, loaded: LoadedModelState | None) -> ModelInventory:
    import torch

    from fastft.models.lora import linear_layer_names

    output = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    targetable = set(linear_layer_names(model))
    linears: list[LinearInfo] = []
    linear_weights: set[int] = set()
    linear_biases: set[int] = set()
    expert_owners: set[str] = set()
    moe_layers: set[int] = set()
    for full, module in model.named_modules():
        if any(part.startswith("lora_") for part in full.split(".")):
            continue
        match = _LAYER.search(full + ".")
        layer = int(match.group(1)) if match else None
        if full.endswith("experts") and next(module.parameters(recurse=False), None) is not None:
            expert_owners.add(full)
            if layer is not None:
                moe_layers.add(layer)
        if isinstance(module, torch.nn.Linear) and module is not output:
            name_ = full.removesuffix(".base_layer")
            short = _short_name(full)
            router = short == "router" or (short == "gate" and _has_experts_sibling(model, name_))
            linears.append(
                LinearInfo(
                    name=name_,
                    short=short,
                    in_features=module.in_features,
                    out_features=module.out_features,
                    bias=module.bias is not None,
                    layer=layer,
                    lora_targetable=short in targetable and not router,
                )
            )
            linear_weights.add(id(module.weight))
            if module.bias is not None:
                linear_biases.add(id(module.bias))

    linear_params = head_params = embedding_params = expert_params = other_params = 0
    seen: set[int] = set()  # tied weights count once
    for full, parameter in model.named_parameters(remove_duplicate=False):
        if "lora_" in full or id(parameter) in seen or id(parameter) in linear_biases:
            continue  # adapters are not base weights; linear biases are counted from LinearInfo.bias
        seen.add(id(parameter))
        count = _logical_numel(parameter)
        if embedding is not None and parameter is embedding.weight:
            embedding_params += count  # a tied head is this same table
        elif output is not None and parameter is output.weight:
            head_params += count
        elif id(parameter) in linear_weights:
            linear_params += count
        elif full.rsplit(".", 1)[0] in expert_owners:
            expert_params += count
        else:
            other_params += count

    layers = _layers(model, linears, moe_layers, int(config.hidden_size))
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    q_proj = next((linear for linear in linears if linear.short == "q_proj"), None)
    head_dim = int(getattr(config, "head_dim", None) or 0) or (
        q_proj.out_features // heads if q_proj else int(config.hidden_size) // heads
    )
    experts = int(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0)
    moe_intermediate = int(
        getattr(config, "moe_intermediate_size", None)
        or (getattr(config, "intermediate_size", 0) if experts else 0)
    )
    return ModelInventory(
        name=name,
        model_type=config.model_type,
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=getattr(config, "max_position_embeddings", None),
        tied_embeddings=head_params == 0,
        experts=experts,
        experts_per_token=int(getattr(config, "num_experts_per_tok", 0) or 0) if experts else 0,
        moe_intermediate=moe_intermediate if experts else 0,
        hidden_act=getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None),
        linears=tuple(linears),
        layers=layers,
        linear_params=linear_params,
        head_params=head_params,
        embedding_params=embedding_params,
        expert_params=expert_params,
        other_params=other_params,
        loaded=loaded,
    )


def _has_experts_sibling(model: torch.nn.Module, full_name: str) -> bool:
    parent = model.get_submodule(full_name.rsplit(".", 1)[0]) if "." in full_name else model
    return hasattr(parent, "experts")


def _logical_numel(parameter: torch.Tensor) -> int:
    """Elements of the unquantised weight (a packed 4-bit tensor holds two per byte)."""
    return weight_formats.of_parameter(parameter).logical_numel(parameter)


def _layers(
    model: torch.nn.Module, linears: list[LinearInfo], moe_layers: set[int], hidden: int
) -> tuple[LayerInfo, ...]:
    by_layer: dict[int, list[LinearInfo]] = {}
    for linear in linears:
        if linear.layer is not None:
            by_layer.setdefault(linear.layer, []).append(linear)
    norms: dict[int, int] = {}
    qk_norm: set[int] = set()
    for full, parameter in model.named_parameters():
        match = _LAYER.search(full)
        if not match or "lora_" in full or not full.endswith("norm.weight"):
            continue
        index = int(match.group(1))
        if full.endswith(("q_norm.weight", "k_norm.weight")):
            qk_norm.add(index)
        elif parameter.dim() == 1 and parameter.numel() == hidden:
            norms[index] = norms.get(index, 0) + 1
    layers = []
    for index in sorted(set(by_layer) | set(norms)):
        own = tuple(by_layer.get(index, ()))
        shared = [
            linear for linear in own if ".shared_expert." in linear.name and linear.short == "gate_proj"
        ]
        layers.append(
            LayerInfo(
                index=index,
                linears=own,
                norms=norms.get(index, 0),
                qk_norm=index in qk_norm,
                moe=index in moe_layers,
                shared_expert_intermediate=shared[0].out_features if shared else 0,
            )
        )
    return tuple(layers)


# -- a loaded model's real state ---------------------------------------------------------------------


def _quant_constant_bytes(parameter: torch.Tensor) -> int:
    """Bytes of a quantised weight's constants: absmax (and its nested state), codebook, int8 row scales, FP8
    channel scales."""
    import torch

    total = 0
    weight_format, state = weight_formats.frozen_state(parameter)
    if (
        weight_format.quantized
        and weight_format.state_attribute is None
        and getattr(parameter, "SCB", None) is None
    ):
        # the scales live on the layer, not the weight (FP8's `weight_scale`): counted as its record says, for
        # every output row (FP8 experts [E, N, K]: E * N of them)
        return weight_format.constant_bytes(parameter.numel(), parameter.numel() // parameter.shape[-1])
    if state is not None:
        for tensor in (state.absmax, getattr(state, "code", None), getattr(state, "offset", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
        nested = getattr(state, "state2", None)
        if nested is not None:
            for tensor in (nested.absmax, getattr(nested, "code", None)):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
    scales = getattr(parameter, "SCB", None)
    if isinstance(scales, torch.Tensor):
        total += scales.numel() * scales.element_size()
    return total


def _loaded_state(model: torch.nn.Module, base: torch.nn.Module) -> LoadedModelState:
    import torch

    from fastft.runtime.model_state import state_of

    quantized = []  # the quantised formats its weights are stored in
    weight_bytes = constants = lora_params = lora_bytes = 0
    dtypes: dict[torch.dtype, int] = {}
    seen: set[int] = set()
    for full, parameter in model.named_parameters():
        if id(parameter) in seen:
            continue
        seen.add(id(parameter))
        nbytes = parameter.numel() * parameter.element_size()
        if "lora_" in full:
            lora_params += parameter.numel()
            lora_bytes += nbytes
            continue
        weight_format = weight_formats.of_parameter(parameter)
        if weight_format.quantized:
            quantized.append(weight_format)
        else:
            dtypes[parameter.dtype] = dtypes.get(parameter.dtype, 0) + parameter.numel()
        weight_bytes += nbytes
        constants += _quant_constant_bytes(parameter)
    # a mix (an NF4 model's int8-stored buffers) is named by the first registered format: NF4 before int8
    found = [record.name for record in weight_formats.quantized() if record in quantized]
    quantization = found[0] if found else None
    compute = max(dtypes, key=dtypes.get) if dtypes else torch.bfloat16
    if quantization:
        info = getattr(model, "fastft_info", None) or getattr(base, "fastft_info", None)
        compute = getattr(info, "dtype", None) or torch.bfloat16
    # add_lora keeps the non-quantised weights as loaded (fp16 as bf16): the embeddings' dtype is the
    # residual stream's, before add_lora and after
    embedding = base.get_input_embeddings()
    residual = embedding.weight.element_size() if embedding is not None else 2
    settings = getattr(state_of(model), "lora", None)
    peft_config = getattr(model, "peft_config", {}).get("default") if hasattr(model, "peft_config") else None
    r = getattr(settings, "r", None) or getattr(peft_config, "r", None)
    targets = tuple(
        getattr(settings, "target_modules", ()) or sorted(getattr(peft_config, "target_modules", ()) or ())
    )
    fused = None
    if lora_params:
        try:
            from fastft.models.patch import is_fused

            fused = is_fused(model)
        except ImportError:
            fused = False
    return LoadedModelState(
        fused=fused,
        quantization=quantization,
        compute_dtype=compute,
        weight_bytes=weight_bytes,
        quant_constant_bytes=constants,
        residual_bytes=residual,
        lora_params=lora_params,
        lora_bytes=lora_bytes,
        lora_r=int(r) if r else None,
        lora_targets=targets,
        checkpointing=settings.gradient_checkpointing.resolved(cuda=True).kind if settings else None,
    )

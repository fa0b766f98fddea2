"""Models with random weights: a catalog architecture (or an embedded preset) built without downloading a
byte, for the benchmarks, the VRAM measurements and the tests. The one place such a model is built."""

from __future__ import annotations

import gc

import torch
from transformers import AutoModelForCausalLM

from fastft.models.catalog import CATALOG
from fastft.models.loading import load_model
from fastft.models.presets import PRESETS


def random_model(
    name: str, device: torch.device | str, dtype: torch.dtype, seed: int | None = None, **config
) -> torch.nn.Module:
    """A catalog architecture with random weights (transformers' init under the global RNG), built on
    `device`; or an embedded preset as `load_model` gives it. `config` overrides the catalog config's fields
    (``num_hidden_layers=2``: a per-layer ``layer_types`` list is cut to follow).

    With a `seed`, the weights are held once: built on the meta device, allocated on `device`, and filled in
    place from a generator of that seed (1-D tensors 1, the others N(0, 0.02), a matrix 1,024 rows at a
    time, so no full fp32 temporary of it exists): for a model too large to initialise twice in memory."""
    if name in PRESETS and not config and seed is None:
        model, _ = load_model(name, dtype=dtype, device=device)
        return model
    if name not in CATALOG:
        raise ValueError(f"unknown model {name!r}: use a preset ({', '.join(PRESETS)}) or a catalog hub id")
    settings = CATALOG[name].to_config()
    for key, value in config.items():
        setattr(settings, key, value)
    layers = config.get("num_hidden_layers")
    if layers is not None and isinstance(getattr(settings, "layer_types", None), list):
        settings.layer_types = settings.layer_types[:layers]
    if seed is None:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(settings, dtype=dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(settings, dtype=dtype)
    model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.fill_(1.0)
            else:
                for rows in parameter.split(1024):
                    rows.copy_(torch.randn(rows.shape, generator=generator, device=device) * 0.02)
    return model


def split_precision(precision: str):
    """``"nf4-fp16"`` -> ``("nf4", torch.float16)``: the base's precision and the compute dtype (bf16 unless a
    ``-fp16`` suffix, or the precision itself, says fp16 or fp32: what a GPU without bf16, a T4, computes in)."""
    base, _, compute = precision.partition("-")
    name = compute or base
    return base, {"fp32": torch.float32, "fp16": torch.float16}.get(name, torch.bfloat16)


def build_random_model(name: str, precision: str = "bf16", device: torch.device | str = "cuda"):
    """The architecture of `name` (catalog hub id or preset) with random weights on `device`.

    For "nf4" (NF4, double quantisation, blocks of 64: what `load_model(load_in_4bit=True)` asks
    bitsandbytes for) and "int8", every `nn.Linear` but the output head is replaced by its bitsandbytes
    layer, quantised from the random weights; the model is then marked as loaded in 4/8-bit, so `add_lora`
    prepares it exactly as it prepares a quantised hub model.

    The quantised weights are made as loading makes them: each from a host copy, one at a time, after
    every 16-bit projection has left the device. Quantised where the whole 16-bit model lay, each small
    persistent NF4 tensor took the tail of a freed 16-bit weight's segment (best fit), and those segments
    could never be released: on Qwen2.5-1.5B, 1.2 GiB of a 6 GiB cap sat free in pieces of 26 MiB when a
    long-context step asked for 225 MiB (2026-12-06, the out-of-memory observer of `fastft bench
    long-context --snapshot`), something a loaded hub model does not have.
    """
    device = torch.device(device)
    precision, dtype = split_precision(precision)
    model = random_model(name, device, dtype)
    model.config.use_cache = False
    if precision in ("nf4", "int8"):
        quantize_in_place(model, precision, dtype, device)
    gc.collect()
    torch.cuda.empty_cache()
    return model


def quantize_in_place(
    model: torch.nn.Module, precision: str, dtype: torch.dtype, device: torch.device
) -> None:
    """Every `nn.Linear` of `model` but the output head replaced by its bitsandbytes layer ("nf4" or "int8"),
    quantised from its weights (see `build_random_model`)."""
    try:  # bitsandbytes is an optional dependency (fastft[gpu])
        import bitsandbytes as bnb
    except ImportError as error:
        raise RuntimeError(f"{precision} needs bitsandbytes: pip install 'fastft[gpu]'.") from error
    output = model.get_output_embeddings()
    targets = [
        (full, module)
        for full, module in model.named_modules()
        if type(module) is torch.nn.Linear and module is not output
    ]
    with torch.no_grad():  # every 16-bit projection to the host first, so its device segments are released
        for _, module in targets:
            module.weight.data = module.weight.data.cpu()
    gc.collect()
    torch.cuda.empty_cache()
    for index, (full, module) in enumerate(targets):
        targets[index] = None  # its host copy goes with the module
        bias = module.bias is not None
        if precision == "nf4":
            layer = bnb.nn.Linear4bit(
                module.in_features,
                module.out_features,
                bias=bias,
                compute_dtype=dtype,
                compress_statistics=True,
                quant_type="nf4",
                device="meta",
            )
            weight = bnb.nn.Params4bit(
                module.weight.data,
                requires_grad=False,
                compress_statistics=True,
                quant_type="nf4",
                blocksize=64,
                module=layer,
            )
            layer.weight = weight.to(device)  # quantises on the way
        else:
            layer = bnb.nn.Linear8bitLt(
                module.in_features,
                module.out_features,
                bias=bias,
                has_fp16_weights=False,
                threshold=6.0,
                device="meta",
            )
            weight = bnb.nn.Int8Params(module.weight.data, requires_grad=False, has_fp16_weights=False)
            layer.weight = weight._quantize(device)
        if bias:
            layer.bias = torch.nn.Parameter(module.bias.data, requires_grad=False)
        model.set_submodule(full, layer)
        del module, weight
    if precision == "nf4":
        model.is_loaded_in_4bit = True
    else:
        model.is_loaded_in_8bit = True


__all__ = ["build_random_model", "quantize_in_place", "random_model", "split_precision"]

"""`load_model`: an embedded preset, a local folder or a hub id → (model, tokenizer).

Presets are built from their config with seeded weights. Folders and hub ids go through the
real ``from_pretrained`` path (safetensors only, no remote code unless asked). FP8 loading
(`load_in_fp8`) reads the 16-bit checkpoint to the host and makes each projection FP8 on the device, one at a
time (`fastft.models.fp8`). 4-bit loading is
NF4 with double quantisation through bitsandbytes; without CUDA its CPU backend quantises and
dequantises (slowly, with a one-line notice), so a notebook runs anywhere. A preset asked for in 4/8-bit
is saved to a temporary folder and loaded back through that same path, so there is one
quantisation code path.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import fastft.weight_formats as weight_formats
from fastft.atomic import recover_folder
from fastft.checks import whole_number
from fastft.data.hub import hub_offline_while_importing, offline_fix, offline_reason
from fastft.models.catalog import CATALOG, close_names
from fastft.models.errors import (  # noqa: F401  (re-exported: `fastft.ModelLoadError` is read from here)
    ModelLoadError,
    QuantizationError,
    RemoteCodeError,
    UnknownModelError,
    UnsupportedArchitectureError,
)
from fastft.models.lora import load_adapter
from fastft.models.presets import PRESETS, build_preset_model, load_preset_tokenizer
from fastft.models.remote_code import consent, from_pretrained

# Function-local imports: imported after the environment they read is set (environment variables, offline mode).


@dataclass(frozen=True)
class ModelInfo:
    """What fastft knows about a loaded model; attached to the instance as ``model.fastft_info``."""

    name: str
    source: str  # "preset", "local" or "hub"
    model_type: str
    dtype: torch.dtype
    quantization: (
        str | None
    )  # None (16/32-bit) or a quantised `fastft.weight_formats` name: "nf4", "int8", "fp8"
    max_seq_length: int


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """bf16 on a GPU that computes in it (sm80 and newer), fp16 on an older GPU (a T4), fp32 on the CPU."""
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda":
        # torch answers True on a T4 by default, where bf16 is only emulated (slowly; and Triton's kernels
        # do not compile bf16 for sm75)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16
        _say_fp16_once(device)
        return torch.float16
    return torch.float32


_SAID_FP16 = False


def _say_fp16_once(device: torch.device) -> None:
    global _SAID_FP16
    if not _SAID_FP16:
        _SAID_FP16 = True
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "This GPU"
        warnings.warn(
            f"{name} has no bf16 compute: fastft loads and trains in fp16 (loss scaling on the device, CUDA "
            "graphs kept). Pass dtype=torch.float32 for full precision.",
            stacklevel=4,
        )


def default_device() -> torch.device:
    """The GPU when there is one (under torchrun this rank's, ``cuda:LOCAL_RANK``), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return (
        torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        if "LOCAL_RANK" in os.environ
        else torch.device("cuda")
    )


def resolve_device(device: torch.device | str | None) -> torch.device:
    """`device` as a `torch.device` that this machine has (None: the GPU when there is one, else the CPU)."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ModelLoadError(
            f"device={device!r} is not a device: use 'cpu' or 'cuda' (or 'cuda:1')."
        ) from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"device={device!r}, but CUDA is not available here (torch {torch.__version__}, "
                f"{'built without CUDA' if torch.version.cuda is None else 'no GPU visible'}): use device='cpu', "
                "or leave device=None to pick the GPU when there is one."
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ModelLoadError(
                f"device={device!r}, but this machine has {torch.cuda.device_count()} GPU(s): use 'cuda:0'…"
            )
    elif resolved.type not in ("cpu", "mps", "xpu", "meta"):
        raise ModelLoadError(f"device={device!r}: use 'cpu' or 'cuda'.")
    return resolved


def _check_architecture(model_type: str, name: str, config) -> None:
    if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return
    hint = ""
    if getattr(config, "auto_map", None):
        hint = " It ships its own modelling code: pass trust_remote_code=True if you trust its author."
    raise UnsupportedArchitectureError(
        f"'{name}' has model_type '{model_type}', which is not a causal language model transformers "
        f"{_transformers_version()} can load.{hint} Supported model types include: "
        + ", ".join(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)[:40])
        + ", …"
    )


def _transformers_version() -> str:
    return transformers.__version__


def _quantization_config(
    load_in_4bit: bool, load_in_8bit: bool, compute_dtype: torch.dtype, device: torch.device
):
    """The `WeightFormat` the flags pick and what `from_pretrained` needs to load it (None: load as is)."""
    try:
        record = weight_formats.from_flags(load_in_4bit=load_in_4bit, load_in_8bit=load_in_8bit)
    except weight_formats.UnknownWeightFormatError as error:
        raise QuantizationError(str(error)) from None
    return record, _LOADERS[record.loader](record, compute_dtype, device)


def _load_in_dtype(record, compute_dtype: torch.dtype, device: torch.device):
    return None


def _bitsandbytes_config(record, compute_dtype: torch.dtype, device: torch.device):
    width, _, kind = record.label.partition(" ")  # "4-bit NF4" → "4-bit (NF4)", "8-bit" as is
    bits = f"{width} ({kind})" if kind else width

    try:
        # its CPU backend asks the hub for a kernel at import; an install that fails raises here
        with hub_offline_while_importing("bitsandbytes"):
            import bitsandbytes  # noqa: F401
    except ImportError as error:
        raise QuantizationError(
            f"{bits} loading needs bitsandbytes: pip install 'fastft[gpu]' (or pip install bitsandbytes)."
        ) from error
    from transformers import BitsAndBytesConfig

    if device.type == "cpu":
        warnings.warn(
            f"{bits} on the CPU runs through bitsandbytes' CPU backend, which is slow (every layer's weight is "
            "dequantised at each use); load_in_4bit=False is faster here, a CUDA GPU much faster.",
            stacklevel=4,
        )
    options = {
        key: compute_dtype if value == weight_formats.COMPUTE_DTYPE else value
        for key, value in record.loader_options
    }
    return BitsAndBytesConfig(**options)


# how each `WeightFormat.loader` loads: (record, compute dtype, device) → from_pretrained's
# quantization_config (None: plain weights in the compute dtype)
_LOADERS = {"dtype": _load_in_dtype, "bitsandbytes": _bitsandbytes_config, "fp8": _load_in_dtype}


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def load_model(
    name_or_path: str | os.PathLike,
    max_seq_length: int = 2048,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    trust_remote_code: bool = False,
    token: str | None = None,
    load_in_fp8: bool = False,
):
    """Load a causal LM and its tokenizer, ready for `add_lora`.

    `name_or_path` is an embedded preset (`fastft.PRESETS`: "tiny-llama", "tiny-qwen3", …),
    a local folder written by ``save_pretrained``, a LoRA adapter folder (`save_adapter`: its recorded base
    is loaded, then the adapter is attached, trainable; the model returned is then a `peft.PeftModel`),
    or a Hugging Face hub id.
    `dtype=None` picks bf16 on a GPU that has it (fp16 on older GPUs) and fp32 on the CPU.
    `max_seq_length` is the longest sequence the model will be trained on; it becomes the
    tokenizer's ``model_max_length``.
    `load_in_fp8=True` stores the frozen projections (attention and MLP) as FP8 e4m3 with per-channel scales,
    made from the 16-bit checkpoint at load; their GEMMs run on FP8 tensor cores (L4, RTX 40xx, H100 and newer;
    refused on older cards; the CPU runs a dequantised reference). Norms, embeddings and the head stay 16-bit.
    Returns ``(model, tokenizer)``; ``model.fastft_info`` records how it was loaded.
    """
    whole_number("max_seq_length", max_seq_length, minimum=2, fix="It is a token count, e.g. 2048.")
    consent(trust_remote_code)
    device = resolve_device(device)
    if load_in_fp8:
        from fastft.models.fp8 import check_fp8_device

        if load_in_4bit or load_in_8bit:
            raise QuantizationError(
                "Choose one of load_in_fp8=True, load_in_4bit=True or load_in_8bit=True, not several."
            )
        check_fp8_device(device)
    dtype = _resolve_dtype(dtype, device)
    weight_format, quantization = _quantization_config(load_in_4bit, load_in_8bit, dtype, device)
    if load_in_fp8:
        weight_format = weight_formats.get("fp8")
    # an FP8 model is read in 16-bit to the host and made FP8 on the device one projection at a time
    load_device = torch.device("cpu") if load_in_fp8 else device
    name = os.fspath(name_or_path)

    if name in PRESETS:
        tokenizer = load_preset_tokenizer(name)
        model = build_preset_model(
            PRESETS[name],
            len(tokenizer),
            dtype,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
        )
        source = "preset"
        if quantization is not None:
            with tempfile.TemporaryDirectory(prefix="fastft-preset-") as folder:
                model.save_pretrained(folder)
                model = _from_pretrained(folder, name, dtype, quantization, device, False, None)
        elif not load_in_fp8:
            model.to(device)
        # the name PEFT writes as the adapter's base_model_name_or_path, and load_model reads back
        model.config.name_or_path = model.name_or_path = name
    elif recover_folder(name).is_dir() and _is_adapter_folder(
        name
    ):  # a save killed half-way: finished or undone
        return _load_adapter_folder(
            name,
            max_seq_length,
            load_in_4bit,
            load_in_8bit,
            dtype,
            device,
            trust_remote_code,
            token,
            load_in_fp8,
        )
    elif Path(name).expanduser().is_dir():
        folder = str(Path(name).expanduser())
        source = "local"
        model = _from_pretrained(folder, name, dtype, quantization, load_device, trust_remote_code, None)
        tokenizer = _load_tokenizer(folder, name, trust_remote_code, None)
    elif _looks_like_hub_id(name):
        source = "hub"
        offline = offline_reason() is not None  # then only the local cache is read: no retries
        model = _from_pretrained(
            name, name, dtype, quantization, load_device, trust_remote_code, token, offline
        )
        tokenizer = _load_tokenizer(name, name, trust_remote_code, token, offline)
    else:
        raise UnknownModelError(_unknown_model_message(name))

    if load_in_fp8:
        from fastft.models.fp8 import convert_to_fp8

        convert_to_fp8(model, device)
        model.is_loaded_in_fp8 = True  # how `fastft.weight_formats.of_model` tells the format
    _prepare_tokenizer(tokenizer, model, max_seq_length)
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions and max_seq_length > max_positions:
        warnings.warn(
            f"max_seq_length={max_seq_length} is longer than the {max_positions} positions "
            f"'{name}' was trained on; quality beyond that length is not guaranteed.",
            stacklevel=2,
        )
    model.fastft_info = ModelInfo(
        name=name,
        source=source,
        model_type=model.config.model_type,
        dtype=dtype,
        quantization=weight_format.name if weight_format.quantized else None,
        max_seq_length=max_seq_length,
    )
    return model, tokenizer


def _is_adapter_folder(name: str) -> bool:
    folder = Path(name).expanduser()
    return (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file()


def _load_adapter_folder(
    name,
    max_seq_length,
    load_in_4bit,
    load_in_8bit,
    dtype,
    device,
    trust_remote_code,
    token,
    load_in_fp8=False,
):
    """A LoRA adapter folder (`save_adapter`, PEFT's ``save_pretrained``): its base (``base_model_name_or_path``,
    a preset, folder or hub id) loaded as `load_model` loads it, the adapter attached trainable, and the
    folder's tokenizer if it holds one."""

    folder = Path(name).expanduser()
    base_name = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base_name:
        raise ModelLoadError(
            f"'{name}' is a LoRA adapter that does not record its base model (base_model_name_or_path is "
            "empty). Fix: load the base with load_model(base_name) and attach the adapter with "
            f"fastft.models.lora.load_adapter(model, '{name}') (or peft.PeftModel.from_pretrained)."
        )
    model, tokenizer = load_model(
        base_name,
        max_seq_length=max_seq_length,
        load_in_4bit=load_in_4bit,
        load_in_8bit=load_in_8bit,
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
        token=token,
        load_in_fp8=load_in_fp8,
    )
    if (folder / "tokenizer_config.json").is_file():
        tokenizer = _load_tokenizer(str(folder), name, trust_remote_code, None)
        _prepare_tokenizer(tokenizer, model, max_seq_length)
    info = model.fastft_info
    model = load_adapter(model, folder)
    model.fastft_info = info
    return model, tokenizer


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, str):
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
        resolved = getattr(torch, aliases.get(dtype, dtype), None)
        if not isinstance(resolved, torch.dtype):
            raise ModelLoadError(f"Unknown dtype '{dtype}': use 'bfloat16', 'float16' or 'float32'.")
        return resolved
    return dtype


def _unknown_model_message(name: str) -> str:
    close = close_names(name, list(PRESETS) + list(CATALOG))
    suggestion = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"'{name}' is not an embedded preset, an existing folder, or a hub id of the form 'org/name'."
        f"{suggestion} Presets: {', '.join(PRESETS)}."
    )


def _from_pretrained(source, name, dtype, quantization, device, trust_remote_code, token, offline=False):
    try:
        config = from_pretrained(
            AutoConfig, source, name, trust_remote_code, token=token, local_files_only=offline
        )
    except RemoteCodeError:
        raise
    except ValueError as error:
        raw = _raw_config(source, token)
        if "model_type" in raw:
            raise UnsupportedArchitectureError(
                f"'{name}' has model_type '{raw['model_type']}', which transformers {_transformers_version()} "
                "does not know. Fix: upgrade transformers (pip install -U transformers)."
            ) from error
        raise ModelLoadError(f"Could not read the config of '{name}': {error}") from error
    except OSError as error:
        if offline:
            raise ModelLoadError(offline_fix(name)) from error
        raise ModelLoadError(
            f"Could not load '{name}': {error}\nFix: check the id or path; for a gated hub model accept its "
            "licence and log in (hf auth login); offline, download it first and pass the local folder."
        ) from error
    if not trust_remote_code:
        _check_architecture(config.model_type, name, config)
    # Weights go straight to their device (no full copy in host memory first).
    target = torch.cuda.current_device() if device.type == "cuda" and device.index is None else str(device)
    kwargs = dict(
        dtype=dtype,
        token=token,
        use_safetensors=True,
        device_map={"": target},
        local_files_only=offline,
        # No hub kernels (transformers >= 5.25 turns them on wherever the `kernels` package is installed):
        # they are compiled code fetched from the hub at load time, and fastft's fused forwards replace the
        # modules they would serve. A user who wants them calls `model.set_use_kernels(True)`; fastft's
        # patches survive that (`fastft.models.patch`).
        use_kernels=False,
    )
    if quantization is not None:
        kwargs.update(quantization_config=quantization)
    try:
        model = from_pretrained(AutoModelForCausalLM, source, name, trust_remote_code, **kwargs)
    except OSError as error:
        raise ModelLoadError(
            f"Could not load the weights of '{name}': {error}\nFix: fastft loads safetensors weights only "
            "(never pickled .bin files); convert the checkpoint with save_pretrained(safe_serialization=True)."
        ) from error
    if quantization is not None and device.type == "cpu":
        _keep_nf4_layout(model)
    return model


def _keep_nf4_layout(model) -> None:
    """Turn off bitsandbytes' AVX512-BF16 inference path on the CPU: at a layer's first eval-mode call it repacks
    the NF4 weight in place into a CPU layout (and fails outright unless the layer's output width is a multiple
    of 32), which fastft's NF4 kernels and the exporters then read as plain NF4. Its dequantise-and-matmul
    fallback keeps the weight as loaded."""
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False


def _raw_config(source, token) -> dict:
    try:
        return PretrainedConfig.get_config_dict(source, token=token)[0]
    except (OSError, ValueError):
        return {}


def _load_tokenizer(source, name, trust_remote_code, token, offline=False):
    try:
        return from_pretrained(
            AutoTokenizer, source, name, trust_remote_code, token=token, local_files_only=offline
        )
    except RemoteCodeError:
        raise
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"Could not load a tokenizer for '{name}': {error}\nFix: save the tokenizer beside the weights "
            "(tokenizer.save_pretrained(folder))."
        ) from error


def _prepare_tokenizer(tokenizer, model, max_seq_length: int) -> None:
    """Give the tokenizer a pad token and the run's length; never resize the model's embeddings."""
    tokenizer.model_max_length = max_seq_length
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None and model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id

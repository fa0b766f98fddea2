"""Unsloth's saving methods on a fastft model: ``model.save_pretrained_merged(dir, tokenizer,
save_method=...)``, ``model.save_pretrained_gguf(dir, tokenizer, quantization_method=...)`` and the
``push_to_hub_*`` variants, bound to each model `FastLanguageModel` returns (per instance: no class is
patched), so an Unsloth notebook runs unchanged to its last cell.

The ``push_to_hub_*`` methods never connect: they need network access and a Hugging Face token, and say so
with the local command that does the same.
"""

from __future__ import annotations

import os
import types
import warnings
from pathlib import Path

import torch

from fastft import weight_formats
from fastft.atomic import written_by_fastft
from fastft.export import save_gguf, save_ollama
from fastft.export.ollama import modelfile
from fastft.export.writer import K_QUANTS, GGUFExportError, k_quantizer
from fastft.models.hf_save import save_adapter, save_merged
from fastft.models.lora import save_pretrained_offline

# Unsloth's quantization_method names → fastft's
GGUF_METHODS = {
    "not_quantized": "bf16",
    "fast_quantized": "q8_0",
    "quantized": "q4_k_m",
    "f32": "f32",
    "f16": "f16",
    "bf16": "bf16",
    "q8_0": "q8_0",
    "q4_0": "q4_0",
    "q4_k_m": "q4_k_m",
    "q5_k_m": "q5_k_m",
    "q4_k_s": "q4_k_s",
    "q5_k_s": "q5_k_s",
    "q6_k": "q6_k",
    "q3_k_m": "q3_k_m",
    "q2_k": "q2_k",
}
# Unsloth arguments of the save methods that do not apply here (memory knobs of its own converter)
_IGNORED = {
    "maximum_memory_usage",
    "temporary_location",
    "safe_serialization",
    "max_shard_size",
    "first_conversion",
}


class HubUploadError(RuntimeError):
    """Uploading needs network access and a token; fastft does not upload (the message gives the way)."""


def save_pretrained_merged(
    model, save_directory, tokenizer=None, save_method: str = "merged_16bit", **kwargs
):
    """Unsloth's ``save_pretrained_merged``: ``"merged_16bit"`` writes the merged 16-bit model
    (`fastft.save_merged`), ``"lora"`` the adapter (`fastft.save_adapter`). Returns the folder. As Unsloth
    does, the merged files may go into a folder that holds other files (the adapter ``model.save_pretrained``
    wrote there): they are kept, and a file of the same name with other bytes is refused, naming it."""

    _refuse_push(kwargs, "save_pretrained_merged", "push_to_hub_merged")
    overwrite = bool(kwargs.pop("overwrite", False))
    _drop(kwargs, "save_pretrained_merged")
    if save_method == "lora":
        return save_adapter(model, save_directory, tokenizer, overwrite=overwrite)
    if save_method == "merged_16bit":
        dtype = torch.float16 if getattr(model, "dtype", None) == torch.float16 else torch.bfloat16
        base_format = weight_formats.of_model(model)
        if base_format.quantized and base_format.merge != "refuse":  # an 8-bit base: save_merged refuses it
            warnings.warn(
                f"save_pretrained_merged: the base is {base_format.label}, so the adapter is merged into its "
                f"dequantised {base_format.name.upper()} weights (the original 16-bit weights are not recovered). "
                f"For a merge on them, load the adapter folder with {base_format.load_flag}=False and save again.",
                stacklevel=2,
            )
        # beside=True: Unsloth writes the merged files into the folder `model.save_pretrained` filled with the
        # adapter (gpt-oss notebook); fastft keeps every file there and refuses to replace one that differs
        folder = save_merged(
            model, save_directory, tokenizer, dtype=dtype, overwrite=overwrite, dequantize=True, beside=True
        )
        _warn_if_merged_beside_adapter(folder, "save_pretrained_merged")
        return folder
    if save_method == "mxfp4":
        raise ValueError(
            "save_method='mxfp4': fastft does not write MXFP4 checkpoints. Use save_method='merged_16bit' (the "
            "merged model in 16-bit, which vLLM and transformers load), or save_method='lora' for the adapter."
        )
    if save_method in ("merged_4bit", "merged_4bit_forced"):
        raise ValueError(
            f"save_method={save_method!r}: fastft does not write merged 4-bit models (merging into 4-bit weights "
            "loses the adapter's precision). Use save_method='merged_16bit', or save_pretrained_gguf(dir, "
            "tokenizer, quantization_method='q4_k_m') for a small 4-bit file."
        )
    raise ValueError(f"save_method={save_method!r}: choose 'merged_16bit' or 'lora'.")


def save_pretrained_gguf(
    model, save_directory, tokenizer=None, quantization_method="fast_quantized", **kwargs
):
    """Unsloth's ``save_pretrained_gguf``: a folder with ``model.<QUANT>.gguf`` per quantisation and an Ollama
    ``Modelfile`` (`fastft.save_ollama`), each file checked after it is written. `quantization_method` is
    one name or a list (Unsloth's "not_quantized" = bf16, "fast_quantized" = q8_0, "quantized" = q4_k_m).
    Saving into a folder that already holds an export adds the new ``model.<QUANT>.gguf`` beside the others
    (the Modelfile then names the newest); nothing else there is touched. llama.cpp's K-quants (q4_k_m, …)
    need its ``llama-quantize`` on PATH: without it the call fails before writing, naming the fix and the
    nearest type fastft writes itself. Returns the `GGUFExport` (a list of them for a list of methods).

    As Unsloth's `FastModel` notebooks call it (``save_pretrained_gguf(dir, quantization_type="Q8_0")``):
    `quantization_type` names the method too, and without `tokenizer` the one ``from_pretrained`` returned
    with this model is used (the same object ``get_chat_template`` changed in place, so its template)."""

    quantization_type = kwargs.pop("quantization_type", None)
    if quantization_type is not None:
        if quantization_method != "fast_quantized":
            raise ValueError(
                f"save_pretrained_gguf: quantization_method={quantization_method!r} and "
                f"quantization_type={quantization_type!r} both name the GGUF type: pass one of them."
            )
        quantization_method = quantization_type
    if tokenizer is None:
        tokenizer = getattr(model, "fastft_tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            "save_pretrained_gguf needs the tokenizer: model.save_pretrained_gguf(dir, tokenizer, ...) (this model "
            "was not loaded by fastft.unsloth's from_pretrained, which would have given it one)."
        )
    _refuse_push(kwargs, "save_pretrained_gguf", "push_to_hub_gguf")
    overwrite = bool(kwargs.pop("overwrite", False))
    check = bool(kwargs.pop("check", True))
    _drop(kwargs, "save_pretrained_gguf")
    methods = [quantization_method] if isinstance(quantization_method, str) else list(quantization_method)
    unknown = [m for m in methods if str(m).lower() not in GGUF_METHODS]
    if unknown:
        raise ValueError(f"quantization_method {unknown[0]!r}: choose one of {', '.join(GGUF_METHODS)}.")
    names = [GGUF_METHODS[str(m).lower()] for m in methods]
    k_quants = [name for name in names if name in K_QUANTS]
    if k_quants and k_quantizer() is None:
        nearest = "q4_0" if k_quants[0].startswith(("q2", "q3", "q4")) else "q8_0"
        raise GGUFExportError(
            f"quantization_method={k_quants[0]!r} is a llama.cpp K-quant, made by its llama-quantize tool, which "
            "is not on PATH. Fix: install llama.cpp (a release from github.com/ggml-org/llama.cpp, `brew install "
            "llama.cpp`, or build it: llama-quantize lands in build/bin) and put llama-quantize on PATH, or "
            "`pip install llama-cpp-python`; or pass "
            f"quantization_method={nearest!r}, the nearest type fastft writes itself."
        )
    folder = Path(save_directory).expanduser()
    ours = folder.is_dir() and written_by_fastft(folder)  # an earlier save (GGUF, merged, adapter) is kept
    results = []
    for name in names:
        if not results and not ours:
            results.append(save_ollama(model, folder, tokenizer, name, check=check, overwrite=overwrite))
            continue
        target = folder / f"model.{name.upper()}.gguf"
        results.append(save_gguf(model, target, tokenizer, name, check=check, overwrite=overwrite))
        _point_modelfile(model, tokenizer, folder, target.name)
    # Unsloth keeps the Modelfile on the tokenizer; its Ollama notebooks print tokenizer._ollama_modelfile
    tokenizer._ollama_modelfile = (folder / "Modelfile").read_text(encoding="utf-8")
    return results[0] if isinstance(quantization_method, str) else results


def _point_modelfile(model, tokenizer, folder, gguf_name: str) -> None:
    """Rewrite the folder's Modelfile (fastft's) to import `gguf_name`."""

    (folder / "Modelfile").write_text(modelfile(model, tokenizer, f"./{gguf_name}"), encoding="utf-8")


def push_to_hub_merged(model, repo_id=None, tokenizer=None, save_method="merged_16bit", token=None, **kwargs):
    """Refused: uploading needs network access and a token; save locally and upload with the hub's CLI."""
    raise HubUploadError(
        _upload_message(
            "push_to_hub_merged",
            f"model.save_pretrained_merged('merged', tokenizer, save_method={save_method!r})",
            "merged",
            repo_id,
        )
    )


def push_to_hub_gguf(
    model, repo_id=None, tokenizer=None, quantization_method="fast_quantized", token=None, **kwargs
):
    """Refused: uploading needs network access and a token; save locally and upload with the hub's CLI."""
    raise HubUploadError(
        _upload_message(
            "push_to_hub_gguf",
            f"model.save_pretrained_gguf('gguf', tokenizer, quantization_method={quantization_method!r})",
            "gguf",
            repo_id,
        )
    )


def save_pretrained_ggml(model, save_directory=None, tokenizer=None, **kwargs):
    """Refused: Unsloth's LoRA-to-GGML conversion (llama.cpp's adapter format) is not written by fastft."""
    raise NotImplementedError(
        "save_pretrained_ggml converts the LoRA adapter to llama.cpp's adapter format, which fastft does not write. "
        "Use model.save_pretrained_gguf(dir, tokenizer) for the merged model as GGUF, or model.save_pretrained(dir) "
        "for the PEFT adapter (llama.cpp's convert_lora_to_gguf.py converts that folder)."
    )


def push_to_hub_ggml(model, *args, **kwargs):
    """Refused, as `save_pretrained_ggml` (and uploading needs network access and a token)."""
    save_pretrained_ggml(model)


def save_pretrained_torchao(model, save_directory=None, tokenizer=None, **kwargs):
    """Refused: fastft writes no torchao-quantised checkpoints."""
    raise NotImplementedError(
        "save_pretrained_torchao writes a torchao-quantised checkpoint, which fastft does not. Use "
        "model.save_pretrained_merged(dir, tokenizer, save_method='merged_16bit') (vLLM and transformers quantise "
        "it on load), or save_pretrained_gguf(dir, tokenizer, quantization_method='q8_0') for an 8-bit file."
    )


def _warn_if_merged_beside_adapter(folder: Path, method: str) -> None:
    """Warn when `folder` holds a merged model and an adapter (each kept, as Unsloth keeps them): transformers
    would load the merged weights and apply the adapter on top of them."""
    folder = Path(folder)
    if not (
        (folder / "adapter_config.json").is_file()
        and (folder / "config.json").is_file()
        and any(folder.glob("model*.safetensors"))
    ):
        return
    warnings.warn(
        f"{method}: '{folder}' now holds the merged model and the adapter side by side (both kept, as Unsloth keeps "
        "them). transformers' AutoModelForCausalLM.from_pretrained on that folder loads the merged weights and "
        "then applies the adapter on top, a second time; to serve the merged model, save it and the adapter into "
        "folders of their own (save_pretrained_merged('merged', ...), save_pretrained('lora')).",
        stacklevel=3,
    )


def save_pretrained(model, save_directory, *args, **kwargs):
    """The model's own ``save_pretrained`` (PEFT's for an adapter), with a warning where the adapter lands beside
    a merged model ``save_pretrained_merged`` wrote into the same folder (Unsloth's notebooks save both into
    ``"model"`` once their ``if False`` saves are switched on)."""
    # a PeftModel's adapter: fastft's save, which never looks the base up on the hub (`fastft.models.lora`)
    if hasattr(model, "peft_config"):
        result = save_pretrained_offline(model, save_directory, *args, **kwargs)
    else:
        result = type(model).save_pretrained(model, save_directory, *args, **kwargs)
    if isinstance(save_directory, (str, os.PathLike)):
        _warn_if_merged_beside_adapter(Path(save_directory), "save_pretrained")
    return result


def bind(model):
    """Give `model` (one instance) Unsloth's saving methods; returns it."""
    for function in (
        save_pretrained_merged,
        save_pretrained_gguf,
        push_to_hub_merged,
        push_to_hub_gguf,
        save_pretrained_ggml,
        push_to_hub_ggml,
        save_pretrained_torchao,
        save_pretrained,
    ):
        object.__setattr__(model, function.__name__, types.MethodType(function, model))
    return model


def _upload_message(method: str, save_call: str, folder: str, repo_id) -> str:
    repo = repo_id or "USER/REPO"
    return (
        f"{method} uploads to the Hugging Face hub, which needs network access and a token (token=... or the "
        f"HF_TOKEN variable); fastft does not upload. Save locally, then upload: {save_call}, then "
        f"`hf upload {repo} {folder}` (huggingface_hub's CLI) on a machine that is online."
    )


def _refuse_push(kwargs: dict, method: str, push_method: str) -> None:
    if kwargs.pop("push_to_hub", False):
        raise HubUploadError(
            f"{method}(push_to_hub=True) uploads, which needs network access and a token; fastft does not upload. "
            f"Save without push_to_hub, then upload the folder with `hf upload USER/REPO FOLDER` ({push_method} "
            "says the same)."
        )
    kwargs.pop("token", None)


def _drop(kwargs: dict, method: str) -> None:
    for name in sorted(kwargs):
        if name in _IGNORED:
            kwargs.pop(name)
            warnings.warn(f"{method}: '{name}' does not apply in fastft and is ignored.", stacklevel=3)
    if kwargs:
        raise TypeError(f"{method} got unexpected arguments: {sorted(kwargs)}")

"""Write a model as one GGUF file, tensor by tensor, atomically.

The header (metadata and the table of tensors: names, shapes, types) is written first from the model's
shapes alone; then each merged tensor is computed (`fastft.models.hf_save.merged_tensors`), converted to the
file's layout (`fastft.export.families`), quantised with the `gguf` package's quantisers and written before
the next one is made. The model is never copied whole: the extra host memory is one tensor and its encoding.

The file is written under a hidden temporary name beside `path` (``.NAME.xxxxxxxx.partial``, locked with
``flock`` while its writer lives), fsynced, checked (`fastft.export.check`) and only then renamed into place,
so `path` holds a complete, checked file or what it held before. A partial file whose writer was killed is
unlocked; the next `save_gguf` into that folder removes it and says so (`remove_stale_partials`). The space
the tensors need is checked before the first is written.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import os
import re
import shutil
import subprocess
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import gguf
import numpy as np
import torch

import fastft.weight_formats as weight_formats
from fastft.atomic import (
    DiskFullError,
    FolderInTheWayError,
    RemovedLeftoverWarning,
    expand,
    is_disk_full,
    read_manifest,
    unchanged,
)
from fastft.export.families import (
    convert_tensor,
    family_of,
    hyperparameters,
    rope_freq_factors,
    tensor_layout,
)
from fastft.export.vocab import build_vocab
from fastft.models.hf_save import merged_keys, merged_tensors
from fastft.runtime.model_state import base_model

# what fastft quantises itself (with the gguf package), and llama.cpp's K-quants (through llama-quantize)
QUANTIZATIONS = ("f32", "f16", "bf16", "q8_0", "q4_0")
K_QUANTS = {
    "q2_k": "Q2_K",
    "q3_k_m": "Q3_K_M",
    "q4_k_s": "Q4_K_S",
    "q4_k_m": "Q4_K_M",
    "q5_k_s": "Q5_K_S",
    "q5_k_m": "Q5_K_M",
    "q6_k": "Q6_K",
}
FASTFT_KEY = "fastft.version"  # marks a file fastft wrote (so it may replace it)
_PARTIAL = re.compile(r"^\..+\.[0-9a-f]{8}\.partial$")  # `temporary_sibling`'s names


class GGUFExportError(ValueError):
    """A GGUF export could not be done as asked; the message says why and what to do."""


@dataclass
class WrittenFile:
    """What `write_gguf` wrote: the file, its quantisation, and the tensors kept at another type than asked
    (name → type), e.g. a quantised tensor whose rows are not a multiple of the block size."""

    path: Path
    quantization: str
    tensors: int
    kept: dict[str, str] = field(default_factory=dict)


def normalise_quantization(quantization: str) -> str:
    """Lower-case name of a supported quantisation (``"Q8_0"`` → ``"q8_0"``), or `GGUFExportError`."""
    name = str(quantization).lower().replace("-", "_")
    name = {"fp16": "f16", "float16": "f16", "bfloat16": "bf16", "fp32": "f32", "float32": "f32"}.get(
        name, name
    )
    if name in QUANTIZATIONS or name in K_QUANTS:
        return name
    raise GGUFExportError(
        f"unknown GGUF quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)} (written by "
        f"fastft) or {', '.join(K_QUANTS)} (llama.cpp's K-quants, with llama-quantize on PATH)."
    )


def llama_quantize_path() -> str | None:
    """llama.cpp's ``llama-quantize`` (or the older ``quantize``) on PATH, or None."""
    return shutil.which("llama-quantize") or shutil.which("llama.cpp-quantize")


def k_quantizer() -> str | None:
    """What makes llama.cpp's K-quants here: the path of ``llama-quantize`` on PATH, else ``"llama-cpp-python"``
    where that package is installed (its binding of the same function), else None."""
    tool = llama_quantize_path()
    if tool is not None:
        return tool
    return "llama-cpp-python" if importlib.util.find_spec("llama_cpp") is not None else None


def _ggml_type(name: str):
    return {
        "f32": gguf.GGMLQuantizationType.F32,
        "f16": gguf.GGMLQuantizationType.F16,
        "bf16": gguf.GGMLQuantizationType.BF16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "q4_0": gguf.GGMLQuantizationType.Q4_0,
    }[name]


def _file_type(name: str) -> int:
    return {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "bf16": gguf.LlamaFileType.MOSTLY_BF16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    }[name]


def tensor_type(name: str, shape: tuple[int, ...], quantization: str, tied: bool) -> str:
    """The type one tensor is stored at, as llama.cpp's converter chooses: norms, biases, the router and
    RoPE factors in f32; a quantised tensor whose rows are not a multiple of the block size in f16; under
    q4_0 the output head (the embedding when tied) in q8_0, as llama-quantize keeps it at higher precision."""

    if len(shape) == 1 or ".ffn_gate_inp." in name or name.startswith("rope_freqs"):
        return "f32"
    if quantization in ("q8_0", "q4_0"):
        if quantization == "q4_0" and (name == "output.weight" or (tied and name == "token_embd.weight")):
            quantization = "q8_0"
        block = gguf.GGML_QUANT_SIZES[_ggml_type(quantization)][0]
        if shape[-1] % block:
            return "f16"
    return quantization


def _encode(tensor: torch.Tensor, kind: str) -> np.ndarray:
    """`tensor` in the file's encoding: float arrays for f32/f16, bytes for bf16 and the quants. A tensor
    already of the target type is written from its own memory, without a copy."""

    if kind == "f32":
        return tensor.float().contiguous().numpy()
    if kind == "f16":
        return tensor.to(torch.float16).contiguous().numpy()
    if kind == "bf16":
        # torch rounds to nearest-even like gguf.quants.BF16 (tests/export checks they agree)
        return tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint8)
    return gguf.quants.quantize(tensor.float().contiguous().numpy(), _ggml_type(kind))


def _nbytes(shape: tuple[int, ...], kind: str) -> tuple[tuple[int, ...], int]:
    """(shape as add_tensor_info takes it, bytes) for a tensor of torch `shape` stored as `kind`."""

    if kind in ("f32", "f16"):
        return shape, int(np.prod(shape)) * (4 if kind == "f32" else 2)
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, _ggml_type(kind))
    return byte_shape, int(np.prod(byte_shape))


def _tensor_shapes(model) -> list[tuple[str, tuple[int, ...]]]:
    """(key, logical shape) of every tensor of the merged model, in order, without computing any (NF4 weights
    report their unpacked shape)."""

    shapes = []
    for key, value in merged_keys(model):
        shapes.append((key, weight_formats.of_parameter(value).logical_shape(value)))
    return shapes


def write_gguf(
    model,
    path: str | os.PathLike,
    tokenizer,
    quantization: str = "q8_0",
    metadata: dict[str, object] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> WrittenFile:
    """Write `model` (a PEFT model, merged on the fly, or a plain transformers model) to the GGUF file
    `path` (no check, no rename: `save_gguf` does both). `metadata` adds or replaces entries (a value of
    None removes one); `progress(done, total)` is called after each tensor."""
    import gguf

    quantization = normalise_quantization(quantization)
    if quantization in K_QUANTS:
        raise GGUFExportError(f"write_gguf writes {', '.join(QUANTIZATIONS)}; save_gguf makes K-quants.")
    base = base_model(model)
    config = base.config
    family = family_of(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    vocab = build_vocab(tokenizer, config.vocab_size, family.model_type)
    entries: dict[str, tuple[object, str]] = {
        "general.name": (str(getattr(config, "_name_or_path", "") or family.model_type), "STRING"),
        "general.file_type": (int(_file_type(quantization)), "UINT32"),
        "general.quantization_version": (int(gguf.GGML_QUANT_VERSION), "UINT32"),
        FASTFT_KEY: (_fastft_version(), "STRING"),
    }
    for key, value, kind in hyperparameters(config, family) + vocab.entries():
        entries[key] = (value, kind)
    for key, value in (metadata or {}).items():
        if value is None:
            entries.pop(key, None)
        else:
            entries[key] = (value, entries.get(key, (None, _kind_of(value)))[1])

    path = expand(path)
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[family.arch]])
    for key, (value, kind) in entries.items():
        if key == "general.architecture":
            writer.kv_data[0][key] = gguf.GGUFValue(value, gguf.GGUFValueType.STRING)
            continue
        if kind == "ARRAY":
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, gguf.GGUFValueType[kind])

    planned: list[tuple[str, str]] = []  # (name, type) in write order
    kept: dict[str, str] = {}

    def plan(name: str, shape: tuple[int, ...]) -> None:
        kind = tensor_type(name, shape, quantization, tied)
        if kind != quantization and len(shape) > 1 and not name.startswith("rope_freqs"):
            kept[name] = kind
        info_shape, nbytes = _nbytes(shape, kind)
        raw = None if kind in ("f32", "f16") else _ggml_type(kind)
        dtype = {"f32": np.float32, "f16": np.float16}.get(kind, np.uint8)
        writer.add_tensor_info(name, info_shape, np.dtype(dtype), nbytes, raw_dtype=raw)
        planned.append((name, kind))

    factors = rope_freq_factors(config)
    if factors is not None:
        plan("rope_freqs.weight", tuple(factors.shape))
    for key, shape in _tensor_shapes(model):
        for name, gguf_shape in tensor_layout(config, family, key, shape):
            plan(name, gguf_shape)

    needed = sum(info.nbytes for info in writer.tensors[0].values())
    free = shutil.disk_usage(path.parent).free
    if needed > free:
        raise _disk_full(path, needed, free)
    writer.open_output_file(path)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        order = iter(planned)
        done = 0

        def put(name: str, tensor: torch.Tensor) -> None:
            nonlocal done
            expected, kind = next(order)
            if name != expected:  # the two passes over the state dict disagree: never write a shuffled file
                raise RuntimeError(f"GGUF writer: tensor {name!r} came where {expected!r} was planned")
            writer.write_tensor_data(_encode(tensor, kind))
            done += 1
            if progress is not None:
                progress(done, len(planned))

        if factors is not None:
            put("rope_freqs.weight", factors)
        with torch.no_grad():
            for key, value in merged_tensors(model):
                for name, tensor in convert_tensor(config, family, key, value):
                    put(name, tensor)
                del value
        if done != len(planned):
            raise RuntimeError(f"GGUF writer: {len(planned) - done} planned tensors were never written")
        writer.flush()
        for handle in writer.fout:
            os.fsync(handle.fileno())
    except OSError as error:  # numpy reports a full disk as "46784 requested and 8160 written", no errno
        if is_disk_full(error, path.parent):
            raise _disk_full(path, needed, shutil.disk_usage(path.parent).free) from error
        raise
    finally:
        writer.close()
    return WrittenFile(path=path, quantization=quantization, tensors=len(planned), kept=kept)


def require_llama_quantize(quantization: str) -> str:
    """The K-quantizer (`k_quantizer`), or `GGUFExportError` saying how to get one."""
    tool = k_quantizer()
    if tool is None:
        raise GGUFExportError(
            f"quantization {quantization!r} is one of llama.cpp's K-quants, made by its llama-quantize tool, "
            "which is not on PATH. Install llama.cpp (its build puts llama-quantize in build/bin) and add it to "
            "PATH, or `pip install llama-cpp-python` (fastft then quantizes through its binding), or choose a "
            f"quantization fastft writes itself: {', '.join(QUANTIZATIONS)}."
        )
    return tool


def quantize_with_llama_cpp(source: Path, destination: Path, quantization: str) -> None:
    """Run llama.cpp's llama-quantize (or llama-cpp-python's binding of it) to make a K-quant from a 16-bit
    GGUF file."""
    tool = require_llama_quantize(quantization)
    if tool == "llama-cpp-python":
        import llama_cpp  # optional: loads llama.cpp's shared library

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{K_QUANTS[quantization]}")
        code = llama_cpp.llama_model_quantize(
            str(source).encode(), str(destination).encode(), ctypes.byref(params)
        )
        if code != 0:
            raise GGUFExportError(
                f"llama-cpp-python's llama_model_quantize failed ({code}) making {quantization}"
            )
        return
    result = subprocess.run(
        [tool, str(source), str(destination), K_QUANTS[quantization]],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise GGUFExportError(
            f"llama-quantize failed ({result.returncode}) making {quantization}: {result.stderr.strip()[-600:]}"
        )


def _disk_full(path: Path, needed: int, free: int) -> DiskFullError:
    error = DiskFullError(errno.ENOSPC, f"{path} needs {needed} bytes, {free} are free")
    error.needed, error.free = needed, free
    return error


def temporary_sibling(path: Path, claims: list | None = None) -> Path:
    """A hidden name beside `path` for the file being written (removed unless renamed into place). With
    `claims` (a list), the file is created and held under an exclusive ``flock`` whose open file is appended
    to `claims` (close them when done): while it is held, `remove_stale_partials` leaves the file alone."""
    while True:
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.partial"
        if claims is None:
            return tmp
        handle = open(tmp, "xb")  # noqa: SIM115 - held until the save ends
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except ImportError:  # no flock (Windows): stale partials are never judged dead there
            pass
        with contextlib.suppress(FileNotFoundError):  # a cleaner removed it before the lock: take another
            if os.path.samestat(os.fstat(handle.fileno()), os.stat(tmp)):
                claims.append(handle)
                return tmp
        handle.close()


def remove_stale_partials(folder: Path) -> list[Path]:
    """Remove the hidden partial files (`temporary_sibling`) in `folder` whose writer is gone (no process
    holds their lock: a save that was killed), warning with their names; returns them."""
    try:
        import fcntl
    except ImportError:
        return []
    removed = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not _PARTIAL.match(path.name) or path.is_symlink() or not path.is_file():
            continue
        try:
            with open(path, "rb") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while its writer lives
                size = os.fstat(handle.fileno()).st_size
                path.unlink()
        except OSError:
            continue
        removed.append((path, size))
    if removed:
        names = ", ".join(f"{path.name} ({size} bytes)" for path, size in removed)
        warnings.warn(
            f"removed {len(removed)} partial file(s) that an interrupted save_gguf left in {folder}: {names}",
            RemovedLeftoverWarning,
            stacklevel=3,
        )
    return [path for path, _ in removed]


def check_file_destination(path: Path, overwrite: bool) -> None:
    """Refuse to replace a file fastft did not write, unless `overwrite`: in a folder fastft saved, one its
    manifest lists must be unchanged since; elsewhere a GGUF must carry fastft's key."""
    if path.is_dir():
        raise FolderInTheWayError(
            f"{path} is a folder: save_gguf writes one file. Name a file, e.g. {path}/model.gguf"
        )
    if not path.exists() or overwrite:
        return
    record = (read_manifest(path.parent) or {}).get(path.name)
    if record is not None:
        if unchanged(path, record):
            return
        raise FolderInTheWayError(
            f"{path} changed since fastft wrote it: saving there would replace it. Pick a new name, or pass "
            "overwrite=True."
        )
    if not written_by_fastft(path):
        raise FolderInTheWayError(
            f"{path} already exists and was not written by fastft: saving there would replace it. Pick a new "
            "name, or pass overwrite=True."
        )


def written_by_fastft(path: Path) -> bool:
    """Whether `path` is a GGUF file that fastft wrote (it carries ``fastft.version``)."""

    try:
        return FASTFT_KEY in gguf.GGUFReader(path).fields
    except Exception:  # noqa: BLE001 - not a GGUF file (or unreadable): not ours
        return False


def remove_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _fastft_version() -> str:
    try:
        return version("fastft")
    except PackageNotFoundError:
        return "unknown"


def _kind_of(value) -> str:
    if isinstance(value, bool):
        return "BOOL"
    if isinstance(value, int):
        return "UINT32"
    if isinstance(value, float):
        return "FLOAT32"
    if isinstance(value, (list, tuple)):
        return "ARRAY"
    return "STRING"

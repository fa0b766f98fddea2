"""`save_gguf` and `save_ollama`: the trained model as a file llama.cpp, Ollama and LM Studio run, checked.

Every export is read back before it is kept (`fastft.export.check`): written under a temporary name, run
from the file and compared with the merged model; a file that fails is deleted and `GGUFCheckError` says
what differs. ``check=False`` skips it (the file is still written atomically).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastft.atomic import (
    expand,
    explain_write_error,
    fsync_folder,
    record_file,
    replace_folder_atomically,
)
from fastft.export.check import ExportCheck, GGUFCheckError, check_gguf, check_prompts
from fastft.export.ollama import modelfile
from fastft.export.writer import (
    K_QUANTS,
    check_file_destination,
    normalise_quantization,
    quantize_with_llama_cpp,
    remove_quietly,
    remove_stale_partials,
    require_llama_quantize,
    temporary_sibling,
    write_gguf,
)


@dataclass
class GGUFExport:
    """A written GGUF file: where, at which quantisation, its read-back check (None with ``check=False``),
    the tensors kept at another type than asked, and the Ollama Modelfile when `save_ollama` wrote one."""

    path: Path
    quantization: str
    check: ExportCheck | None
    kept: dict[str, str]
    modelfile: Path | None = None

    def __str__(self) -> str:
        verdict = self.check.message() if self.check is not None else "not checked (check=False)"
        return f"{self.path}: {verdict}"


def save_gguf(
    model,
    path: str | os.PathLike,
    tokenizer,
    quantization: str = "q8_0",
    check: bool = True,
    prompts: list | None = None,
    overwrite: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    metadata: dict[str, object] | None = None,
) -> GGUFExport:
    """Write `model` (trained with LoRA, merged on the fly; an NF4 base is dequantised exactly) as one GGUF
    file at `path`, quantised as asked: ``f16``, ``bf16``, ``q8_0`` or ``q4_0`` by fastft, or llama.cpp's
    K-quants (``q4_k_m``, ``q5_k_m``, …) through ``llama-quantize`` on PATH.

    The file is checked before it is kept (see the module doc): `prompts` are chat conversations or strings
    (default: 8 held-out skills questions; at least one: a check of nothing is no check). Only `path` is
    written: other files in its folder stay, another quantisation's file included. An existing file at
    `path` is replaced only if fastft wrote it (and, in a folder fastft saved, it is unchanged since), or with
    ``overwrite=True``. Partial files of an earlier save_gguf into the folder that was killed are removed,
    with a warning. `progress(stage, done, total)` reports "write" per tensor and "check" per prompt.
    `metadata` adds or replaces GGUF metadata entries (None removes one); the check tests the file as
    written. Returns a `GGUFExport`; raises `GGUFCheckError` (the file is not kept) when the check fails, and
    `DiskFullError` / `PermissionError` naming `path` (with the bytes needed and free) when it cannot be
    written."""
    quantization = normalise_quantization(quantization)
    path = expand(path)
    if path.suffix.lower() != ".gguf":
        raise ValueError(
            f"save_gguf writes one .gguf file; {path} does not end in .gguf. Name it e.g. model.gguf"
        )
    if check:
        check_prompts(prompts)
    check_file_destination(path, overwrite)
    claims: list = []
    on_tensor = (lambda done, total: progress("write", done, total)) if progress else None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(path.parent)
        tmp = temporary_sibling(path, claims)
        try:
            if quantization in K_QUANTS:
                require_llama_quantize(quantization)  # before any work
                source = temporary_sibling(path, claims)
                try:
                    written = write_gguf(
                        model, source, tokenizer, "bf16", metadata=metadata, progress=on_tensor
                    )
                    quantize_with_llama_cpp(source, tmp, quantization)
                finally:
                    remove_quietly(source)
                kept = written.kept
            else:
                written = write_gguf(
                    model, tmp, tokenizer, quantization, metadata=metadata, progress=on_tensor
                )
                kept = written.kept
            report = None
            if check:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # transformers' notes on a model it builds for the check
                    report = check_gguf(
                        tmp, model, tokenizer, quantization, prompts=prompts, progress=progress
                    )
                report.path = path
                if not report.passed:
                    raise GGUFCheckError(report)
            os.replace(tmp, path)
            fsync_folder(path.parent)
        finally:
            remove_quietly(tmp)
    except OSError as error:  # a full disk or a read-only folder, named by the user's path, not the partial's
        explained = explain_write_error(error, path, "nothing under that path was changed")
        if explained is not None:
            raise explained from error
        raise
    finally:
        for handle in claims:
            handle.close()
    try:
        record_file(path.parent, path.name, "save_gguf")  # in a folder fastft saved: listed in its manifest
    except OSError as error:  # the file is saved; unlisted, it is still replaceable as fastft's (its key)
        warnings.warn(
            f"{path} was saved, but its folder's manifest could not be updated: {error}", stacklevel=2
        )
    return GGUFExport(path=path, quantization=quantization, check=report, kept=kept)


def save_ollama(
    model,
    folder: str | os.PathLike,
    tokenizer,
    quantization: str = "q8_0",
    check: bool = True,
    prompts: list | None = None,
    overwrite: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    parameters: dict[str, object] | None = None,
    system: str | None = None,
) -> GGUFExport:
    """Write a folder Ollama imports: ``model.<QUANT>.gguf`` (as `save_gguf`, checked) and a ``Modelfile``
    whose TEMPLATE is the chat template translated to Ollama's template language (checked by rendering
    both), with the stop tokens and default parameters (`parameters` adds or replaces them; `system` sets a
    default system prompt). Then: ``ollama create NAME -f FOLDER/Modelfile``. A chat template with no
    faithful translation leaves TEMPLATE out, with a warning and a comment saying what to do (the GGUF file
    holds the chat template).

    The folder is written atomically into a folder fastft wrote (or any with `overwrite`), and replaces only
    the files this save writes: a GGUF of another quantisation saved there before stays beside the new one,
    and so does anything the user added (`fastft.atomic`)."""

    quantization = normalise_quantization(quantization)
    name = f"model.{quantization.upper()}.gguf"
    results: list[GGUFExport] = []

    def write(target: Path) -> None:
        text = modelfile(model, tokenizer, f"./{name}", parameters=parameters, system=system)
        result = save_gguf(
            model, target / name, tokenizer, quantization, check=check, prompts=prompts, progress=progress
        )
        (target / "Modelfile").write_text(text, encoding="utf-8")
        results.append(result)

    if check:
        check_prompts(prompts)  # before the folder's work
    destination = replace_folder_atomically(
        write, folder, overwrite=overwrite, kind="ollama", by="save_ollama", replace_previous=False
    )
    result = results[0]
    result.path = destination / name
    result.modelfile = destination / "Modelfile"
    if result.check is not None:
        result.check.path = result.path
    return result


__all__ = ["GGUFCheckError", "GGUFExport", "save_gguf", "save_ollama"]

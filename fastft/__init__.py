"""fastft: fast, exact LoRA/QLoRA fine-tuning from a notebook.

The five steps of a run, as plain calls::

    import fastft
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=256)   # 1. pick a model
    model = fastft.add_lora(model, r=16, alpha=16)
    data = fastft.pack(fastft.load_dataset("bundled:skills"), tokenizer)    # 2. pack a dataset
    result = fastft.train(model, tokenizer, data, max_steps=100)            # 4. run
    fastft.save_adapter(model, "runs/adapter", tokenizer)                   # 5. keep the result

or with clicks: ``fastft.studio()`` (widget panels for the same five steps).

Names are imported on first use, so ``import fastft`` is quick.
"""

from __future__ import annotations

import importlib
import logging
import warnings

from fastft.lazy_exports import lazy_export as _lazy_export
from fastft.runtime import keep_fit as _keep_fit

__version__ = "0.1.0"


class _BitsandbytesCpuKernelNotice(logging.Filter):
    """Drops one bitsandbytes warning: on a CPU with AVX512-BF16, importing bitsandbytes (peft does, for any
    LoRA) tries the hub package ``kernels`` for a CPU 4-bit GEMM and warns when it is absent. fastft never
    calls that GEMM (NF4 is dequantised by its own kernels), so the warning told every ``fastft demo`` on such
    a CPU about a package it does not need. Only this message is dropped; the logger is otherwise untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(
            "Failed to load CPU gemm_4bit_forward from kernels-community"
        )


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_BitsandbytesCpuKernelNotice())


class _OfflineKernelTrustNotice(logging.Filter):
    """Drops the `kernels` package's "Skipping publisher trust check for 'kernels-community/quantization-
    bitsandbytes' because Hugging Face Hub is in offline mode" warning: the same bitsandbytes CPU kernel look-up
    as above, made offline (HF_HUB_OFFLINE, or `fastft.data.hub.hub_offline_while_importing`). Only messages
    about that repository are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            message.startswith("Skipping publisher trust check")
            and "kernels-community/quantization-bitsandbytes" in message
        )


logging.getLogger("kernels._internals.hf_hub").addFilter(_OfflineKernelTrustNotice())

# peft 0.21 reads transformers' deprecated `model.is_gradient_checkpointing` whenever a PeftModel is made (its
# own `PeftModel.from_pretrained` included, which the notebooks use to reload an adapter with plain peft): a
# red FutureWarning about code neither fastft nor its user wrote. Only this message is dropped.
warnings.filterwarnings(
    "ignore", message=r"`is_gradient_checkpointing` is deprecated", category=FutureWarning
)


def _keeping_fits(model, tokens, device):
    """The VRAM estimator's answer to offloading's conditional keep (`fastft.runtime.keep_fit`), imported on
    first call so that ``import fastft`` stays light."""
    from fastft.vram.keeping import keeping_fits

    return keeping_fits(model, tokens, device)


_keep_fit.register(_keeping_fits)

_EXPORTS = {
    # models
    "load_model": "fastft.models.loading",
    "ModelLoadError": "fastft.models.loading",
    "add_lora": "fastft.models.lora",
    "patch": "fastft.models.patch",
    "unpatch": "fastft.models.patch",
    "is_fused": "fastft.models.patch",
    "LoraTargetError": "fastft.models.lora",
    "linear_layer_names": "fastft.models.lora",
    "save_adapter": "fastft.models.hf_save",
    "save_merged": "fastft.models.hf_save",
    "save_gguf": "fastft.export",
    "save_ollama": "fastft.export",
    "GGUFCheckError": "fastft.export",
    "PRESETS": "fastft.models.presets",
    "CATALOG": "fastft.models.catalog",
    "find_model": "fastft.models.catalog",
    "FastLanguageModel": "fastft.unsloth.models",
    "FastModel": "fastft.unsloth.models",
    "is_bfloat16_supported": "fastft.unsloth.models",
    "Checkpointing": "fastft.runtime.activation_checkpointing",
    # data
    "load_dataset": "fastft.data.loading",
    "list_bundled": "fastft.data.loading",
    "MalformedRowError": "fastft.data.errors",
    "pack": "fastft.data.packing",
    "pack_shards": "fastft.data.packing",
    "pack_pairs": "fastft.data.pairs",
    "PackedPairs": "fastft.data.pairs",
    "PackedDataset": "fastft.data.packing",
    "PackedStream": "fastft.data.stream",
    "PackedBatch": "fastft.data.batch",
    # train
    "train": "fastft.training.trainer",
    "Trainer": "fastft.training.trainer",
    "TrainConfig": "fastft.training.trainer",
    "TrainResult": "fastft.training.trainer",
    "NonFiniteLossError": "fastft.training.trainer",
    "StepEvent": "fastft.training.events",
    "EvalEvent": "fastft.training.events",
    "grpo": "fastft.training.objectives.grpo",
    "GRPOConfig": "fastft.training.objectives.grpo",
    "GRPOTrainer": "fastft.training.objectives.grpo",
    "evaluate_accuracy": "fastft.training.evaluate",
    "generate_answers": "fastft.training.evaluate",
    # tools
    "estimate_vram": "fastft.vram",
    "max_context": "fastft.vram",
    "fits": "fastft.vram",
    "GPUS": "fastft.vram",
    "pick_settings": "fastft.vram.pick",
    "kernel_status": "fastft.kernels.capability",
    "StepProfile": "fastft.profile",
    "profile_window": "fastft.profile",
    # faces
    "RunReport": "fastft.report",
    "write_report": "fastft.report",
    **{
        name: "fastft.report"
        for name in (
            "loss_figure",
            "throughput_figure",
            "learning_rate_figure",
            "accuracy_figure",
            "sequence_length_figure",
            "vram_figure",
            "step_profile_figure",
            "step_timeline_figure",
            "kernel_profile_figure",
        )
    },
    "run_demo": "fastft.demo",
}
# Modules exported as themselves: ``fastft.studio()``, ``fastft.studio.ModelPanel()``,
# ``fastft.chat_templates.get_chat_template`` (Unsloth's ``unsloth.chat_templates``, kept in
# ``fastft.unsloth.chat_templates``) and ``fastft.rewards``.
_MODULES = {
    "studio": "fastft.studio",
    "chat_templates": "fastft.unsloth.chat_templates",
    "rewards": "fastft.data.rewards",  # GRPO's reward functions: fastft.rewards.exact_match, …
}

__all__ = [*_EXPORTS, *_MODULES, "__version__"]


def __getattr__(name: str):
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
        globals()[name] = value
        return value
    return _lazy_export(globals(), _EXPORTS, name)


def __dir__() -> list[str]:
    return sorted(__all__)

"""The Unsloth drop-in layer: an Unsloth notebook runs on fastft with its imports switched.

    from unsloth import FastLanguageModel          →  from fastft.unsloth import FastLanguageModel
    from unsloth.chat_templates import ...         →  from fastft.unsloth.chat_templates import ...
    from vllm import SamplingParams                →  from fastft.unsloth import SamplingParams

As in Unsloth, the `fastft.unsloth.chat_templates` functions are importable from the top level too
(``from unsloth import to_sharegpt, standardize_sharegpt, apply_chat_template``, as the Ollama notebooks write).

`FastLanguageModel` / `FastModel` (`fastft.unsloth.models`) map Unsloth's ``from_pretrained`` and
``get_peft_model`` onto `fastft.load_model` and `fastft.add_lora`; each model they return carries Unsloth's
saving methods (`fastft.unsloth.saving`) and its vLLM calls ``fast_generate`` / ``save_lora`` / ``load_lora``
(`fastft.unsloth.generation`, on fastft's own sampler).

Importing this package adapts TRL in place, as Unsloth does, so that the notebooks' trainer calls work with
the installed TRL and transformers: ``SFTTrainer(tokenizer=..., dataset_text_field=..., max_seq_length=...)``,
``DPOTrainer(tokenizer=..., beta=..., max_length=...)``, ``warmup_ratio=...``, ``from trl import ORPOTrainer``
(`fastft.unsloth.trl_compat` lists every rule). Only the signatures change, never what the trainers do; a
one-line notice says so the first time. A plain ``import fastft`` adapts nothing; ``from fastft import
FastLanguageModel`` imports this package, and so adapts TRL too.
"""

from __future__ import annotations

from fastft.unsloth.trl_compat import adapt_trl

adapt_trl()

from fastft.unsloth.chat_templates import (  # noqa: E402  (Unsloth exports them at its top level too)
    apply_chat_template,
    get_chat_template,
    standardize_data_formats,
    standardize_sharegpt,
    to_sharegpt,
    train_on_responses_only,
)
from fastft.unsloth.generation import LoRARequest, SamplingParams  # noqa: E402
from fastft.unsloth.models import FastLanguageModel, FastModel, is_bfloat16_supported  # noqa: E402
from fastft.unsloth.trainers import (  # noqa: E402
    PatchDPOTrainer,
    PatchFastRL,
    UnslothTrainer,
    UnslothTrainingArguments,
    unsloth_train,
)

__all__ = [
    "FastLanguageModel",
    "FastModel",
    "LoRARequest",
    "PatchDPOTrainer",
    "PatchFastRL",
    "SamplingParams",
    "UnslothTrainer",
    "UnslothTrainingArguments",
    "apply_chat_template",
    "get_chat_template",
    "is_bfloat16_supported",
    "standardize_data_formats",
    "standardize_sharegpt",
    "to_sharegpt",
    "train_on_responses_only",
    "unsloth_train",
]

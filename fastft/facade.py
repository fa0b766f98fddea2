"""`FastLanguageModel`: Unsloth's calling convention on top of fastft, so switching is one import.

from fastft import FastLanguageModel            # instead of: from unsloth import FastLanguageModel
model, tokenizer = FastLanguageModel.from_pretrained("tiny-llama", max_seq_length=2048)
model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing="unsloth")
"""

from __future__ import annotations

import warnings

from fastft.models.loading import load_model
from fastft.models.lora import add_lora

# Unsloth arguments that fastft accepts and ignores because they do not apply here.
_IGNORED_LOAD = {"device_map", "fix_tokenizer", "use_exact_model_name", "fast_inference", "full_finetuning"}
_IGNORED_PEFT = {"max_seq_length", "use_dora", "layers_to_transform", "layers_pattern", "modules_to_save"}


class FastLanguageModel:
    """Static methods with Unsloth's names and argument names, mapped onto `load_model`/`add_lora`."""

    @staticmethod
    def from_pretrained(
        model_name: str = "tiny-llama",
        max_seq_length: int = 2048,
        dtype=None,
        load_in_4bit: bool = False,
        load_in_8bit: bool = False,
        token: str | None = None,
        trust_remote_code: bool = False,
        **kwargs,
    ):
        """`load_model` under Unsloth's argument names; returns ``(model, tokenizer)``."""
        _drop_ignored(kwargs, _IGNORED_LOAD, "from_pretrained")
        return load_model(
            model_name,
            max_seq_length=max_seq_length,
            dtype=dtype,
            load_in_4bit=load_in_4bit,
            load_in_8bit=load_in_8bit,
            token=token,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )

    @staticmethod
    def get_peft_model(
        model,
        r: int = 16,
        target_modules="all-linear",
        lora_alpha: float = 16,
        lora_dropout: float = 0.0,
        bias: str = "none",
        use_gradient_checkpointing: bool | str = "unsloth",
        random_state: int = 3407,
        use_rslora: bool = False,
        loftq_config=None,
        **kwargs,
    ):
        """`add_lora` under Unsloth's argument names ("unsloth" checkpointing = fastft's best mode)."""
        if loftq_config:
            raise ValueError("loftq_config is not supported by fastft; leave it None.")
        _drop_ignored(kwargs, _IGNORED_PEFT, "get_peft_model")
        if kwargs:
            raise TypeError(f"get_peft_model got unexpected arguments: {sorted(kwargs)}")
        return add_lora(
            model,
            r=r,
            alpha=lora_alpha,
            dropout=lora_dropout,
            target_modules=target_modules,
            gradient_checkpointing=use_gradient_checkpointing,
            bias=bias,
            use_rslora=use_rslora,
            seed=random_state,
        )

    @staticmethod
    def for_inference(model):
        """Evaluation mode with the KV cache on (for `generate`)."""
        model.eval()
        model.config.use_cache = True
        return model

    @staticmethod
    def for_training(model):
        model.train()
        return model


def _drop_ignored(kwargs: dict, ignored: set[str], where: str) -> None:
    for name in sorted(ignored & kwargs.keys()):
        kwargs.pop(name)
        warnings.warn(
            f"FastLanguageModel.{where}: '{name}' does not apply in fastft and is ignored.", stacklevel=3
        )

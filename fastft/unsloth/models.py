"""`FastLanguageModel`, `FastModel`, `is_bfloat16_supported`: Unsloth's calling convention on top of fastft,
so switching is changing the imports (`fastft.unsloth`'s docstring lists them).

from fastft.unsloth import FastLanguageModel     # instead of: from unsloth import FastLanguageModel
model, tokenizer = FastLanguageModel.from_pretrained("tiny-llama", max_seq_length=2048)
model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, use_gradient_checkpointing="unsloth")

An Unsloth argument that does not apply here is accepted with a warning saying so; one that changes what is
trained is carried out (``modules_to_save``, ``use_dora``) or refused with the alternative
(``layers_to_transform``, ``full_finetuning=True``, ``loftq_config``), never dropped. vLLM's arguments
(``fast_inference``, ``gpu_memory_utilization``, ``max_lora_rank``) are accepted with one notice: fastft has no
vLLM, and ``model.fast_generate`` samples with fastft's own decoder (`fastft.unsloth.generation`).

Each model returned carries Unsloth's saving methods (``save_pretrained_merged``, ``save_pretrained_gguf``,
``push_to_hub_merged``, ``push_to_hub_gguf``: `fastft.unsloth.saving`) and its vLLM methods
(``fast_generate``, ``save_lora``, ``load_lora``), bound to that instance (no class is patched).
"""

from __future__ import annotations

import collections.abc
import types
import warnings

import jinja2
import torch

from fastft.models.loading import load_model
from fastft.models.lora import add_lora, linear_layer_names
from fastft.unsloth import generation, saving

# Unsloth arguments that fastft accepts and ignores because they do not apply here.
_IGNORED_LOAD = {
    "device_map",
    "device_map_planner_kwargs",
    "fix_tokenizer",
    "use_exact_model_name",
    "float32_mixed_precision",  # fastft picks the precision from the device (fp32 on the CPU)
    "offload_embedding",
    "unsloth_tiled_mlp",
    "text_only",  # fastft loads text models only
    "random_state",  # get_peft_model's random_state seeds the adapters
    "use_gradient_checkpointing",  # get_peft_model's use_gradient_checkpointing applies
}
# Unsloth loading options fastft does not have: refused when set (to anything but their default), with the way
_UNSUPPORTED_LOAD = {
    "rope_scaling": "fastft loads the model's own RoPE settings; extend the context with a model trained for it",
    "resize_model_vocab": "fastft never resizes the vocabulary; add tokens to the tokenizer and train embed_tokens / "
    "lm_head with modules_to_save",
    "revision": "fastft loads the hub's default revision; download the revision you want and pass its folder",
    "qat_scheme": "fastft has no quantisation-aware training; train 16-bit or QLoRA (load_in_4bit=True)",
}
# vLLM's arguments (Unsloth's fast_inference): accepted, with one notice
_VLLM_LOAD = (
    "fast_inference",
    "gpu_memory_utilization",
    "max_lora_rank",
    "float8_kv_cache",
    "disable_log_stats",
)
_IGNORED_PEFT = {"max_seq_length", "temporary_location"}
# Unsloth arguments that would change which layers train: refused when set, never dropped.
_UNSUPPORTED_PEFT = {"layers_to_transform": "target_modules", "layers_pattern": "target_modules"}
# Modules Unsloth's continued-pretraining notebooks list in target_modules: trained whole (modules_to_save).
_WHOLE_MODULES = ("embed_tokens", "lm_head")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")


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
        load_in_fp8: bool | str = False,
        **kwargs,
    ):
        """`load_model` under Unsloth's argument names; returns ``(model, tokenizer)``. `model_name` may be
        an adapter folder saved earlier (``model.save_pretrained("lora_model")``): its base and the adapter load."""
        if kwargs.pop("full_finetuning", False):
            raise ValueError(
                "full_finetuning=True: fastft trains LoRA / QLoRA adapters, not every weight. Use "
                "full_finetuning=False and get_peft_model(...); to train the embeddings or the head whole, pass "
                "modules_to_save=['embed_tokens', 'lm_head'] there."
            )
        if kwargs.pop("load_in_16bit", False) and (load_in_4bit or load_in_8bit):
            raise ValueError(
                "from_pretrained: load_in_16bit=True with load_in_4bit / load_in_8bit: choose one precision "
                "(load_in_16bit=True alone loads 16-bit weights, as does leaving all three off)."
            )
        if load_in_fp8 == "row":  # Unsloth's name for its default FP8 mode (load_in_fp8=True): fastft's
            load_in_fp8 = True
        if load_in_fp8 not in (False, True, None):
            raise ValueError(
                f"from_pretrained: load_in_fp8 is not supported by fastft as {load_in_fp8!r}: its FP8 weights have one "
                "scale per output channel, Unsloth's 'row' mode (load_in_fp8=True or 'row'), not Unsloth's "
                "'block' scales (one per 128 x 128 block); pass load_in_fp8=True."
            )
        for name, instead in _UNSUPPORTED_LOAD.items():
            if kwargs.pop(name, None) not in (None, False):
                raise ValueError(
                    f"from_pretrained: {name} is not supported by fastft: {instead}; leave it unset."
                )
        _drop_ignored(kwargs, _IGNORED_LOAD, "from_pretrained")
        _vllm_notice(kwargs)
        model, tokenizer = load_model(
            model_name,
            max_seq_length=max_seq_length,
            dtype=dtype,
            load_in_4bit=load_in_4bit,
            load_in_8bit=load_in_8bit,
            load_in_fp8=bool(load_in_fp8),
            token=token,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )
        if load_in_fp8 and model.device.type == "cpu":
            warnings.warn(
                "from_pretrained(load_in_fp8=True): the projections are stored FP8 (e4m3, one scale per output "
                "row, as Unsloth's default 'row' mode), but on the CPU their GEMMs run on the weights dequantised "
                "with the activations not quantised (Unsloth's FP8 needs a GPU with FP8 tensor cores): losses differ "
                "slightly from an FP8 GPU run.",
                stacklevel=2,
            )
        return bind(model, tokenizer), adapt_tokenizer(tokenizer)

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
        modules_to_save: list[str] | None = None,
        use_dora: bool = False,
        **kwargs,
    ):
        """`add_lora` under Unsloth's argument names ("unsloth" checkpointing = fastft's best mode).

        ``embed_tokens`` / ``lm_head`` in `target_modules` (as Unsloth's continued-pretraining notebooks
        write them) are trained whole, as `modules_to_save`, the way Unsloth treats them."""
        if loftq_config:
            raise ValueError(
                "loftq_config: fastft does not initialise adapters with LoftQ; leave loftq_config=None (adapters "
                "start at zero, as with Unsloth's default)."
            )
        if kwargs.pop("init_lora_weights", True) is not True:
            raise ValueError(
                "init_lora_weights: fastft initialises adapters as PEFT's default (B = 0, so training starts from the "
                "base model), as Unsloth's init_lora_weights=True does; leave it True."
            )
        _drop_ignored(kwargs, _IGNORED_PEFT, "get_peft_model")
        for name, instead in _UNSUPPORTED_PEFT.items():
            if kwargs.pop(name, None) is not None:
                raise ValueError(
                    f"get_peft_model: {name} is not supported by fastft (every decoder layer is adapted); "
                    f"choose what trains with {instead} instead, or leave {name}=None."
                )
        if kwargs:
            raise TypeError(f"get_peft_model got unexpected arguments: {sorted(kwargs)}")
        tokenizer = getattr(model, "fastft_tokenizer", None)
        whole = list(modules_to_save or [])
        if not isinstance(target_modules, str):
            whole += [name for name in target_modules if name in _WHOLE_MODULES and name not in whole]
            target_modules = [name for name in target_modules if name not in _WHOLE_MODULES]
        return bind(
            add_lora(
                model,
                r=r,
                alpha=lora_alpha,
                dropout=lora_dropout,
                target_modules=target_modules,
                gradient_checkpointing=use_gradient_checkpointing,
                bias=bias,
                use_rslora=use_rslora,
                seed=random_state,
                modules_to_save=whole or None,
                use_dora=use_dora,
            ),
            tokenizer,
        )

    @staticmethod
    def for_inference(model):
        """Evaluation mode with the KV cache on (for `generate`)."""
        model.eval()
        model.config.use_cache = True
        return model

    @staticmethod
    def for_training(model, use_gradient_checkpointing: bool = True):
        """Training mode (dropout on, no KV cache), as after `get_peft_model`."""
        model.train()
        model.config.use_cache = False
        return model


class FastModel(FastLanguageModel):
    """Unsloth's `FastModel` for the text models fastft supports: `from_pretrained` as `FastLanguageModel`'s;
    `get_peft_model` also takes the ``finetune_*`` switches, which pick the attention and MLP projections."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        """`FastLanguageModel.from_pretrained`; the tokenizer's ``apply_chat_template`` answers as the processor
        Unsloth's `FastModel` returns for the models its notebooks load (Gemma 3, Gemma 3n, …): called
        without ``tokenize`` / ``return_tensors`` / ``return_dict``, it gives the text (a processor's default),
        which the notebooks then pass to ``tokenizer([text], return_tensors="pt")``."""
        model, tokenizer = FastLanguageModel.from_pretrained(*args, **kwargs)
        object.__setattr__(tokenizer, "fastft_text_by_default", True)
        return model, tokenizer

    @staticmethod
    def get_peft_model(
        model,
        finetune_vision_layers: bool = False,
        finetune_language_layers: bool = True,
        finetune_attention_modules: bool = True,
        finetune_mlp_modules: bool = True,
        target_modules=None,
        **kwargs,
    ):
        """`FastLanguageModel.get_peft_model`; without `target_modules`, the targets are the attention
        projections (q/k/v/o) and/or the MLP ones (gate/up/down, experts) of the language layers."""
        if finetune_vision_layers and _has_vision_tower(model):
            raise ValueError(
                "finetune_vision_layers=True: fastft trains the language layers of text models only; this "
                "model has a vision tower. Use finetune_vision_layers=False."
            )
        if target_modules is None:
            if not finetune_language_layers:
                raise ValueError(
                    "finetune_language_layers=False leaves nothing to train in a text model: set it True, "
                    "or pass target_modules."
                )
            target_modules = _language_targets(model, finetune_attention_modules, finetune_mlp_modules)
        return FastLanguageModel.get_peft_model(model, target_modules=target_modules, **kwargs)


def is_bfloat16_supported() -> bool:
    """Whether this machine trains in bf16: a CUDA GPU that supports it (Ampere and later); False on the CPU,
    where fastft trains in fp32 (as Unsloth's function of this name answers)."""

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def _has_vision_tower(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "vision_config", None) is not None


def _language_targets(model, attention: bool, mlp: bool) -> list[str]:
    if not (attention or mlp):
        raise ValueError(
            "finetune_attention_modules=False and finetune_mlp_modules=False leave nothing to train: set one "
            "True, or pass target_modules."
        )
    names = linear_layer_names(model)
    return [name for name in names if (name in _ATTENTION and attention) or (name not in _ATTENTION and mlp)]


def bind(model, tokenizer=None):
    """Give `model` (one instance) Unsloth's saving and vLLM methods, and remember its tokenizer (which
    ``fast_generate`` tokenises with); returns it."""
    saving.bind(model)
    if tokenizer is not None:
        object.__setattr__(model, "fastft_tokenizer", tokenizer)
    for function in (generation.fast_generate, generation.save_lora, generation.load_lora):
        object.__setattr__(model, function.__name__, types.MethodType(function, model))
    return model


def adapt_tokenizer(tokenizer):
    """This tokenizer's ``apply_chat_template`` as the notebooks call it (transformers 4, datasets 3), bound to
    this instance (no class is patched); returns the tokenizer.

    - a column of conversations as `datasets` 4+ returns it (``dataset["conversations"]`` is a lazy
      `datasets.Column`, not a list, as the Qwen3 notebooks pass it) is a batch, as a list is;
    - ``tokenize=True`` without ``return_dict`` returns the token ids (transformers 4's default), not
      transformers 5's `BatchEncoding`: the notebooks pass the result to ``model.generate(input_ids=...)``.
      TRL and fastft always pass ``return_dict`` or ``tokenize=False``, so nothing of theirs changes;
    - for `FastModel`'s tokenizer (``fastft_text_by_default``), a call without ``tokenize`` / ``return_tensors`` /
      ``return_dict`` returns the text, as the processor Unsloth's `FastModel` returns does."""

    if "apply_chat_template" in vars(tokenizer):
        return tokenizer
    method = type(tokenizer).apply_chat_template

    def apply_chat_template(self, conversation, *args, **kwargs):
        if isinstance(conversation, collections.abc.Sequence) and not isinstance(
            conversation, (list, tuple, str)
        ):
            conversation = list(conversation)
        explicit = {"tokenize", "return_tensors", "return_dict"} & kwargs.keys()
        if not args and not explicit and getattr(self, "fastft_text_by_default", False):
            kwargs["tokenize"] = False
        if not args and kwargs.get("tokenize", True) and "return_dict" not in kwargs:
            kwargs["return_dict"] = False
        try:
            return method(self, conversation, *args, **kwargs)
        except jinja2.exceptions.UndefinedError as error:
            clear = _unmapped_keys_error(conversation, error)
            if clear is None:
                raise
            raise clear from error

    object.__setattr__(tokenizer, "apply_chat_template", types.MethodType(apply_chat_template, tokenizer))
    return tokenizer


def _unmapped_keys_error(conversation, error: Exception) -> ValueError | None:
    """A clear error for messages whose keys the chat template does not read (ShareGPT's ``from`` / ``value``
    given to a template of ``role`` / ``content``); None when the messages have both."""
    messages = conversation
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], (list, tuple)):
        messages = messages[0]  # a batch: its first conversation
    if not isinstance(messages, (list, tuple)) or not messages or not isinstance(messages[0], dict):
        return None
    keys = sorted(set().union(*(m.keys() for m in messages if isinstance(m, dict))))
    if "role" in keys and "content" in keys:
        return None
    return ValueError(
        f"apply_chat_template: the messages have the keys {keys}, and this tokenizer's chat template reads "
        f"'role' and 'content' ({error}). Map the keys onto the template: tokenizer = get_chat_template("
        "tokenizer, chat_template=..., mapping={'role': 'from', 'content': 'value', 'user': 'human', "
        "'assistant': 'gpt'}) for ShareGPT messages, or convert the rows with standardize_sharegpt. A "
        "tokenizer from_pretrained read from an adapter folder without tokenizer files (model.save_pretrained "
        "writes the adapter only) is the base model's, without an earlier get_chat_template: apply it again, "
        "or save the tokenizer beside the adapter (tokenizer.save_pretrained(folder))."
    )


def _vllm_notice(kwargs: dict) -> None:
    given = {name: kwargs.pop(name) for name in _VLLM_LOAD if name in kwargs}
    if given.get("fast_inference") or len(given) > ("fast_inference" in given):
        warnings.warn(
            f"FastLanguageModel.from_pretrained: {', '.join(sorted(given))} are vLLM's; fastft has no vLLM. "
            "model.fast_generate samples with fastft's own decoder and TRL's GRPOTrainer with transformers' "
            "generate; the adapter rank is get_peft_model's r, and memory is not reserved up front.",
            stacklevel=3,
        )


def _drop_ignored(kwargs: dict, ignored: set[str], where: str) -> None:
    for name in sorted(ignored & kwargs.keys()):
        kwargs.pop(name)
        warnings.warn(
            f"FastLanguageModel.{where}: '{name}' does not apply in fastft and is ignored.", stacklevel=3
        )

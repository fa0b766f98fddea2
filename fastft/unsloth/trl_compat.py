"""TRL under the argument names Unsloth's notebooks write, applied when `fastft.unsloth` is imported.

Unsloth patches TRL so that the calls of older TRL and transformers releases keep working; its notebooks rely
on that. fastft does the same, only on ``import fastft.unsloth`` (never on a plain ``import fastft``), once,
in place (so ``from trl import SFTTrainer`` afterwards gets the adapted class, as with Unsloth), and only the
signatures and `SFTTrainer`'s preparation of text rows (as Unsloth prepares them): the training is TRL's.

Trainers (`SFTTrainer`, `DPOTrainer`, `ORPOTrainer`, `KTOTrainer`, `GRPOTrainer`):

- ``tokenizer=`` is ``processing_class=``;
- an argument that moved into the trainer's config (``dataset_text_field``, ``max_seq_length``, ``packing``,
  ``dataset_num_proc``, ``beta``, ``max_length``, ``max_prompt_length``, …) is set on ``args``; a
  `transformers.TrainingArguments` given as ``args`` becomes the trainer's config class with the same values
  (what TRL did itself when it took these arguments).

Configs (`transformers.TrainingArguments` and TRL's ``*Config``):

- ``warmup_ratio=r`` (removed in transformers 5) is ``warmup_steps=r``, which transformers 5 reads as a share of
  the steps when below 1 (a ``warmup_steps`` given as well wins, as it did);
- ``max_seq_length`` is ``max_length``;
- ``max_prompt_length`` / DPO's ``max_completion_length``, gone from TRL 1.x (whose trainers truncate whole
  sequences to ``max_length``), are accepted with a warning saying so;
- TRL's configs given no ``output_dir`` and the default save settings save no checkpoint
  (``save_strategy="no"``), as Unsloth's (TRL would write one into ``trainer_output/`` at the end of training);
- `GRPOConfig`: a ``per_device_train_batch_size`` that is not a multiple of ``num_generations`` becomes
  ``num_generations``, as Unsloth sets it (TRL 1.x refuses it), with a warning;
- `SFTTrainer`: where no length is given (the config's ``max_length`` at TRL's default), rows are truncated at
  the ``max_seq_length`` the model was loaded with, as Unsloth's (TRL alone: 1,024 tokens);
- `SFTTrainer`: a ``formatting_func`` written for batches (it returns a list of texts, Unsloth's and older
  TRL's convention) is applied to batches of the rows before TRL sees them, as Unsloth applies it (TRL 1.x calls
  it on one row);
- `SFTTrainer`: text rows (``dataset_text_field``) are trained as they are, as with Unsloth: one BOS for a text
  that already starts with it (rendered by a Llama-3 or Gemma chat template), no EOS appended, and the text
  rather than a conversational column beside it (TRL 1.x would add a second BOS, an EOS after the newline
  that ends every ChatML row, and train the ``conversations`` the text was rendered from);
- `GRPOConfig`'s ``vllm_sampling_params`` (Unsloth's) sets ``top_p``, ``top_k``, ``min_p``,
  ``repetition_penalty`` and ``temperature`` from a `fastft.unsloth.SamplingParams`, and ``use_vllm=True``
  becomes False with a warning (fastft has no vLLM; TRL generates through transformers).

``from trl import ORPOConfig, ORPOTrainer`` works again (they live in ``trl.experimental.orpo`` in TRL 1.x), and
so does ``from trl import PPOConfig, PPOTrainer`` (Unsloth's PPO notebook, written for TRL 0.22): from
``trl.experimental.ppo`` where the installed TRL has it; where TRL has removed PPO altogether, the names exist and
using either raises an error saying so and naming the ways on (GRPO with the reward model, or a TRL with PPO).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import warnings

import transformers

# Function-local imports: TRL is an optional dependency (the baselines and the facade's trainers); torch and
# transformers submodules load where their feature is used (not every supported version has each, and each costs its
# import).

_MARK = "_fastft_unsloth_original"
# trainer class name → its config class name (both in trl)
_TRAINERS = {
    "SFTTrainer": "SFTConfig",
    "DPOTrainer": "DPOConfig",
    "KTOTrainer": "KTOConfig",
    "GRPOTrainer": "GRPOConfig",
    "ORPOTrainer": "ORPOConfig",
}
# TRL 1.x names of arguments that older TRL took under another name
_RENAMED = {"max_seq_length": "max_length"}
# arguments TRL 1.x no longer has, accepted with a warning saying what happens instead
_REMOVED = {
    "max_prompt_length": (
        "TRL 1.x no longer truncates prompts on their own: each sequence is truncated to max_length "
        "(keep max_length above your longest prompt + completion, or filter long prompts out)"
    ),
    "max_completion_length": "TRL 1.x truncates each sequence to max_length instead",
}
# vLLM SamplingParams fields that GRPOConfig has under the same name (TRL samples with them)
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_NOTICE = (
    "fastft.unsloth: TRL's trainers and configs now also take Unsloth's argument names (tokenizer=, "
    "dataset_text_field=, max_seq_length=, packing=, beta=, warmup_ratio=, …; `from trl import ORPOTrainer`); "
    "SFTTrainer prepares text rows as Unsloth does; the training is TRL's."
)
_adapted: list[str] = []


def adapt_trl() -> list[str]:
    """Adapt TRL's trainers and configs (and `transformers.TrainingArguments`) in place to Unsloth's argument
    names; idempotent. Returns the names of the classes adapted. Prints a one-line notice the first time."""
    if _adapted:
        return list(_adapted)
    import trl

    _from_experimental(trl, "orpo", ("ORPOConfig", "ORPOTrainer"))
    if not _from_experimental(trl, "ppo", ("PPOConfig", "PPOTrainer")):
        for name in ("PPOConfig", "PPOTrainer"):
            setattr(trl, name, _removed_from_trl(name, trl.__version__))
    configs = [transformers.TrainingArguments]
    for trainer_name, config_name in _TRAINERS.items():
        trainer, config = getattr(trl, trainer_name, None), getattr(trl, config_name, None)
        if trainer is None or config is None:
            continue
        configs.append(config)
        if _adapt_init(trainer, functools.partial(_trainer_kwargs, config)):
            _adapted.append(trainer_name)
    for config in configs:
        if _adapt_init(config, functools.partial(_config_kwargs, config)):
            _adapted.append(config.__name__)
    print(_NOTICE)
    return list(_adapted)


def _from_experimental(trl, module: str, names: tuple[str, ...]) -> bool:
    """Give `trl` the top-level `names` TRL 1.x moved into ``trl.experimental.<module>``. False where the
    installed TRL has them in neither place."""
    if all(hasattr(trl, name) for name in names):
        return True  # an older TRL that still has them at the top level
    try:
        with warnings.catch_warnings():  # "trl.experimental is unstable": the user asked for `trl.<name>`
            warnings.simplefilter("ignore")
            moved = importlib.import_module(f"trl.experimental.{module}")
    except ImportError:
        return False
    for name in names:
        setattr(trl, name, getattr(moved, name))
    return True


def _removed_from_trl(name: str, version: str) -> type:
    """A stand-in for `trl.<name>`, which the installed TRL no longer has: ``from trl import <name>`` works (the
    notebook's import line), and using it raises the reason and the ways on."""
    message = (
        f"trl.{name}: TRL {version} has no PPO (TRL moved PPOTrainer / PPOConfig to trl.experimental.ppo, then "
        "removed them), so this PPO code cannot run here; Unsloth's PPO notebook pins trl==0.22.2. fastft trains "
        "with TRL 1.x, whose GRPOTrainer takes a sequence-classification reward model as a reward function: "
        "GRPOTrainer(model=model, reward_funcs=reward_model, args=GRPOConfig(...), train_dataset=prompts). To run "
        "PPO itself, use a TRL that still has it, in an environment of its own."
    )

    def refuse(*args, **kwargs):
        raise NotImplementedError(message)

    return type(name, (), {"__init__": refuse, "__doc__": message, "__module__": "trl"})


def is_adapted(cls) -> bool:
    """Whether `cls.__init__` is the adapted one (set by `adapt_trl`)."""
    return hasattr(cls.__dict__.get("__init__"), _MARK)


def _adapt_init(cls, adapt) -> bool:
    """Wrap `cls.__init__` (its own, not an inherited one) so `adapt(signature, args, kwargs)` rewrites the
    arguments first; a class already wrapped is left as it is."""
    original = cls.__dict__.get("__init__")
    if original is None or hasattr(original, _MARK):
        return False
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        args, kwargs = adapt(signature, args, kwargs)
        original(self, *args, **kwargs)

    setattr(__init__, _MARK, original)
    cls.__init__ = __init__
    return True


def _config_kwargs(config_cls, signature, args, kwargs):
    kwargs = config_arguments(config_cls, kwargs, where=config_cls.__name__)
    if config_cls is not transformers.TrainingArguments and not args:  # args: output_dir given by position
        _no_checkpoint_by_default(config_cls, kwargs)
    return args, kwargs


def config_arguments(config_cls, kwargs: dict, where: str) -> dict:
    """`kwargs` for `config_cls` with Unsloth's / older TRL's names turned into the ones `config_cls` has."""
    fields = {f.name for f in dataclasses.fields(config_cls) if f.init}
    kwargs = dict(kwargs)
    if "warmup_ratio" in kwargs and "warmup_ratio" not in fields:
        ratio = kwargs.pop("warmup_ratio")
        if ratio is not None:
            if not 0 <= ratio < 1:
                raise ValueError(
                    f"{where}(warmup_ratio={ratio}): a ratio is a share of the steps in [0, 1); for a number of "
                    "steps pass warmup_steps instead."
                )
            if not kwargs.get("warmup_steps"):
                kwargs["warmup_steps"] = ratio
    for old, new in _RENAMED.items():
        if old in kwargs and old not in fields and new in fields:
            value = kwargs.pop(old)
            if new in kwargs and kwargs[new] != value:
                raise TypeError(f"{where}: got both {old}={value} and {new}={kwargs[new]}; pass only {new}.")
            kwargs[new] = value
    for name, instead in _REMOVED.items():
        if name in kwargs and name not in fields:
            value = kwargs.pop(name)
            if value is not None:
                warnings.warn(f"{where}: {name}={value} is not applied: {instead}.", stacklevel=4)
    if "bf16" in fields and "bf16" not in kwargs and not kwargs.get("fp16") and not _bf16_device():
        # TRL's configs default to bf16, which transformers refuses without a bf16 GPU; Unsloth picks the
        # precision from the hardware (is_bfloat16_supported()), so without one: fp32, as fastft trains there
        kwargs["bf16"] = False
    if "vllm_sampling_params" in kwargs and "vllm_sampling_params" not in fields:
        _sampling_into(kwargs, kwargs.pop("vllm_sampling_params"), fields, where)
    if "num_generations" in fields and not {"generation_batch_size", "steps_per_generation"} & kwargs.keys():
        _batch_of_whole_groups(config_cls, kwargs, where)
    if kwargs.get("use_vllm") and "use_vllm" in fields:
        kwargs["use_vllm"] = False
        warnings.warn(
            f"{where}(use_vllm=True): fastft has no vLLM; TRL samples the completions through transformers' "
            "generate (use_vllm=False).",
            stacklevel=4,
        )
    return kwargs


def _batch_of_whole_groups(config_cls, kwargs: dict, where: str) -> None:
    """Unsloth's GRPO rule: ``per_device_train_batch_size`` not a multiple of ``num_generations`` (the notebooks'
    batch of 1 with 4 generations, which TRL 1.x refuses) becomes ``num_generations``, said once."""
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    generations = kwargs.get("num_generations", defaults["num_generations"])
    batch = kwargs.get("per_device_train_batch_size", defaults["per_device_train_batch_size"])
    if generations and batch % generations:
        kwargs["per_device_train_batch_size"] = generations
        warnings.warn(
            f"{where}: per_device_train_batch_size={batch} is not a multiple of num_generations={generations}; it "
            f"is set to {generations}, as Unsloth does (each batch holds whole groups of completions).",
            stacklevel=5,
        )


def _no_checkpoint_by_default(config_cls, kwargs: dict) -> None:
    """Unsloth's rule for TRL's configs: no ``output_dir`` and the default save settings (``save_strategy="steps"``,
    ``save_steps=500``) save no checkpoint (``save_strategy="no"``); TRL would write a whole checkpoint
    (adapter, optimizer state) into ``trainer_output/checkpoint-N`` at the end of every notebook's training."""
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    if (
        kwargs.get("output_dir") is None
        and kwargs.get("save_strategy", defaults["save_strategy"]) == "steps"
        and kwargs.get("save_steps", defaults["save_steps"]) == defaults["save_steps"]
        and not kwargs.get("load_best_model_at_end")  # which needs saves at its evaluations
    ):
        kwargs["save_strategy"] = "no"


def _bf16_device() -> bool:
    from transformers.utils import is_torch_bf16_gpu_available

    return is_torch_bf16_gpu_available()


def _sampling_into(kwargs: dict, params, fields: set[str], where: str) -> None:
    """Unsloth's ``vllm_sampling_params``: the fields a `SamplingParams` was given, as the config's own."""
    if params is None:
        return
    given = getattr(params, "given", None)
    if given is None:
        raise TypeError(
            f"{where}(vllm_sampling_params=...): fastft reads a fastft.unsloth.SamplingParams (vLLM's cannot be "
            "imported here): replace `from vllm import SamplingParams` by `from fastft.unsloth import "
            "SamplingParams`."
        )
    ignored = []
    for name, value in given.items():
        if name in _SAMPLING_FIELDS and name in fields:
            if name == "top_k" and value == -1:  # vLLM's "no top-k" is TRL's 0
                value = 0
            kwargs.setdefault(name, value)  # the config's own argument wins
        elif name == "max_tokens" and "max_completion_length" in fields:
            kwargs.setdefault("max_completion_length", value)
        elif name not in ("seed", "include_stop_str_in_output") and not (
            name == "stop" and not value  # an empty stop list asks for nothing
        ):
            ignored.append(name)
    if ignored:
        warnings.warn(
            f"{where}(vllm_sampling_params=...): {', '.join(sorted(ignored))} not applied (TRL's generation "
            "stops at the EOS token and samples with temperature, top_p, top_k, min_p and repetition_penalty).",
            stacklevel=5,
        )


def _trainer_kwargs(config_cls, signature, args, kwargs):
    """A trainer's arguments: ``tokenizer`` as ``processing_class``, and the arguments that moved into the
    config set on ``args`` (a `TrainingArguments` becoming `config_cls` first)."""
    params = signature.parameters
    kwargs = dict(kwargs)
    where = config_cls.__name__.replace("Config", "Trainer")
    if "tokenizer" in kwargs and "tokenizer" not in params and "processing_class" in params:
        tokenizer = kwargs.pop("tokenizer")
        if kwargs.get("processing_class") not in (None, tokenizer):
            raise TypeError(
                f"{where}: got both tokenizer= and processing_class=; pass processing_class only."
            )
        kwargs["processing_class"] = tokenizer
    if where == "SFTTrainer":
        _batched_formatting(kwargs)
        _text_rows_as_given(kwargs)
    fields = {f.name for f in dataclasses.fields(config_cls) if f.init}
    movable = fields | set(_RENAMED) | set(_REMOVED) | {"warmup_ratio"}
    moved = {name: kwargs.pop(name) for name in list(kwargs) if name not in params and name in movable}
    if where == "SFTTrainer":
        model = kwargs.get("model", args[0] if args else None)
        _max_length_from_model(config_cls, model, kwargs.get("args"), moved)
    bound = signature.bind_partial(
        None, *args, **kwargs
    )  # a wrong argument raises TypeError here, as TRL would
    arguments = dict(list(bound.arguments.items())[1:])  # without self
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in arguments:
            arguments.update(arguments.pop(name))
    config = arguments.get("args")
    if not moved and (config is None or isinstance(config, config_cls)):
        return args, kwargs
    arguments["args"] = _with_fields(config_cls, config, config_arguments(config_cls, moved, where=where))
    return (), arguments


def _max_length_from_model(config_cls, model, config, moved: dict) -> None:
    """Unsloth's SFTTrainer truncates at the ``max_seq_length`` the model was loaded with where neither the
    trainer's arguments nor its config set a length (the config's ``max_length`` left at TRL's default, 1024):
    the conversational notebooks pass ``max_seq_length`` only to ``from_pretrained``, and TRL alone would cut
    every row after 1,024 tokens. A length given explicitly is kept as given."""
    limit = getattr(getattr(model, "fastft_info", None), "max_seq_length", None)
    default = {f.name: f.default for f in dataclasses.fields(config_cls)}.get("max_length")
    if limit is None or default is None or {"max_length", "max_seq_length"} & moved.keys():
        return
    if config is not None and getattr(config, "max_length", default) != default:
        return
    moved["max_length"] = limit


def _each_dataset(kwargs: dict, prepare) -> bool:
    """Replace each dataset given by keyword (``train_dataset``, ``eval_dataset``, a dict of evaluation sets) by
    ``prepare(dataset)`` where that returns one (None: left as it is); whether any was replaced."""
    replaced = False
    for name in ("train_dataset", "eval_dataset"):
        given = kwargs.get(name)
        if given is None:
            continue
        datasets = given if isinstance(given, dict) else {None: given}
        prepared = {key: prepare(dataset) for key, dataset in datasets.items()}
        if all(dataset is None for dataset in prepared.values()):
            continue
        merged = {key: datasets[key] if prepared[key] is None else prepared[key] for key in datasets}
        kwargs[name] = merged if isinstance(given, dict) else merged[None]
        replaced = True
    return replaced


def _rows(dataset) -> tuple[dict | None, list[str], dict]:
    """The first row of `dataset` (None if empty), its column names and `map`'s progress label argument."""
    import datasets

    first = next(iter(dataset), None)
    names = getattr(dataset, "column_names", None) or list(first or ())
    return (
        first,
        names,
        {"desc": "Unsloth's SFT preparation"} if isinstance(dataset, datasets.Dataset) else {},
    )


def _batched_formatting(kwargs: dict) -> None:
    """Unsloth's (and TRL < 0.20's) ``formatting_func``: called on a batch of rows, it returns a list of texts
    (the notebooks' ``formatting_prompts_func(examples)`` loops over ``examples[...]``); TRL 1.x calls it on one
    row for one str, where such a function fails or loops over the characters of a field. A ``formatting_func``
    that returns a list of one text for a batch of the first row is applied as Unsloth applies it: on batches,
    into the text column (``dataset_text_field``), the other columns dropped; TRL then gets the text rows and no
    ``formatting_func``. One that returns a str is TRL 1.x's, left to TRL."""
    func = kwargs.get("formatting_func")
    if func is None:
        return
    field = _text_field(kwargs)

    def texts(batch):
        return {field: func(batch)}

    def formatted(dataset):
        first, names, desc = _rows(dataset)
        if first is None or "input_ids" in names:  # TRL ignores formatting_func on tokenized rows
            return None
        try:  # a batch of the first row: a batched function returns one text in a list
            probe = func({name: [value] for name, value in first.items()})
        except Exception:  # noqa: BLE001 - a function of one row (TRL 1.x's form): TRL calls it
            return None
        if not (isinstance(probe, list) and len(probe) == 1 and isinstance(probe[0], str)):
            return None
        return dataset.map(texts, batched=True, remove_columns=names, **desc)

    if _each_dataset(kwargs, formatted):
        kwargs["formatting_func"] = None


def _text_field(kwargs: dict) -> str:
    config = kwargs.get("args")
    return kwargs.get("dataset_text_field") or getattr(config, "dataset_text_field", None) or "text"


def _text_rows_as_given(kwargs: dict) -> None:
    """Unsloth's SFTTrainer trains the text column (``dataset_text_field``) as it is: tokenized with the
    tokenizer's BOS unless the text already starts with it (the notebooks render their rows with
    ``apply_chat_template``, whose Llama-3 / Gemma templates write the BOS), and nothing appended. TRL 1.x,
    given the same rows, trains a conversational column beside the text instead when the rows have one (the
    ShareGPT ``conversations`` the text was rendered from, converted to ``messages``), adds a second BOS to such
    a text and an EOS to a text that does not end with it (after the newline that ends every ChatML / Qwen
    row). The text rows of the datasets given by keyword are tokenized here as Unsloth tokenizes them (their
    other columns dropped), and TRL takes the tokenized rows as they are (labels, truncation, packing are
    TRL's). Left to TRL: rows with ``input_ids``, ``labels`` or ``prompt`` + ``completion`` (which Unsloth
    also takes before the text), a ``formatting_func`` of TRL's one-row form, ``assistant_only_loss``,
    ``skip_prepare_dataset`` and a tokenizer that is not a transformers tokenizer."""
    from transformers import PreTrainedTokenizerBase

    tokenizer = kwargs.get("processing_class")
    config = kwargs.get("args")
    if (
        not isinstance(tokenizer, PreTrainedTokenizerBase)
        or kwargs.get("formatting_func") is not None
        or getattr(config, "assistant_only_loss", False)
        or (getattr(config, "dataset_kwargs", None) or {}).get("skip_prepare_dataset")
    ):
        return
    field = _text_field(kwargs)
    bos = tokenizer.bos_token if tokenizer.bos_token_id is not None else None

    def tokenize(batch):
        return {
            "input_ids": [
                tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]
                for text in batch[field]
            ]
        }

    def tokenized(dataset):
        first, names, desc = _rows(dataset)
        if first is None or not isinstance(first.get(field), str):
            return None
        if {"input_ids", "labels"} & set(names) or {"prompt", "completion"} <= set(names):
            return None
        return dataset.map(tokenize, batched=True, remove_columns=names, **desc)

    _each_dataset(kwargs, tokenized)


def _with_fields(config_cls, config, values: dict):
    """`config` (None, a `TrainingArguments` or a `config_cls`) as a `config_cls` with `values` set."""
    if config is None:
        return config_cls(**values)
    if not isinstance(config, config_cls):
        fields = {f.name for f in dataclasses.fields(config_cls) if f.init}
        settings = config.to_dict()
        settings["hub_token"] = getattr(config, "hub_token", None)  # to_dict masks it
        settings = {name: value for name, value in settings.items() if name in fields}
        return config_cls(**{**settings, **values})
    for name, value in values.items():
        setattr(config, name, value)
    return config

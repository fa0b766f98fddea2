"""Unsloth's vLLM calls on a fastft model: ``model.fast_generate``, ``model.save_lora``, ``model.load_lora`` and
a `SamplingParams` in place of vLLM's (``from vllm import SamplingParams`` becomes ``from fastft.unsloth import
SamplingParams``: fastft has no vLLM).

``model.fast_generate(texts, sampling_params=..., lora_request=...)`` returns what vLLM's ``LLM.generate``
returns, one `RequestOutput` per prompt with ``.outputs[i].text``. As in Unsloth (where vLLM holds the base
weights and the adapter apart), ``lora_request=None`` samples the base model with the adapter switched off, and
``lora_request=model.load_lora(folder)`` samples with that saved adapter's weights (swapped in for the call,
then the trained ones put back). Sampling that fastft's rollout engine covers (temperature > 0 with top-p only)
runs there (`fastft.training.objectives.rollout.sample`, the static-cache decoder GRPO uses); top-k, min-p, repetition
penalty or greedy decoding (temperature 0) run through transformers' ``generate``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fastft.models.hf_save import save_adapter
from fastft.models.stops import stop_token_ids
from fastft.training.objectives.rollout import Sampling, sample

# Function-local imports: peft imports bitsandbytes, which asks the hub for a kernel: peft loads first under
# `fastft.data.hub.hub_offline_while_importing` (fastft.models.lora).


@dataclass(init=False)
class SamplingParams:
    """vLLM's ``SamplingParams`` for `fast_generate` and `GRPOConfig(vllm_sampling_params=...)`, with vLLM's
    defaults (``max_tokens=16``, ``top_k=-1``: no top-k). `given` records the fields set explicitly."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    given: dict = field(default_factory=dict, repr=False)

    def __init__(self, **kwargs):
        names = [f.name for f in dataclasses.fields(self) if f.name != "given"]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(
                f"SamplingParams: {unknown} are vLLM options fastft does not sample with; it takes {names}."
            )
        for f in dataclasses.fields(self):
            if f.name != "given":
                setattr(self, f.name, kwargs.get(f.name, f.default))
        self.given = dict(kwargs)
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.n < 1:
            raise ValueError(
                f"SamplingParams(temperature={self.temperature}, top_p={self.top_p}, n={self.n}): temperature "
                "must be >= 0, top_p in (0, 1] and n >= 1."
            )


@dataclass(frozen=True)
class LoRARequest:
    """What ``model.load_lora(folder)`` returns (vLLM's ``LoRARequest``): a saved adapter to sample with."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


@dataclass
class RequestOutput:
    prompt: str
    outputs: list[CompletionOutput]


_lora_ids = itertools.count(1)
_calls = itertools.count()


def save_lora(model, save_directory: str | os.PathLike) -> Path:
    """Unsloth's ``model.save_lora(folder)``: the adapter (``adapter_config.json``, ``adapter_model.safetensors``),
    written as `fastft.save_adapter` writes it (a folder fastft wrote is replaced, any other refused)."""

    return save_adapter(model, save_directory)


def load_lora(model, save_directory: str | os.PathLike, load_tensors: bool = False) -> LoRARequest:
    """Unsloth's ``model.load_lora(folder)``: a `LoRARequest` for ``fast_generate(..., lora_request=...)``."""
    folder = Path(save_directory).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"load_lora('{save_directory}'): no adapter_config.json there. Save the adapter first with "
            f"model.save_lora('{save_directory}')."
        )
    return LoRARequest(folder.name, next(_lora_ids), str(folder))


@torch.no_grad()
def fast_generate(model, prompts, sampling_params: SamplingParams | None = None, lora_request=None, **kwargs):
    """Unsloth's ``model.fast_generate`` (vLLM's ``LLM.generate``): one `RequestOutput` per prompt (a text, or a
    list of texts). See the module docstring for which weights and which sampler are used."""
    kwargs.pop("use_tqdm", None)
    if kwargs:
        raise TypeError(f"fast_generate got unexpected arguments: {sorted(kwargs)}")
    tokenizer = getattr(model, "fastft_tokenizer", None)
    if tokenizer is None:
        raise ValueError(
            "fast_generate needs the model FastLanguageModel.from_pretrained returned (it keeps the tokenizer)."
        )
    params = sampling_params or SamplingParams()
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not texts or not all(isinstance(text, str) for text in texts):
        raise TypeError("fast_generate takes a prompt text or a list of prompt texts.")
    with _weights_for(model, lora_request):
        return [_generate_one(model, tokenizer, text, params) for text in texts]


class _weights_for:
    """The weights `fast_generate` samples with: the base (adapter off) for None, a saved adapter's for a
    `LoRARequest` (swapped in for the call, the trained ones put back after)."""

    def __init__(self, model, request):
        self.model, self.request, self.context, self.saved = model, request, None, None

    def __enter__(self):
        from peft import PeftModel

        model = self.model
        if not isinstance(model, PeftModel):
            if self.request is not None:
                raise ValueError(
                    "fast_generate(lora_request=...) needs a model with adapters: call "
                    "FastLanguageModel.get_peft_model first, or load the folder with "
                    "FastLanguageModel.from_pretrained(model_name=folder)."
                )
            return
        if self.request is None:
            self.context = model.disable_adapter()
            self.context.__enter__()
            return
        if not isinstance(self.request, LoRARequest):
            raise TypeError("lora_request: pass model.load_lora(folder) (or None for the base model).")
        from peft import get_peft_model_state_dict, set_peft_model_state_dict
        from peft.utils import load_peft_weights

        device = next(model.parameters()).device
        weights = load_peft_weights(self.request.lora_path, device=str(device))
        current = get_peft_model_state_dict(model)
        shapes = {k.replace(".default", ""): tuple(v.shape) for k, v in current.items()}
        theirs = {k.replace(".default", ""): tuple(v.shape) for k, v in weights.items()}
        if shapes != theirs:
            raise ValueError(
                f"lora_request={self.request.lora_path}: that adapter's layers or rank differ from this model's "
                "adapter. Load it on its own: FastLanguageModel.from_pretrained(model_name=folder)."
            )
        self.saved = {k: v.detach().clone() for k, v in current.items()}
        set_peft_model_state_dict(model, weights)

    def __exit__(self, *exc):
        if self.context is not None:
            self.context.__exit__(*exc)
        if self.saved is not None:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, self.saved)
        return False


def _generate_one(model, tokenizer, text: str, params: SamplingParams) -> RequestOutput:
    bos = tokenizer.bos_token
    ids = tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)))["input_ids"]
    max_new = params.max_tokens or max(1, tokenizer.model_max_length - len(ids))
    engine = params.temperature > 0 and params.top_k in (-1, 0, None) and not params.min_p
    if engine and params.repetition_penalty == 1.0:
        completions, truncated = _rollout(model, tokenizer, ids, params, max_new)
    else:
        completions, truncated = _hf_generate(model, tokenizer, ids, params, max_new)
    outputs = []
    for index, (new_ids, cut) in enumerate(zip(completions, truncated, strict=True)):
        decoded = tokenizer.decode(new_ids, skip_special_tokens=params.skip_special_tokens)
        decoded, stopped = _cut_at_stop(decoded, params)
        outputs.append(
            CompletionOutput(
                index, decoded, [int(i) for i in new_ids], "stop" if stopped or not cut else "length"
            )
        )
    return RequestOutput(text, outputs)


def _rollout(model, tokenizer, ids, params, max_new):

    sampling = Sampling(
        num_generations=params.n, max_new_tokens=max_new, temperature=params.temperature, top_p=params.top_p
    )
    seed = params.seed if params.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
    samples = sample(model, tokenizer, [np.asarray(ids, dtype=np.int64)], sampling, (seed, next(_calls)))
    return samples.completion_ids, list(samples.truncated)


def _hf_generate(model, tokenizer, ids, params, max_new):
    device = next(model.parameters()).device
    stops = stop_token_ids(model, tokenizer)
    greedy = params.temperature == 0
    settings = (
        dict(do_sample=False)
        if greedy
        else dict(
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k and params.top_k > 0 else 0,
            min_p=params.min_p or None,
        )
    )
    generator_state = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
    with generator_state:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        was_training = model.training
        model.eval()
        try:
            output = model.generate(
                input_ids=torch.tensor([ids], device=device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                max_new_tokens=max_new,
                num_return_sequences=params.n,
                repetition_penalty=params.repetition_penalty,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=stops,
                use_cache=True,
                **settings,
            )[:, len(ids) :]
        finally:
            model.train(was_training)
    completions, truncated = [], []
    for row in output.tolist():
        end = next((i for i, token in enumerate(row) if token in stops), None)
        if end is not None:
            completions.append(row[: end + 1])
            truncated.append(False)
        else:
            completions.append(row)
            truncated.append(True)
    return completions, truncated


def _cut_at_stop(text: str, params: SamplingParams) -> tuple[str, bool]:
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
    found = [(text.find(s), s) for s in stops if s and s in text]
    if not found:
        return text, False
    at, stop = min(found)
    return text[: at + (len(stop) if params.include_stop_str_in_output else 0)], True

"""GRPO's rollouts: prompts tokenised once, G completions sampled per prompt, packed for training.

Sampling is batched (every prompt of the step, left-padded, G rows each) on the LoRA-patched model: a
patched layer sees the KV cache and runs the original forward (`fastft.models.patch`), so the completions
come from the adapted policy. Supported decoders sample through `fastft.training.objectives.decode.StaticDecoder` (a
static KV cache, each decode step one CUDA graph replay on a GPU); the others, or ``static_decode=False``,
through Hugging Face ``generate`` with the same temperature and top-p. Its random numbers
come from a generator seeded with ``(seed, step)`` (the static decoder's own; ``generate``'s forked off the global one): a step's completions are
a pure function of the seed, the step and the weights, so a resumed run samples what the uninterrupted one
did. A completion ends after its first EOS token (kept: the policy learns to stop) or at `max_new_tokens`
(then it is `truncated`).

The completions of a step are packed padding-free (`PackedBatch.from_sequences`: prompt tokens untrained,
completion tokens the targets), into micro-batches of at most `micro_batch_tokens` by best-fit decreasing
(`fastft.data.packing.best_fit_decreasing`), their metadata built once per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from fastft.data.batch import PackedBatch
from fastft.data.packing import best_fit_decreasing
from fastft.data.tokenize import IGNORE_INDEX
from fastft.models.stops import stop_token_ids
from fastft.training.objectives.decode import StaticDecoder, supports


def prompt_rows(prompts) -> list[dict]:
    """GRPO's prompt rows from what was passed: rows (dicts, or a `datasets.Dataset`) as they are, or bare
    prompts, each becoming ``{"prompt": ...}``: a plain string is the text the model continues (no chat
    template, as TRL treats a prompt that is not conversational), a conversation (a list of ``{"role",
    "content"}`` messages) is rendered with the chat template and its generation prompt."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError(
            f"prompts={prompts[:40]!r} is one string: pass a list of prompts (strings, conversations or rows "
            "with a 'prompt' column), or a dataset name to fastft.grpo(..., prompts='bundled:skills')."
        )
    rows = []
    for index, item in enumerate(prompts):
        if isinstance(item, Mapping):
            rows.append(dict(item))
        elif isinstance(item, str):
            rows.append({"prompt": item})
        elif (
            isinstance(item, (list, tuple))
            and item
            and all(isinstance(m, Mapping) and "role" in m for m in item)
        ):
            rows.append({"prompt": [dict(m) for m in item]})
        else:
            raise ValueError(
                f"GRPO prompt {index} is a {type(item).__name__} ({item!r:.60}): give each prompt as a string, a "
                "conversation (a list of {'role', 'content'} messages) or a row with a 'prompt' column."
            )
    return rows


def prompt_of(row: dict):
    """What a row asks: its ``prompt`` (a text or a message list), its ``messages`` up to the final
    assistant turn, or its ``prompt_ids`` (token ids, used as they are)."""
    if "prompt" in row:
        return row["prompt"]
    if "messages" in row:
        from fastft.training.evaluate import prompt_messages

        return prompt_messages(row)
    if "prompt_ids" in row:
        return [int(i) for i in row["prompt_ids"]]
    raise ValueError(
        f"A GRPO prompt row needs a 'prompt' (text or messages), 'messages' or 'prompt_ids' column; this one has "
        f"{', '.join(sorted(row)) or 'nothing'}."
    )


def tokenize_prompt(tokenizer, prompt) -> np.ndarray:
    """A prompt's token ids: a message list through the chat template with the generation prompt, a text
    as it is, token ids unchanged."""
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
        return np.asarray(prompt, dtype=np.int64)
    if isinstance(prompt, str):
        text = prompt
    else:
        text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"The prompt {prompt!r:.80} has no tokens: give every row a non-empty prompt.")
    return np.asarray(ids, dtype=np.int64)


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn (`GRPOConfig`'s fields of the same names)."""

    num_generations: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    generation_batch_size: int | None = None
    static_decode: bool | None = None


def static_decoding(model, asked: bool | None) -> bool:
    """Whether a rollout samples through `fastft.training.objectives.decode.StaticDecoder` (`asked` None: wherever the
    model supports it) or through ``generate`` (False, or an architecture it does not cover)."""
    if asked is False:
        return False
    if supports(model):
        return True
    if asked:
        from fastft.training.objectives.decode import SUPPORTED_MODEL_TYPES

        raise ValueError(
            f"static_decode=True covers the decoders {', '.join(sorted(SUPPORTED_MODEL_TYPES))} with full "
            f"attention in every layer; this {type(model).__name__} is not one: leave static_decode=None "
            "(generate samples it)."
        )
    return False


def stop_ids(model, tokenizer) -> set[int]:
    """Every token id that ends a completion: the tokenizer's EOS and the generation config's."""
    ids = set(stop_token_ids(model, tokenizer))
    if not ids:
        raise ValueError(
            "The tokenizer has no EOS token, so no completion could stop: set tokenizer.eos_token."
        )
    return ids


class Samples(NamedTuple):
    """A rollout's completions, prompt-major (prompt i's are ``i*G … i*G+G-1``): their token ids (EOS
    included where one was drawn), whether each ran out of tokens, and -- where the static decoder drew them
    and they were asked for -- each drawn token's log-probability under the sampling policy at temperature 1,
    ``[completions, max_new_tokens]`` float32 on the model's device (None otherwise)."""

    completion_ids: list[np.ndarray]
    truncated: np.ndarray
    log_probs: torch.Tensor | None = None


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompt_ids: list[np.ndarray],
    sampling: Sampling,
    seed: tuple[int, int],
    decode_stats: dict[str, int] | None = None,
    keep_log_probs: bool = False,
) -> Samples:
    """`sampling.num_generations` completions of each prompt (`Samples`). `decode_stats` (a dict) gets the
    static decoder's eager and replayed decode steps added to it; `keep_log_probs` asks the static decoder for
    the drawn tokens' log-probabilities (``generate`` gives none: `Samples.log_probs` stays None)."""
    device = next(model.parameters()).device
    stops = stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    chunk = sampling.generation_batch_size or len(prompt_ids)
    static = static_decoding(model, sampling.static_decode)
    was_training = model.training
    model.eval()
    completions: list[np.ndarray] = []
    truncated: list[bool] = []
    log_probs: list[torch.Tensor] = []
    devices = [device] if device.type == "cuda" else []
    derived = int(np.random.SeedSequence(list(seed)).generate_state(1)[0])
    generator = None
    if static:  # its own generator: the global one is left alone, and never meets a graph capture
        generator = torch.Generator(device=device)
        generator.manual_seed(derived)
    try:
        with contextlib.nullcontext() if static else torch.random.fork_rng(devices=devices):
            if not static:
                torch.manual_seed(derived)
            for start in range(0, len(prompt_ids), chunk):
                part = prompt_ids[start : start + chunk]
                width = max(len(ids) for ids in part)
                input_ids = torch.full((len(part), width), pad, dtype=torch.long)
                attention_mask = torch.zeros((len(part), width), dtype=torch.long)
                for row, ids in enumerate(part):
                    input_ids[row, width - len(ids) :] = torch.from_numpy(ids)
                    attention_mask[row, width - len(ids) :] = 1
                if static:
                    group = sampling.num_generations
                    decoder = StaticDecoder(
                        model,
                        len(part) * group,
                        width,
                        sampling.max_new_tokens,
                        stops,
                        pad,
                        sampling.temperature,
                        sampling.top_p,
                        generator=generator,
                        group=group,
                        keep_log_probs=keep_log_probs,
                    )
                    new_ids = decoder.decode(input_ids, attention_mask)
                    if keep_log_probs:
                        log_probs.append(decoder.log_probs)
                    if decode_stats is not None:
                        for key, count in decoder.stats.items():
                            decode_stats[key] = decode_stats.get(key, 0) + count
                    del decoder  # its KV cache goes now, before the next chunk's or the update's
                else:
                    new_ids = model.generate(
                        input_ids=input_ids.to(device),
                        attention_mask=attention_mask.to(device),
                        do_sample=True,
                        temperature=sampling.temperature,
                        top_p=sampling.top_p,
                        top_k=0,  # the policy's distribution: no top-k or repetition penalty from generation_config
                        repetition_penalty=1.0,
                        max_new_tokens=sampling.max_new_tokens,
                        num_return_sequences=sampling.num_generations,
                        pad_token_id=pad,
                        eos_token_id=sorted(stops),
                        use_cache=True,
                    )[:, width:]
                for ids in new_ids.cpu().numpy():
                    ends = np.flatnonzero(np.isin(ids, list(stops)))
                    completions.append(ids[: ends[0] + 1] if len(ends) else ids)
                    truncated.append(not len(ends))
    finally:
        model.train(was_training)
    return Samples(completions, np.asarray(truncated), torch.cat(log_probs) if log_probs else None)


@dataclass(frozen=True)
class MicroBatch:
    """Packed completions of one micro-batch: the batch, which completions it holds (their indices in the
    step), and each one's token count as a ``[sequences]`` tensor."""

    batch: PackedBatch
    members: np.ndarray
    counts: torch.Tensor
    sequence: torch.Tensor

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(
            self.batch.to(device),
            self.members,
            self.counts.to(device, non_blocking=True),
            self.sequence.to(device, non_blocking=True),
        )


def pack_completions(
    prompt_ids: list[np.ndarray], completion_ids: list[np.ndarray], micro_batch_tokens: int | None
) -> list[MicroBatch]:
    """The step's sequences (prompt + completion, one per completion) packed into micro-batches of at most
    `micro_batch_tokens` tokens (None: one micro-batch). Only completion tokens are trained."""
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    if micro_batch_tokens is None:
        bins = [list(range(len(lengths)))]
    else:
        if max(lengths) > micro_batch_tokens:
            raise ValueError(
                f"A prompt with its completion takes {max(lengths)} tokens, more than micro_batch_tokens="
                f"{micro_batch_tokens}: raise micro_batch_tokens to at least the longest prompt + max_new_tokens."
            )
        bins = [sorted(b) for b in best_fit_decreasing(lengths, micro_batch_tokens)]
    batches = []
    for members in bins:
        ids = [np.concatenate([prompt_ids[i], completion_ids[i]]) for i in members]
        labels = [
            np.concatenate([np.full(len(prompt_ids[i]), IGNORE_INDEX), completion_ids[i]]) for i in members
        ]
        batch = PackedBatch.from_sequences(ids, labels)
        counts = np.asarray([len(completion_ids[i]) for i in members], dtype=np.float32)
        sequence = np.repeat(np.arange(len(members)), counts.astype(np.int64))
        batches.append(
            MicroBatch(batch, np.asarray(members), torch.from_numpy(counts), torch.from_numpy(sequence))
        )
    return batches

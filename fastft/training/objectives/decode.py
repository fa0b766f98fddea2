"""Static-cache sampling for GRPO's rollouts, each decode step replayed from one CUDA graph on a GPU.

Hugging Face ``generate`` spends most of a decode step on the host (BENCHMARKS.md, "GRPO step and rollout
generation"). `StaticDecoder` keeps everything a step
touches in fixed buffers -- a KV cache of ``width + max_new_tokens`` slots per layer (`StaticKVCache`, which
writes at a position held in a device tensor), the next tokens, their positions, an additive attention mask
recomputed on the device each step, the output ids and the finished flags -- so one step is the same kernels on the
same addresses every time. On CUDA it runs two steps eagerly on a side stream, captures the third, and
replays the graph for the rest; elsewhere it runs every step eagerly (the same code, so the CPU tests check
the math the graph replays).

Rows are left-padded to the chunk's longest prompt: every row writes the same cache slot at each step, and a
pad slot is closed in the mask (a pad query attends only to itself, so no softmax row is empty). Position ids
count real tokens only, as ``generate`` does with an attention mask. The model gets that mask as a ready 4D
additive mask, so transformers builds none, and explicit ``position_ids``, so it never asks the cache how much
it holds (a host read of a device counter that a graph would freeze at its capture value).

Sampling is ``generate``'s: logits over temperature, nucleus `top_p` (the smallest set of tokens whose
probability reaches `top_p`, at least one), then a draw from the softmax -- as ``argmax(p / E)`` with
``E ~ Exp(1)`` per token, which picks token i with probability p_i and needs no host work. The noise is
drawn into a fixed buffer before each step, outside the graph, from `generator` (`fastft.training.objectives.rollout.sample`
gives each rollout its own, seeded with the step; on an H200, a draw from the default generator forked by
``fork_rng`` around a capture failed the next rollout's first draw): a seeded rollout draws the same
completions eagerly or replayed, and every run of the same seed the same ones.

A row stops at its first stop token (kept) and pads after it. The host reads the finished flags every 16
steps on a GPU (a sync) and every step on the CPU (free there): decoding ends once every row has stopped, and
once at most half the batch is still running the finished rows leave it (`compact`): every per-row buffer and
the KV cache are cut to the live rows, a new graph is captured for the smaller batch, and what the dropped
rows drew stays in the results. The noise is drawn for every row and gathered for the live ones, so
compacting changes the work a step does and never what it draws: a group's short answers stop costing
decode work once they end instead of riding along with the longest one (BENCHMARKS.md, "Rollout decode:
finished rows leave the batch"); each compaction costs two eager steps and one capture. The finished check reads `is_stop`, a table over the vocabulary, not ``torch.isin``
(which sorts, syncing the host, for a large stop set: the capture then failed).

`supports(model)` says whether a model can decode this way: a plain causal decoder whose layers all attend alike, to the full sequence or within one sliding window (Mistral's),
which the mask then carries; the others (hybrid layers, attention sinks) sample through ``generate``.
"""

from __future__ import annotations

import inspect
import warnings

import torch

from fastft.runtime.model_state import base_model, model_state
from fastft.training.graph import GraphCaptureWarning, warmup_stream

# decoders whose layers write their KV through `cache.update(key, value, layer_idx, ...)`, rotate with the
# given position ids and read a 4D additive mask as it is; each is checked against a full forward in
# tests/training/test_decode.py
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"})
_FINISHED_CHECK_EVERY = 16


def _config(model):
    base = base_model(model)
    return base, base.config


def attention_window(model) -> int | None | bool:
    """The sliding window every layer of `model` attends within (None: full attention), or False where
    layers differ (Qwen2's `max_window_layers`, Gemma's hybrid layers): one mask cannot serve them all."""
    _, config = _config(model)
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        window = None
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds <= {"full_attention"} and (window is None or not kinds):
        return window
    if kinds == {"sliding_attention"} and window:
        return window
    return False


def supports(model) -> bool:
    """Whether `model` decodes with `StaticDecoder` (else ``generate``): a supported architecture whose
    layers all attend alike (the full sequence, or one sliding window)."""
    _, config = _config(model)
    return (
        getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES and attention_window(model) is not False
    )


class StaticKVCache:
    """A KV cache of `length` slots per layer at fixed addresses, for transformers' attention layers (it
    answers ``update`` as their ``Cache`` does). A call's tokens go to slots ``position, position + 1, …``,
    `position` being a one-element device tensor the decoder advances in place; each layer's keys and values
    are allocated at its first update, in its own shape and dtype."""

    is_compileable = True

    def __init__(self, length: int, device: torch.device) -> None:
        self.length = length
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self._offsets = torch.arange(length, device=device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):
            rows, heads, _, dim = key_states.shape
            self.keys.append(key_states.new_zeros(rows, heads, self.length, dim))
            self.values.append(value_states.new_zeros(rows, heads, self.length, value_states.shape[-1]))
        slots = self.position + self._offsets[: key_states.shape[-2]]
        self.keys[layer_idx].index_copy_(2, slots, key_states)
        self.values[layer_idx].index_copy_(2, slots, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def expand(self, group: int) -> None:
        """Each row's keys and values repeated `group` times in place of it (a prompt prefilled once for
        its G completions)."""
        self.keys = [keys.repeat_interleave(group, 0) for keys in self.keys]
        self.values = [values.repeat_interleave(group, 0) for values in self.values]

    def keep(self, rows: torch.Tensor) -> None:
        """Only these rows from now on (finished rows leave the batch)."""
        self.keys = [keys.index_select(0, rows) for keys in self.keys]
        self.values = [values.index_select(0, rows) for values in self.values]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError(
            "StaticDecoder passes position_ids on every call: nothing should ask the cache's length"
        )

    def __len__(self) -> int:
        return len(self.keys)


def nucleus_sample(
    logits: torch.Tensor, temperature: float, top_p: float, noise: torch.Tensor | None = None
) -> torch.Tensor:
    """One token per row of `logits` ``[rows, vocab]`` as ``generate`` samples it (temperature, then top-p
    keeping at least one token), drawn as ``argmax(p / E)`` with exponential noise `E` (float32, the shape
    of `logits`; drawn here when not given): no host work."""
    scores = logits.float() / temperature
    if top_p < 1.0:
        ascending, order = scores.sort(dim=-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probabilities = scores.softmax(dim=-1)
    if noise is None:
        noise = torch.empty_like(probabilities).exponential_()
    return (probabilities / noise).argmax(dim=-1)


def _cache_keyword(model) -> str:
    """What the causal LM calls its KV cache argument: ``cache`` from transformers 5.2x, else
    ``past_key_values``."""
    base, _ = _config(model)
    parameters = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class StaticDecoder:
    """Samples up to `new_tokens` tokens for each of `rows` rows: `group` rows (G completions) per left-padded
    prompt of `width` tokens, the prompt prefilled once for its group.

    ``choose(logits) -> token ids`` picks each step's tokens (default `nucleus_sample` at `temperature` and
    `top_p`, its noise from `generator`). `decode(input_ids, attention_mask)`, one row per prompt, returns
    ``[rows, new_tokens]`` ids (prompt-major), `pad` after each row's first stop token; with `keep_log_probs`,
    `log_probs` then holds each drawn token's log-probability at temperature 1 (float32, same shape).
    `compact` drops finished rows from the batch once at most half of it runs (module docstring; a `choose`
    then sees the live rows' logits only). On CUDA the decode
    steps replay one graph (`graph`), released when `decode` returns (its memory pool with it: the training
    step after a rollout gets the memory back).
    """

    def __init__(
        self,
        model,
        rows: int,
        width: int,
        new_tokens: int,
        stops: set[int],
        pad: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        choose=None,
        generator: torch.Generator | None = None,
        group: int = 1,
        keep_log_probs: bool = False,
        compact: bool = True,
    ) -> None:
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
        self.model = model
        self.device = next(model.parameters()).device
        if group < 1 or rows % group:
            raise ValueError(f"rows={rows} must be a whole number of groups of {group}")
        self.rows, self.width, self.new_tokens, self.group = rows, width, new_tokens, group
        self.noise: torch.Tensor | None = None  # [rows, vocab] float32, drawn before each step
        self._draws_noise = choose is None
        self.generator = generator  # of the noise (None: the default one)
        # a method, not a lambda over self: a cycle would keep the decoder, and its KV cache, until the garbage
        # collector runs, alive through the training step (BENCHMARKS.md, "GRPO step and rollout generation")
        self._choose, self.temperature, self.top_p = choose, temperature, top_p
        self.pad = pad
        # a lookup table, not torch.isin: isin sorts (a host sync, which breaks a capture) for large stop sets
        head = model.get_output_embeddings()
        vocab = head.weight.shape[0] if head is not None else model.get_input_embeddings().weight.shape[0]
        self.is_stop = torch.zeros(max(vocab, max(stops, default=-1) + 1), dtype=torch.bool)
        self.is_stop[[stop for stop in stops if stop >= 0]] = True
        self.is_stop = self.is_stop.to(self.device)
        self.dtype = model.get_input_embeddings().weight.dtype
        self.closed = torch.finfo(self.dtype).min
        self._cache_keyword = _cache_keyword(model)
        self.window = attention_window(model) or None
        self.slots = torch.arange(width + new_tokens, device=self.device)
        self.keep_log_probs = keep_log_probs
        self._allocate_rows()
        self.step_index = torch.zeros(1, dtype=torch.long, device=self.device)
        self.graph = None
        self.compact = compact
        self.stats = dict(eager_steps=0, replays=0, captures=0, compactions=0)

    def _allocate_rows(self) -> None:
        """Every per-row buffer, for all `rows` (a compaction cuts them; a new `decode` starts afresh)."""
        rows, slots, device, pad = self.rows, self.width + self.new_tokens, self.device, self.pad
        self.cache = StaticKVCache(slots, device)
        self.tokens = torch.full((rows, 1), pad, dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.real = torch.ones((rows, slots), dtype=torch.bool, device=device)  # not a pad slot
        self.mask = torch.full((rows, 1, 1, slots), self.closed, dtype=self.dtype, device=device)
        self.output = torch.full((rows, self.new_tokens), pad, dtype=torch.long, device=device)
        self.finished = torch.zeros(rows, dtype=torch.bool, device=device)
        # each drawn token's log-probability under the policy (temperature 1, no top-p: what the GRPO loss
        # computes), for GRPO's old policy when it updates more than once per rollout
        self.log_probs = (
            torch.zeros((rows, self.new_tokens), dtype=torch.float32, device=device)
            if self.keep_log_probs
            else None
        )
        self.live: torch.Tensor | None = None  # after a compaction: each batch row's row in the results

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """This step's tokens: the `choose` given, else `nucleus_sample` with the drawn noise."""
        if self._choose is not None:
            return self._choose(logits)
        return nucleus_sample(logits, self.temperature, self.top_p, self.noise)

    def _forward(self, input_ids, position_ids, attention_mask) -> torch.Tensor:
        output = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_keyword: self.cache},
        )
        return output.logits[:, -1]

    def _take(self, logits: torch.Tensor) -> None:
        """Record the step's tokens (`pad` for finished rows) and advance every counter, on the device."""
        chosen = torch.where(self.finished, self.pad, self.choose(logits))
        self.output.index_copy_(1, self.step_index, chosen[:, None])
        if self.log_probs is not None:
            taken = logits.float().log_softmax(-1).gather(1, chosen[:, None])
            self.log_probs.index_copy_(1, self.step_index, taken)
        self.finished |= self.is_stop[chosen]
        self.tokens.copy_(chosen[:, None])
        self.step_index += 1

    def _open_slots(self) -> None:
        """The step's mask: every real slot up to the new token's, within the window."""
        visible = self.real & (self.slots <= self.cache.position)
        if self.window is not None:
            visible &= self.cache.position - self.slots < self.window
        self.mask.fill_(self.closed).masked_fill_(visible[:, None, None], 0.0)

    def _step(self) -> None:
        """One decode step: the new token's slot opens, the model reads it, the next token is drawn."""
        self._open_slots()
        logits = self._forward(self.tokens, self.positions, self.mask)
        self.cache.position += 1
        self.positions += 1
        self._take(logits)

    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Each distinct prompt once (`group` rows share it), its KV then repeated for every row."""
        prompts, width = input_ids.shape
        if (prompts * self.group, width) != (self.rows, self.width):
            raise ValueError(
                f"StaticDecoder for {self.rows // self.group} x {self.width} prompts got {prompts} x {width}"
            )
        real = attention_mask.to(device=self.device, dtype=torch.bool)
        slots = torch.arange(width + self.new_tokens, device=self.device)
        queries = torch.arange(width, device=self.device)
        keys_real = torch.nn.functional.pad(real, (0, self.new_tokens))  # [rows, slots]
        sees = (slots[None, :] <= queries[:, None])[None] & keys_real[:, None, :]
        if self.window is not None:
            sees &= (queries[:, None] - slots[None, :] < self.window)[None]
        sees |= (slots[None, :] == queries[:, None])[None]  # a pad query sees itself: no empty softmax row
        prefill_mask = torch.zeros(sees.shape, dtype=self.dtype, device=self.device)
        prefill_mask.masked_fill_(~sees, self.closed)
        positions = (real.long().cumsum(-1) - 1).clamp_min(0)
        if self.cache.keys:  # a decode before: a fresh cache (its group repeat and compactions undone)
            self._allocate_rows()
        self.cache.position.zero_()
        logits = self._forward(input_ids.to(self.device), positions, prefill_mask[:, None])
        if self.group > 1:
            self.cache.expand(self.group)
            logits, real, positions = (t.repeat_interleave(self.group, 0) for t in (logits, real, positions))
        self.real[:, :width] = real
        self.cache.position.fill_(width)
        self.positions.copy_(positions[:, -1:] + 1)
        self.finished.zero_()
        self.step_index.zero_()
        self.output.fill_(self.pad)
        self.results, self.result_log_probs = self.output, self.log_probs
        if self._draws_noise and (self.noise is None or self.noise.shape != logits.shape):
            self.noise = torch.empty(logits.shape, dtype=torch.float32, device=self.device)
        self.all_noise = self.noise
        self._draw_noise()
        self._take(logits)

    def _draw_noise(self) -> None:
        """The next step's exponential noise, eagerly into the buffer the (captured) step reads: drawn for
        every row and gathered for the live ones after a compaction, so compacting never changes a draw."""
        if self._draws_noise:
            self.all_noise.exponential_(generator=self.generator)
            if self.live is not None:
                torch.index_select(self.all_noise, 0, self.live, out=self.noise)

    def _compact(self, keep: torch.Tensor) -> None:
        """Only the batch rows `keep` decode from here on: every per-row buffer (the KV cache's too) is cut to
        them, and what the dropped rows drew stays in the results (`results`)."""
        self._write_back()
        self.live = keep if self.live is None else self.live[keep]
        for name in ("tokens", "positions", "real", "mask", "output", "finished", "log_probs"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).index_select(0, keep))
        if self._draws_noise:
            self.noise = self.all_noise.index_select(0, self.live)
        self.cache.keep(keep)
        self.stats["compactions"] += 1

    def _write_back(self) -> None:
        """The batch's rows into the results (nothing to do before a compaction: they are the same)."""
        if self.live is not None:
            self.results.index_copy_(0, self.live, self.output)
            if self.log_probs is not None:
                self.result_log_probs.index_copy_(0, self.live, self.log_probs)

    def _capture(self, state) -> torch.cuda.CUDAGraph | None:
        """One decode step captured (not run), or None after a failed capture: the decoding goes on eagerly,
        and so do this model's later rollouts (`ModelState.decode_graphs`), with one warning."""
        graph = torch.cuda.CUDAGraph()
        try:
            # thread-local: the studio trains in a background thread while the notebook's thread stays free
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._step()
        except Exception as error:  # noqa: BLE001 - a host sync or an op a graph cannot hold
            state.decode_graphs = False
            warnings.warn(
                f"CUDA graph capture of a decode step failed ({type(error).__name__}: {error}); this model's "
                "rollouts decode eagerly from now on.",
                GraphCaptureWarning,
                stacklevel=3,
            )
            return None
        return graph

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self._prefill(input_ids, attention_mask)
        remaining = self.new_tokens - 1
        state = model_state(self.model)
        graphs = self.device.type == "cuda" and remaining > 3 and state.decode_graphs
        # a host read of the finished flags: free on the CPU, a sync on a GPU (there every 16 steps)
        check_every = _FINISHED_CHECK_EVERY if self.device.type == "cuda" else 1
        side = warmup_stream(self.device) if graphs else None
        try:
            done = warm = 0  # steps run; eager steps since the batch last changed shape
            while done < remaining:
                if done % check_every == 0:
                    live = (~self.finished).nonzero().flatten()
                    if not len(live):
                        break
                    if self.compact and len(live) <= len(self.finished) // 2:
                        self._compact(live)
                        self.graph, warm = None, 0
                self._draw_noise()
                if graphs and self.graph is None and warm >= 2 and remaining - done > 3:
                    self.graph = self._capture(state)
                    graphs = self.graph is not None
                    self.stats["captures"] += graphs
                if self.graph is not None:
                    self.graph.replay()
                    self.stats["replays"] += 1
                elif graphs:  # a warm-up step before a capture: a real step, on a side stream
                    side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(side):
                        self._step()
                    torch.cuda.current_stream(self.device).wait_stream(side)
                    self.stats["eager_steps"] += 1
                    warm += 1
                else:
                    self._step()
                    self.stats["eager_steps"] += 1
                done += 1
            self._write_back()
            self.output, self.log_probs = self.results, self.result_log_probs  # every row's, for the caller
        finally:
            self.graph = None
        return self.results.clone()


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "StaticDecoder",
    "StaticKVCache",
    "attention_window",
    "nucleus_sample",
    "supports",
]

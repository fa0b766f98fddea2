"""What a preference or GRPO step adds to an SFT step's bytes: micro-batches of whole pairs, the summed
log-probs, DPO's reference pass, and GRPO's rollout (the static decoder's KV cache and sampling) with its
settings (`fastft.vram.estimate` reads them by ``method``)."""

from __future__ import annotations

from dataclasses import dataclass

from fastft.vram.part_bytes import Stored, fused_ce_rows
from fastft.vram.result import VramEstimateError
from fastft.vram.settings import ResolvedRun

PREFERENCE_METHODS = ("dpo", "orpo", "simpo")
# `estimate_vram`'s GRPO arguments, in `Rollout.of`'s order (its settings repeat them as given)
ROLLOUT_ARGUMENTS = (
    "generations",
    "prompts_per_step",
    "completion_tokens",
    "generation_batch_size",
    "kl_coef",
    "num_iterations",
)


def sides_per_unit(method: str, precompute_reference: bool) -> int:
    """Sequences one `seq_len` unit of a micro-batch holds: 1 for SFT and GRPO, a pair's 2 for a preference
    method."""
    if method not in ("sft", "grpo", *PREFERENCE_METHODS):
        raise VramEstimateError(
            f"method={method!r} is not one of sft, {', '.join(PREFERENCE_METHODS)}, grpo."
        )
    if precompute_reference and method != "dpo":
        raise VramEstimateError(
            f"precompute_reference=True applies to method='dpo' only ({method!r} has no reference pass)."
        )
    return 2 if method in PREFERENCE_METHODS else 1


@dataclass(frozen=True)
class Rollout:
    """A GRPO step's sampling: `rows` sequences decoded at once, `step_rows` trained per step."""

    generations: int
    prompts: int  # per generate call
    step_rows: int
    completion_tokens: int
    reference_pass: bool  # a KL reference or an old-policy pass before the update

    @property
    def rows(self) -> int:
        return self.prompts * self.generations

    @classmethod
    def of(
        cls, seq_len, generations, prompts_per_step, completion_tokens, generation_batch_size, kl, iterations
    ):
        for name, value, low in (
            ("generations", generations, 1),
            ("prompts_per_step", prompts_per_step, 1),
            ("completion_tokens", completion_tokens, 1),
            ("num_iterations", iterations, 1),
        ):
            if not isinstance(value, int) or value < low:
                raise VramEstimateError(f"{name}={value!r}: give a whole number of at least {low}.")
        if completion_tokens >= seq_len:
            raise VramEstimateError(
                f"completion_tokens={completion_tokens} must be below seq_len={seq_len} (a prompt and its "
                "completion): pass seq_len=prompt tokens + completion_tokens."
            )
        prompts = min(generation_batch_size or prompts_per_step, prompts_per_step)
        return cls(
            generations, prompts, prompts_per_step * generations, completion_tokens, kl > 0 or iterations > 1
        )


# top-p sampling of one decode step, bytes per row and vocabulary entry: the 16-bit logits, their fp32
# scores, the ascending sort's values (fp32) and indices (int64), the cumulative probabilities (fp32), the
# drop mask scattered back (2 bools), the probabilities and the exponential noise (fp32 each)
_SAMPLING_BYTES_PER_LOGIT = 2 + 4 + 4 + 8 + 4 + 2 + 4 + 4


def rollout_bytes(run: ResolvedRun, stored: Stored, rollout: Rollout) -> int:
    """The rollout's peak above what lives through the step (`fastft.training.objectives.decode.StaticDecoder`): the
    largest of the prefill (each prompt once: its KV cache, one layer's forward, the 4D mask, the last
    position's logits), the KV cache repeated for the group (both copies at once), and a decode step (every
    row's cache and the sampling buffers); on 4/8-bit bases one dequantised weight on top."""
    inventory, rows, prompts, length = run.inventory, rollout.rows, rollout.prompts, run.seq_len
    width = length - rollout.completion_tokens  # the prompts' slots
    residual = run.profile.residual
    per_slot = inventory.num_layers * 2 * inventory.num_kv_heads * inventory.head_dim * residual
    kv_prompts, kv_rows = prompts * length * per_slot, rows * length * per_slot
    prefill = (
        kv_prompts
        + (max(stored.per_layer, default=0) + 2 * run.layer_input) * prompts * width  # one layer's forward
        + prompts * width * length * residual  # the prompts' 4D additive mask
        + prompts * inventory.vocab_size * (residual + 4)  # the last position's logits
    )
    expand = kv_prompts + kv_rows
    decode = (
        kv_rows + rows * inventory.vocab_size * _SAMPLING_BYTES_PER_LOGIT + rows * length * (residual + 1)
    )
    dequantised = 0
    if run.profile.quantized:
        dequantised = (
            max((lin.in_features * lin.out_features for lin in inventory.linears), default=0) * residual
        )
    return max(prefill, expand, decode) + dequantised


def with_log_prob_sums(run: ResolvedRun, loss_entry: tuple[int, str]) -> tuple[int, str]:
    """Per-sequence summed log-probs (`fastft.training.objectives.preference.sequence_log_probs`): the per-target fp32
    log-probs, their trained mask and the int64 sequence of each target, beside the loss's own buffers."""
    logits, note = loss_entry
    return logits + 16 * run.trained, note + "; per-target log-probs summed per sequence (16 B a target)"


def reference_pass(run: ResolvedRun, stored: Stored) -> int:
    """DPO's reference forward (adapters off, no autograd), before the policy's: nothing is saved, so the
    moment is one layer's forward (its input, output and activations) or the final norm's output with one
    log-prob chunk of the fused head and the per-target log-probs."""
    tokens, trained, vocab = run.tokens, run.trained, run.inventory.vocab_size
    layer = (max(stored.per_layer, default=0) + 2 * run.layer_input) * tokens
    if run.loss == "eager":  # the trained positions' logits, their fp32 copy and log-softmax (no grads kept)
        chunk = trained * vocab * 10
    else:
        chunk = fused_ce_rows(trained, vocab, run.profile.residual) * vocab * run.profile.residual
    head = run.layer_input * tokens + chunk
    return max(layer, head + 16 * trained)

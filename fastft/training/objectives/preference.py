"""Preference tuning on packed pairs: DPO (sigmoid, IPO, robust), ORPO and SimPO.

A micro-batch of `fastft.data.pairs.PackedPairs` holds whole pairs, chosen and rejected alternating. One
forward gives every trained target's log-probability through the model's fused head
(`fastft.training.loss.target_losses`: the ``[tokens, vocab]`` logits never exist, forward or backward); they
are summed per sequence on the device (no host sync), so sequence ``2 i`` is pair ``i``'s chosen answer and
``2 i + 1`` its rejected one. DPO's reference log-probs come from the same model with its adapters disabled
(the flags PEFT's ``disable_adapter()`` sets, `adapters_disabled`), under ``no_grad``: no second copy of
the weights.

With ``c``/``r`` the policy's summed log-probs of the chosen/rejected answer, ``c0``/``r0`` the reference's,
``|c|``/``|r|`` the answers' token counts, β `beta` and ε `label_smoothing`:

* ``dpo`` sigmoid: ``z = β ((c - c0) - (r - r0))``, loss ``-(1-ε) log σ(z) - ε log σ(-z)``;
* ``dpo`` robust: ``(-(1-ε) log σ(z) + ε log σ(-z)) / (1 - 2ε)``;
* ``dpo`` IPO: with length-averaged log-ratios, ``((c - c0) / |c| - (r - r0) / |r| - 1 / (2β))²``;
* ``orpo`` (no reference): with ``c̄ = c / |c|``, ``r̄ = r / |r|``, the chosen answer's mean NLL ``-c̄`` minus
  ``β log σ(log-odds)``, ``log-odds = (c̄ - r̄) - (log(1 - e^c̄) - log(1 - e^r̄))``;
* ``simpo`` (no reference): ``z = β (c̄ - r̄) - γ``, loss ``-(1-ε) log σ(z) - ε log σ(-z)``.

Rewards are ``β (c - c0)`` and ``β (r - r0)`` for DPO (IPO included), ``β c̄`` and ``β r̄`` for ORPO and
SimPO (TRL's conventions); the margin is their difference and the accuracy the share of pairs whose
chosen reward is the higher. The step loss is the mean over the step's pairs.

`PreferenceObjective` runs these on the `Trainer`'s packed step (`fastft.training.objectives.packed`): its unit
is the pair, its metrics the mean rewards, margin and accuracy (`StepEvent.preference`, `EvalEvent.preference`).

With ``TrainConfig(precompute_reference=True)`` the adapter-disabled pass runs once over every bin before
training (`cached_reference_log_probs`), and each step reads its sequences' reference log-probs from that
cache instead of running the reference forward. The cache is kept with the data (`PackedPairs`), indexed by
sequence (not by bin or step, so any shuffle or a resume finds each sequence's value) and keyed by a
fingerprint of the base model (`base_fingerprint`), so data reused with another model is computed again.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fastft.data.batch import PackedBatch
from fastft.data.packing import PackedDataset
from fastft.data.pairs import PackedPairs, pack_pairs
from fastft.data.stream import PackedStream
from fastft.training.loss import target_losses
from fastft.training.objectives.packed import PackedObjective

# Function-local imports: peft imports bitsandbytes, which asks the hub for a kernel: peft loads first under
# `fastft.data.hub.hub_offline_while_importing` (fastft.models.lora).

METHODS = ("sft", "dpo", "orpo", "simpo")
DPO_LOSSES = ("sigmoid", "ipo", "robust")
DEFAULT_BETA = {"dpo": 0.1, "orpo": 0.1, "simpo": 2.0}
METRICS = ("rewards_chosen", "rewards_rejected", "margin", "accuracy")


@dataclass(frozen=True)
class PreferenceLoss:
    """One preference objective (`TrainConfig`'s ``method``, ``dpo_loss``, ``beta``, ``label_smoothing``,
    ``simpo_gamma``)."""

    method: str = "dpo"
    dpo_loss: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    @property
    def needs_reference(self) -> bool:
        return self.method == "dpo"


def sequence_log_probs(model: torch.nn.Module, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probs, trained-token counts) of each sequence of `batch`, both ``[num_sequences]`` fp32
    on the model's device. Pad targets (a static shape's) count nothing."""
    log_probs = -target_losses(model, batch)
    sequence = torch.searchsorted(batch.cu_seqlens[1:].to(torch.int64), batch.target_positions, right=True)
    trained = (batch.target_ids != -100).to(log_probs.dtype)
    sums = log_probs.new_zeros(batch.num_sequences).index_add_(0, sequence, log_probs * trained)
    counts = log_probs.new_zeros(batch.num_sequences).index_add_(0, sequence, trained)
    return sums, counts


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base model's forward, with autograd off: every adapter layer's ``disable_adapters`` flag set for
    the block and restored after, the state PEFT's ``disable_adapter()`` leaves the layers in.

    PEFT's own context manager costs tens of milliseconds of host time per use on an 8B model (it builds the
    model's whole status report, module reprs included, and toggles ``requires_grad`` on every adapter
    tensor), paid on every DPO step before the GPU has work; under ``no_grad`` the flags alone give the same
    forward (the fused and PEFT forwards read only them). Models that are not PEFT LoRA-style tuners (prompt
    learning, or no adapters) take PEFT's context manager."""
    layers = _adapter_layers(model)
    if layers is None:
        with model.disable_adapter(), torch.no_grad():
            yield
        return
    was_disabled = [layer._disable_adapters for layer in layers]
    model_was_disabled = getattr(model, "_adapters_disabled", False)
    try:
        for layer in layers:
            layer._disable_adapters = True
        model._adapters_disabled = True
        with torch.no_grad():
            yield
    finally:
        for layer, disabled in zip(layers, was_disabled, strict=True):
            layer._disable_adapters = disabled
        model._adapters_disabled = model_was_disabled


def _adapter_layers(model: torch.nn.Module) -> tuple | None:
    """The model's adapter layers (PEFT tuner layers and trained-copy wrappers), found once per set of
    adapters and kept on the instance; None where the flags are not how this model turns adapters off."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper  # PEFT >= 0.15: trained copies and tokens

    if not isinstance(model, PeftModel):
        return None
    config = model.peft_config.get(model.active_adapter)
    if config is None or config.is_prompt_learning or config.is_adaption_prompt:
        return None
    key = tuple(sorted(model.peft_config))
    cached = getattr(model, "_fastft_adapter_layers", None)
    if cached is None or cached[0] != key:
        layers = tuple(
            m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))
        )
        if not all(hasattr(m, "_disable_adapters") for m in layers):
            return None
        cached = (key, layers)
        model._fastft_adapter_layers = cached
    return cached[1]


def base_fingerprint(model: torch.nn.Module) -> str:
    """A key of the frozen base weights the reference comes from: the architecture, the parameter shapes and
    dtypes, and a checksum of the first and last base tensors (one reduction each, once per run)."""

    frozen = [(name, p) for name, p in model.named_parameters() if not p.requires_grad]
    digest = hashlib.sha256(type(getattr(model, "base_model", model)).__name__.encode())
    for name, parameter in frozen:
        digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype};".encode())
    with torch.no_grad():
        for _, parameter in frozen[:1] + frozen[-1:]:
            digest.update(repr(float(parameter.detach().double().sum())).encode())
    return digest.hexdigest()[:16]


def cached_reference_log_probs(model: torch.nn.Module, pairs) -> torch.Tensor:
    """Every sequence's summed reference log-prob (the model with its adapters off), ``[len(pairs.data)]`` fp32
    on the model's device, indexed like ``pairs.data``; computed once bin by bin and kept on `pairs` under the
    base model's fingerprint (a second call, or a resumed run on the same data, reads it back)."""
    key = base_fingerprint(model)
    cache = pairs.reference_cache
    if key not in cache:
        device = next(model.parameters()).device
        values = torch.zeros(len(pairs.data), device=device)
        was_training = model.training
        model.eval()
        try:
            with adapters_disabled(model):
                for index in range(len(pairs)):
                    sums, _ = sequence_log_probs(model, pairs.batch([index]).to(device))
                    values[torch.as_tensor(pairs.bins[index], device=device)] = sums.float()
        finally:
            model.train(was_training)
        cache.clear()  # one base model's values at a time
        cache[key] = values
    return cache[key].to(next(model.parameters()).device)


def pair_losses(
    settings: PreferenceLoss,
    policy: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the chosen and rejected rewards, each ``[pairs]``, from per-sequence (sums, counts)
    of the policy and (for DPO) the reference (see the module docstring)."""
    sums, counts = policy
    beta, smoothing = settings.beta, settings.label_smoothing
    if settings.method == "dpo":
        if reference is None:
            raise ValueError("DPO needs the reference log-probs (the model with its adapters disabled)")
        ratios = sums - reference[0]
        chosen_ratio, rejected_ratio = ratios[0::2], ratios[1::2]
        logits = chosen_ratio - rejected_ratio
        if settings.dpo_loss == "ipo":
            averaged = ratios / counts.clamp(min=1)
            losses = (averaged[0::2] - averaged[1::2] - 1 / (2 * beta)) ** 2
        elif settings.dpo_loss == "robust":
            losses = (
                -F.logsigmoid(beta * logits) * (1 - smoothing) + F.logsigmoid(-beta * logits) * smoothing
            ) / (1 - 2 * smoothing)
        else:
            losses = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
        return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    averaged = sums / counts.clamp(min=1)
    chosen, rejected = averaged[0::2], averaged[1::2]
    if settings.method == "orpo":
        log_odds = (chosen - rejected) - (torch.log1p(-torch.exp(chosen)) - torch.log1p(-torch.exp(rejected)))
        losses = -chosen - beta * F.logsigmoid(log_odds)
    elif settings.method == "simpo":
        logits = beta * (chosen - rejected) - settings.simpo_gamma
        losses = -F.logsigmoid(logits) * (1 - smoothing) - F.logsigmoid(-logits) * smoothing
    else:
        raise ValueError(f"unknown preference method {settings.method!r}; use one of {METHODS[1:]}")
    return losses, beta * chosen.detach(), beta * rejected.detach()


def pair_loss_sum(
    model: torch.nn.Module,
    batch: PackedBatch,
    settings: PreferenceLoss,
    reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's summed pair loss (a scalar with its graph) and its metric sums ``[4]`` (chosen and
    rejected rewards, margin, correctly ordered pairs), detached; the caller divides by the step's pairs.
    `reference`, the batch's sequences' precomputed reference log-probs (``[num_sequences]``), replaces the
    adapter-disabled forward. A batch padded to a static shape (`PackedBatch.padded`, for a CUDA graph) ends
    in pad segments; they pair up into pairs with no trained token, which add nothing to the loss, the
    rewards or the accuracy (found on the device, so a graph replays whatever the batch's pair count)."""
    if batch.num_sequences % 2:
        raise ValueError(
            f"a preference micro-batch needs whole pairs, got {batch.num_sequences} sequences: pack the data "
            "with fastft.pack_pairs(...)"
        )
    if settings.needs_reference and reference is None:
        with adapters_disabled(model):
            reference = sequence_log_probs(model, batch)[0]
    sums, counts = sequence_log_probs(model, batch)
    real = None
    if batch.static:  # padded to a static shape: the pad segments pair up into pairs without a trained token
        real = (counts[0::2] + counts[1::2]) > 0
        sides = real.repeat_interleave(2)
        # placeholders where a pad pair's values would be 0 / 0 (ORPO's log(1 - e^0)): no NaN, no gradient
        sums, counts = torch.where(sides, sums, -1.0), torch.where(sides, counts, 1.0)
        reference = None if reference is None else torch.where(sides, reference, -1.0)
    losses, chosen_rewards, rejected_rewards = pair_losses(
        settings, (sums, counts), None if reference is None else (reference, counts)
    )
    if real is not None:
        losses = torch.where(real, losses, 0.0)
        chosen_rewards = torch.where(real, chosen_rewards, 0.0)
        rejected_rewards = torch.where(real, rejected_rewards, 0.0)
    margin = chosen_rewards - rejected_rewards
    metrics = torch.stack(
        [chosen_rewards.sum(), rejected_rewards.sum(), margin.sum(), (margin > 0).to(margin.dtype).sum()]
    )
    return losses.sum(), metrics.float()


class PreferenceObjective(PackedObjective):
    """A preference objective on packed pairs (`TrainConfig`'s ``method`` "dpo", "orpo" or "simpo"): the step
    loss is the mean pair loss; the metrics fill `StepEvent.preference` and `EvalEvent.preference`."""

    unit = "pair"
    metrics = METRICS

    def __init__(self, settings: PreferenceLoss, precompute_reference: bool = False):
        super().__init__()
        self.settings = settings
        self.name = settings.method
        self.precompute_reference = precompute_reference
        self.references: dict | None = None  # "train" / "eval" → per-sequence reference log-probs

    @classmethod
    def from_config(cls, config) -> PreferenceObjective:
        """The objective of a `TrainConfig` (``beta`` None: the method's default)."""
        beta = config.beta if config.beta is not None else DEFAULT_BETA[config.method]
        settings = PreferenceLoss(
            config.method, config.dpo_loss, float(beta), config.label_smoothing, config.simpo_gamma
        )
        return cls(settings, config.precompute_reference)

    def prepare(self, trainer, train_data, eval_data) -> tuple:
        """Preference rows are packed with `pack_pairs`; `PackedPairs` stay as they are."""
        train_data, eval_data = (
            _as_pairs(train_data, trainer.tokenizer),
            _as_pairs(eval_data, trainer.tokenizer),
        )
        return super().prepare(trainer, train_data, eval_data)

    def captures_graphs(self, config) -> bool:
        # a precomputed reference is a per-step input the graph does not copy in: those DPO runs stay eager
        return not self.precompute_reference

    def start(self, trainer) -> None:
        """With ``precompute_reference``, the adapter-disabled pass over the train and eval pairs, once."""
        if not self.precompute_reference or self.references is not None:
            return
        self.references = {"train": cached_reference_log_probs(trainer.model, trainer.train_data)}
        if trainer.eval_data is not None:
            self.references["eval"] = cached_reference_log_probs(trainer.model, trainer.eval_data)

    def extra_input(self, trainer, split: str, bins: list) -> torch.Tensor | None:
        """The precomputed reference log-probs of these bins' sequences, in batch order (None without)."""
        if self.references is None or split not in self.references:
            return None
        data = trainer.train_data if split == "train" else trainer.eval_data
        members = torch.as_tensor([row for b in bins for row in data.bins[b]])
        return self.references[split][members.to(trainer.device, non_blocking=True)]

    def loss_sum(self, model: torch.nn.Module, batch: PackedBatch, extra=None):
        return pair_loss_sum(model, batch, self.settings, extra)

    def event_fields(self, metrics: list[float], info: dict) -> dict:
        return {"preference": preference_metrics(metrics, info["pairs"])}

    def eval_fields(self, means: list[float], pairs: int) -> dict:
        return {"preference": preference_metrics(means, pairs)}


def preference_metrics(values: list[float], pairs: int) -> dict[str, float] | None:
    """A step's or an evaluation's `METRICS` means with its pair count (None without values)."""
    if not values:
        return None
    return {"pairs": pairs, **dict(zip(METRICS, values, strict=True))}


def _as_pairs(data, tokenizer):
    """Preference data as `PackedPairs` (rows are packed with `pack_pairs`); None stays None."""
    if data is None or isinstance(data, PackedPairs):
        return data
    if isinstance(data, (PackedDataset, PackedStream)):
        raise ValueError(
            "A preference method trains on pairs: pass the preference rows, or fastft.pack_pairs(rows, tokenizer), "
            "not a dataset packed for SFT."
        )
    return pack_pairs(data, tokenizer)

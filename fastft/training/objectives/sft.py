"""Supervised fine-tuning: next-token cross-entropy on the trained tokens of packed bins.

The loss of a step is the sum over its trained tokens divided by their count (token-weighted over the
micro-batches), through the model's fused head (`fastft.training.loss.causal_lm_loss_sum`: no ``[tokens, vocab]``
logits).
"""

from __future__ import annotations

import torch

from fastft.data.batch import PackedBatch
from fastft.training.loss import causal_lm_loss_sum
from fastft.training.objectives.packed import PackedObjective


class SFTObjective(PackedObjective):
    """`TrainConfig(method="sft")`: the summed next-token loss of a micro-batch; no metrics."""

    name = "sft"

    def loss_sum(self, model: torch.nn.Module, batch: PackedBatch, extra=None) -> tuple[torch.Tensor, None]:
        return causal_lm_loss_sum(model, batch), None

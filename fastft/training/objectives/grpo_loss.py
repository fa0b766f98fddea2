"""The GRPO objective on packed completions: group advantages, the clipped ratio, the KL to the reference.

With ``l_t`` a completion token's log-probability under the policy, ``o_t`` under the policy that sampled it
(``l_t`` detached when each rollout takes one update, so the ratio is exactly 1 and the gradient is
``A ∇l_t``), ``r_t`` under the reference (the model with its adapters disabled), ``A_i`` completion ``i``'s
advantage, ε / ε_high the clip range and β `kl_coef`, each token's loss is

    ``-min(ρ_t A_i, clip(ρ_t, 1 - ε, 1 + ε_high) A_i) + β (e^(r_t - l_t) - (r_t - l_t) - 1)``

(the KL term is the k3 estimator of GRPO and TRL). The ratio ρ_t is ``e^(l_t - o_t)`` per token, or with
GSPO's sequence-level importance sampling ``e^(mean_t (l_t - o_t))`` over the completion's tokens, shared by
all of them. The step loss normalises the token losses (`loss_type`):

* ``grpo``: each completion's mean token loss, averaged over the step's completions;
* ``dapo``: the sum over every completion token of the step, divided by their count (token-level);
* ``dr_grpo``: that sum divided by ``completions × max_new_tokens`` (Dr. GRPO's constant).

Advantages are ``(R_i - mean(R_group)) / (std(R_group) + 1e-4)`` (``scale_rewards``; else not divided),
exactly 0 in a group whose rewards are all equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
IMPORTANCE_SAMPLING = ("token", "sequence")
SCALE_EPSILON = 1e-4


def group_advantages(rewards: np.ndarray, group_size: int, scale: bool = True) -> np.ndarray:
    """Group-normalised advantages (float64, host) of `rewards`, ``[groups * group_size]``, group-major."""
    grouped = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if scale:
        spread = grouped.std(axis=1, ddof=1, keepdims=True) if group_size > 1 else np.zeros_like(centred)
        centred = centred / (spread + SCALE_EPSILON)
    centred[grouped.max(axis=1) == grouped.min(axis=1)] = 0.0  # exactly: a mean's rounding would leave crumbs
    return centred.reshape(-1)


@dataclass(frozen=True)
class GRPOLoss:
    """One GRPO objective (`GRPOConfig`'s ``loss_type``, ``importance_sampling``, ``epsilon``,
    ``epsilon_high``, ``kl_coef``, ``max_new_tokens``)."""

    loss_type: str = "grpo"
    importance_sampling: str = "token"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    kl_coef: float = 0.0
    max_new_tokens: int = 16

    def divisor(self, completions: int, completion_tokens: int) -> int:
        """What the step's summed `token_loss_sum` is divided by (host numbers of the whole step)."""
        if self.loss_type == "grpo":
            return completions
        if self.loss_type == "dapo":
            return completion_tokens
        return completions * self.max_new_tokens


def token_loss_sum(
    settings: GRPOLoss,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    sequence: torch.Tensor,
    counts: torch.Tensor,
    reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's summed GRPO loss (before the step's `GRPOLoss.divisor`) and its metric sums ``[2]``
    (the KL summed over tokens, the clipped tokens), detached.

    log_probs, old_log_probs, reference: ``[targets]`` fp32 (old None: the policy's own, detached);
    advantages, counts: ``[sequences]`` (counts: each completion's token count); sequence: ``[targets]``, the
    completion each target belongs to."""
    old = log_probs.detach() if old_log_probs is None else old_log_probs
    log_ratio = log_probs - old
    if settings.importance_sampling == "sequence":
        per_sequence = log_ratio.new_zeros(counts.shape[0]).index_add_(0, sequence, log_ratio)
        log_ratio = (per_sequence / counts.clamp(min=1))[sequence]
    ratio = torch.exp(log_ratio)
    advantage = advantages[sequence]
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.epsilon_high)
    losses = -torch.minimum(ratio * advantage, clipped * advantage)
    kl_sum = log_probs.new_zeros(())
    if reference is not None:
        delta = reference - log_probs
        kl = torch.exp(delta) - delta - 1
        if settings.kl_coef:
            losses = losses + settings.kl_coef * kl
        kl_sum = kl.detach().sum()
    if settings.loss_type == "grpo":
        losses = losses / counts.clamp(min=1)[sequence]
    with torch.no_grad():
        low = (ratio < 1 - settings.epsilon) & (advantage < 0)
        high = (ratio > 1 + settings.epsilon_high) & (advantage > 0)
        clip_count = (low | high).to(log_probs.dtype).sum()
    return losses.sum(), torch.stack([kl_sum, clip_count])

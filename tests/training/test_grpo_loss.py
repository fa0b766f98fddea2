"""The GRPO objective on packed completions against a plain-PyTorch reference (each sequence alone, full
logits, the papers' formulas written out), fp32 on the CPU."""

import numpy as np
import pytest
import torch

import fastft
from fastft.runtime.attention import patch_packed_attention
from fastft.training.loss import target_losses
from fastft.training.objectives.grpo_loss import GRPOLoss, group_advantages, token_loss_sum
from fastft.training.objectives.preference import adapters_disabled
from fastft.training.objectives.rollout import pack_completions

MAX_NEW = 9


def _model(adapter=True):
    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=4, alpha=8, gradient_checkpointing=False, seed=1)
    if adapter:
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    patch_packed_attention(model, "auto")
    model.train()
    return model, tokenizer


def _rollout(vocab, groups=3, group_size=4, seed=0):
    """Random prompts (one per group, repeated) and completions of awkward lengths, rewards, advantages."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, int(rng.integers(3, 13))) for _ in range(groups)]
    prompt_ids = [prompts[i // group_size] for i in range(groups * group_size)]
    completion_ids = [rng.integers(3, vocab, int(rng.integers(1, MAX_NEW + 1))) for _ in prompt_ids]
    rewards = rng.integers(0, 3, groups * group_size).astype(np.float64)
    return prompt_ids, completion_ids, group_advantages(rewards, group_size)


def _completion_log_probs(model, prompt_ids, completion_ids):
    """Each sequence alone through the unpacked model: log-softmax of the full logits at its completion."""
    out = []
    for prompt, completion in zip(prompt_ids, completion_ids, strict=True):
        ids = torch.as_tensor(np.concatenate([prompt, completion]))[None]
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
        out.append(logits[positions].log_softmax(-1).gather(1, torch.as_tensor(completion)[:, None])[:, 0])
    return out


def _reference_loss(settings, policy, old, reference, advantages):
    """The GRPO / DAPO / Dr. GRPO / GSPO losses written per completion from their definitions."""
    eps_low, eps_high, beta = settings.epsilon, settings.epsilon_high, settings.kl_coef
    per_sequence, total, tokens = [], 0.0, 0
    for i, logp in enumerate(policy):
        if settings.importance_sampling == "sequence":
            ratio = torch.exp((logp - old[i]).mean()).expand_as(logp)
        else:
            ratio = torch.exp(logp - old[i])
        a = float(advantages[i])
        surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
        loss = -surrogate
        if reference is not None:
            loss = loss + beta * (torch.exp(reference[i] - logp) - (reference[i] - logp) - 1)
        per_sequence.append(loss.mean())
        total = total + loss.sum()
        tokens += len(logp)
    if settings.loss_type == "grpo":
        return torch.stack(per_sequence).mean()
    if settings.loss_type == "dapo":
        return total / tokens
    return total / (len(policy) * settings.max_new_tokens)


CASES = [
    GRPOLoss("grpo", "token", epsilon=0.2, epsilon_high=0.2, kl_coef=0.0, max_new_tokens=MAX_NEW),
    GRPOLoss("grpo", "token", epsilon=0.1, epsilon_high=0.3, kl_coef=0.1, max_new_tokens=MAX_NEW),
    GRPOLoss("dapo", "token", epsilon=0.2, epsilon_high=0.28, kl_coef=0.05, max_new_tokens=MAX_NEW),
    GRPOLoss("dr_grpo", "token", epsilon=0.2, epsilon_high=0.2, kl_coef=0.0, max_new_tokens=MAX_NEW),
    GRPOLoss("grpo", "sequence", epsilon=3e-2, epsilon_high=4e-2, kl_coef=0.04, max_new_tokens=MAX_NEW),
    GRPOLoss("dapo", "sequence", epsilon=3e-2, epsilon_high=4e-2, kl_coef=0.0, max_new_tokens=MAX_NEW),
]


@pytest.mark.parametrize(
    "settings", CASES, ids=lambda s: f"{s.loss_type}-{s.importance_sampling}-kl{s.kl_coef}"
)
def test_the_loss_and_every_lora_gradient_equal_the_plain_reference(settings):
    model, _ = _model()
    vocab = model.config.vocab_size
    prompt_ids, completion_ids, advantages = _rollout(vocab)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # an old policy a little off the current one, so that some ratios clip
        policy = _completion_log_probs(model, prompt_ids, completion_ids)
        old = [p + 0.3 * torch.randn(p.shape, generator=generator) for p in policy]
        with adapters_disabled(model):
            reference = _completion_log_probs(model, prompt_ids, completion_ids)
    use_reference = settings.kl_coef > 0
    parameters = {n: p for n, p in model.named_parameters() if p.requires_grad}

    batches = pack_completions(prompt_ids, completion_ids, micro_batch_tokens=48)  # several micro-batches
    assert len(batches) > 1
    divisor = settings.divisor(len(completion_ids), sum(len(c) for c in completion_ids))
    model.zero_grad(set_to_none=True)
    loss, clipped = 0.0, 0.0
    for mb in batches:
        members = mb.members.tolist()
        micro_loss, metrics = token_loss_sum(
            settings,
            -target_losses(model, mb.batch),
            torch.cat([old[i] for i in members]),
            torch.as_tensor(advantages[members], dtype=torch.float32),
            mb.sequence,
            mb.counts,
            torch.cat([reference[i] for i in members]) if use_reference else None,
        )
        (micro_loss / divisor).backward()
        loss = loss + micro_loss.detach() / divisor
        clipped += float(metrics[1])
    grads = {n: p.grad.clone() for n, p in parameters.items()}

    model.zero_grad(set_to_none=True)
    policy = _completion_log_probs(model, prompt_ids, completion_ids)
    expected = _reference_loss(settings, policy, old, reference if use_reference else None, advantages)
    expected.backward()
    assert clipped > 0  # the clip is exercised
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for name, parameter in parameters.items():  # relative error in norm, as the other parity tests
        assert parameter.grad.norm() > 0, name
        assert (grads[name] - parameter.grad).norm() / parameter.grad.norm() <= 1e-5, name


def test_advantages_are_zero_exactly_where_a_group_rewards_all_alike():
    rewards = np.array([0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 1.0, 0.3, 0.3, 0.3, 0.3, 2.0, 2.0, 2.0, 2.0])
    for scale in (True, False):
        advantages = group_advantages(rewards, 4, scale).reshape(4, 4)
        assert np.array_equal(advantages[[0, 2, 3]], np.zeros((3, 4)))
        assert np.abs(advantages[1]).min() > 0.2
        assert abs(advantages[1].sum()) < 1e-12
    expected = (rewards[4:8] - 0.75) / (np.std(rewards[4:8], ddof=1) + 1e-4)
    np.testing.assert_allclose(group_advantages(rewards, 4)[4:8], expected, rtol=1e-12)


def test_with_one_update_the_ratio_is_exactly_one_and_the_gradient_is_the_policy_gradient():
    model, _ = _model()
    prompt_ids, completion_ids, advantages = _rollout(model.config.vocab_size, seed=4)
    (mb,) = pack_completions(prompt_ids, completion_ids, None)
    parameters = [p for p in model.parameters() if p.requires_grad]
    a = torch.as_tensor(advantages, dtype=torch.float32)
    settings = GRPOLoss("dapo", "token", 0.2, 0.2, 0.0, MAX_NEW)

    log_probs = -target_losses(model, mb.batch)
    loss, metrics = token_loss_sum(settings, log_probs, None, a, mb.sequence, mb.counts)
    assert float(metrics[1]) == 0.0  # nothing clips at a ratio of exactly 1
    assert torch.equal(loss, -a[mb.sequence].sum())  # min(1·A, clip(1)·A) = A
    grads = torch.autograd.grad(loss, parameters)
    log_probs = -target_losses(model, mb.batch)
    expected = torch.autograd.grad(-(a[mb.sequence] * log_probs).sum(), parameters)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_the_kl_term_is_zero_while_the_adapter_is_zero():
    model, _ = _model(adapter=False)  # add_lora starts every B at zero: the policy is the reference
    prompt_ids, completion_ids, advantages = _rollout(model.config.vocab_size, seed=5)
    (mb,) = pack_completions(prompt_ids, completion_ids, None)
    settings = GRPOLoss("grpo", "token", 0.2, 0.2, 0.5, MAX_NEW)
    a = torch.as_tensor(advantages, dtype=torch.float32)
    log_probs = -target_losses(model, mb.batch)
    with adapters_disabled(model):
        reference = -target_losses(model, mb.batch)
    with_kl, metrics = token_loss_sum(settings, log_probs, None, a, mb.sequence, mb.counts, reference)
    without, _ = token_loss_sum(settings, log_probs, None, a, mb.sequence, mb.counts)
    assert abs(float(metrics[0])) <= 1e-6 * len(log_probs)
    torch.testing.assert_close(with_kl, without, rtol=0, atol=1e-6)

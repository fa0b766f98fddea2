"""DPO-family losses on packed pairs against a plain-PyTorch reference (unpacked sequences, full logits)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastft
from fastft.checks import SettingError
from fastft.data.pairs import pack_pairs
from fastft.training.objectives.preference import (
    PreferenceLoss,
    adapters_disabled,
    pair_loss_sum,
    pair_losses,
    sequence_log_probs,
)
from fastft.training.trainer import TrainConfig, Trainer

SETTINGS = [
    PreferenceLoss("dpo", "sigmoid", beta=0.3),
    PreferenceLoss("dpo", "ipo", beta=0.7),
    PreferenceLoss("dpo", "robust", beta=0.2, label_smoothing=0.1),
    PreferenceLoss("orpo", beta=0.25),
    PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.05),
]


def _rows(count=5, seed=0):
    rng = np.random.default_rng(seed)
    words = "the a cat dog runs sat on mat blue green red one two three four".split()

    def text(n):
        return " ".join(rng.choice(words, n))

    return [
        {
            "prompt": text(int(rng.integers(3, 17))),
            "chosen": text(int(rng.integers(1, 9))),
            "rejected": text(int(rng.integers(2, 13))),
        }
        for _ in range(count)
    ]


def _model(fused=True):
    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=4, alpha=8, gradient_checkpointing=False, fused=fused, seed=1)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    model.train()
    return model, tokenizer


def _reference_log_probs(model, pairs):
    """Each sequence alone, the full logits, log-softmax, the labelled tokens summed."""
    sums, counts = [], []
    for ids, labels in zip(pairs.data.input_ids, pairs.data.labels, strict=True):
        ids = torch.as_tensor(ids, dtype=torch.long)[None]
        labels = torch.as_tensor(labels, dtype=torch.long)
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        targets = labels[1:]
        keep = targets != -100
        logp = logits.log_softmax(-1)[keep].gather(1, targets[keep][:, None])[:, 0]
        sums.append(logp.sum())
        counts.append(keep.sum().float())
    return torch.stack(sums), torch.stack(counts)


def _reference_losses(settings, policy, reference):
    """The losses written out from the papers' definitions (TRL's conventions), independently of fastft."""
    (s, n), beta, eps = policy, settings.beta, settings.label_smoothing
    c, r, nc, nr = s[0::2], s[1::2], n[0::2], n[1::2]
    if settings.method == "dpo":
        c0, r0 = reference[0][0::2], reference[0][1::2]
        delta = (c - c0) - (r - r0)
        if settings.dpo_loss == "sigmoid":
            return -(1 - eps) * F.logsigmoid(beta * delta) - eps * F.logsigmoid(-beta * delta)
        if settings.dpo_loss == "robust":
            return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (
                1 - 2 * eps
            )
        return ((c - c0) / nc - (r - r0) / nr - 1 / (2 * beta)) ** 2
    ca, ra = c / nc, r / nr
    if settings.method == "orpo":
        odds = lambda x: x - torch.log(1 - torch.exp(x))  # noqa: E731 - log(p / (1 - p))
        return -ca - beta * F.logsigmoid(odds(ca) - odds(ra))
    z = beta * (ca - ra) - settings.simpo_gamma
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


@pytest.mark.parametrize("fused", [True, False])
def test_sequence_log_probs_of_a_packed_batch_equal_each_sequence_alone(fused):
    model, tokenizer = _model(fused)
    pairs = pack_pairs(_rows(), tokenizer, 512)
    batch = pairs.batch(range(len(pairs)))
    members = [row for b in range(len(pairs)) for row in pairs.bins[b]]
    sums, counts = sequence_log_probs(model, batch)
    expected_sums, expected_counts = _reference_log_probs(model, pairs)
    torch.testing.assert_close(counts, expected_counts[members], rtol=0, atol=0)
    torch.testing.assert_close(sums, expected_sums[members], rtol=1e-5, atol=1e-5)


def test_the_reference_is_the_model_with_its_adapters_off():
    model, tokenizer = _model()
    pairs = pack_pairs(_rows(3), tokenizer, 512)
    batch = pairs.batch(range(len(pairs)))
    with adapters_disabled(model):
        reference, _ = sequence_log_probs(model, batch)
    with_adapters, _ = sequence_log_probs(model, batch)
    assert (reference - with_adapters).abs().max() > 1e-3  # the adapters change the answer's probability
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.zero_()
    base, _ = sequence_log_probs(model, batch)
    torch.testing.assert_close(reference, base, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
def test_adapters_disabled_answers_like_peft_disable_adapter_without_its_status_report(fused, monkeypatch):
    """The flags alone give PEFT's adapter-off forward, with a trained head copy too, and restore every layer's
    own state after (one layer left disabled by the user stays disabled); PEFT's status report, the host
    cost of its context manager, is never built."""
    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(
        model, r=4, alpha=8, gradient_checkpointing=False, fused=fused, seed=1, modules_to_save=["lm_head"]
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    batch = pack_pairs(_rows(3), tokenizer, 512).batch([0])
    with model.disable_adapter(), torch.no_grad():
        expected, _ = sequence_log_probs(model, batch)
    requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
    monkeypatch.setattr(type(model), "get_model_status", lambda self: pytest.fail("status report built"))
    with adapters_disabled(model):
        reference, _ = sequence_log_probs(model, batch)
        assert not torch.is_grad_enabled()
    torch.testing.assert_close(reference, expected, rtol=0, atol=0)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == requires_grad
    with_adapters, _ = sequence_log_probs(model, batch)
    assert (with_adapters - reference).abs().max() > 1e-3  # every adapter is back on

    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    layer.enable_adapters(False)
    with adapters_disabled(model):
        pass
    assert (
        layer.disable_adapters
        and not model.base_model.model.model.layers[0].self_attn.k_proj.disable_adapters
    )


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.method}-{s.dpo_loss}")
def test_each_loss_and_every_lora_gradient_equal_the_plain_reference(settings):
    model, tokenizer = _model()
    pairs = pack_pairs(_rows(6, seed=3), tokenizer, 160)  # several bins, pairs of awkward lengths
    order = [row for b in range(len(pairs)) for row in pairs.bins[b]]
    parameters = {n: p for n, p in model.named_parameters() if p.requires_grad}

    model.zero_grad(set_to_none=True)
    total = sum(pair_loss_sum(model, pairs.batch([b]), settings)[0] for b in range(len(pairs)))
    loss = total / pairs.pairs
    loss.backward()
    grads = {n: p.grad.clone() for n, p in parameters.items()}

    model.zero_grad(set_to_none=True)
    policy = _reference_log_probs(model, pairs)
    with adapters_disabled(model):
        reference = _reference_log_probs(model, pairs)
    expected = _reference_losses(settings, policy, reference).mean()
    expected.backward()
    assert len(order) == 2 * pairs.pairs
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for name, parameter in parameters.items():  # relative error in norm, as the other parity tests
        assert parameter.grad.norm() > 0, name
        assert (grads[name] - parameter.grad).norm() / parameter.grad.norm() <= 1e-5, name


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.method}-{s.dpo_loss}")
def test_a_batch_padded_to_a_static_shape_gives_the_loss_metrics_and_gradients_of_the_unpadded_one(settings):
    """The pad tail and the zero-length boundaries pair up into pad pairs: no loss, reward or accuracy, no
    NaN (ORPO's log(1 - e^0) at an empty side) and no gradient from them."""
    from fastft.data.batch import BatchShape

    model, tokenizer = _model()
    pairs = pack_pairs(_rows(6, seed=4), tokenizer, 512)
    batch = pairs.batch(range(len(pairs)))
    shape = BatchShape.covering(batch.num_tokens + 37, batch.num_sequences + 5, batch.num_trained_tokens + 9)
    padded = batch.padded(shape)
    assert padded.static and padded.num_sequences > batch.num_sequences + 2
    assert padded.padding == shape.tokens - batch.num_tokens > 0
    assert padded.real_sequences == batch.num_sequences == batch.real_sequences
    parameters = [p for p in model.parameters() if p.requires_grad]
    results = []
    for which in (batch, padded):
        model.zero_grad(set_to_none=True)
        reference = None
        if settings.needs_reference:  # precomputed, padded like the batch's sequences
            with adapters_disabled(model):
                reference = sequence_log_probs(model, which)[0]
        loss, metrics = pair_loss_sum(model, which, settings, reference)
        loss.backward()
        results.append((loss.detach(), metrics, [p.grad.clone() for p in parameters]))
        if which is padded:  # the reference computed inside, from the padded batch, too
            inner, inner_metrics = pair_loss_sum(model, padded, settings)
            torch.testing.assert_close(inner.detach(), loss.detach(), rtol=1e-5, atol=1e-6)
    (loss, metrics, grads), (padded_loss, padded_metrics, padded_grads) = results
    assert torch.isfinite(padded_loss)
    torch.testing.assert_close(padded_loss, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(padded_metrics, metrics, rtol=1e-5, atol=1e-6)
    for expected, got in zip(grads, padded_grads, strict=True):
        assert torch.isfinite(got).all()
        assert (got - expected).norm() <= 1e-5 * expected.norm() + 1e-9


def test_dpo_with_static_shapes_trains_like_unpadded_steps():
    """`static_shapes=True` (what a CUDA graph replays on GPU) pads every micro-batch of pairs: the same
    losses, metrics and pair counts as the unpadded run, the padding reported."""
    rows = _rows(24, seed=5)
    runs = []
    for static in (False, True):
        model, tokenizer = _model()
        data = pack_pairs(rows, tokenizer, 160)
        config = TrainConfig(
            method="dpo", max_steps=4, learning_rate=1e-3, warmup=0, micro_batch_bins=2, static_shapes=static
        )
        trainer = Trainer(model, tokenizer, data, config=config)
        runs.append(trainer.train().steps)
        assert (trainer.batch_shape is not None) == static
    unpadded, padded = runs
    assert any(e.padding_tokens > 0 for e in padded) and all(e.padding_tokens == 0 for e in unpadded)
    for a, b in zip(unpadded, padded, strict=True):
        assert a.preference["pairs"] == b.preference["pairs"] and a.tokens == b.tokens
        assert b.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-6)
        for key in ("rewards_chosen", "margin", "accuracy"):
            assert b.preference[key] == pytest.approx(a.preference[key], rel=1e-4, abs=1e-6), key


def test_dpo_training_orders_held_out_pairs():
    """A short DPO run on programmatic pairs (the bare right answer chosen, a wrong wordy one rejected)
    raises the held-out accuracy and margin from the start (every reward 0: the policy is the reference)."""
    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=8, seed=0)
    rows = [
        {
            "prompt": f"What is {i} plus {i + 3}?",
            "chosen": f"{2 * i + 3}",
            "rejected": f"The answer is {2 * i + 5}.",
        }
        for i in range(48)
    ]
    config = TrainConfig(
        method="dpo", beta=0.1, max_steps=8, learning_rate=2e-3, warmup=0, micro_batch_bins=2
    )
    train, held_out = pack_pairs(rows[:40], tokenizer, 128), pack_pairs(rows[40:], tokenizer, 128)
    assert len(train) >= 8  # a step draws 2 of its bins, a few pairs, not the whole set
    trainer = Trainer(model, tokenizer, train, held_out, config)
    before = trainer.evaluate()
    assert before.preference["margin"] == pytest.approx(0.0, abs=1e-6)
    result = trainer.train()
    after = trainer.evaluate()
    assert after.preference["accuracy"] == 1.0 and after.preference["margin"] > 0.5
    assert after.eval_loss < before.eval_loss
    step = result.steps[-1].preference
    assert step["pairs"] > 0 and set(step) == {
        "pairs",
        "rewards_chosen",
        "rewards_rejected",
        "margin",
        "accuracy",
    }


def test_preference_settings_are_checked_with_the_fix():
    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=4)
    with pytest.raises(SettingError, match="Did you mean 'simpo'"):
        TrainConfig(method="simpO")
    with pytest.raises(SettingError, match="dpo_loss"):
        TrainConfig(method="dpo", dpo_loss="hinge")
    with pytest.raises(SettingError, match="beta"):
        TrainConfig(method="dpo", beta=0)
    packed_for_sft = fastft.pack(
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}],
        tokenizer,
        64,
    )
    with pytest.raises(ValueError, match="trains on pairs"):
        Trainer(model, tokenizer, packed_for_sft, config=TrainConfig(method="dpo"))


# -- against TRL's own loss code -------------------------------------------------------------------------------
# TRL (1.16) defines, where fastft differs on purpose:
# * DPO "sigmoid" takes no label smoothing (conservative DPO is its "robust" / cDPO elsewhere); fastft's sigmoid
#   with ε > 0 is cDPO, so the comparison runs at ε = 0 for it.
# * IPO averages each log-ratio over the completion's tokens (TRL's reading, confirmed by the IPO authors); so
#   does fastft.
# * ORPO's NLL term is TRL's token-weighted cross-entropy over the batch's chosen tokens; fastft's is the mean of
#   each chosen answer's mean NLL (every pair weighs the same, whatever its length). The odds-ratio term, which
#   is what the test compares, is the same.
# * SimPO (TRL's CPOTrainer, loss_type "simpo") gets length-averaged log-probs, as fastft's does.


def _trl_namespace(**fields):
    from types import SimpleNamespace

    accelerator = SimpleNamespace(
        device=torch.device("cpu"),
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        unwrap_model=lambda m: m,
    )
    return SimpleNamespace(accelerator=accelerator, **fields)


def _trl_dpo_losses(settings, policy, reference):
    """TRL's `DPOTrainer._compute_loss` run on given log-probs: a stand-in model returns per-token log-probs
    whose rows sum to each sequence's log-prob, with the reference precomputed (`ref_*_logps`), so TRL's own
    code turns them into its loss. Returns TRL's mean loss."""
    from collections import defaultdict
    from types import SimpleNamespace

    trl = pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]')")
    sums, counts = policy
    chosen_first = torch.cat([sums[0::2], sums[1::2]])  # TRL's batch is [chosen..., rejected...]
    lengths = torch.cat([counts[0::2], counts[1::2]]).long()
    width = int(lengths.max()) + 1
    completion = (torch.arange(width)[None] >= width - lengths[:, None]).long()  # left-padded prompts of 1
    completion[:, 0] = 0
    per_token = chosen_first[:, None] * F.one_hot(torch.full_like(lengths, width - 2), width - 1)

    def model(**_):
        zeros = torch.zeros(per_token.shape)
        return SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    model.training = True
    trainer = _trl_namespace(
        model=model,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[settings.dpo_loss],
        loss_weights=[1.0],
        beta=settings.beta,
        label_smoothing=settings.label_smoothing,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(completion.shape, dtype=torch.long),
        "attention_mask": torch.ones(completion.shape, dtype=torch.long),
        "completion_mask": completion,
        "ref_chosen_logps": reference[0][0::2],
        "ref_rejected_logps": reference[0][1::2],
    }
    return trl.DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)


@pytest.mark.parametrize(
    "settings",
    [
        PreferenceLoss("dpo", "sigmoid", beta=0.3),
        PreferenceLoss("dpo", "ipo", beta=0.7),
        PreferenceLoss("dpo", "robust", beta=0.2, label_smoothing=0.1),
        PreferenceLoss("orpo", beta=0.25),
        PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.05),
    ],
    ids=lambda s: f"{s.method}-{s.dpo_loss}",
)
def test_each_loss_equals_trls_loss_on_the_same_log_probs(settings):
    """fastft's pair losses and their gradients in the policy log-probs equal TRL's (DPOTrainer for DPO, the
    experimental ORPOTrainer / CPOTrainer for ORPO / SimPO), on the tiny model's real log-probs of packed pairs."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]')")
    model, tokenizer = _model()
    pairs = pack_pairs(_rows(6, seed=5), tokenizer, 512)
    batch = pairs.batch(range(len(pairs)))
    with torch.no_grad():
        sums, counts = sequence_log_probs(model, batch)
        with adapters_disabled(model):
            reference = sequence_log_probs(model, batch)
    ours_input = sums.clone().requires_grad_()
    theirs_input = sums.clone().requires_grad_()
    ours, chosen_rewards, _ = pair_losses(
        settings, (ours_input, counts), reference if settings.needs_reference else None
    )
    ours = ours.mean()
    if settings.method == "dpo":
        theirs = _trl_dpo_losses(settings, (theirs_input, counts), reference)
        expected_chosen = settings.beta * (sums - reference[0])[0::2]
    else:
        averaged = theirs_input / counts
        chosen, rejected = averaged[0::2], averaged[1::2]
        if settings.method == "orpo":
            from trl.experimental.orpo import ORPOTrainer

            namespace = _trl_namespace(beta=settings.beta)
            odds, theirs_chosen, _, _, _ = ORPOTrainer.odds_ratio_loss(namespace, chosen, rejected)
            theirs = (-chosen).mean() - odds.mean()  # fastft's NLL term: each chosen answer's mean NLL
        else:
            from trl.experimental.cpo import CPOTrainer

            namespace = _trl_namespace(
                beta=settings.beta,
                loss_type="simpo",
                simpo_gamma=settings.simpo_gamma,
                label_smoothing=settings.label_smoothing,
                alpha=0.0,
            )
            losses, theirs_chosen, _ = CPOTrainer.cpo_loss(namespace, chosen, rejected)
            theirs = losses.mean()
        expected_chosen = theirs_chosen
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(chosen_rewards, expected_chosen.detach(), rtol=1e-5, atol=1e-7)
    (ours_gradient,) = torch.autograd.grad(ours, ours_input)
    (theirs_gradient,) = torch.autograd.grad(theirs, theirs_input)
    assert ours_gradient.abs().max() > 0
    torch.testing.assert_close(ours_gradient, theirs_gradient, rtol=1e-5, atol=1e-8)


def _arithmetic_pairs(count):
    return [
        {"prompt": f"What is {i} plus {i + 3}?", "chosen": f"{2 * i + 3}", "rejected": f"It is {2 * i + 5}."}
        for i in range(count)
    ]


def _dpo_run(tokenizer, train_rows, eval_rows, steps, precompute, output_dir=None, resume_from=None, **extra):
    model, _ = _model()
    config = TrainConfig(
        method="dpo",
        beta=0.2,
        max_steps=steps,
        learning_rate=3e-3,
        warmup=0,
        seed=5,
        precompute_reference=precompute,
        output_dir=output_dir,
        resume_from=resume_from,
        profile=False,
        **extra,
    )
    train, held_out = pack_pairs(train_rows, tokenizer, 96), pack_pairs(eval_rows, tokenizer, 96)
    trainer = Trainer(model, tokenizer, train, held_out, config)
    return trainer, trainer.train()


def test_precomputed_reference_log_probs_give_the_on_the_fly_losses_and_skip_the_reference_pass(monkeypatch):
    """One adapter-disabled pass before training, cached by sequence: every step's loss, metrics and the eval
    equal the run that computes the reference in each step (bit for bit: the same bins, fp32), and no step
    runs the reference forward."""
    _, tokenizer = fastft.load_model("tiny-llama")
    rows = _arithmetic_pairs(14)
    _, on_the_fly = _dpo_run(tokenizer, rows[:10], rows[10:], 5, precompute=False)
    trainer, precomputed = _dpo_run(tokenizer, rows[:10], rows[10:], 5, precompute=True)
    assert [e.loss for e in precomputed.steps] == [e.loss for e in on_the_fly.steps]
    assert [e.preference for e in precomputed.steps] == [e.preference for e in on_the_fly.steps]
    assert precomputed.evals[-1].eval_loss == on_the_fly.evals[-1].eval_loss
    assert on_the_fly.steps[-1].preference["margin"] != 0  # the policy moved away from the reference

    import fastft.training.objectives.preference as preference

    calls = []
    original = preference.adapters_disabled
    monkeypatch.setattr(preference, "adapters_disabled", lambda m: calls.append(1) or original(m))
    cache = trainer.train_data.reference_cache
    assert len(cache) == 1 and next(iter(cache.values())).shape == (len(trainer.train_data.data),)
    trainer.max_steps += 2
    trainer.train()  # the cache is read, not rebuilt, and the steps skip the reference forward
    assert calls == []


def test_precomputed_reference_resumes_exactly(tmp_path):
    """Killed after 2 steps and resumed in a fresh trainer on freshly packed data (the cache is rebuilt from
    the base model, keyed by sequence): the remaining steps' losses equal the uninterrupted run's."""
    _, tokenizer = fastft.load_model("tiny-llama")
    rows = _arithmetic_pairs(12)
    _, whole = _dpo_run(tokenizer, rows[:10], rows[10:], 4, precompute=True)
    first, _ = _dpo_run(tokenizer, rows[:10], rows[10:], 4, True, str(tmp_path / "run"), save_every=2)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert checkpoint.is_dir()
    _, resumed = _dpo_run(
        tokenizer, rows[:10], rows[10:], 4, True, str(tmp_path / "resumed"), str(checkpoint)
    )
    after = [e for e in resumed.steps if e.step > 2]
    assert [e.step for e in after] == [3, 4]
    assert [e.loss for e in after] == [e.loss for e in whole.steps[2:]]
    assert first.result.steps[-1].loss == whole.steps[-1].loss


def test_precompute_reference_is_for_dpo_only():
    with pytest.raises(SettingError, match="precompute_reference"):
        TrainConfig(method="simpo", precompute_reference=True)
    with pytest.raises(SettingError, match="True or False"):
        TrainConfig(method="dpo", precompute_reference="yes")

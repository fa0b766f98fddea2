"""A patched model called the Hugging Face way, ``model(input_ids, labels=...)`` (HF `Trainer`, TRL, a plain
loop): its loss comes from the fused linear cross-entropy, with no ``[tokens x vocab]`` logits, and equals
transformers' own; padding-free rows run through fastft's packed attention with their boundaries read once.

Tolerance (fp32 on the CPU, kernels through the Triton interpreter): loss and every LoRA gradient within 1e-5
relative of the unpatched PEFT model's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import masking_utils

import fastft
from fastft.data.batch import PackedBatch
from fastft.models.patch import LogitsNotComputedError, UnfusedWarning


@pytest.fixture
def boundary_reads(monkeypatch) -> list:
    """One entry per `PackedBatch.from_position_ids` call: each padding-free batch the packed attention read."""
    reads = []
    original = PackedBatch.from_position_ids.__func__

    def counting(cls, *args, **kwargs):
        reads.append(1)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(PackedBatch, "from_position_ids", classmethod(counting))
    return reads


def _pair(name: str = "tiny-llama"):
    """The same LoRA model twice: fastft's fused one and plain transformers + PEFT."""
    models = []
    for fused in (True, False):
        model, _ = fastft.load_model(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnfusedWarning)
            model = fastft.add_lora(model, r=4, alpha=8, gradient_checkpointing=False, fused=fused)
        with torch.no_grad():
            generator = torch.Generator().manual_seed(1)
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
        model.train()
        models.append(model)
    return models


def _grads(model, loss):
    lora = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, lora)


def _assert_same(fused_model, fused_loss, plain_model, plain_loss):
    assert float(fused_loss) == pytest.approx(float(plain_loss), rel=1e-5)
    for got, want in zip(_grads(fused_model, fused_loss), _grads(plain_model, plain_loss), strict=True):
        assert float((got - want).norm() / want.norm().clamp_min(1e-30)) <= 1e-5


def _padded_batch(vocab: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 29), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0  # right padding
    mask[2, :5] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :6] = -100  # a prompt
    return ids, mask, labels


def test_labels_call_gives_transformers_loss_and_gradients_without_logits(monkeypatch, interpreted):
    from fastft.kernels import fused_linear_ce

    fused, plain = _pair()
    ids, mask, labels = _padded_batch(fused.config.vocab_size)
    calls = []
    real = fused_linear_ce.FusedLinearCrossEntropyFunction.apply
    monkeypatch.setattr(
        fused_linear_ce.FusedLinearCrossEntropyFunction, "apply", lambda *a: calls.append(1) or real(*a)
    )

    def no_logits(module, args, output):
        raise AssertionError("the output head ran: full logits were built")

    hook = fused.get_base_model().get_output_embeddings().register_forward_hook(no_logits)
    out = fused(input_ids=ids, attention_mask=mask, labels=labels)
    hook.remove()
    assert calls == [1]  # the loss came from the fused kernel, in chunks of the vocabulary matmul
    want = plain(input_ids=ids, attention_mask=mask, labels=labels)
    _assert_same(fused, out.loss, plain, want.loss)
    with pytest.raises(LogitsNotComputedError, match="without labels="):
        _ = out.logits
    with pytest.raises(KeyError, match="prediction_loss_only"):
        out["logits"]
    assert getattr(out, "logits", None) is None  # code that probes for logits sees none


def test_num_items_in_batch_sums_like_the_hf_trainer(interpreted):
    fused, plain = _pair()
    ids, mask, labels = _padded_batch(fused.config.vocab_size, seed=3)
    items = torch.tensor(41)  # the Trainer counts a whole accumulated step's tokens
    out = fused(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=items)
    want = plain(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=items)
    _assert_same(fused, out.loss, plain, want.loss)


def test_calls_without_labels_keep_the_logits():
    fused, plain = _pair()
    ids, mask, _ = _padded_batch(fused.config.vocab_size)
    torch.testing.assert_close(
        fused(input_ids=ids, attention_mask=mask).logits,
        plain(input_ids=ids, attention_mask=mask).logits,
        rtol=1e-5,
        atol=1e-5,
    )


def _flattened(vocab: int, lengths, seed: int = 0):
    """A padding-free row as DataCollatorWithFlattening builds it: positions restart, each sequence's first
    label is -100."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
    labels = ids.clone()
    labels[0, torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])] = -100
    return ids, positions, labels


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_padding_free_rows_run_the_packed_attention_with_boundaries_read_once(
    name, monkeypatch, interpreted, boundary_reads
):
    """Against each sequence run alone. (transformers 5's SDPA path does not isolate the sequences of such a
    row: its loss there lets each attend to the ones before it.)"""
    fused, plain = _pair(name)
    lengths = (9, 23, 4, 17)
    ids, positions, labels = _flattened(fused.config.vocab_size, lengths)
    total, count, start = 0.0, 0, 0
    for n in lengths:
        piece = slice(start, start + n)
        trained = int((labels[0, piece][1:] != -100).sum())
        total = total + plain(input_ids=ids[:, piece], labels=labels[:, piece]).loss * trained
        count, start = count + trained, start + n
    want = total / count

    def forbidden(*args, **kwargs):
        raise AssertionError("transformers rebuilt packing metadata")

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", forbidden)
    monkeypatch.setattr(masking_utils, "sdpa_mask", forbidden)
    out = fused(input_ids=ids, position_ids=positions, labels=labels)
    assert len(boundary_reads) == 1  # once for the batch, not per layer
    _assert_same(fused, out.loss, plain, want)


def test_boundaries_from_position_ids():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3]])
    batch = PackedBatch.from_position_ids(positions)
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 6, 10]
    assert batch.sequence_lengths == (3, 2, 1, 4) and batch.max_seqlen == 4 and batch.num_tokens == 10
    # a row that starts mid-sequence (positions not from 0) still starts a sequence at its first token
    assert PackedBatch.from_position_ids(torch.tensor([[5, 6, 0, 1]])).sequence_lengths == (2, 2)


def test_hf_trainer_with_flattening_collator_trains_the_fused_model(tmp_path, boundary_reads):
    from datasets import Dataset
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=4)
    generator = torch.Generator().manual_seed(0)
    rows = [
        {"input_ids": torch.randint(3, 500, (int(n),), generator=generator).tolist()}
        for n in torch.randint(8, 40, (24,), generator=generator)
    ]
    for row in rows:
        row["labels"] = list(row["input_ids"])
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-3,
        report_to=[],
        logging_steps=1,
        use_cpu=True,
        save_strategy="no",
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        data_collator=DataCollatorWithFlattening(),
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert len(boundary_reads) == 4  # every step's padding-free batch went through the packed attention


def test_trl_sft_trainer_with_packing_trains_the_fused_model_and_logs_token_accuracy(
    tmp_path, boundary_reads, monkeypatch
):
    import inspect

    from fastft.kernels import fused_linear_ce

    trl = pytest.importorskip("trl")
    from datasets import Dataset

    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=4)
    words = "the a cat dog runs sat on mat blue green red one two three".split()
    generator = torch.Generator().manual_seed(0)

    def sentence(n):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=generator))

    rows = [
        {
            "messages": [
                {"role": "user", "content": sentence(6)},
                {"role": "assistant", "content": sentence(9)},
            ]
        }
        for _ in range(32)
    ]
    config = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        packing=True,  # best-fit packing, padding-free rows: what Unsloth + TRL users run
        learning_rate=1e-3,
        report_to=[],
        logging_steps=1,
        use_cpu=True,
        save_strategy="no",
        max_length=128,
    )
    trainer = trl.SFTTrainer(
        model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    logits = []  # the head run as a module: full [tokens × vocab] logits
    model.get_output_embeddings().register_forward_hook(lambda m, i, out: logits.append(tuple(out.shape)))
    fused = []
    real = fused_linear_ce.FusedLinearCrossEntropyFunction.apply
    monkeypatch.setattr(
        fused_linear_ce.FusedLinearCrossEntropyFunction, "apply", lambda *a: fused.append(1) or real(*a)
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 3 and all(0.0 <= entry["mean_token_accuracy"] <= 1.0 for entry in logged)
    assert all(torch.isfinite(torch.tensor(entry["loss"])) for entry in logged)
    assert len(boundary_reads) >= 3  # TRL's packed rows ran through fastft's packed attention
    assert logits == []  # no step built the full logits
    # TRL >= 1.15 installs its own chunked LM head on the model (add_fused_lm_head) and computes the loss
    # and its metrics there; before, the labels= call reached fastft's fused linear cross-entropy
    trl_head = "add_fused_lm_head" in inspect.getsource(trl.SFTTrainer.__init__)
    assert (len(fused) == 0) == trl_head, (trl.__version__, len(fused))


def test_trl_default_gradient_checkpointing_keeps_fastft_offload(tmp_path):
    """TRL's SFTConfig turns gradient_checkpointing on by default and calls the model's switch: the model
    keeps fastft's offloaded checkpointing (the same offloader on every layer), never transformers'
    plain recompute stacked or swapped in."""
    trl = pytest.importorskip("trl")
    from copy_stand_ins import SyncCopies
    from datasets import Dataset

    from fastft.runtime.offload import enable_offload, offloader_of

    model, tokenizer = fastft.load_model("tiny-llama")
    model = fastft.add_lora(model, r=4, gradient_checkpointing="offload")
    offloader = enable_offload(model, copies=SyncCopies())  # CPU stand-in copies: the offload path runs
    layers = list(model.get_base_model().model.layers)
    rows = [{"text": f"{i} plus {i} is {2 * i}. " * 3} for i in range(16)]
    config = trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_length=64,
    )
    assert config.gradient_checkpointing  # TRL's default, left as a user leaves it
    trl.SFTTrainer(
        model=model, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    ).train()
    assert offloader_of(model) is offloader
    assert all(layer._gradient_checkpointing_func is offloader for layer in layers)
    assert offloader.stats().layers_offloaded > 0

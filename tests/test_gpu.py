"""CUDA paths of the foundation: bf16 autocast, fused AdamW, deferred readout, fp16 + loss scaling, NF4.

Marked `gpu`: skipped without CUDA (CI), run on the device before a GPU-facing change is called done.
"""

from __future__ import annotations

import pytest
import torch

import fastft
from fastft.bench.common import count_syncs
from fastft.data.skills import generate
from fastft.runtime.model_state import model_state
from fastft.training.loss import causal_lm_loss_sum
from fastft.training.readout import PendingReadout
from fastft.training.trainer import TrainConfig, Trainer

pytestmark = pytest.mark.gpu
ROWS = list(generate(400, seed=21))


def _model(**kwargs):
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=256, **kwargs)
    return fastft.add_lora(model, r=16, alpha=32, seed=3), tokenizer


def test_bf16_training_on_cuda_learns_and_reports_gpu_memory():
    model, tokenizer = _model()
    assert model.dtype == torch.bfloat16 and next(model.parameters()).is_cuda
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    assert all(p.dtype == torch.float32 for p in lora)  # adapters stay fp32 under a bf16 base
    trainer = Trainer(
        model,
        tokenizer,
        fastft.pack(ROWS, tokenizer),
        config=TrainConfig(max_steps=40, learning_rate=2e-3, micro_batch_bins=2),
    )
    assert trainer.autocast_dtype == torch.bfloat16 and trainer.loss_scaler is None
    assert trainer.optimizer.defaults["fused"]
    result = trainer.train()
    losses = [e.loss for e in result.steps]
    assert len(losses) == 40 and sum(losses[-5:]) < 0.8 * sum(losses[:5])
    event = result.steps[-1]
    assert event.memory_kind == "cuda" and 0 < event.peak_memory_bytes < 2**31
    assert event.step_seconds > 0 and event.trained_tokens_per_second > 0


def test_fp16_training_uses_the_loss_scaler():
    model, tokenizer = _model(dtype=torch.float16)
    trainer = Trainer(
        model, tokenizer, fastft.pack(ROWS, tokenizer), config=TrainConfig(max_steps=12, learning_rate=2e-3)
    )
    assert trainer.autocast_dtype == torch.float16 and trainer.loss_scaler is not None
    result = trainer.train()
    assert all(torch.isfinite(torch.tensor(e.loss)) for e in result.steps)


def test_nf4_double_quantised_preset_trains_with_lora():
    pytest.importorskip("bitsandbytes")
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=256, load_in_4bit=True)
    base = model
    assert base.is_loaded_in_4bit and base.fastft_info.quantization == "nf4"
    quant = base.config.quantization_config
    assert quant.bnb_4bit_quant_type == "nf4" and quant.bnb_4bit_use_double_quant
    model = fastft.add_lora(model, r=8, alpha=16)
    result = fastft.train(
        model, tokenizer, fastft.pack(ROWS, tokenizer), max_steps=10, learning_rate=2e-3, progress=False
    )
    assert all(torch.isfinite(torch.tensor(e.loss)) for e in result.steps)
    with pytest.raises(ValueError, match="4/8-bit base"):
        fastft.save_merged(model, "/tmp/never")


def test_resume_on_cuda_reproduces_the_uninterrupted_losses(tmp_path):
    def run(output, stop_at=None, resume=False):
        model, tokenizer = _model()
        config = TrainConfig(
            max_steps=8,
            learning_rate=2e-3,
            save_every=4,
            output_dir=str(output),
            resume_from="latest" if resume else None,
        )
        trainer = Trainer(model, tokenizer, fastft.pack(ROWS, tokenizer), config=config)
        if stop_at:
            trainer.subscribe(
                lambda e: trainer.stop() if getattr(e, "step", 0) == stop_at and hasattr(e, "loss") else None
            )
        return [e.loss for e in trainer.train().steps]

    full = run(tmp_path / "a")
    run(tmp_path / "b", stop_at=4)
    resumed = run(tmp_path / "b", resume=True)
    assert resumed[:4] == full[:4]
    assert resumed[4:] == pytest.approx(full[4:], rel=2e-2)  # bf16 kernels may reorder sums


def test_packed_loss_equals_per_sequence_loss_in_bf16():
    model, tokenizer = fastft.load_model("tiny-qwen3", max_seq_length=256)
    data = fastft.pack(ROWS, tokenizer)
    batch = data.batch([0, 1]).to("cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        packed = causal_lm_loss_sum(model, batch)
        alone = sum(
            causal_lm_loss_sum(
                model,
                fastft.PackedBatch.from_sequences([data.data.input_ids[i]], [data.data.labels[i]]).to("cuda"),
            )
            for b in (0, 1)
            for i in data.bins[b]
        )
    assert float(packed) == pytest.approx(float(alone), rel=2e-2)


def test_a_packed_training_step_has_no_host_device_sync():
    """With fastft's packed attention, a whole dense-model step (forward, recompute, backward,
    clipping, fused AdamW, the loss readout) never waits for the GPU."""
    model, tokenizer = _model()
    data = fastft.pack(ROWS, tokenizer)
    trainer = Trainer(model, tokenizer, data, config=TrainConfig(max_steps=10, micro_batch_bins=2))
    trainer.train()  # warm up: backend choice (a measured sync, once), allocator, kernels
    resolved = model_state(model).attention.resolved
    assert resolved in ("sdpa_masked", "sdpa_segments", "varlen", "flex", "flash_attn")
    trainer.optimizer.zero_grad(set_to_none=True)
    syncs = count_syncs(trainer._train_step)
    print(f"attention backend {resolved}; syncs in one step: {syncs}")
    assert syncs == 0


def _reference_attention(q, k, v, lengths, window):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    outputs, start = [], 0
    for n in lengths:
        i = torch.arange(n, device=q.device)
        mask = i[None, :] <= i[:, None]
        if window:
            mask &= i[:, None] - i[None, :] < window
        s = slice(start, start + n)
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, s], k[:, :, s], v[:, :, s], attn_mask=mask
            )
        )
        start += n
    return torch.cat(outputs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("lengths", [(7, 300, 1031, 64, 2000, 129), (1024, 1024), (3000,)])
@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("backend", ["sdpa_masked", "sdpa_segments", "varlen", "flash_attn", "flex"])
def test_cuda_backends_match_sdpa_per_sequence_in_bf16(backend, window, lengths):
    from fastft.runtime.attention import available_backends, packed_attention

    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not available here")
    if len(set(lengths)) == 1 and backend != "varlen":
        pytest.skip("equal-length bins take a separate path only in varlen")
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 100, (n,), generator=generator).numpy() for n in lengths]
    batch = fastft.PackedBatch.from_sequences(ids, ids).to("cuda")
    make = lambda h: torch.randn(1, h, batch.num_tokens, 128, device="cuda")  # noqa: E731
    q32, k32, v32 = (t.requires_grad_() for t in (make(32), make(8), make(8)))
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in (q32, k32, v32))
    out = packed_attention(q, k, v, batch, backend, sliding_window=window)
    ref = _reference_attention(q32, k32, v32, lengths, window)
    assert ((out.float() - ref).norm() / ref.norm()) < 2e-2
    upstream = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), upstream.bfloat16())
    want = torch.autograd.grad(ref, (q32, k32, v32), upstream)
    for g, w in zip(got, want, strict=True):
        assert ((g.float() - w).norm() / w.norm()) < 2e-2


def test_auto_backend_on_cuda_is_the_measured_fastest_available():
    from fastft.runtime.attention import available_backends, choose_backend, patch_packed_attention

    model, tokenizer = _model()
    patch_packed_attention(model, "auto")
    batch = fastft.pack(ROWS, tokenizer).batch([0, 1, 2]).to("cuda")
    expected = "varlen" if "varlen" in available_backends("cuda") else "sdpa_masked"
    assert choose_backend(model, batch) == expected


def test_demo_uses_the_gpu(tmp_path):
    from fastft.demo import DemoConfig, run_demo

    result = run_demo(
        DemoConfig(
            steps=20, eval_every=10, eval_samples=32, output_dir=str(tmp_path), name="gpu", progress=False
        ),
        log=lambda m: None,
    )
    assert result.summary["device"] != "cpu" and result.summary["memory_kind"] == "cuda"
    assert (tmp_path / "gpu" / "report.html").exists()


def test_trainer_module_reads_scalars_without_blocking():
    values = torch.tensor([1.5, 2.5], device="cuda")
    readout = PendingReadout(values, {})
    assert readout.host.is_pinned() and readout.read() == [1.5, 2.5]

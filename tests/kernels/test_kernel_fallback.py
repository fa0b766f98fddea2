"""Where Triton cannot serve (no Triton, a GPU below sm75, bf16 on sm75, FASTFT_NO_TRITON=1), fastft says once
which parts run in PyTorch, and trains as the fused kernels do; the capability table's per-architecture
GEMM configs fit each architecture."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import fastft
from fastft.data.skills import generate
from fastft.kernels import capability
from fastft.kernels.capability import ARCHS, KernelFallbackWarning

ROWS = list(generate(24, seed=5))


def _losses(preset: str) -> list[float]:
    model, tokenizer = fastft.load_model(preset, max_seq_length=64, dtype=torch.float32)
    model = fastft.add_lora(model, r=4, alpha=8, seed=1)
    result = fastft.train(
        model, tokenizer, fastft.pack(ROWS, tokenizer, 64), max_steps=2, learning_rate=1e-3, progress=False
    )
    return [event.loss for event in result.steps]


@pytest.mark.slow  # the fused run's kernels are interpreted: about 30 s a preset on 2 idle cores
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_a_forced_no_triton_run_trains_like_the_fused_run(preset, interpreted, monkeypatch):
    """fp32, the same seed: the fused kernels (interpreted) and their PyTorch references give the same losses
    to 1e-5; the reference run launches no kernel and says once why."""
    monkeypatch.setattr(capability, "_SAID", set())
    launches = {"n": 0}
    real_getitem = InterpretedFunction.__getitem__

    def counting(self, grid):
        launches["n"] += 1
        return real_getitem(self, grid)

    monkeypatch.setattr(InterpretedFunction, "__getitem__", counting)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelFallbackWarning)
        fused = _losses(preset)
    fused_launches, launches["n"] = launches["n"], 0
    monkeypatch.setenv("FASTFT_NO_TRITON", "1")
    with pytest.warns(KernelFallbackWarning, match=r"FASTFT_NO_TRITON=1 is set\): RMSNorm, RoPE") as said:
        reference = _losses(preset)
    assert fused_launches > 0 and launches["n"] == 0
    assert len([w for w in said if issubclass(w.category, KernelFallbackWarning)]) == 1  # said once
    np.testing.assert_allclose(reference, fused, rtol=1e-5)


def test_each_reason_to_fall_back_is_named(monkeypatch):
    monkeypatch.delenv("FASTFT_NO_TRITON", raising=False)
    for capability_code, dtype, expected in (
        (60, torch.float16, "sm60: Triton runs on sm75 (T4) and newer"),
        (70, torch.float16, "sm70"),
        (75, torch.bfloat16, "sm75) has no bfloat16 compute: load the model in fp16"),
        (75, torch.float16, None),
        (75, torch.uint8, None),  # NF4's packed bytes
        (86, torch.bfloat16, None),
        (90, torch.float32, None),
    ):
        monkeypatch.setattr(
            capability, "device_capability", lambda device=None, c=capability_code: divmod(c, 10)
        )
        reason = capability.fallback_reason("cuda", dtype)
        assert reason is None if expected is None else expected in reason
    assert "pip install triton" in capability.fallback_reason("cuda", torch.float16, triton_importable=False)
    monkeypatch.setenv("FASTFT_NO_TRITON", "1")
    assert capability.fallback_reason("cuda", torch.float16) == "FASTFT_NO_TRITON=1 is set"


def test_the_fallback_is_said_once_per_reason(monkeypatch):
    monkeypatch.setattr(capability, "_SAID", set())
    with pytest.warns(KernelFallbackWarning) as said:
        for _ in range(3):
            capability.say_fallback("this GPU is sm60")
        capability.say_fallback("Triton is not installed")
    assert len(said) == 2 and "MoE grouped GEMMs" in str(said[0].message)


def test_every_architecture_has_gemm_configs_that_fit_its_shared_memory():
    for table in ("fwd", "dw"):
        for code, arch in ARCHS.items():
            rows = capability.gemm_config_tuples(table, code)
            assert set(rows) == {"wide", "skinny_n", "small_k"} and all(rows.values()), (table, code)
            for configs in rows.values():
                for config in configs:
                    assert capability.operand_bytes(table, config) <= arch.shared_bytes, (table, code, config)
    # sm90 and sm80 keep the tuned lists; the 99 KiB and 64 KiB parts cut the deep pipelines of the widest tiles
    for table in ("fwd", "dw"):
        assert capability.gemm_config_tuples(table, 90) == capability.GEMM_TABLES[table]
        assert capability.gemm_config_tuples(table, 80) == capability.GEMM_TABLES[table]
    assert (128, 256, 64, 8, 4, 8) not in capability.gemm_config_tuples("fwd", 86)["wide"]
    assert (128, 256, 64, 8, 3, 8) in capability.gemm_config_tuples("fwd", 86)["wide"]
    assert (128, 256, 64, 8, 2, 8) in capability.gemm_config_tuples("fwd", 75)["wide"]


def test_a_capability_between_rows_takes_its_architecture_s_limits():
    assert capability.arch_of(87) is ARCHS[86] and capability.arch_of(120) is ARCHS[90]
    with pytest.raises(ValueError, match="sm60 is below sm75"):
        capability.arch_of(60)


def test_kernel_status_on_the_cpu_names_the_reference():
    status = capability.kernel_status("cpu")
    assert status["triton"] is False and "CPU" in status["reason"] and "RMSNorm" in status["fallback"]


@pytest.mark.gpu
def test_gpu_kernel_status_names_triton_and_the_forced_reference(monkeypatch):
    from fastft.kernels import use_triton

    monkeypatch.delenv("FASTFT_NO_TRITON", raising=False)
    monkeypatch.setattr(capability, "_SAID", set())
    status = fastft.kernel_status()
    assert status == {"triton": True, "reason": None, "fallback": []}
    x = torch.randn(4, 64, device="cuda", dtype=torch.float16)
    assert use_triton(x)
    monkeypatch.setenv("FASTFT_NO_TRITON", "1")
    with pytest.warns(KernelFallbackWarning, match="FASTFT_NO_TRITON=1 is set"):
        assert not use_triton(x)
    assert fastft.kernel_status()["reason"] == "FASTFT_NO_TRITON=1 is set"


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-moe"])
def test_gpu_a_forced_no_triton_run_trains_like_the_fused_run(preset, monkeypatch):
    """On CUDA in fp32: the compiled kernels and their references give the same losses (1e-4: the kernels'
    reductions run in another order than the references'; on the CPU the interpreted ones agree to 1e-5)."""
    monkeypatch.delenv("FASTFT_NO_TRITON", raising=False)
    fused = _losses(preset)
    monkeypatch.setenv("FASTFT_NO_TRITON", "1")
    monkeypatch.setattr(capability, "_SAID", set())
    with pytest.warns(KernelFallbackWarning):
        reference = _losses(preset)
    print(preset, fused, reference)
    np.testing.assert_allclose(reference, fused, rtol=1e-4)

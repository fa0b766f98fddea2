"""The estimator checks offloading against the host memory it may pin (issue 24: `max_context` promised
693,248 tokens under an 80 GiB cap, whose layer inputs need 169 GiB of pinned host memory; the offloader
would have turned itself off and the run would have run out of GPU memory). Since 2026-12-06 the offloader
fills its budget with the first layers' inputs and leaves the rest on the GPU, and the estimate counts that."""

from __future__ import annotations

import pytest

from fastft.vram import VramEstimateError, capped_gpu, estimate_vram, fits, max_context

GiB = 2**30
MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # a catalog model: no download
QLORA = dict(precision="nf4", lora_r=32, checkpointing="offload")


def _host_bytes(length: int) -> int:
    """Llama-3.1-8B's layer inputs at `length` tokens: 32 layers × 4,096 × 2 bytes a token."""
    return 32 * 4096 * 2 * length


def test_an_offload_the_host_holds_in_part_keeps_the_other_layers_inputs_on_the_gpu():
    """300,000 tokens: 32 inputs of 2.29 GiB, which pinned slabs (powers of two) hold in 88 GiB; 64 GiB hold 27
    of them (one 64 GiB slab), the other 5 stay on the GPU and nothing is kept beside them. With no room for
    a single input it is the plain recompute the offloader then runs."""
    gpu = capped_gpu(80 * GiB)
    unchecked = estimate_vram(MODEL, 300_000, gpu=gpu, host_memory=None, **QLORA)
    roomy = estimate_vram(MODEL, 300_000, gpu=gpu, host_memory=1024 * GiB, **QLORA)
    small = estimate_vram(MODEL, 300_000, gpu=gpu, host_memory=64 * GiB, **QLORA)
    none = estimate_vram(MODEL, 300_000, gpu=gpu, host_memory=GiB, **QLORA)
    inputs_only = estimate_vram(MODEL, 300_000, gpu=gpu, host_memory=None, keep_attention=False, **QLORA)
    recompute = estimate_vram(MODEL, 300_000, gpu=gpu, **{**QLORA, "checkpointing": "recompute"})
    assert unchecked.settings.checkpointing == roomy.settings.checkpointing == "offload"
    assert roomy.total_bytes == unchecked.total_bytes and unchecked.fits
    assert small.settings.checkpointing == "offload"
    assert small.total_bytes == inputs_only.total_bytes + 5 * _host_bytes(300_000) // 32
    assert small.fits and not recompute.fits  # partly offloaded, 300k tokens still train under 80 GiB
    assert any("may pin 64.00 GiB" in note and "first 27 of 32 layers" in note for note in small.notes)
    assert none.settings.checkpointing == "recompute" and none.total_bytes == recompute.total_bytes


@pytest.mark.parametrize("host_gib", [24, 64, 96])
def test_max_context_never_needs_more_host_memory_than_it_has(host_gib):
    gpu = capped_gpu(80 * GiB)
    unchecked = max_context(MODEL, gpu, host_memory=None, **QLORA)
    longest = max_context(MODEL, gpu, host_memory=host_gib * GiB, **QLORA)
    assert 0 < longest < unchecked
    at = estimate_vram(MODEL, longest, gpu=gpu, host_memory=host_gib * GiB, **QLORA)
    assert at.fits
    # the inputs the host cannot hold are counted on the GPU
    unlimited = estimate_vram(MODEL, longest, gpu=gpu, host_memory=None, keep_attention=False, **QLORA)
    on_gpu = max(0, _host_bytes(longest) - host_gib * GiB)
    assert at.total_bytes >= unlimited.total_bytes + on_gpu
    beyond = estimate_vram(MODEL, longest + 128, gpu=gpu, host_memory=host_gib * GiB, **QLORA)
    assert not beyond.fits


def test_fits_judges_its_fixes_on_the_same_host():
    verdict = fits(MODEL, 400_000, capped_gpu(80 * GiB), host_memory=64 * GiB, **QLORA)
    assert not verdict and verdict.fixes
    for fix in verdict.fixes:
        trial = estimate_vram(
            MODEL,
            fix.changes.get("seq_len", 400_000),
            gpu=capped_gpu(80 * GiB),
            host_memory=64 * GiB,
            **{**QLORA, **{k: v for k, v in fix.changes.items() if k not in ("seq_len", "batch_tokens")}},
        )
        assert trial.fits, fix


def test_ranks_of_one_host_share_its_memory():
    one = estimate_vram(MODEL, 200_000, gpu=capped_gpu(80 * GiB), host_memory=64 * GiB, **QLORA)
    two = estimate_vram(MODEL, 200_000, gpu=capped_gpu(80 * GiB), host_memory=64 * GiB, world_size=2, **QLORA)
    assert one.settings.checkpointing == "offload"  # 48.8 GiB of inputs fit 64 GiB
    assert not any("layers fit there" in note for note in one.notes)  # every input fits
    assert any("first 20 of 32 layers" in note for note in two.notes)  # 32 GiB each hold 20 of 1.53 GiB
    assert two.total_bytes > one.total_bytes


def test_auto_is_this_hosts_budget_and_a_bad_value_is_named(monkeypatch):
    import fastft.runtime.host_budget as host_budget

    monkeypatch.setattr(host_budget, "host_memory_available", lambda: 32 * GiB)  # may pin 24 GiB
    auto = estimate_vram(MODEL, 100_000, gpu=capped_gpu(80 * GiB), **QLORA)  # 24.4 GiB of inputs
    assert any("may pin 24.00 GiB" in note and "first 30 of 32 layers" in note for note in auto.notes)
    monkeypatch.setattr(host_budget, "host_memory_available", lambda: None)  # a host that does not say
    assert (
        estimate_vram(MODEL, 100_000, gpu=capped_gpu(80 * GiB), **QLORA).settings.checkpointing == "offload"
    )
    with pytest.raises(VramEstimateError, match="host_memory"):
        estimate_vram(MODEL, 1024, host_memory="lots", **QLORA)


def test_the_cli_takes_the_host_memory_in_gib(capsys):
    from fastft.cli import main

    args = [
        "estimate",
        MODEL,
        "--seq-len",
        "300000",
        "--precision",
        "nf4",
        "--lora-r",
        "32",
        "--checkpointing",
        "offload",
        "--gpu",
        "h100",
    ]
    assert main([*args, "--host-memory", "64"]) == 0
    assert "this host may pin 64.00 GiB" in capsys.readouterr().out
    assert main([*args, "--host-memory", "none"]) == 0
    assert "may pin" not in capsys.readouterr().out

"""The VRAM estimate per GPU of a run on several GPUs (`fastft.vram.parallel`): DDP holds the whole model on
each GPU, FSDP2 splits the 16-bit base, the adapters, their gradients and the optimizer states."""

from __future__ import annotations

import pytest

import fastft
from fastft.vram.inventory import inventory_of
from fastft.vram.result import VramEstimateError

MODEL = "meta-llama/Llama-3.1-8B-Instruct"  # a catalog id: its inventory ships with fastft (offline)


def _estimate(**options):
    return fastft.estimate_vram(MODEL, seq_len=2048, gpu="H100", **options)


def test_ddp_holds_the_one_process_step_on_each_gpu_plus_the_all_reduce_buckets():
    one, two = _estimate(), _estimate(world_size=2)
    assert two.settings.world_size == 2 and two.settings.sharding == "ddp"
    assert two.component("communication").own_bytes == 4 * one.lora_parameters
    for c in one.components:  # every other component is the one-process one
        assert two.component(c.key) == c
    assert two.total_bytes >= one.total_bytes


def test_fsdp_splits_the_base_the_adapters_and_the_optimizer_across_the_gpus():
    one = _estimate(sharding="fsdp")
    assert one.total_bytes == _estimate().total_bytes  # one GPU: nothing to split
    inventory = inventory_of(MODEL)
    weights = one["weights"]
    head = weights * inventory.head_params // inventory.total_params
    for n in (2, 4, 8):
        split = _estimate(world_size=n, sharding="fsdp")
        layer = (weights - head) / inventory.num_layers
        expected = head + (weights - head) / n + 2 * layer * (n - 1) / n
        assert split["weights"] == pytest.approx(expected, rel=1e-6)
        for key in ("lora", "optimizer"):
            assert split[key] == one[key] // n
        assert split.component("activations") == one.component("activations")  # batch_tokens per rank
    totals = [_estimate(world_size=n, sharding="fsdp").total_bytes for n in (1, 2, 4, 8)]
    assert totals == sorted(totals, reverse=True) and totals[-1] < totals[0] / 2


def test_settings_that_cannot_run_are_refused_with_the_fix():
    with pytest.raises(VramEstimateError, match="cannot shard a quantised base"):
        _estimate(world_size=2, sharding="fsdp", precision="nf4")
    with pytest.raises(VramEstimateError, match="1 or more"):
        _estimate(world_size=0)
    with pytest.raises(VramEstimateError, match="not one of ddp, fsdp"):
        _estimate(world_size=2, sharding="zero3")


def test_fits_judges_its_fixes_per_gpu_and_the_cli_answers_per_gpu(capsys):
    """`fits` for a run on several GPUs tries each fix on the same GPUs; `fastft estimate --world-size N
    --sharding fsdp` prints the per-GPU estimate."""
    from fastft.cli import main
    from fastft.vram import estimate_vram, fits

    model, seq = "Qwen/Qwen3-14B", 16384
    settings = dict(gpu="rtx4090", checkpointing="recompute", host_memory=None)
    verdict = fits(model, seq, world_size=2, sharding="fsdp", **settings)
    assert not verdict and verdict.fixes
    for fix in verdict.fixes:
        changed = {k: v for k, v in fix.changes.items() if k not in ("seq_len", "batch_tokens")}
        trial = estimate_vram(
            model, fix.changes.get("seq_len", seq), world_size=2, sharding="fsdp", **{**settings, **changed}
        )
        assert trial.fits and trial.total_bytes == fix.total_bytes, fix
    args = ["estimate", model, "--seq-len", "8192", "--gpu", "rtx4090", "--host-memory", "none"]
    assert main([*args, "--world-size", "2", "--sharding", "fsdp"]) == 0
    two = capsys.readouterr().out
    assert "per GPU of 2 (FSDP2)" in two
    assert main(args) == 0
    assert "per GPU of" not in capsys.readouterr().out

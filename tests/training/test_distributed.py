"""Several processes, one run (`fastft.training.distributed`): 2 gloo ranks on the CPU, started by
``fastft launch --nproc 2`` (torchrun), train tiny-llama exactly as one process does with the same global
batch, under DDP and FSDP2; a 2-rank run resumes exactly; only rank 0 writes checkpoints."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastft.training.trainer import TrainConfig, Trainer

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_worker.py"
sys.path.insert(0, str(HERE))
import distributed_worker  # noqa: E402


def _two_ranks(out: Path, **config) -> dict:
    """`distributed_worker.run(out, config)` on 2 ranks through ``fastft launch``; rank 0's summary."""
    command = [
        sys.executable,
        "-m",
        "fastft",
        "launch",
        "--nproc",
        "2",
        str(WORKER),
        str(out),
        json.dumps(config),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return torch.load(out / "result.pt")


def _assert_same_run(distributed: dict, single: dict, weights_rtol: float = 1e-5) -> None:
    """Same losses, gradient norms, eval losses (1e-5 relative) and final LoRA weights (`weights_rtol` of each
    tensor's largest value)."""
    assert distributed["trained"] == single["trained"]  # the events count every rank's tokens
    assert distributed["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert distributed["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)
    assert distributed["evals"] == pytest.approx(single["evals"], rel=1e-5)
    assert distributed["weights"].keys() == single["weights"].keys()
    for name, weight in single["weights"].items():
        error = (distributed["weights"][name] - weight).abs().max()
        assert error <= weights_rtol * weight.abs().max(), (name, float(error))
    trained = [w for n, w in single["weights"].items() if "lora_B" in n]
    assert any(w.abs().max() > 0 for w in trained)  # LoRA B starts at zero: the run really trained


def test_two_ddp_ranks_equal_one_process_with_the_same_global_batch(tmp_path):
    config = dict(max_steps=4, eval=True)
    distributed = _two_ranks(tmp_path / "ddp", **config)
    single = distributed_worker.run(tmp_path / "one", dict(config, grad_accum_steps=2))
    _assert_same_run(distributed, single)
    assert "communication" in distributed["phases"]  # the gradient all-reduce, timed as its own phase
    assert "communication" not in single["phases"]


def test_two_ddp_ranks_with_gradient_accumulation_equal_one_process(tmp_path):
    """Each rank accumulates 2 micro-batches (the global step's 0 and 2, or 1 and 3) and the ranks' sums are
    added: the gradient is the one-process sum in another order. Losses agree to 1e-7; Adam's first steps
    divide each gradient by its own magnitude, which lifts that rounding to a few 1e-6 of the weights
    (measured: 9e-6 of the largest value), hence 5e-5 for the weights here."""
    distributed = _two_ranks(tmp_path / "ddp", max_steps=4, grad_accum_steps=2)
    single = distributed_worker.run(tmp_path / "one", dict(max_steps=4, grad_accum_steps=4))
    _assert_same_run(distributed, single, weights_rtol=5e-5)


def test_an_overflow_in_one_fsdp2_rank_s_shard_skips_the_step_on_every_rank(tmp_path):
    """fp16's loss scale under FSDP2 (2 gloo ranks, tiny-llama, fp16 autocast on the CPU): each rank unscales its
    own gradient shard, so an inf only rank 1's shard holds is found by rank 1 alone; the flag is all-reduced
    (max) before the step, so both ranks skip step 2 and halve the scale, and the ranks stay one model."""
    _two_ranks(tmp_path, max_steps=3, distributed="fsdp", fp16_overflow=[1, 2])
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text())["scaler"] for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert [step["found_inf"] for step in ranks[0]] == [0.0, 1.0, 0.0]
    assert [step["scale"] for step in ranks[0]] == [2.0**16, 2.0**15, 2.0**15]


def test_two_fsdp2_ranks_equal_one_process_with_the_same_global_batch(tmp_path):
    config = dict(max_steps=3, checkpointing="recompute", eval=True)
    distributed = _two_ranks(tmp_path / "fsdp", distributed="fsdp", **config)
    single = distributed_worker.run(tmp_path / "one", dict(config, grad_accum_steps=2))
    _assert_same_run(distributed, single)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_two_ranks_train_dpo_as_one_process(tmp_path, sharding):
    """A preference step divides by the global pair count and sums the metrics over the ranks; DPO's reference
    pass (adapters disabled) runs under FSDP2's hooks too."""
    config = dict(max_steps=3, method="dpo", eval=True, micro_batch_bins=1)
    distributed = _two_ranks(tmp_path / "ranks", distributed=sharding, **config)
    single = distributed_worker.run(tmp_path / "one", dict(config, grad_accum_steps=2))
    # the losses, gradient norms and eval losses agree to 1e-5; Adam's first steps lift the ranks'
    # summation-order rounding in the weights (see the gradient-accumulation test above): measured 1.8e-5
    # and 5.7e-5 of a tensor's largest value in two FSDP2 runs on a 2-core machine, hence 2e-4
    _assert_same_run(distributed, single, weights_rtol=2e-4)
    assert len(distributed["preference"]) == 4 and all(distributed["preference"])
    for mine, theirs in zip(distributed["preference"], single["preference"], strict=True):
        assert mine["pairs"] == theirs["pairs"]
        # a reward is β times a difference of two sequence log-prob sums of a few hundred nats: their fp32
        # rounding in another summation order is ~1e-6 absolute (measured 2.9e-6 on a margin of 0.11)
        assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-5)


def test_two_ranks_train_grpo_each_sampling_its_share_of_the_prompts(tmp_path):
    """GRPO under torchrun: each rank samples whole groups of its share of the step's prompts; the events
    count every rank's completions, the gradients are summed, and a checkpoint resumes exactly."""
    import json as json_

    config = dict(method="grpo", max_steps=4, save_every=2, output_dir=str(tmp_path / "run" / "checkpoints"))
    full = _two_ranks(tmp_path / "run", **config)
    assert [g["completions"] for g in full["grpo"]] == [4 * 3] * 4  # both ranks' 2 prompts × G=3
    assert all(math.isfinite(loss) for loss in full["losses"])
    trained = [w for n, w in full["weights"].items() if "lora_B" in n]
    assert any(w.abs().max() > 0 for w in trained)
    ranks = [json_.loads((tmp_path / "run" / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["writes"] == ["checkpoint-2", "checkpoint-4"] and ranks[1]["writes"] == []
    resumed = _two_ranks(
        tmp_path / "resumed",
        **dict(config, resume_from=str(tmp_path / "run" / "checkpoints" / "checkpoint-2")),
    )
    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-5)
    assert [g["reward"] for g in resumed["grpo"]] == pytest.approx([g["reward"] for g in full["grpo"]])
    for name, weight in full["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], weight, rtol=1e-5, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """A 2-rank DDP run of 6 steps with checkpoints at 2, 4 and 6 (dropout on, so each rank's RNG matters)."""
    out = tmp_path_factory.mktemp("run")
    config = dict(
        max_steps=6, save_every=2, save_total_limit=3, output_dir=str(out / "checkpoints"), dropout=0.1
    )
    return out, config, _two_ranks(out, **config)


def test_only_rank_0_writes_the_checkpoints_and_every_rank_knows_them(two_rank_run):
    out, _, _ = two_rank_run
    ranks = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["writes"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert ranks[1]["writes"] == []
    assert ranks[0]["checkpoints"] == ranks[1]["checkpoints"]
    state = json.loads((out / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["distributed"]["world_size"] == 2 and len(state["rank_rng"]) == 2
    assert state["rank_rng"][0] != state["rank_rng"][1]  # each rank's dropout generator, kept apart


@pytest.mark.parametrize("run", ["two_rank_run", "two_rank_fsdp_run"])  # DDP, then FSDP2
def test_a_two_rank_run_resumes_exactly_on_two_ranks(run, request, tmp_path):
    out, config, full = request.getfixturevalue(run)
    resumed = _two_ranks(tmp_path, **dict(config, resume_from=str(out / "checkpoints" / "checkpoint-2")))
    assert resumed["losses"][:2] == full["losses"][:2]  # read back from the checkpoint
    assert resumed["losses"][2:] == pytest.approx(full["losses"][2:], rel=1e-5)
    for name, weight in full["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_a_checkpoint_resumes_only_on_the_world_size_that_wrote_it(two_rank_run):
    import fastft

    out, _, _ = two_rank_run
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=128, device="cpu")
    model = fastft.add_lora(model, r=4, alpha=8, dropout=0.1, seed=7)
    data = fastft.pack(distributed_worker.ROWS, tokenizer, 128)
    config = TrainConfig(max_steps=6, resume_from=str(out / "checkpoints" / "checkpoint-4"), attention=None)
    with pytest.raises(ValueError, match=r"2 rank\(s\), this one runs on 1: resume with --nproc_per_node=2"):
        Trainer(model, tokenizer, data, config=config).train()


@pytest.fixture(scope="module")
def two_rank_fsdp_run(tmp_path_factory):
    """A 2-rank FSDP2 run of 6 steps with checkpoints at 2, 4 and 6 (dropout on)."""
    out = tmp_path_factory.mktemp("fsdp-run")
    config = dict(
        max_steps=6,
        save_every=2,
        save_total_limit=3,
        output_dir=str(out / "checkpoints"),
        dropout=0.1,
        distributed="fsdp",
    )
    return out, config, _two_ranks(out, **config)


def test_fsdp2_checkpoints_are_plain_peft_adapters_written_once(two_rank_fsdp_run):
    """The sharded adapter and optimizer state are gathered into one checkpoint, written by rank 0: an
    adapter plain PEFT loads (full shapes), with the final weights of the run."""
    from safetensors.torch import load_file

    out, _, full = two_rank_fsdp_run
    ranks = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["writes"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"] and ranks[1]["writes"] == []
    state = json.loads((out / "checkpoints" / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["distributed"] == {"world_size": 2, "sharding": "fsdp"}
    adapter = load_file(str(out / "checkpoints" / "checkpoint-6" / "adapter_model.safetensors"))
    final = {name.replace(".default", ""): weight for name, weight in full["weights"].items()}
    assert adapter.keys() == final.keys()
    for name, weight in final.items():
        assert torch.equal(adapter[name], weight), name
    optimizer = torch.load(out / "checkpoints" / "checkpoint-6" / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(final)  # every trained weight's Adam moments, gathered whole


def test_a_process_group_fastft_starts_ends_at_exit(tmp_path):
    """A script that trains under torchrun and never ends the process group: the group fastft started is
    destroyed at exit, while the interpreter is whole (the check, registered first, runs last)."""
    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, torch, torch.distributed as dist\n"
        "from fastft.training.distributed import setup\n"
        "atexit.register(lambda: print('initialised at exit:', dist.is_initialized()))\n"
        "print(setup(torch.device('cpu'), 'ddp').world_size)\n"
    )
    environment = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    environment |= {"MASTER_PORT": str(_free_port())}
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **environment},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["1", "initialised at exit: False"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launch_refuses_what_cannot_start(tmp_path):
    from fastft.launch import LaunchError, check_launch

    with pytest.raises(LaunchError, match="is not a file"):
        check_launch(tmp_path / "missing.py", 2)
    with pytest.raises(LaunchError, match="1 or more"):
        check_launch(WORKER, 0)
    done = subprocess.run(
        [sys.executable, "-m", "fastft", "launch", "--gpus", "2", str(tmp_path / "missing.py")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "is not a file" in done.stderr


def test_the_ddp_bench_runs_one_rank_and_two_on_the_cpu(tmp_path):
    out = tmp_path / "ddp.json"
    command = [sys.executable, "-m", "fastft", "bench", "ddp", "--model", "tiny-llama", "--gpus", "2"]
    command += [
        "--device",
        "cpu",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--chats",
        "60",
        "--max-seq-length",
        "128",
    ]
    command += ["--folder", str(tmp_path / "models"), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert [(run["world_size"], run["backend"]) for run in report["runs"]] == [(1, "gloo"), (2, "gloo")]
    assert all(run["trained_tokens_per_second"] > 0 and run["communication_ms"] > 0 for run in report["runs"])
    assert (
        report["speedup"]
        == report["runs"][1]["trained_tokens_per_second"] / report["runs"][0]["trained_tokens_per_second"]
    )
    assert "speed-up on 2 rank(s)" in done.stdout


@pytest.mark.parametrize("checkpointing", [False, True])
def test_fsdp2_sharded_adapters_train_under_16_bit_autocast_in_one_process(
    tmp_path, checkpointing, monkeypatch
):
    """Under 16-bit autocast the fused forwards want the adapters in 16 bits, and fastft keeps 16-bit copies of
    them (`AdapterComputeCopies`). FSDP2's sharded adapters (DTensors) get none: the copy was a plain tensor
    written from a DTensor, which stopped every FSDP2 step on a GPU (bf16) and no fp32 CPU run. One gloo rank,
    CPU bf16 autocast, with and without recomputed layers: the sharded model's loss and LoRA gradients are the
    unsharded model's."""
    import fastft
    from fastft.data.batch import PackedBatch
    from fastft.kernels import tiling
    from fastft.training.distributed import Distributed, full_tensor, shard_model
    from fastft.training.loss import causal_lm_loss_sum

    monkeypatch.setattr(
        tiling, "ADAPTER_COMPUTE_COPIES", True
    )  # off by default; this checks them under FSDP2

    def loss_and_grads(model):
        generator = torch.Generator().manual_seed(0)
        ids = [torch.randint(3, 500, (n,), generator=generator).numpy() for n in (13, 30)]
        batch = PackedBatch.from_sequences(ids, [i.copy() for i in ids])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss_sum(model, batch)
        loss.backward()
        grads = {n: full_tensor(p.grad).float() for n, p in model.named_parameters() if p.requires_grad}
        return float(loss.detach()), grads

    def lora_model():
        torch.manual_seed(0)
        model, _ = fastft.load_model("tiny-llama")
        model = fastft.add_lora(model, r=4, alpha=8, gradient_checkpointing=checkpointing, seed=0)
        model.train()
        return model

    reference_loss, reference_grads = loss_and_grads(lora_model())
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = lora_model()
        parallel = Distributed(
            rank=0, world_size=1, sharding="fsdp", backend="gloo", device=torch.device("cpu")
        )
        shard_model(model, parallel)
        assert any(hasattr(p, "full_tensor") for p in model.parameters() if p.requires_grad)
        loss, grads = loss_and_grads(model)
    finally:
        torch.distributed.destroy_process_group()
    assert loss == pytest.approx(reference_loss, rel=1e-5)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()))

"""Ten SIGKILLs at random moments of a run that checkpoints every step and saves its adapter every second:
half at random moments (during start-up, or inside one of the next few steps), half at chosen moments
inside a save (torch.save of the optimizer, the marker, the rename into place, the exchange of the adapter
folders, the deletion of a pruned checkpoint).

After every kill the latest checkpoint and the adapter (once one was written) load, and every step a resumed
run computes has the loss of the uninterrupted run; the run finished after the last kill ends with its
adapter. Runs are forked from this process (one import of torch, not eleven), so the test takes seconds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest
import torch

import fastft
from fastft import atomic
from fastft.data.skills import generate
from fastft.training import checkpoint as checkpoint_module
from fastft.training.checkpoint import latest_checkpoint, read_checkpoint
from fastft.training.events import StepEvent
from fastft.training.trainer import TrainConfig, Trainer

STEPS = 50
CHILD_ERRORS = f"/tmp/fastft-kill-test-{os.getpid()}.err"
TRAPS = ("torch.save", "marker", "rename", "exchange", "prune")


@pytest.fixture(scope="module")
def job():
    """The pristine LoRA model and packed data every forked run starts from."""
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=64)
    model = fastft.add_lora(model, r=4, alpha=8, dropout=0.1, seed=1)  # dropout: the RNG is resumed too
    return model, tokenizer, fastft.pack(list(generate(60, seed=1)), tokenizer, 64)


def _run(job, output_dir, log_path, trap: tuple[str, int] | None = None) -> None:
    """In a forked child: resume from the latest checkpoint, train to the end, log each step's loss."""
    model, tokenizer, data = job
    if trap is not None:
        _install_trap(*trap, fired_dir=output_dir.parent)
    config = TrainConfig(
        max_steps=STEPS,
        learning_rate=3e-3,
        save_every=1,
        save_total_limit=2,
        output_dir=str(output_dir),
        resume_from="latest",
        attention=None,
        profile=False,
        seed=5,
    )
    trainer = Trainer(model, tokenizer, data, config=config)
    log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - the process is killed, not closed

    def record(event):
        if isinstance(event, StepEvent):
            log.write(json.dumps([event.step, event.loss]) + "\n")
            log.flush()
            if event.step % 2 == 0:
                fastft.save_adapter(model, output_dir / "adapter")

    trainer.subscribe(record)
    trainer.train()
    fastft.save_adapter(model, output_dir / "adapter")


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _install_trap(target: str, after: int, fired_dir) -> None:
    """SIGKILL this process at the `after`-th call of a chosen moment of a save (noted in `fired_dir`)."""
    calls = {"n": 0}

    def due() -> bool:
        calls["n"] += 1
        if calls["n"] >= after:
            (fired_dir / target).touch()
            return True
        return False

    if target == "torch.save":
        real_save = torch.save

        def save(obj, path, *args, **kwargs):
            if str(path).endswith("optimizer.pt") and due():
                with open(path, "wb") as f:  # half a file, then the kill
                    f.write(b"PK\x03\x04partial")
                    f.flush()
                _die()
            return real_save(obj, path, *args, **kwargs)

        checkpoint_module.torch.save = save
    elif target == "marker":
        real_marker = atomic._write_marker
        atomic._write_marker = lambda *marker: _die() if due() else real_marker(*marker)
    elif target == "rename":
        real_replace = os.replace

        def replace(src, dst):
            if atomic._LEFTOVER.match(os.path.basename(src)) and due():
                _die()
            return real_replace(src, dst)

        atomic.os.replace = replace
    elif target == "exchange":
        real_exchange = atomic._exchange

        def exchange(a, b):
            swapped = real_exchange(a, b)
            if due():
                _die()  # the new folder in place, the old one not yet removed
            return swapped

        atomic._exchange = exchange
    elif target == "prune":
        real_rmtree = atomic.shutil.rmtree

        def rmtree(path, *args, **kwargs):
            if ".prune-" in str(path) and due():
                next(p for p in path.iterdir() if p.is_file()).unlink()  # half deleted, then the kill
                _die()
            return real_rmtree(path, *args, **kwargs)

        atomic.shutil.rmtree = rmtree


def _fork(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child leaves through os._exit
        code = 1
        # the parent's OpenMP pool did not survive the fork: a parallel region would wait on it forever
        torch.set_num_threads(1)
        try:
            fn(*args)
            code = 0
        except BaseException:
            import traceback

            with open(CHILD_ERRORS, "a", encoding="utf-8") as f:
                f.write(traceback.format_exc())
        finally:
            os._exit(code)
    return pid


def _child_errors() -> str:
    try:
        with open(CHILD_ERRORS, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        return "no error: it finished (raise STEPS)"


def _wait_or_kill(pid: int, seconds: float) -> bool:
    """Wait up to `seconds` for the child, then SIGKILL it; True when it died of a SIGKILL (ours or its own)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.WIFSIGNALED(status)


def _kill_after_steps(pid: int, log_path, new_steps: int, delay: float) -> bool:
    """SIGKILL the child `delay` seconds after it logged `new_steps` more steps (0: during its start-up);
    True when it died of the SIGKILL. Counted in steps, not seconds, so a fast machine cannot finish the
    run before the kill (a timed kill did, on CI)."""
    with open(log_path, encoding="utf-8") as f:
        target = sum(1 for _ in f) + new_steps
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        with open(log_path, encoding="utf-8") as f:
            if sum(1 for _ in f) >= target:
                break
        time.sleep(0.002)
    return _wait_or_kill(pid, delay)


def _logged(log_path) -> dict[int, float]:
    """Step → loss for every complete line (a kill can cut the last one)."""
    losses = {}
    with open(log_path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):
                step, loss = json.loads(line)
                losses.setdefault(step, []).append(loss)
    return losses


def _assert_loadable(output_dir, adapter_keys: dict[str, tuple]) -> None:
    from safetensors.torch import load_file

    latest = latest_checkpoint(output_dir)
    if latest is not None:
        contents = read_checkpoint(latest)
        assert {k: tuple(v.shape) for k, v in contents["adapter"].items()} == adapter_keys
    adapter = output_dir / "adapter"
    if (output_dir / "adapter-was-saved").exists():
        assert adapter.is_dir(), "the adapter folder went missing"
        weights = load_file(adapter / "adapter_model.safetensors")
        assert {k: tuple(v.shape) for k, v in weights.items()} == adapter_keys
        json.loads((adapter / "adapter_config.json").read_text())
    if adapter.is_dir():
        (output_dir / "adapter-was-saved").touch()


def test_ten_kills_at_random_moments_resume_exactly_and_lose_nothing(job, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    seed = int(os.environ.get("FASTFT_KILL_SEED", random.randrange(2**31)))
    rng = random.Random(seed)
    adapter_keys = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(job[0]).items()}

    reference_dir = tmp_path / "reference"
    started = time.monotonic()
    pid = _fork(_run, job, reference_dir, tmp_path / "reference.log")
    assert os.waitpid(pid, 0)[1] == 0
    step_seconds = (time.monotonic() - started) / STEPS  # an upper bound: start-up counted in
    reference = {step: losses[0] for step, losses in _logged(tmp_path / "reference.log").items()}
    assert sorted(reference) == list(range(1, STEPS + 1))

    output_dir, log_path = tmp_path / "killed", tmp_path / "killed.log"
    output_dir.mkdir()
    log_path.touch()
    traps = [(target, rng.randint(1, 2)) for target in TRAPS] + [None] * 5
    rng.shuffle(traps)
    for trap in traps:
        pid = _fork(_run, job, output_dir, log_path, trap)
        if trap:
            killed = _wait_or_kill(pid, 8.0)
        else:  # a random moment: start-up, or somewhere inside one of the next three steps
            killed = _kill_after_steps(pid, log_path, rng.randint(0, 3), rng.uniform(0, step_seconds))
        assert killed, f"the run ended before kill {trap} (FASTFT_KILL_SEED={seed}): {_child_errors()}"
        _assert_loadable(output_dir, adapter_keys)

    fired = sorted(target for target in TRAPS if (tmp_path / target).exists())
    assert fired == sorted(TRAPS), f"traps that never fired: {set(TRAPS) - set(fired)} (seed {seed})"

    pid = _fork(_run, job, output_dir, log_path)  # no kill: the run finishes
    assert os.waitpid(pid, 0)[1] == 0, f"the final resume failed (FASTFT_KILL_SEED={seed})"
    _assert_loadable(output_dir, adapter_keys)

    logged = _logged(log_path)
    assert sorted(logged) == list(range(1, STEPS + 1)), f"seed {seed}"
    resumed = sum(len(losses) for losses in logged.values()) - STEPS
    assert resumed > 0  # some steps were run again after a kill, and each one matched
    for step, losses in logged.items():
        assert losses == [reference[step]] * len(losses), f"step {step} differs (FASTFT_KILL_SEED={seed})"

    final = read_checkpoint(latest_checkpoint(output_dir))
    expected = read_checkpoint(latest_checkpoint(reference_dir))
    assert final["state"]["step"] == STEPS
    for key, tensor in expected["adapter"].items():
        assert torch.equal(final["adapter"][key], tensor), key
    assert not atomic.leftovers(output_dir)
    base, _ = fastft.load_model("tiny-llama", max_seq_length=64)
    PeftModel.from_pretrained(base, output_dir / "adapter")  # the adapter loads with plain peft

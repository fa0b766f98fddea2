"""`measure`: real training steps on CUDA, their peak memory beside the estimate.

The model is the real architecture with random weights (a catalog hub id or a preset; nothing is
downloaded), quantised in place with bitsandbytes for "nf4"/"int8", wrapped with LoRA by `add_lora`.
A step mirrors `fastft.training.trainer.Trainer._train_step`: bf16 autocast, fastft's packed attention
and loss, backward, gradient clipping (foreach), the optimizer step, ``zero_grad(set_to_none=True)``.
Peaks are read per phase (forward + loss, backward, optimizer) with ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import fastft.weight_formats as weight_formats
from fastft.vram.estimate import estimate_vram
from fastft.vram.result import VramEstimate, VramEstimateError
from fastft.vram.settings import resolve_checkpointing

if TYPE_CHECKING:  # torch and numpy are imported where a step runs: `import fastft.vram` needs neither
    import torch

# Function-local imports: `import fastft.vram` and `fastft estimate` run without torch or transformers
# (tests/faces/test_cli.py); tests replace these names on their modules, so they are looked up when called.


def resident_memory(
    model: torch.nn.Module, optimizer=None, device: torch.device | None = None
) -> dict[str, int]:
    """The device bytes a training run holds between steps, by owner: what a step's peak stands on.

    Frozen weights (with bitsandbytes' quantisation state), the adapters, their gradients, the optimizer's
    states, the modules' buffers (RoPE tables), fastft's adapter compute copies
    (`fastft.kernels.lora.AdapterComputeCopies`) and offload device buffers
    (`fastft.runtime.offload.ActivationOffloader`), and on CUDA what else the allocator has out ("not
    itemised": CUDA-graph pools' outputs, cuBLAS workspaces, a trainer's batch buffers, another model). Each
    storage counts once, under the first owner that holds it. Works on any model, fastft's or not (Unsloth's,
    for a side-by-side), and on any device; `device` defaults to the first parameter's."""
    import torch

    from fastft.runtime.model_state import base_model, model_state

    parameters = list(model.parameters())
    if device is None:
        device = parameters[0].device if parameters else torch.device("cpu")
    device = _indexed(torch.device(device))
    seen: set[int] = set()

    def nbytes(tensors) -> int:
        total = 0
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or _indexed(tensor.device) != device:
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        return total

    def quant_state_tensors(parameter) -> list:
        state = weight_formats.frozen_state(parameter)[1]
        found = []
        for value in vars(state).values() if state is not None and hasattr(state, "__dict__") else ():
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif hasattr(value, "__dict__"):  # the nested state of double quantisation
                found.extend(v for v in vars(value).values() if isinstance(v, torch.Tensor))
        return found

    frozen = [p for p in parameters if not p.requires_grad]
    trainable = [p for p in parameters if p.requires_grad]
    state = model_state(base_model(model))
    kernels = state.kernels
    copies = getattr(kernels, "copies", None)
    owners = {
        "frozen weights": nbytes(frozen) + nbytes(t for p in frozen for t in quant_state_tensors(p)),
        "adapters": nbytes(trainable),
        "adapter gradients": nbytes(p.grad for p in trainable),
        "optimizer states": 0
        if optimizer is None
        else nbytes(value for group in optimizer.state.values() for value in group.values()),
        "module buffers": nbytes(model.buffers()),
        "adapter compute copies": 0 if copies is None else nbytes(copies.device_tensors()),
        "offload device buffers": 0 if state.offload is None else nbytes(state.offload.device_tensors()),
    }
    if device.type == "cuda":
        owners["not itemised"] = max(0, torch.cuda.memory_allocated(device) - sum(owners.values()))
    return owners


def _indexed(device):
    """`device` with its index: ``torch.device("cuda")`` names the current CUDA device, but a tensor on it
    says ``cuda:0``, and the two compare unequal (the bench passes the former; every owner then read 0)."""
    import torch

    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class StepMemory:
    """Peak bytes allocated during each phase of one training step (and reserved over the step), counted
    above what the process held before the probe was built (another model in the same notebook)."""

    forward: int  # forward and loss
    backward: int
    optimizer: int
    reserved: int
    seconds: float

    @property
    def peak(self) -> int:
        return max(self.forward, self.backward, self.optimizer)


@dataclass(frozen=True)
class VramMeasurement:
    """Measured peaks of real training steps, beside the estimate of the same run."""

    estimate: VramEstimate
    peak_allocated: int  # torch.cuda.max_memory_allocated over the steps, less what was there before
    peak_reserved: int  # torch.cuda.max_memory_reserved over the steps, less what was there before
    steps: tuple[StepMemory, ...]
    setup_allocated: int  # weights, adapters and optimizer before the first step
    context_bytes: int  # device memory in use outside PyTorch's allocator (CUDA context, handles)

    @property
    def error(self) -> float:
        """(estimated − measured) / measured for the allocated peak; positive = overestimate."""
        return (self.estimate.allocated_bytes - self.peak_allocated) / self.peak_allocated

    def to_dict(self) -> dict:
        return {
            "estimate": self.estimate.to_dict(),
            "estimated_allocated": self.estimate.allocated_bytes,
            "estimated_total": self.estimate.total_bytes,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "error": self.error,
            "setup_allocated": self.setup_allocated,
            "context_bytes": self.context_bytes,
            "steps": [{**step.__dict__, "peak": step.peak} for step in self.steps],
        }


def _require_cuda() -> torch.device:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "measure() runs real training steps and needs a CUDA GPU; none is visible. On a CPU use "
            "estimate_vram(...) (no GPU needed), or run `fastft bench vram` on a GPU machine."
        )
    return torch.device("cuda", torch.cuda.current_device())


# -- the model ----------------------------------------------------------------------------------------


# -- training steps ------------------------------------------------------------------------------------


def synthetic_batch(tokens: int, seq_len: int, vocab: int, trained_fraction: float = 1.0, seed: int = 0):
    """A packed batch of `tokens` random tokens in sequences of `seq_len` (the last one shorter)."""
    import numpy as np

    from fastft.data.batch import PackedBatch

    rng = np.random.default_rng(seed)
    lengths = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    ids, labels = [], []
    for length in lengths:
        sequence = rng.integers(3, vocab, size=length).astype(np.int64)
        label = sequence.copy()
        label[: int(length * (1 - trained_fraction))] = -100
        ids.append(sequence)
        labels.append(label)
    return PackedBatch.from_sequences(ids, labels)


def free_in_pinned_segments(device: torch.device | str) -> int:
    """Bytes the CUDA caching allocator holds reserved but not allocated once its cache is emptied: free
    pieces of segments that a persistent tensor pins, which no request larger than its piece can use."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` means the device ran out of memory (allocator or a library's own allocation)."""
    import torch

    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


class TrainingProbe:
    """A random-weight model with LoRA and its optimizer, ready to run training steps of any length."""

    def __init__(
        self,
        model: str,
        precision: str = "bf16",
        lora_r: int = 16,
        targets="all-linear",
        checkpointing: str | bool = "auto",
        optimizer: str = "adamw",
        seed: int = 0,
        fused: bool = True,
    ):
        import torch

        from fastft.models.lora import add_lora
        from fastft.models.random_model import build_random_model, split_precision
        from fastft.runtime.attention import patch_packed_attention
        from fastft.training.optimizer import adamw

        self.device = _require_cuda()
        # whatever else lives in this process (another model in the notebook, earlier tests) is not ours:
        # every figure below is counted from here
        gc.collect()
        torch.cuda.empty_cache()
        self.baseline_allocated = torch.cuda.memory_allocated(self.device)
        self.baseline_reserved = torch.cuda.memory_reserved(self.device)
        self.mode = resolve_checkpointing(checkpointing)
        self.precision = precision
        self.dtype = split_precision(precision)[1]
        base = build_random_model(model, precision, self.device)
        self.vocab = base.config.vocab_size
        self.model = add_lora(
            base,
            r=lora_r,
            alpha=lora_r,
            target_modules=targets,
            gradient_checkpointing=self.mode,
            seed=seed,
            fused=fused,
        )
        patch_packed_attention(self.model, "auto")
        self.model.train()
        self.parameters = [p for p in self.model.parameters() if p.requires_grad]
        if optimizer == "adamw":
            self.optimizer = adamw(self.parameters, lr=1e-5, fused=True)  # its state made now, as fastft's
        elif optimizer == "adamw_8bit":
            import bitsandbytes as bnb

            self.optimizer = bnb.optim.AdamW8bit(self.parameters, lr=1e-5)
        elif optimizer == "sgd":
            self.optimizer = torch.optim.SGD(self.parameters, lr=1e-5)
        else:
            raise VramEstimateError(f"optimizer={optimizer!r}: use 'adamw', 'adamw_8bit' or 'sgd'.")
        self.seed = seed
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        self.setup_allocated = torch.cuda.memory_allocated(self.device) - self.baseline_allocated
        self.setup_pinned_free = free_in_pinned_segments(self.device) - (
            self.baseline_reserved - self.baseline_allocated
        )

    def step(self, tokens: int, seq_len: int | None = None, trained_fraction: float = 1.0) -> StepMemory:
        """One optimizer step on `tokens` random tokens; raises torch.OutOfMemoryError when it does not fit."""
        import torch

        from fastft.training.loss import causal_lm_loss_sum

        batch = synthetic_batch(tokens, seq_len or tokens, self.vocab, trained_fraction, self.seed).to(
            self.device
        )
        reserved = 0
        started = time.perf_counter()
        try:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast("cuda", dtype=self.dtype, enabled=self.dtype != torch.float32):
                loss = causal_lm_loss_sum(self.model, batch) / batch.num_trained_tokens
            torch.cuda.synchronize()
            forward, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            del loss
            torch.cuda.synchronize()
            backward = torch.cuda.max_memory_allocated()
            reserved = max(reserved, torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
            torch.nn.utils.clip_grad_norm_(self.parameters, 1.0, foreach=True)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            optimizer = torch.cuda.max_memory_allocated()
            reserved = max(reserved, torch.cuda.max_memory_reserved())
        except RuntimeError as error:  # torch.OutOfMemoryError, or cuBLAS failing to allocate its workspace
            if not is_out_of_memory(error):
                raise
            self.recover()
            if isinstance(error, torch.OutOfMemoryError):
                raise
            raise torch.OutOfMemoryError(str(error)) from error
        base, base_reserved = self.baseline_allocated, self.baseline_reserved
        return StepMemory(
            forward - base,
            backward - base,
            optimizer - base,
            reserved - base_reserved,
            time.perf_counter() - started,
        )

    def recover(self) -> None:
        """Drop everything a failed step left behind (gradients, cached blocks)."""
        import torch

        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()

    def context_bytes(self) -> int:
        """Device memory in use outside PyTorch's allocator (CUDA context, library handles)."""
        import torch

        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free - torch.cuda.memory_reserved(self.device))

    def close(self) -> None:
        import torch

        self.model = self.optimizer = self.parameters = None
        gc.collect()
        torch.cuda.empty_cache()


def measure(
    model: str,
    seq_len: int = 2048,
    batch_tokens: int | None = None,
    precision: str = "bf16",
    lora_r: int = 16,
    targets="all-linear",
    checkpointing: str | bool = "auto",
    optimizer: str = "adamw",
    *,
    fused: bool = True,
    trained_fraction: float = 1.0,
    steps: int = 2,
    seed: int = 0,
) -> VramMeasurement:
    """Run `steps` real training steps (CUDA) and return their peak memory beside `estimate_vram`'s.

    `model` is a catalog hub id or an embedded preset (random weights; nothing is downloaded); the other
    arguments are `estimate_vram`'s (the loss is whatever fastft's trainer runs: fused with the fused
    kernels, else eager). The reported peak is the largest over the steps (the optimizer's
    states exist from the first step on, so the second step is the steady state).
    """
    _require_cuda()
    tokens = batch_tokens or seq_len
    estimate = estimate_vram(
        model,
        seq_len,
        batch_tokens,
        precision,
        lora_r,
        targets,
        checkpointing,
        optimizer,
        gpu="auto",
        fused=fused,
        trained_fraction=trained_fraction,
    )
    probe = TrainingProbe(model, precision, lora_r, targets, checkpointing, optimizer, seed, fused)
    try:
        setup = probe.setup_allocated
        results = tuple(probe.step(tokens, seq_len, trained_fraction) for _ in range(steps))
        context = probe.context_bytes()
    finally:
        probe.close()
    return VramMeasurement(
        estimate=estimate,
        peak_allocated=max(step.peak for step in results),
        peak_reserved=max(step.reserved for step in results),
        steps=results,
        setup_allocated=setup,
        context_bytes=context,
    )

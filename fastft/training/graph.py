"""A micro-batch's forward and backward captured once as a CUDA graph and replayed.

Why: on a fast GPU a LoRA step is often bound by the host, not the GPU. Every kernel launch, autograd
node and Python wrapper costs microseconds on the CPU; a step of a small or sparse model launches
thousands of them, and the GPU waits: the eager MoE step is host-bound, the replayed one runs at its
kernels' time (BENCHMARKS.md, "Mixture of experts step"). A replay is one launch, whatever the model does
inside.

What a graph needs, and how the step provides it:

- Static shapes and host values. A replay repeats the captured kernels with the captured launch
  parameters, so every host number the forward reads must be the same: the batch's token count,
  sequence count, ``max_seqlen`` and target count. That is the batch `signature`; only batches with the
  captured signature replay. Packed bins of chat data never repeat their lengths, so the trainer pads
  them to one `fastft.data.batch.BatchShape` for the run (a pad tail segment, zero-length boundaries,
  ignored targets): their signature is the shape's, and they replay from the third step on. A batch
  that is not padded (``TrainConfig(static_shapes=False)``, or an attention backend that reads host
  lengths) also signs with its sequence lengths. The loss divisor (the step's trained-token count) is a
  device tensor, copied in like the batch, so gradient accumulation's varying counts replay too.
- Static inputs. The captured batch's tensors and divisor stay alive; a replay copies the next batch's
  ``input_ids``, ``labels``, ``position_ids``, ``cu_seqlens``, targets and divisor into them
  (device-to-device).
  Attention artefacts are built inside the capture, so a replay rebuilds them from the copied tensors.
- fp16's loss scale (`fastft.training.loss_scale.LossScaler`) is a device tensor changed only in place:
  backward runs on ``loss * scale`` inside the graph, so a replay reads the scale the step has now.
- Static gradients. Every trainable parameter gets a ``.grad`` before capture; the captured backward
  accumulates into it, and the trainer zeroes gradients in place (``zero_grad(set_to_none=False)``)
  instead of freeing them. The optimizer step, clipping and the schedule stay eager (a few fused launches).
- No host sync inside the step (fastft's step has none) and no timing events: the step profiler records
  the replay as one top-level phase, ``graph``, and its hooks stay silent inside it.

Policy (`GraphPolicy`, pure host logic): a signature is captured once it has run eagerly `warmup` times in
a row (first use: autotuning, lazy allocations), and only at the first micro-batch of an optimizer step
(gradients are all zero then, so the capture's warm-up pass can be discarded). A batch with another
signature drops the graph first (its memory pool goes back to the allocator: an eager step beside a live
graph would hold two steps' activations) and runs eagerly; after `max_captures` captures the run stops
capturing (its signatures do not settle). A capture that fails turns graphs off for the run with a
`GraphCaptureWarning`, and the step runs eagerly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from fastft.data.batch import PackedBatch

EAGER, CAPTURE, REPLAY = "eager", "capture", "replay"


class GraphCaptureWarning(UserWarning):
    """A CUDA graph capture failed; the run continues eagerly."""


def batch_signature(batch: PackedBatch) -> tuple:
    """Every host value a forward and backward of `batch` can read: its shape, and the sequence lengths
    of a batch that is not padded to a static shape (a backend may read them)."""
    shape = (batch.num_tokens, batch.num_sequences, batch.max_seqlen, int(batch.target_ids.shape[0]))
    return shape if batch.static else (*shape, batch.sequence_lengths)


@dataclass
class GraphPolicy:
    """When to run eagerly, capture or replay (module docstring); no CUDA involved, so testable anywhere."""

    warmup: int = 2
    max_captures: int = 3
    enabled: bool = True
    captured: tuple | None = None
    candidate: tuple | None = None
    seen: int = 0
    captures: int = 0
    replays: int = 0
    eager_runs: int = 0
    drops: int = 0

    def decide(self, signature: tuple, first_micro_batch: bool) -> str:
        """`REPLAY`, `CAPTURE` or `EAGER` for a batch with `signature`; call `dropped()` when a live graph
        has another signature (the caller releases it before running)."""
        if self.enabled and self.captured is not None and signature == self.captured:
            self.replays += 1
            return REPLAY
        self.seen = self.seen + 1 if signature == self.candidate else 1
        self.candidate = signature
        if (
            self.enabled
            and self.seen > self.warmup
            and first_micro_batch
            and self.captures < self.max_captures
        ):
            self.captures += 1
            self.captured = signature
            return CAPTURE
        self.eager_runs += 1
        return EAGER

    def must_drop(self, signature: tuple) -> bool:
        """A graph is live and `signature` is not its own."""
        return self.captured is not None and signature != self.captured

    def dropped(self) -> None:
        self.captured = None
        self.drops += 1

    def disable(self) -> None:
        self.enabled = False
        self.captured = None

    @property
    def stats(self) -> dict[str, int]:
        return dict(captures=self.captures, replays=self.replays, eager=self.eager_runs, drops=self.drops)


# The batch tensors a step reads: cloned once as the graph's inputs, refilled before every replay.
_INPUTS = ("input_ids", "labels", "position_ids", "cu_seqlens", "target_positions", "target_ids")


def _static_copy(batch: PackedBatch) -> PackedBatch:
    """The batch with its own tensors and no cached artefacts: the graph's inputs, filled on every replay."""
    return replace(batch, **{name: getattr(batch, name).clone() for name in _INPUTS}, _artifacts={})


def _fill(static: PackedBatch, batch: PackedBatch) -> None:
    for name in _INPUTS:
        getattr(static, name).copy_(getattr(batch, name), non_blocking=True)


LossFunction = Callable[[PackedBatch, torch.Tensor], torch.Tensor]


_WARMUP_STREAMS: dict[int, torch.cuda.Stream] = {}


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """One warm-up stream per device for every capture: cuBLAS keeps a workspace for
    each stream it has run on, for the life of the process, so a new stream per capture leaked one."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[index] = torch.cuda.Stream(device=index)
    return _WARMUP_STREAMS[index]


class StepGraph:
    """Forward + backward of micro-batches, replayed from a CUDA graph when the signature allows.

    ``loss_fn(batch, divisor)`` returns the micro-batch's loss divided by `divisor` (a 0-d float32 tensor on
    the batch's device), under the caller's autocast; `forward_backward` runs it and its backward and returns
    the loss, detached. `mode(batch, first_micro_batch)` says beforehand whether this batch will run `EAGER`,
    be captured or replayed (the profiler times a graph as one phase). With ``enabled=False``, or off CUDA,
    everything runs eagerly. `accumulators` are device tensors the loss function adds into in place (a
    preference step's metric sums), kept by the caller for the run and zeroed by it at each step's start: a
    capture's discarded warm-up pass is taken out of them as it is out of the gradients. `loss_scale` (fp16)
    is a 0-d device tensor backward multiplies the loss by, eager or captured (the caller changes it only
    in place).
    """

    def __init__(
        self,
        parameters: Sequence[torch.nn.Parameter],
        *,
        enabled: bool = True,
        warmup: int = 2,
        max_captures: int = 3,
        accumulators: Sequence[torch.Tensor] = (),
        loss_scale: torch.Tensor | None = None,
    ):
        self.parameters = list(parameters)
        self.accumulators = list(accumulators)
        self.loss_scale = loss_scale
        cuda = bool(self.parameters) and self.parameters[0].is_cuda
        self.policy = GraphPolicy(warmup=warmup, max_captures=max_captures, enabled=enabled and cuda)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._static: PackedBatch | None = None
        self._divisor: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None
        self._planned = EAGER
        # the allocator's peak when the graph was captured: a replay reuses the capture's private pool
        # without the allocator seeing it, so this is the peak every replay reaches
        self.peak_bytes = 0

    @property
    def holds_gradients(self) -> bool:
        """The parameters' ``.grad`` tensors are captured: zero them in place, never set them to None."""
        return self._graph is not None

    @property
    def stats(self) -> dict[str, int]:
        return self.policy.stats

    def mode(self, batch: PackedBatch, first_micro_batch: bool) -> str:
        """Decide how `batch` runs (call once per micro-batch, right before `forward_backward`)."""
        signature = batch_signature(batch)
        if self.policy.must_drop(signature):
            self.release()
            self.policy.dropped()
        self._planned = self.policy.decide(signature, first_micro_batch)
        return self._planned

    def forward_backward(
        self, batch: PackedBatch, divisor: torch.Tensor, loss_fn: LossFunction
    ) -> torch.Tensor:
        """Run the micro-batch as `mode` decided; returns its loss, detached."""
        decision, self._planned = self._planned, EAGER
        if decision == REPLAY:
            _fill(self._static, batch)
            self._divisor.copy_(divisor, non_blocking=True)
            self._graph.replay()
            return self._loss
        if decision == CAPTURE:
            try:
                return self._capture(batch, divisor, loss_fn)
            except Exception as error:  # noqa: BLE001 - any failure: warn once, train on eagerly
                self.release()
                self.policy.disable()
                for parameter in self.parameters:
                    if parameter.grad is not None:
                        parameter.grad.zero_()
                warnings.warn(
                    f"CUDA graph capture failed ({type(error).__name__}: {error}); training continues "
                    "without CUDA graphs. TrainConfig(cuda_graph=False) skips the attempt.",
                    GraphCaptureWarning,
                    stacklevel=2,
                )
        loss = loss_fn(batch, divisor)
        self._backward(loss)
        return loss.detach()

    def _backward(self, loss: torch.Tensor) -> None:
        (loss if self.loss_scale is None else loss * self.loss_scale).backward()

    def _capture(self, batch: PackedBatch, divisor: torch.Tensor, loss_fn: LossFunction) -> torch.Tensor:
        for parameter in self.parameters:  # the captured backward accumulates into these
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
        # one pass on a side stream first (PyTorch's recipe: lazy initialisation and the allocator's
        # per-stream pools settle outside the capture); its gradients are discarded (they were zero)
        side = warmup_stream(batch.device)
        side.wait_stream(torch.cuda.current_stream(batch.device))
        with torch.cuda.stream(side):
            self._backward(loss_fn(batch, divisor))
        torch.cuda.current_stream(batch.device).wait_stream(side)
        torch._foreach_zero_([parameter.grad for parameter in self.parameters] + self.accumulators)
        static, static_divisor = _static_copy(batch), divisor.clone()
        graph = torch.cuda.CUDAGraph()
        # thread-local: the studio trains in a background thread while the notebook's thread stays free
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            loss = loss_fn(static, static_divisor)
            self._backward(loss)
        self._graph, self._static, self._divisor, self._loss = graph, static, static_divisor, loss.detach()
        graph.replay()
        self.peak_bytes = torch.cuda.max_memory_allocated(batch.device)
        return self._loss

    def release(self) -> None:
        """Drop the graph and its memory pool (a batch with another signature, or the run's end)."""
        self._graph = self._static = self._divisor = self._loss = None
        self.peak_bytes = 0
        self.policy.captured = None


__all__ = [
    "CAPTURE",
    "EAGER",
    "REPLAY",
    "GraphCaptureWarning",
    "GraphPolicy",
    "LossFunction",
    "StepGraph",
    "batch_signature",
]

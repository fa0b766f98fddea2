"""Several processes, one run: data parallelism through `torch.distributed` (launched by ``torchrun``).

Under ``torchrun --nproc_per_node=N`` (or ``fastft launch --gpus N``) every process runs the same script;
`fastft.train` reads ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, starts the process group if the script did
not (NCCL on CUDA, gloo on the CPU) and trains one run across the ranks:

- **Data.** An optimizer step reads ``world_size`` times the bins of one process's step. Each rank builds
  (the metadata-once `PackedBatch` of) only its share: micro-batch ``i`` of the step belongs to rank
  ``i % world_size``, so a run on N ranks with ``grad_accum_steps=g`` trains exactly the bins of a one-process
  run with ``grad_accum_steps=N*g``, and the same losses.
- **Loss.** Token-weighted across ranks: each rank divides its summed loss by the *global* trained-token count
  of the step, one all-reduce of a device scalar before the step's first forward (no host sync; the CUDA
  graph copies it in like a one-process divisor). Gradients are then summed, not averaged.
- **Gradients: an explicit all-reduce, not `DistributedDataParallel`.** Once per optimizer step, after the
  last micro-batch's backward, the trainable (LoRA) gradients are flattened into buckets of
  `BUCKET_BYTES` and summed across ranks (async collectives, waited together), with the step's loss and
  counts in one small extra all-reduce. Why not DDP: DDP wraps the model (``model.module``) and fires its
  reducer from autograd hooks inside the backward, which a captured CUDA graph replays without its hooks, and
  it reduces every micro-batch unless each but the last runs under ``no_sync``; fastft's step captures the
  forward + backward (`fastft.training.graph`), runs offloaded checkpointing's own autograd functions and
  patched instance forwards that DDP's wrapper would sit outside of. The explicit reduce touches none of
  that: the step's compute is the one-process step, and only the trainable parameters (a frozen base has no
  gradient) travel, once per step. What it gives up is DDP's overlap of communication with the backward; a
  LoRA's gradients are small (Llama-3.1-8B, r=16, all linear: 42 M values), so the reduce is one short phase,
  shown apart by the profiler as ``communication``.
- **FSDP2** (``TrainConfig(distributed="fsdp")``): `torch.distributed.fsdp.fully_shard` on every decoder
  layer and on the decoder (the output head stays replicated, see `shard_model`), so the frozen 16-bit base and the LoRA weights are both sharded across ranks; the
  layer's weights are gathered for its forward and backward and its gradients reduce-scattered by FSDP
  (summed: the divisor is global). See `FSDP_LIMITS` for what does not run under it.
- **Checkpoints** are written once, by rank 0, atomically (`fastft.atomic`), with every rank's RNG state and
  the world size; the other ranks wait at a barrier. A resume must use the same world size (the data order
  per rank depends on it) and restores each rank's RNG: the resumed losses equal the uninterrupted run's.
  Under FSDP2 the trainable shards and the optimizer's state are gathered into full tensors on rank 0 first
  (`fastft.training.checkpoint.gather_sharded`), so the checkpoint is a single process's (a plain PEFT adapter), and a resume shards them
  back (`fastft.training.checkpoint.load_sharded`).
- **Events** are the run's: loss, grad norm, trained tokens and tokens/s are global (all ranks). Only rank 0
  shows a progress bar.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

import fastft.weight_formats as weight_formats
from fastft.checks import SettingError
from fastft.runtime.model_state import base_model
from fastft.training.checkpoint import gather_sharded, save_checkpoint

# Function-local imports: torch.distributed's checkpoint and FSDP modules load only in a distributed run.

SHARDINGS = ("ddp", "fsdp")
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size

# What does not run under FSDP2, and why (checked when the trainer starts; each refusal names its fix).
# `python -m fastft.bench.fsdp_limits` forces each past the refusal under torchrun; what each did there is in
# BENCHMARKS.md, "Several GPUs".
FSDP_LIMITS = {
    "cuda_graph": "FSDP2 all-gathers each layer's weights in its forward pre-hook and frees them after, from "
    "Python hooks with allocations of their own that a captured graph would not repeat, so the step runs "
    "eagerly (graphs are turned off for the run). Measured with one NCCL rank on an H100 (2026-12-06, "
    "`python -m fastft.bench.fsdp_limits`, graphs forced on): the capture stops at the graph's own setup, "
    "'aten._foreach_zero_.default: got mixed torch.Tensor and DTensor' -- the sharded adapters' gradients are "
    "DTensors that a captured step's static buffers are not -- and the run continues eagerly with the same "
    "losses",
    "quantised base": "fully_shard splits plain tensors into DTensors; a bitsandbytes Params4bit/Int8Params "
    "holds packed integer data with its quantisation state beside it, which the split does not carry: on a GPU "
    "fully_shard stops with 'only Tensors of floating point dtype can require gradients', so QLoRA runs under "
    "DDP",
}


class DistributedError(RuntimeError):
    """The distributed environment is not usable as set up; the message names the fix."""


def launched() -> bool:
    """True when this process was started by torchrun (or another launcher setting ``WORLD_SIZE``) or a
    process group is already initialised."""
    return (dist.is_available() and dist.is_initialized()) or "WORLD_SIZE" in os.environ


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main_process() -> bool:
    """Rank 0, or a process outside any distributed run: the one that logs and writes."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", 0)) == 0


@dataclass
class Distributed:
    """This process's place in the run, and the step's collectives (module docstring)."""

    rank: int
    world_size: int
    sharding: str
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: list) -> list:
        """This rank's share of a step's micro-batches: every ``world_size``-th from its rank."""
        return items[self.rank :: self.world_size]

    def global_counts(self, counts: list[int]) -> torch.Tensor:
        """The step's host counts (trained tokens, tokens, …) summed over the ranks, as a float32 device
        tensor: one all-reduce on the device, no host sync (a non-blocking copy in, the collective queued)."""
        local = torch.tensor(counts, dtype=torch.float32)
        if self.device.type == "cuda":
            local = local.pin_memory().to(self.device, non_blocking=True)
        dist.all_reduce(local)
        return local

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks in place (a device collective, no host sync)."""
        dist.all_reduce(tensor)
        return tensor

    def broadcast_parameters(self, parameters: list[torch.Tensor]) -> None:
        """Every rank starts from rank 0's trainable weights (as DDP does), whatever seeded them."""
        with torch.no_grad():
            for flat, group in _buckets(parameters, lambda p: p):
                dist.broadcast(flat, 0)
                if self.rank != 0:
                    _unflatten_into(flat, group)

    def reduce_gradients(self, parameters: list[torch.Tensor]) -> None:
        """Sum every trainable gradient over the ranks: buckets of `BUCKET_BYTES`, all launched, then
        waited and copied back (gradients that do not exist on this step are zeros)."""
        for p in parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        pending = []
        for flat, group in _buckets(parameters, lambda p: p.grad):
            pending.append((dist.all_reduce(flat, async_op=True), flat, group))
        for work, flat, group in pending:
            work.wait()
            _unflatten_into(flat, [p.grad for p in group])

    def reduce_step(
        self, parameters: list[torch.Tensor], loss_total: torch.Tensor, metric_sums: torch.Tensor
    ) -> torch.Tensor:
        """The step's communication after its last backward: the gradients summed (DDP; FSDP2 has
        reduce-scattered them already), then the loss and the preference metric sums in one small
        all-reduce. Returns the step's global loss (`metric_sums` is summed in place)."""
        if self.sharding == "ddp":
            self.reduce_gradients(parameters)
        stats = torch.cat([loss_total.reshape(1).float(), metric_sums.float()])
        dist.all_reduce(stats)
        metric_sums.copy_(stats[1:])
        return stats[0]

    def sum_eval(self, total: torch.Tensor, metric_sums: torch.Tensor, trained: int, pairs: int):
        """An evaluation's sums over the ranks (each evaluated its share of the batches)."""
        stats = torch.cat(
            [
                total.reshape(1),
                metric_sums,
                torch.tensor([trained, pairs], dtype=torch.float64).to(total.device),
            ]
        )
        dist.all_reduce(stats)
        n = metric_sums.numel()
        return stats[0], stats[1 : 1 + n], int(stats[1 + n]), int(stats[2 + n])

    def save_once(self, folder, model, optimizer, scheduler, state: dict) -> None:
        """Rank 0 writes the checkpoint (atomically: `fastft.training.checkpoint.save_checkpoint`) with the
        world size and every rank's RNG state; every rank learns whether it succeeded, and a failure on
        rank 0 raises the same error on every rank (none waits for a checkpoint that never comes)."""
        generators = self.gather_objects(_torch_rng())
        state = dict(state, distributed={"world_size": self.world_size, "sharding": self.sharding})
        state["rank_rng"] = generators
        full = {}
        if self.sharding == "fsdp":  # every rank takes part in gathering the shards; rank 0 holds the result
            model_state, optimizer_state = gather_sharded(model, optimizer)
            full = dict(model_state=model_state, optimizer_state=optimizer_state)
        failure = None
        if self.is_main:
            try:
                save_checkpoint(folder, model, optimizer, scheduler, state, **full)
            except Exception as error:  # handed to the other ranks, then raised here as it was
                failure = error
        shared = [(type(failure).__name__, str(failure)) if failure is not None else None]
        dist.broadcast_object_list(shared, 0)
        if failure is not None:
            raise failure
        if shared[0] is not None:
            kind, message = shared[0]
            raise DistributedError(f"Rank 0 could not write the checkpoint {folder} ({kind}: {message}).")

    def restore_rng(self, state: dict) -> None:
        """After `apply_checkpoint` set rank 0's RNG on every rank: this rank's own generators."""
        saved = state.get("rank_rng")
        if saved is not None:
            _set_torch_rng(saved[self.rank])

    def barrier(self) -> None:
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index or 0])
        else:
            dist.barrier()

    def gather_objects(self, value) -> list:
        """`value` of every rank, in rank order (a host collective: checkpoints only, never per step)."""
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


def _torch_rng() -> dict:
    """This rank's torch generators as plain lists (JSON, for ``trainer_state.json``)."""
    plain = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        plain["cuda"] = torch.cuda.get_rng_state().tolist()
    return plain


def _set_torch_rng(plain: dict) -> None:
    torch.set_rng_state(torch.tensor(plain["torch"], dtype=torch.uint8))
    if "cuda" in plain and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(plain["cuda"], dtype=torch.uint8))


def check_resume(folder, state: dict, parallel: Distributed | None) -> None:
    """A checkpoint resumes exactly only on the world size that wrote it (each rank's data share depends on
    it): refuse another one, naming both."""
    saved = state.get("distributed", {}).get("world_size", 1)
    now = parallel.world_size if parallel is not None else 1
    if saved != now:
        raise ValueError(
            f"{folder} was written by a run on {saved} rank(s), this one runs on {now}: resume with "
            f"--nproc_per_node={saved} (fastft launch --gpus {saved}) so every rank reads the same data as before."
        )


def _buckets(parameters: list[torch.Tensor], tensor_of):
    """(flat tensor, parameters) per bucket: parameters of one dtype and device, in order, up to BUCKET_BYTES."""
    groups: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in parameters:
        t = tensor_of(p)
        if current and (
            size + t.numel() * t.element_size() > BUCKET_BYTES
            or t.dtype != tensor_of(current[0]).dtype
            or t.device != tensor_of(current[0]).device
        ):
            groups.append(current)
            current, size = [], 0
        current.append(p)
        size += t.numel() * t.element_size()
    if current:
        groups.append(current)
    for group in groups:
        yield torch.cat([tensor_of(p).reshape(-1) for p in group]), group


def _unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    pieces = flat.split([t.numel() for t in tensors])
    torch._foreach_copy_(tensors, [piece.view_as(t) for piece, t in zip(pieces, tensors, strict=True)])


def setup(device: torch.device, sharding: str) -> Distributed | None:
    """The run's `Distributed` under torchrun (the process group started if the script did not), None in a
    plain single process. Checks that the model sits on this rank's GPU."""
    if sharding not in SHARDINGS:
        raise SettingError(f"distributed={sharding!r} is not one of {', '.join(SHARDINGS)}.")
    if not launched():
        return None
    if not dist.is_available():
        raise DistributedError("This torch build has no torch.distributed: install a build with it.")
    if not dist.is_initialized():
        for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise DistributedError(
                    f"WORLD_SIZE is set but {name} is not: start the script with torchrun "
                    "(`fastft launch --gpus N script.py`) or set RANK, MASTER_ADDR and MASTER_PORT too."
                )
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        # started here, so ended here too: a process group left to the interpreter's finalisation warns
        # and can abort the process while gloo's threads still hold tensors
        atexit.unregister(_end_process_group)  # once, however many runs start a group
        atexit.register(_end_process_group)
    backend = dist.get_backend()
    world_size = dist.get_world_size()
    if device.type == "cuda" and world_size > 1 and device.index != local_rank():
        raise DistributedError(
            f"Rank {dist.get_rank()} (LOCAL_RANK {local_rank()}) trains a model on {device}: each rank needs its "
            f"own GPU. Load the model with device=None (fastft picks cuda:LOCAL_RANK under torchrun) or "
            f"device='cuda:{local_rank()}'."
        )
    return Distributed(dist.get_rank(), world_size, sharding, backend, device)


def _end_process_group() -> None:
    """At exit, the process group `setup` started, unless the script ended it already."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard_model(model: torch.nn.Module, parallel: Distributed) -> None:
    """FSDP2: `fully_shard` every decoder layer, then the model; gradients summed (the divisor is global)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if any(weight_formats.of_parameter(p).quantized for p in model.parameters()):
        raise SettingError(
            f"distributed='fsdp' cannot shard a quantised base ({FSDP_LIMITS['quantised base']}). Use "
            "distributed='ddp' for QLoRA, or load the base in 16 bits."
        )
    mesh = init_device_mesh(parallel.device.type, (parallel.world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    # The root is the decoder, not the causal LM: fastft's loss calls the decoder and then the fused
    # cross-entropy on the head's weight directly (no head forward, so no FSDP hook would gather it). The
    # output head stays replicated (frozen, vocab x hidden), and a tied embedding with it.
    base = base_model(model)
    head = base.get_output_embeddings()
    tied = {head.weight} if head is not None and head.weight is base.get_input_embeddings().weight else set()
    fully_shard(base.get_decoder(), mesh=mesh, ignored_params=tied or None)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)  # a sum: each rank's loss is already over the global count
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a (PEFT-wrapped) transformers causal LM."""
    layers = None
    for module in model.modules():
        if isinstance(getattr(module, "layers", None), torch.nn.ModuleList):
            layers = module.layers
            break
    if layers is None:
        raise SettingError(
            f"distributed='fsdp' found no decoder layers (a `layers` ModuleList) in {type(model).__name__}: "
            "use distributed='ddp' for this model."
        )
    return list(layers)


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """FSDP2: reduce-scatter the gradients only after the step's last micro-batch."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective); a plain tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def start_distributed(model: torch.nn.Module, device: torch.device, config) -> Distributed | None:
    """The trainer's start under torchrun: the process group, and for FSDP2 the checks of `FSDP_LIMITS`
    and the sharding; None outside a distributed run."""
    parallel = setup(device, config.distributed)
    if parallel is None or parallel.sharding != "fsdp":
        return parallel
    shard_model(model, parallel)
    return parallel

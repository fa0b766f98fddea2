"""What `estimate_vram` returns: a `VramEstimate`, the GPU memory of a training step as named components.

Each `VramComponent` is one block of the memory bar, in one phase of the step (outside torch's allocator,
persistent, stored from forward to backward, the loss's peak or the backward's); the estimate sums those at
the peak, judges them against a GPU, and prints them (`VramEstimate.table`) or hands them on as plain data
(`VramEstimate.to_dict`). The arithmetic that fills them in is `fastft.vram.part_bytes`'s (each part's
bytes) and `fastft.vram.assemble`'s (the peaks), which `fastft.vram.estimate` runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from fastft.vram.gpus import GiB, GpuSpec, MiB, get_gpu


class VramEstimateError(ValueError):
    """The estimate's inputs do not make sense together; the message names the input and the fix."""


@dataclass(frozen=True)
class VramComponent:
    """One block of the memory bar.

    ``bytes`` counts at the step's peak (components sum to the total); ``own_bytes`` is the component's own
    size, which differs only for the phase that is not the peak (then ``bytes`` is 0).
    """

    key: str
    label: str
    bytes: int
    own_bytes: int
    phase: str  # "outside" (not torch's allocator), "persistent", "stored", "loss", "backward", "reference" or "rollout"
    note: str = ""


@dataclass(frozen=True)
class VramSettings:
    """The run the estimate describes."""

    seq_len: int
    batch_tokens: int
    precision: str
    lora_r: int
    targets: tuple[str, ...]
    checkpointing: str
    optimizer: str
    loss: str
    trained_tokens: int
    fused: bool  # fastft's fused kernels asked for (add_lora(fused=...))
    kernels: str  # which code path the estimate assumes (fastft fused kernels, or transformers + peft)
    world_size: int = 1  # GPUs of the run; the estimate is per GPU (`fastft.vram.parallel`)
    sharding: str = "ddp"  # "ddp" (whole model on each GPU) or "fsdp" (FSDP2: weights and states split)
    method: str = "sft"  # or a preference method: micro-batches of whole pairs (`estimate_vram`)
    precompute_reference: bool = False  # DPO without its per-step reference pass
    # GRPO (method "grpo"): estimate_vram's generations, prompts_per_step, completion_tokens,
    # generation_batch_size, kl_coef and num_iterations, as given
    rollout: tuple[tuple[str, object], ...] = ()
    # whether offloaded layers keep anything beside their inputs here (attention outputs, routing orders)
    keep_attention: bool = False


@dataclass(frozen=True)
class VramEstimate:
    """A breakdown of the GPU memory a LoRA training step needs. Sizes are in bytes."""

    model: str
    parameters: int
    lora_parameters: int
    settings: VramSettings
    components: tuple[VramComponent, ...]
    peak_phase: str  # "loss", "backward", (DPO, GRPO) "reference" or (GRPO) "rollout"
    gpu: GpuSpec | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def total_bytes(self) -> int:
        """Everything on the device at the peak: CUDA context, allocations, allocator slack."""
        return sum(component.bytes for component in self.components)

    @property
    def allocated_bytes(self) -> int:
        """The peak of ``torch.cuda.max_memory_allocated`` (no context, no slack)."""
        return sum(c.bytes for c in self.components if c.phase != "outside")

    @property
    def capacity_bytes(self) -> int | None:
        return self.gpu.capacity_bytes if self.gpu else None

    @property
    def headroom_bytes(self) -> int | None:
        """Capacity left at the peak (negative: short by that much); None without a GPU."""
        return None if self.gpu is None else self.gpu.capacity_bytes - self.total_bytes

    @property
    def fits(self) -> bool | None:
        return None if self.gpu is None else self.total_bytes <= self.gpu.capacity_bytes

    def phase_bytes(self, phase: str) -> int:
        """Allocated bytes at the peak of one phase ("loss" or "backward"): what lives throughout the step
        plus that phase's own components."""
        return sum(c.own_bytes for c in self.components if c.phase in ("persistent", "stored", phase))

    def component(self, key: str) -> VramComponent:
        for component in self.components:
            if component.key == key:
                return component
        raise KeyError(f"no component {key!r}; components: {[c.key for c in self.components]}")

    def __getitem__(self, key: str) -> int:
        """Bytes of one component at the peak, e.g. ``estimate["activations"]``."""
        return self.component(key).bytes

    def with_gpu(self, gpu: str | GpuSpec) -> VramEstimate:
        """The same estimate judged against another GPU (its CUDA context differs too)."""
        gpu = get_gpu(gpu)
        components = tuple(
            replace(c, bytes=gpu.context_bytes, own_bytes=gpu.context_bytes) if c.key == "context" else c
            for c in self.components
        )
        return replace(self, gpu=gpu, components=components)

    def to_dict(self) -> dict:
        """Plain data for JSON and plots: settings, components (bytes and GiB) and the verdict."""
        return {
            "model": self.model,
            "parameters": self.parameters,
            "lora_parameters": self.lora_parameters,
            "settings": {**asdict(self.settings), "targets": list(self.settings.targets)},
            "components": [
                {**asdict(c), "gib": c.bytes / GiB, "own_gib": c.own_bytes / GiB} for c in self.components
            ],
            "peak_phase": self.peak_phase,
            "allocated_bytes": self.allocated_bytes,
            "total_bytes": self.total_bytes,
            "total_gib": self.total_bytes / GiB,
            "gpu": None if self.gpu is None else {**asdict(self.gpu), "capacity_gib": self.gpu.capacity_gib},
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """The breakdown as aligned text, one component per line, then the total and the verdict."""
        s = self.settings
        targets = "all-linear" if s.targets == ("all-linear",) else ",".join(s.targets)
        head = [
            f"VRAM estimate: {self.model} ({count_label(self.parameters)} parameters), {s.precision}, "
            f"LoRA r={s.lora_r} on {targets} ({count_label(self.lora_parameters)} trainable)",
            f"seq_len {s.seq_len:,}, {s.batch_tokens:,} tokens per micro-batch ({s.trained_tokens:,} trained), "
            f"checkpointing={s.checkpointing}, optimizer={s.optimizer}, loss={s.loss}; {s.kernels}; "
            f"peak during {self.peak_phase}",
            "",
        ]
        unit, scale = ("GiB", GiB) if self.total_bytes >= GiB else ("MiB", MiB)
        width = max(len(c.label) for c in self.components)
        lines = [f"{'component':<{width}}  {unit:>8}  note", f"{'-' * width}  {'-' * 8}  ----"]
        for c in self.components:
            if c.bytes == c.own_bytes:
                value, note = f"{c.bytes / scale:8.2f}", c.note
            else:
                value = f"{'–':>8}"
                note = f"{c.own_bytes / scale:.2f} {unit} during {c.phase}, freed before the {self.peak_phase} peak"
            lines.append(f"{c.label:<{width}}  {value}  {note}".rstrip())
        lines.append(f"{'-' * width}  {'-' * 8}")
        lines.append(f"{'total':<{width}}  {self.total_bytes / scale:8.2f}  {self.verdict()}")
        tail = [f"note: {note}" for note in self.notes]
        return "\n".join(head + lines + tail)

    def verdict(self) -> str:
        if self.gpu is None:
            return "(no GPU given: pass gpu='rtx4090' or another preset to judge the fit)"
        headroom = self.headroom_bytes / GiB
        if self.fits:
            return f"fits {self.gpu} with {headroom:.2f} GiB to spare"
        return f"does NOT fit {self.gpu}: short by {-headroom:.2f} GiB"

    def __str__(self) -> str:
        return self.table()


def count_label(n: int) -> str:
    """A parameter count as the table prints it: 8.03B, 41.94M, 12.00K or the number."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)

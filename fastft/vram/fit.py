"""Will it fit? `max_context` (the longest sequence whose estimate fits a GPU) and `fits` (whether a run
fits, and if not, the changes that make it fit, each one estimated rather than guessed).
"""

from __future__ import annotations

from dataclasses import dataclass

from fastft.vram import activation_bytes as act
from fastft.vram.estimate import estimate_vram
from fastft.vram.gpus import GPUS, GiB, GpuSpec
from fastft.vram.inventory import inventory_of
from fastft.vram.result import VramEstimate, VramEstimateError
from fastft.vram.settings import CHECKPOINTING, resolve_gpu


def max_context(
    model,
    gpu: str | GpuSpec | None = "auto",
    *,
    multiple_of: int = 128,
    limit: int = 1 << 22,
    **settings,
) -> int:
    """The longest `seq_len` (a multiple of `multiple_of`) whose estimate fits `gpu`; 0 if none does.

    `settings` are `estimate_vram`'s (precision, lora_r, checkpointing, …). A micro-batch holds one
    sequence unless `batch_tokens` is given (it then grows with `seq_len` when shorter).
    """
    gpu_spec = _require_gpu(gpu)
    inventory = inventory_of(model)
    settings.pop("seq_len", None)
    fixed_tokens = settings.pop("batch_tokens", None)

    sides = 1 if settings.get("method", "sft") == "sft" else 2  # a preference micro-batch holds a pair

    def fits_at(length: int) -> bool:
        tokens = None if fixed_tokens is None else max(fixed_tokens, sides * length)
        return bool(estimate_vram(inventory, length, tokens, gpu=gpu_spec, **settings).fits)

    if not fits_at(multiple_of):
        return 0
    low, high = multiple_of, multiple_of * 2
    while high <= limit and fits_at(high):
        low, high = high, high * 2
    if high > limit:
        return low if not fits_at(limit) else limit
    while high - low > multiple_of:  # invariant: fits(low), not fits(high)
        middle = (low + high) // 2 // multiple_of * multiple_of
        if middle in (low, high):
            break
        if fits_at(middle):
            low = middle
        else:
            high = middle
    return low


@dataclass(frozen=True)
class Fix:
    """One change that makes the run fit, with the estimate it leads to."""

    description: str
    changes: dict
    total_bytes: int


@dataclass(frozen=True)
class FitVerdict:
    """Whether a run fits a GPU and, when it does not, the changes that make it fit (best first)."""

    fits: bool
    estimate: VramEstimate
    fixes: tuple[Fix, ...] = ()

    def __bool__(self) -> bool:
        return self.fits

    @property
    def message(self) -> str:
        e = self.estimate
        need = f"{e.total_bytes / GiB:.2f} GiB"
        if self.fits:
            return f"Fits: needs {need} of {e.gpu} ({e.headroom_bytes / GiB:.2f} GiB to spare)."
        if not self.fixes:
            return (
                f"Does not fit: needs {need} of {e.gpu}, and no single change tried here (checkpointing, "
                "seq_len, 4-bit, rank, fused loss) is enough. Use a smaller model or a larger GPU."
            )
        fixes = "; ".join(f"{fix.description} (→ {fix.total_bytes / GiB:.2f} GiB)" for fix in self.fixes)
        return f"Does not fit: needs {need} of {e.gpu}. Fixes: {fixes}."

    def __str__(self) -> str:
        return self.message


def fits(
    model,
    seq_len: int = 2048,
    gpu: str | GpuSpec | None = "auto",
    **settings,
) -> FitVerdict:
    """Whether `model` trains at `seq_len` on `gpu`, and if not, which changes make it fit.

    Each fix is computed, not guessed: stronger checkpointing, the fused loss, a shorter `seq_len` (the
    longest that fits), 4-bit weights, a lower LoRA rank, or 4-bit with offloaded checkpointing; for GRPO
    (``method="grpo"``), instead of a shorter `seq_len`: one prompt's group per generate call, micro-batches
    of one completion, a smaller group G, shorter completions. Only changes whose estimate fits are
    returned, least intrusive first.
    """
    gpu_spec = _require_gpu(gpu)
    inventory = inventory_of(model)
    settings.pop("gpu", None)
    estimate = estimate_vram(inventory, seq_len, gpu=gpu_spec, **settings)
    if estimate.fits:
        return FitVerdict(True, estimate)
    s = estimate.settings
    base = {
        "batch_tokens": None
        if s.batch_tokens == s.seq_len * (1 if s.method == "sft" else 2)
        else s.batch_tokens,
        "precision": s.precision if inventory.loaded is None else None,
        "lora_r": s.lora_r,
        "targets": list(s.targets) if s.targets != ("all-linear",) else "all-linear",
        # as asked: an offloaded run the host cannot hold is estimated as the recompute it becomes, and
        # each fix is judged on the same host
        "checkpointing": settings.get("checkpointing", s.checkpointing),
        "host_memory": settings.get("host_memory", "auto"),
        "world_size": s.world_size,
        "sharding": s.sharding,
        "optimizer": s.optimizer,
        "loss": s.loss,
        "fused": s.fused,
        "trained_fraction": s.trained_tokens / s.batch_tokens,
        "method": s.method,
        "precompute_reference": s.precompute_reference,
        **dict(s.rollout),
    }
    grpo = s.method == "grpo"
    if grpo:  # the update's micro-batch follows the rollout's rows unless it was given
        rows = dict(s.rollout)["prompts_per_step"] * dict(s.rollout)["generations"]
        base["batch_tokens"] = None if s.batch_tokens == rows * s.seq_len else s.batch_tokens
        base["trained_fraction"] = 1.0  # estimate_vram derives it from the completion's share

    def fix(description: str, changes: dict) -> Fix | None:
        try:
            trial = estimate_vram(
                inventory,
                changes.get("seq_len", seq_len),
                gpu=gpu_spec,
                **{**base, **{k: v for k, v in changes.items() if k != "seq_len"}},
            )
        except VramEstimateError:  # a change this run cannot take (4-bit weights under FSDP2)
            return None
        return Fix(description, changes, trial.total_bytes) if trial.fits else None

    # least intrusive first: memory traded for time, then a shorter context, then quality-affecting changes
    found: list[Fix | None] = [
        fix(f"use checkpointing='{mode}'", {"checkpointing": mode})
        for mode in CHECKPOINTING[CHECKPOINTING.index(s.checkpointing) + 1 :]
    ]
    if (
        s.loss == "eager"
        and not s.fused
        and act.fusion_plan(inventory.model_type, inventory.hidden_act).fuses_decoder
    ):
        found.append(
            fix(
                "use fastft's fused kernels (add_lora(fused=True)): fused loss, fewer saved activations",
                {"fused": True, "loss": "auto"},
            )
        )
    if grpo:
        found += _grpo_fixes(fix, dict(s.rollout), seq_len)
    else:
        longest = max_context(inventory, gpu_spec, **{k: v for k, v in base.items() if k != "batch_tokens"})
        if 0 < longest < seq_len:
            found.append(fix(f"lower seq_len to {longest:,}", {"seq_len": longest, "batch_tokens": None}))
    rank = s.lora_r // 2
    while rank >= 1:  # the largest rank that fits
        lower = fix(f"lower lora_r to {rank}", {"lora_r": rank})
        if lower is not None:
            found.append(lower)
            break
        rank //= 2
    if inventory.loaded is None and s.precision in ("bf16", "fp16", "fp32"):
        nf4 = fix("use 4-bit weights (precision='nf4', QLoRA)", {"precision": "nf4"})
        found.append(nf4)
        if nf4 is None and s.checkpointing != "offload":
            found.append(
                fix(
                    "use 4-bit weights and checkpointing='offload'",
                    {"precision": "nf4", "checkpointing": "offload"},
                )
            )
    return FitVerdict(False, estimate, tuple(f for f in found if f is not None))


def _grpo_fixes(fix, rollout: dict, seq_len: int) -> list:
    """GRPO's own ways to fit: sample one prompt's group per generate call, train smaller micro-batches,
    a smaller group G, shorter completions (the largest that fit, halving)."""
    found = []
    if rollout["prompts_per_step"] > 1 and rollout["generation_batch_size"] != 1:
        found.append(
            fix("sample one prompt's group at a time (generation_batch_size=1)", {"generation_batch_size": 1})
        )
    found.append(
        fix(
            f"train in micro-batches of one completion (micro_batch_tokens={seq_len})",
            {"batch_tokens": seq_len},
        )
    )
    generations = rollout["generations"] // 2
    while generations >= 2:
        smaller = fix(f"a smaller group: num_generations={generations}", {"generations": generations})
        if smaller is not None:
            found.append(smaller)
            break
        generations //= 2
    prompt = seq_len - rollout["completion_tokens"]
    completion = rollout["completion_tokens"] // 2
    while completion >= 1:
        shorter = fix(
            f"shorter completions: max_new_tokens={completion}",
            {"seq_len": prompt + completion, "completion_tokens": completion},
        )
        if shorter is not None:
            found.append(shorter)
            break
        completion //= 2
    return found


def _require_gpu(gpu) -> GpuSpec:
    spec = resolve_gpu(gpu)
    if spec is None:
        raise VramEstimateError(
            "No GPU to judge the fit against"
            + (" (none is visible here)" if gpu == "auto" else "")
            + f": pass gpu='rtx4090' or another preset ({', '.join(GPUS)}), or a GpuSpec."
        )
    return spec

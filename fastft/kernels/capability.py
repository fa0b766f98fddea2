"""Where fastft's Triton kernels run, in one table: per GPU architecture its limits, the dtypes the kernels
take there, the GEMM tile configs that fit it, and the fallback (each op's plain-PyTorch reference) where a
kernel cannot run.

- **Architectures.** Triton serves compute capability 7.5 and later (Turing's T4 and RTX 20xx, Ampere,
  Ada, Hopper); older GPUs (Kaggle's P100, sm60; V100, sm70) run every op's reference. bf16 needs sm80:
  on sm75 fastft trains in fp16 (`fastft.models.loading.default_dtype`) and a bf16 tensor that reaches a
  kernel there takes the reference. Each architecture's shared memory per block (the opt-in maximum) and
  register file bound the kernel configs: 64 KiB on sm75, 99 KiB on sm86 / sm89, 163 KiB on sm80,
  227 KiB on sm90; 64 Ki registers per block and 255 per thread everywhere.
- **GEMM configs.** The autotuned grouped GEMMs (`fastft.kernels.autotune`) time the configs of
  `gemm_configs(table, cc)`: the lists tuned on an H100 / H200, each tile's pipeline stages cut until its
  operand tiles (`operand_bytes`) fit the architecture's shared memory, tiles that cannot fit dropped (sm90
  and sm80 keep every tuned config; sm86 / sm89 and sm75 cut the deepest and add shallower tiles). ``tests/kernels/test_kernel_targets.py`` compiles every kernel's every config for sm75, sm80,
  sm86, sm89 and sm90 and checks the compiled shared memory and registers against `ARCHS`.
- **The other kernels** (RMSNorm, RoPE, QK-norm + RoPE, gated activations, the cross-entropy rows, NF4
  dequantisation) are row-wise: their blocks follow the row width, not the architecture, and the same
  test checks they fit every target.
- **No Triton.** Without Triton, on a GPU below sm75, or with ``FASTFT_NO_TRITON=1`` (a switch to compare
  against, or to work around a kernel), every op runs its reference; `fastft.kernels.use_triton` decides
  per call from this table and says once, as a `KernelFallbackWarning`, which parts run in PyTorch and why.

Plain Python and torch only (Triton is imported where a config is built), so the dispatch reads it on
machines without Triton.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

# Function-local imports: the CLI and the fusion plan read this module without torch or triton
# (tests/models/test_fusion.py); Triton is Linux-only and the capability table is read without it.

MIN_CAPABILITY = 75  # Triton's oldest NVIDIA target (Turing)
FP8_CAPABILITY = 89  # FP8 tensor cores and e4m3 conversions: Ada, Hopper, Blackwell
NO_TRITON_VARIABLE = "FASTFT_NO_TRITON"


@dataclass(frozen=True)
class Arch:
    """One GPU architecture's limits for a kernel: opt-in shared memory per block (bytes), registers per
    block and per thread, and whether it computes in bf16."""

    capability: int
    cards: str
    shared_bytes: int
    bf16: bool
    registers_per_block: int = 65536
    registers_per_thread: int = 255


ARCHS = {
    75: Arch(75, "Tesla T4, RTX 20xx (Turing)", 64 * 1024, bf16=False),
    80: Arch(80, "A100, A800 (Ampere)", 163 * 1024, bf16=True),
    86: Arch(86, "RTX 30xx, A10G, A40, RTX A6000 (Ampere)", 99 * 1024, bf16=True),
    89: Arch(89, "L4, L40S, RTX 40xx (Ada)", 99 * 1024, bf16=True),
    90: Arch(90, "H100, H200 (Hopper)", 227 * 1024, bf16=True),
}


def arch_of(capability: int) -> Arch:
    """The limits that bind a GPU of compute capability `capability` (e.g. 86): its own row, else the
    nearest known architecture below it of the same major (sm87 → sm86), else the newest below it."""
    if capability in ARCHS:
        return ARCHS[capability]
    known = sorted(c for c in ARCHS if c <= capability)
    if not known:
        raise ValueError(f"sm{capability} is below sm{MIN_CAPABILITY}: Triton does not run there.")
    same_major = [c for c in known if c // 10 == capability // 10]
    return ARCHS[(same_major or known)[-1]]


# The fused ops, what each falls back to, and the dtypes its kernels take (bf16 only where the GPU has it).
OPS = {
    "rms_norm": "RMSNorm",
    "rope": "RoPE",
    "qk_norm_rope": "QK-norm + RoPE",
    "swiglu": "SwiGLU / GeGLU",
    "fused_linear_ce": "fused linear cross-entropy (its row kernel; the logits GEMMs are cuBLAS)",
    "nf4": "NF4 dequantisation",
    "fp8": "FP8 row quantisation (the GEMMs are torch._scaled_mm)",
    "lora": "LoRA-fused projections and MLP",
    "grouped_gemm": "MoE grouped GEMMs",
    "down_combine": "MoE down projection + combine",
}


def supports_dtypes(capability: int, dtypes) -> bool:
    """Whether kernels with operands of these dtypes (``torch.bfloat16`` or names like ``"bfloat16"``) run on
    sm `capability`: Triton's targets, bf16 where the GPU computes in it, FP8 (e4m3) from sm89 (integer
    operands such as NF4's packed bytes run everywhere)."""
    if capability < MIN_CAPABILITY:
        return False
    names = {str(d).removeprefix("torch.") for d in dtypes}
    if "float8_e4m3fn" in names and capability < FP8_CAPABILITY:
        return False
    return "bfloat16" not in names or arch_of(capability).bf16


# -- GEMM tile configs per architecture ---------------------------------------------------------------

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M), tuned on sm90 (H100 / H200). Three regimes,
# picked by shape (`fastft.kernels.autotune.regime`): the expert GEMMs themselves ("wide"), and the LoRA
# low-rank GEMMs, where N = r ("skinny_n": x A^T, dy B) or K = r ("small_k": xa B^T, dxa A) and the work is
# memory-bound -- there, deep reduction tiles or wide output tiles amortise each program's fixed cost.
# "fwd": kernels writing [M, N] output tiles, reducing over K, row tiles swizzled in groups of GROUP_M
# (the grouped GEMM's forward and dA); "dw": kernels writing [N, K] tiles, reducing over the rows M.
GEMM_TABLES = {
    "fwd": {
        "wide": [
            (128, 128, 64, 8, 3, 8),
            (128, 128, 64, 4, 4, 8),
            (64, 128, 64, 4, 4, 8),
            (128, 256, 64, 8, 3, 8),
            (128, 256, 64, 8, 4, 8),
            (64, 256, 64, 8, 3, 8),
        ],
        "skinny_n": [
            (32, 32, 128, 4, 4, 8),
            (64, 32, 128, 4, 4, 8),
            (64, 32, 256, 4, 3, 8),
            (128, 32, 128, 8, 3, 8),
        ],
        "small_k": [
            (64, 128, 32, 4, 2, 8),
            (128, 128, 32, 4, 2, 8),
            (64, 256, 32, 4, 2, 8),
            (128, 256, 32, 8, 2, 8),
        ],
    },
    "dw": {
        "wide": [
            (64, 128, 128, 8, 3, None),
            (128, 128, 128, 8, 3, None),
            (64, 256, 128, 8, 3, None),
            (32, 128, 128, 8, 4, None),
            (64, 128, 64, 4, 4, None),
            (64, 64, 128, 4, 4, None),
        ],
        "skinny_n": [
            (64, 32, 128, 4, 4, None),
            (64, 32, 256, 8, 3, None),
            (128, 32, 128, 8, 3, None),
            (32, 32, 256, 4, 4, None),
        ],
        "small_k": [
            (64, 128, 32, 4, 4, None),
            (64, 256, 32, 8, 3, None),
            (128, 128, 32, 8, 3, None),
        ],
    },
}
# An sm75 / sm86 / sm89 config for the "wide" regime that keeps a deep enough pipeline where the sm90 list's
# tiles are cut to one or two stages.
_SMALL_SHARED_EXTRA = {
    "fwd": {"wide": [(64, 64, 64, 4, 3, 8), (64, 64, 32, 4, 4, 8)]},
    "dw": {"wide": [(64, 64, 64, 4, 3, None), (32, 64, 64, 4, 4, None)]},
}


def operand_bytes(table: str, config: tuple, element_size: int = 2) -> int:
    """Shared memory a config's pipelined operand tiles take: ``stages - 1`` copies of both operands' tiles
    (``fwd``: A ``[BM, BK]`` and B ``[BK, BN]``; ``dw``: dy ``[BM, BN]`` and A ``[BM, BK]``). Triton 3.9's
    pipeline keeps ``stages - 1`` tiles in flight: compiled for sm80, 128 x 256 x 64 at 3 stages takes
    96 KiB, 128 x 128 x 64 at 3 stages 64 KiB, 64 x 128 x 64 at 4 stages 72 KiB, exactly this; the dw kernel,
    whose gathered rows are not pipelined, takes about one tile (`tests/kernels/test_kernel_targets.py`
    compiles every config and checks the real figure against the architecture's limit)."""
    m, n, k, _, stages, _ = config
    tile = m * k + k * n if table == "fwd" else m * n + m * k
    return max(1, stages - 1) * tile * element_size


def _fitted(table: str, rows: dict[str, list[tuple]], shared_bytes: int) -> dict[str, list[tuple]]:
    """Each config with its stages cut (to 2 at least) until `operand_bytes` fits `shared_bytes`; configs
    that cannot fit dropped, duplicates dropped."""
    fitted: dict[str, list[tuple]] = {}
    for regime, configs in rows.items():
        kept: list[tuple] = []
        for m, n, k, warps, stages, group in configs:
            while stages > 2 and operand_bytes(table, (m, n, k, warps, stages, group)) > shared_bytes:
                stages -= 1
            config = (m, n, k, warps, stages, group)
            if operand_bytes(table, config) <= shared_bytes and config not in kept:
                kept.append(config)
        fitted[regime] = kept
    return fitted


@functools.cache
def gemm_config_tuples(table: str, capability: int) -> dict[str, list[tuple]]:
    """The ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M)`` configs of GEMM `table` ("fwd" / "dw") per
    regime for sm `capability` (module docstring): the tuned lists, fitted to its shared memory; the
    architectures below sm80's 163 KiB also get `_SMALL_SHARED_EXTRA`'s shallower wide tiles."""
    arch = arch_of(capability)
    rows = GEMM_TABLES[table]
    if arch.shared_bytes < ARCHS[80].shared_bytes:
        extra = _SMALL_SHARED_EXTRA.get(table, {})
        rows = {regime: list(configs) + list(extra.get(regime, [])) for regime, configs in rows.items()}
    return _fitted(table, rows, arch.shared_bytes)


def gemm_configs(table: str, capability: int) -> dict:
    """`gemm_config_tuples` as ``triton.Config`` lists, for the autotuner."""
    import triton

    def config(m, n, k, warps, stages, group):
        kwargs = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k)
        if group is not None:
            kwargs["GROUP_M"] = group
        return triton.Config(kwargs, num_warps=warps, num_stages=stages)

    return {
        regime: [config(*c) for c in configs]
        for regime, configs in gemm_config_tuples(table, capability).items()
    }


# -- the dispatch's answer --------------------------------------------------------------------------


class KernelFallbackWarning(UserWarning):
    """fastft's Triton kernels cannot run here: the ops named run their PyTorch references."""


def triton_importable() -> bool:
    """Whether the ``triton`` package imports (checked once)."""
    global _IMPORTABLE
    if _IMPORTABLE is None:
        try:
            import triton  # noqa: F401
        except ImportError:
            _IMPORTABLE = False
        else:
            _IMPORTABLE = True
    return _IMPORTABLE


_IMPORTABLE: bool | None = None


def forced_off() -> bool:
    """``FASTFT_NO_TRITON=1``: every op runs its PyTorch reference."""
    return os.environ.get(NO_TRITON_VARIABLE, "") not in ("", "0")


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


def device_capability(device=None) -> tuple[int, int]:
    """``(major, minor)`` of a CUDA device (cached per device)."""
    import torch

    index = getattr(device, "index", None)
    return _capability_of(index if index is not None else torch.cuda.current_device())


def fallback_reason(device=None, dtype=None, triton_importable: bool = True) -> str | None:
    """Why a CUDA tensor of `dtype` on `device` cannot take the Triton kernels; None when it can."""
    if forced_off():
        return f"{NO_TRITON_VARIABLE}=1 is set"
    if not triton_importable:
        return "Triton is not installed (pip install triton)"
    major, minor = device_capability(device)
    capability = 10 * major + minor
    if capability < MIN_CAPABILITY:
        return f"this GPU is sm{capability}: Triton runs on sm{MIN_CAPABILITY} (T4) and newer"
    if dtype is not None and not supports_dtypes(capability, [dtype]):
        return f"this GPU (sm{capability}) has no {str(dtype).removeprefix('torch.')} compute: load the model in fp16"
    return None


_SAID: set[str] = set()


def say_fallback(reason: str) -> None:
    """Warn once per reason per process which parts of fastft run in PyTorch (correct, slower)."""
    if reason in _SAID:
        return
    _SAID.add(reason)
    parts = ", ".join(OPS[name].split(" (")[0] for name in OPS)
    warnings.warn(
        f"fastft's Triton kernels are off ({reason}): {parts} run their PyTorch references instead. "
        "Training is correct, but slower and with more memory.",
        KernelFallbackWarning,
        stacklevel=4,
    )


def kernel_status(device=None, dtype=None) -> dict:
    """What the studio and a notebook show: ``{"triton": bool, "reason": str | None, "fallback": [op
    names]}`` for a device (None: the current CUDA device, or the CPU when there is none) and dtype."""
    import torch

    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda":
        reason = "no CUDA GPU: the CPU runs the PyTorch references"
    else:
        reason = fallback_reason(device, dtype, triton_importable())
    return {
        "triton": reason is None,
        "reason": reason,
        "fallback": [] if reason is None else list(OPS.values()),
    }


__all__ = [
    "ARCHS",
    "MIN_CAPABILITY",
    "NO_TRITON_VARIABLE",
    "OPS",
    "Arch",
    "KernelFallbackWarning",
    "arch_of",
    "device_capability",
    "fallback_reason",
    "forced_off",
    "gemm_config_tuples",
    "gemm_configs",
    "kernel_status",
    "operand_bytes",
    "say_fallback",
    "supports_dtypes",
]

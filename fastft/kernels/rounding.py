"""Rounding shared by the Triton kernels: fp32 to a 16-bit dtype, nearest with ties to even, also under the
CPU interpreter (whose own fp32 -> bf16 cast truncates)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_RNE: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (round to nearest, ties to even), returned as ``dtype``.

    ``EMULATE_RNE`` (the CPU interpreter only) rounds to bf16 with integer ops first, because the
    interpreter's own fp32 -> bf16 cast truncates; on a GPU the native conversion runs.
    """
    if EMULATE_RNE and dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = u + (0x7FFF + ((u >> 16) & 1))
        rounded = ((u >> 16) << 16).to(tl.float32, bitcast=True)
        x = tl.where(x != x, x, rounded)
    return x.to(dtype)

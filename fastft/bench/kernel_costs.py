"""The least each kernel of `fastft bench kernels` must move or compute: bytes read + written, FLOPs."""

from __future__ import annotations

import math


# Byte counts: the least each op must read + write (element_size in bytes; bf16 = 2)
def copy_bytes(nbytes: int) -> int:
    """``dst.copy_(src)``: read ``nbytes``, write ``nbytes``."""
    return 2 * nbytes


def rms_norm_bytes(rows: int, hidden: int, element_size: int = 2) -> dict[str, int]:
    """Forward: read x and w, write y. Backward: read x, dy and w, write dx and dw.

    The per-row rstd a kernel may save (4 bytes a row, 0.05 % at hidden 4096) is not counted: the
    backward can recompute it from x, which it reads anyway.
    """
    act = rows * hidden * element_size
    weight = hidden * element_size
    return {"forward": 2 * act + weight, "backward": 3 * act + 2 * weight}


def rope_bytes(
    batch: int,
    q_heads: int,
    kv_heads: int,
    seq: int,
    head_dim: int,
    element_size: int = 2,
    cos_batch: int = 1,
) -> dict[str, int]:
    """Forward: read q, k, cos, sin, write q_rot, k_rot. Backward: the same with the incoming gradients
    read and dq, dk written. cos / sin are ``[cos_batch, seq, head_dim]`` each, read once."""
    qk = batch * (q_heads + kv_heads) * seq * head_dim * element_size
    cos_sin = 2 * cos_batch * seq * head_dim * element_size
    return {"forward": 2 * qk + cos_sin, "backward": 2 * qk + cos_sin}


def swiglu_bytes(rows: int, cols: int, element_size: int = 2) -> dict[str, int]:
    """Forward: read gate, up, write h. Backward: read dh, gate, up, write d_gate, d_up (act recomputed)."""
    one = rows * cols * element_size
    return {"forward": 3 * one, "backward": 5 * one}


def nf4_bytes(n: int, blocksize: int = 64, nested: bool = True, out_element_size: int = 2) -> dict[str, int]:
    """Dequantise ``n`` NF4 values: read ``ceil(n / 2)`` packed bytes and one absmax per block (uint8 when
    double-quantised, plus one fp32 scale per 256 blocks and the fp32 offset; fp32 otherwise), write ``n``
    outputs. The 16- and 256-entry code tables (1 KiB, constants) are not counted."""
    blocks = math.ceil(n / blocksize)
    absmax = blocks + 4 * math.ceil(blocks / 256) + 4 if nested else 4 * blocks
    return {"forward": math.ceil(n / 2) + absmax + n * out_element_size}


def flce_flops(tokens: int, vocab: int, hidden: int, weight_trains: bool) -> int:
    """Matmul FLOPs of linear + cross-entropy forward and backward: logits, grad_hidden (+ grad_weight)."""
    return (3 if weight_trains else 2) * 2 * tokens * vocab * hidden


def lora_mlp_flops(tokens: int, hidden: int, intermediate: int, r: int) -> int:
    """Matmul FLOPs of a gated MLP with frozen base weights and LoRA on all three projections, forward and
    backward: base forward and dx (2 x 3 x 2 N H I), LoRA forward (2 N r (in + out) per projection) and
    backward (twice that: dB, dxa, dA, dx)."""
    base = 2 * 3 * 2 * tokens * hidden * intermediate
    lora = 3 * 2 * tokens * r * (hidden + intermediate) * 3
    return base + lora

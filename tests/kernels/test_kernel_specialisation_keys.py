"""A new padded length must not compile new kernels: the per-token launchers' specialisation keys (what a
GPU compiles one kernel per, `tests/triton_keys.py`) do not depend on the token count.

Triton specialises every integer argument on ``== 1`` and ``% 16 == 0``. Where a kernel took the row or
sequence count that way, TRL's padded micro-batches (each padded to its own longest row) met a new key
whenever a batch's length crossed one of those classes, and each meant compiling the kernel again
(about a second each on an H100 host) in the middle of training."""

from __future__ import annotations

import pytest
import torch
from triton_keys import SpecialisationKeys, differing

from fastft.kernels.qk_norm_rope import _launch_qk_norm_rope_bwd, _launch_qk_norm_rope_fwd
from fastft.kernels.rms_norm import rms_norm_backward, rms_norm_forward
from fastft.kernels.rope import rope_backward, rope_forward

pytest.importorskip("triton")

# TRL's padded lengths of the Alpaca notebook's micro-batches cross every class: odd, 8 * odd, 16 * k
LENGTHS = (517, 520, 528, 533)
BATCH, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 2, 4, 2, 64, 256


def _keys(length: int) -> dict[str, set[tuple]]:
    x = torch.empty(BATCH, length, HIDDEN)
    weight = torch.ones(HIDDEN)
    q = torch.empty(BATCH, HEADS, length, HEAD_DIM)
    k = torch.empty(BATCH, KV_HEADS, length, HEAD_DIM)
    cos = sin = torch.empty(1, length, HEAD_DIM)
    norm = torch.ones(HEAD_DIM)
    with SpecialisationKeys(run=False) as recorded:
        _, rows, rstd = rms_norm_forward(x, weight, 1e-6)
        for programs in (264, 528):  # an H100's 132 SMs at the backward's programs per SM, and twice that
            rms_norm_backward(x, rows, weight, rstd, num_programs=programs)
        rope_forward(q, k, cos, sin)
        rope_backward(q, k, cos, sin)
        _launch_qk_norm_rope_fwd(q, k, norm, norm, cos, sin, 1e-6)
        _launch_qk_norm_rope_bwd(q, k, q, k, norm, norm, cos, sin, 1e-6, (True, True, True, True))
    return recorded.keys


def test_padded_lengths_share_every_kernel_specialisation(interpreted):
    first, *others = (_keys(length) for length in LENGTHS)
    assert set(first) >= {
        "_rms_norm_forward_kernel",
        "_rms_norm_backward_kernel",
        "_sum_partials_kernel",
        "_rope_kernel",
        "_qk_norm_rope_fwd_kernel",
        "_qk_norm_rope_bwd_kernel",
    }
    for length, keys in zip(LENGTHS[1:], others, strict=True):
        assert differing(first, keys) == {}, f"padded length {LENGTHS[0]} vs {length}"

"""Every Triton kernel, in every launch config fastft uses (the GEMMs: every config of each architecture's
table), compiles for sm75, sm80, sm86, sm89 and sm90 without a GPU, within each target's shared memory and
register file (`fastft.kernels.capability.ARCHS`). The compiling runs in a process of its own
(`compile_targets.py`): it pretends to be on CUDA so every launcher takes its GPU branch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from fastft.kernels.capability import ARCHS

pytestmark = pytest.mark.slow

# CI compiles for the two tightest targets (sm75: 64 KiB of shared memory a block, fp16 only; sm86: 99 KiB),
# about two minutes on 2 cores; FASTFT_EVERY_TARGET=1 compiles for all five (about five CPU-minutes).
TARGETS = (75, 80, 86, 89, 90) if os.environ.get("FASTFT_EVERY_TARGET") == "1" else (75, 86)
KERNELS = {
    "_rms_norm_forward_kernel",
    "_rms_norm_backward_kernel",
    "_sum_partials_kernel",
    "_rope_kernel",
    "_qk_norm_rope_fwd_kernel",
    "_qk_norm_rope_bwd_kernel",
    "_gated_activation_fwd_kernel",
    "_gated_activation_bwd_kernel",
    "_cross_entropy_rows_kernel",
    "_nf4_dequantize_kernel",
    "_grouped_mm_kernel",
    "_grouped_mm_dw_kernel",
}


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    script = Path(__file__).with_name("compile_targets.py")
    done = subprocess.run(
        [sys.executable, str(script), *map(str, TARGETS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_compiles_for_every_target(compiled):
    errors = [entry for entry in compiled if "error" in entry]
    assert not errors, errors[:5]
    by_target = defaultdict(set)
    for entry in compiled:
        by_target[entry["cc"]].add(entry["kernel"])
    # the FP8 row quantiser from sm89 on (e4m3 conversions; older cards refuse FP8 weights)
    expected = {cc: KERNELS | ({"_quantize_rows_kernel"} if cc >= 89 else set()) for cc in TARGETS}
    assert {cc: by_target[cc] for cc in TARGETS} == expected
    # bf16 is compiled where the GPU computes in it; sm75 runs fp16 (bf16 takes the reference there)
    assert not [e for e in compiled if e["cc"] == 75 and "bfloat16" in e["op"]]
    assert [e for e in compiled if e["cc"] == TARGETS[1] and "bfloat16" in e["op"]]


def test_every_compiled_kernel_fits_its_target(compiled):
    """Shared memory per block within the target's opt-in maximum; registers within 255 per thread and the
    64 Ki a block may hold (``cuobjdump`` reads them from the cubin)."""
    over = []
    for entry in compiled:
        arch = ARCHS[entry["cc"]]
        threads = 32 * entry["warps"]
        registers = entry.get("registers")
        if entry["shared"] > arch.shared_bytes:
            over.append(("shared", entry))
        if registers is not None and (
            registers > arch.registers_per_thread or registers * threads > arch.registers_per_block
        ):
            over.append(("registers", entry))
    assert not over, over[:5]
    assert any(entry.get("registers") for entry in compiled)  # cuobjdump did read them


def test_each_architecture_compiles_its_own_gemm_configs(compiled):
    """Every GEMM config of each architecture's table was compiled for it: the autotuner there times only
    configs that fit."""
    from fastft.kernels.capability import gemm_config_tuples

    for cc in TARGETS:
        for kernel, table in (("_grouped_mm_kernel", "fwd"), ("_grouped_mm_dw_kernel", "dw")):
            seen = {
                (e["config"].split(", num_warps")[0], e["warps"], e["stages"])
                for e in compiled
                if e["cc"] == cc and e["kernel"] == kernel and e["config"]
            }
            # the wide launch (1536 x 2048) keeps every tile whole
            for m, n, k, warps, stages, group in gemm_config_tuples(table, cc)["wide"]:
                tiles = f"BLOCK_M: {m}, BLOCK_N: {n}, BLOCK_K: {k}" + (f", GROUP_M: {group}" if group else "")
                assert (tiles, warps, stages) in seen, (cc, kernel, tiles, warps, stages)

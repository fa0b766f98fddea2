"""Autotuning for the GEMM-shaped Triton kernels (GPU only; never under the interpreter).

A kernel that computes a tile of an ``N`` x ``K``-shaped problem with ``BLOCK_N`` / ``BLOCK_K`` (and
``BLOCK_M``, optionally ``GROUP_M``) meta-parameters gets its autotuner from :func:`autotuned`::

    tuned = autotuned(kernel, "fwd", key=["N", "K", ...])   # built once per kernel
    tuned[grid](*args, **flags)

A table (`fastft.kernels.capability.GEMM_TABLES`, per architecture) maps a shape regime (:func:`regime`,
from ``N`` and ``K``) to its candidate configs; each call
times only its regime's configs, with the column / reduction tiles shrunk to the problem. The key names
the kernel's arguments the results are kept per (the caller's choice: the grouped GEMM keys on ``N``, ``K``
and its variant flags, never on ``M``, which changes every step). Configs are timed with CUDA events and
no flush buffer (:func:`_time_config`), and kept on disk where Triton can.
"""

from __future__ import annotations

import inspect

import torch
import triton

from fastft.kernels import capability


def table_for_device(table: str) -> dict[str, list]:
    """GEMM `table`'s configs ("fwd" / "dw") for the current CUDA device's architecture
    (`fastft.kernels.capability.gemm_configs`: the tiles whose pipeline fits its shared memory); the tuned
    (sm90) lists in a process without a GPU, which never launches them."""
    if not torch.cuda.is_available():
        return capability.gemm_configs(table, 90)
    major, minor = capability.device_capability()
    return capability.gemm_configs(table, 10 * major + minor)


def regime(n: int, k: int) -> str:
    """The table row a problem of ``N = n`` output columns and ``K = k`` reduction depth is tuned in."""
    if n <= 32 < k:
        return "skinny_n"
    if k <= 32 < n:
        return "small_k"
    return "wide"


def _pruner(table):
    def prune(configs, named_args, **kwargs):
        """The shape's regime's configs, column / reduction tiles shrunk to the problem, never below 16
        (``tl.dot``'s minimum); duplicates dropped."""
        n, k = named_args["N"], named_args["K"]
        fitted, seen = [], set()
        for config in table[regime(n, k)]:
            kw = dict(config.kwargs)
            kw["BLOCK_N"] = min(kw["BLOCK_N"], max(16, triton.next_power_of_2(n)))
            kw["BLOCK_K"] = min(kw["BLOCK_K"], max(16, triton.next_power_of_2(k)))
            key = (tuple(sorted(kw.items())), config.num_warps, config.num_stages)
            if key not in seen:
                seen.add(key)
                fitted.append(triton.Config(kw, num_warps=config.num_warps, num_stages=config.num_stages))
        return fitted

    return prune


# Triton >= 3.4 keeps autotuning results in its cache folder, keyed by the kernel's source, the GPU and the key
# values: a new process (a restarted notebook, each `fastft bench step` worker) reuses them instead of
# re-timing every config for tens of seconds. Older Tritons (some Colab images) lack the option.
_DISK_CACHE = (
    {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
)


def _time_config(kernel_call, quantiles) -> list[float]:
    """How the autotuner times one config: CUDA events around ~25 ms of calls, median and the asked
    quantiles. Triton's own ``do_bench`` allocates a 256 MiB buffer for every config it times, to flush
    the L2 between calls; timed inside a training step's first backward, that buffer was the MoE step's
    peak memory (+256 MiB over the steady state). Without it nothing is allocated; the operands of these
    GEMMs (tens of MiB and more) outgrow the L2 anyway."""
    kernel_call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        kernel_call()
    end.record()
    torch.cuda.synchronize()
    reps = max(5, min(100, int(25.0 / max(start.elapsed_time(end) / 3, 1e-3))))
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for first, last in events:
        first.record()
        kernel_call()
        last.record()
    torch.cuda.synchronize()
    times = sorted(first.elapsed_time(last) for first, last in events)
    return [times[min(reps - 1, int(q * reps))] for q in quantiles]


_OWN_TIMING = (
    {"do_bench": _time_config} if "do_bench" in inspect.signature(triton.autotune).parameters else {}
)
_tuned: dict[object, object] = {}


def autotuned(kernel, table: str, key: list[str]):
    """The autotuned wrapper of the ``@triton.jit`` ``kernel``, built on first use and kept: every config
    of GEMM `table` ("fwd" / "dw") for this GPU's architecture (`table_for_device`), each call pruned to its
    shape's regime, results kept per value of the ``key`` arguments (on disk where Triton can), configs
    timed by :func:`_time_config`."""
    if kernel not in _tuned:
        rows = table_for_device(table)
        configs = [config for row in rows.values() for config in row]
        tuner = triton.autotune(
            configs=configs,
            key=key,
            prune_configs_by={"early_config_prune": _pruner(rows)},
            **_DISK_CACHE,
            **_OWN_TIMING,
        )(kernel)
        # what `tests/kernels/compile_targets.py` reads to compile every target's configs of this kernel
        tuner.fastft_table = table
        tuner.fastft_prune = lambda rows, named_args: _pruner(rows)(None, named_args)
        _tuned[kernel] = tuner
    return _tuned[kernel]


__all__ = ["autotuned", "regime", "table_for_device"]

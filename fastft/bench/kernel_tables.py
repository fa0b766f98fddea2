"""`fastft bench kernels`' result rows, their tables and the targets they are judged by."""

from __future__ import annotations

from fastft.bench.common import environment_line, markdown_table

# The bar for memory-bound kernels, as a share of the measured copy bandwidth.
TARGET_PERCENT_OF_COPY = 80.0
# The bar for fused linear CE: peak extra memory at most this share of eager's.
TARGET_FLCE_MEMORY_SHARE = 1 / 8


def bandwidth_gbs(nbytes: int, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else nbytes / ms / 1e6


def ratio(ms: float | None, baseline_ms: float | None) -> float | None:
    return None if ms is None or baseline_ms is None or baseline_ms <= 0 else ms / baseline_ms


def kernel_row(
    op: str,
    direction: str,
    shape: str,
    nbytes: int,
    copy_gbs: float,
    times: dict[str, float | None],
    max_abs_diff: float | None = None,
) -> dict:
    """One memory-bound row: ``times`` maps system (fastft, fastft_kernel, eager, liger, bitsandbytes) to
    median ms or None. ``fastft`` is the autograd path a model runs (the Function and its host work);
    ``fastft_kernel`` the host launcher alone, the kernels' own bandwidth. GB/s are decimal (1e9 bytes/s);
    ``*_pct_copy`` is the share of the measured copy bandwidth."""
    row = {"op": op, "direction": direction, "shape": shape, "bytes": nbytes}
    for system in ("fastft", "fastft_kernel", "eager", "liger", "bitsandbytes"):
        ms = times.get(system)
        gbs = bandwidth_gbs(nbytes, ms)
        row[f"{system}_ms"] = ms
        row[f"{system}_gbs"] = gbs
        row[f"{system}_pct_copy"] = None if gbs is None else 100.0 * gbs / copy_gbs
    for system in ("eager", "liger", "bitsandbytes"):
        row[f"fastft_over_{system}"] = ratio(times.get("fastft"), times.get(system))
    row["max_abs_diff_vs_eager"] = max_abs_diff
    return row


def memory_row(
    workload: str,
    system: str,
    ms: float | None,
    peak_bytes: int | None,
    flops: int,
    eager_ms: float | None,
    eager_peak_bytes: int | None,
) -> dict:
    """One forward + backward row: time, TFLOP/s of the matmuls, peak memory beyond the inputs, both as
    shares of eager's."""
    return {
        "workload": workload,
        "system": system,
        "ms": ms,
        "tflops": None if ms is None or ms <= 0 else flops / ms / 1e9,
        "peak_extra_bytes": peak_bytes,
        "time_over_eager": ratio(ms, eager_ms),
        "memory_over_eager": None
        if peak_bytes is None or not eager_peak_bytes
        else peak_bytes / eager_peak_bytes,
    }


def _fmt(value, kind: str):
    if value is None:
        return None
    if kind == "ms":
        return f"{value:.3f}" if value < 10 else f"{value:,.1f}"
    if kind == "gbs":
        return f"{value:,.0f}"
    if kind == "pct":
        return f"{value:.1f} %"
    if kind == "ratio":
        return f"{value:.2f}"
    if kind == "gib":
        return f"{value / 2**30:.2f}"
    return value


KERNEL_COLUMNS = [
    ("op", "op", None),
    ("direction", "direction", None),
    ("fastft_ms", "fastft ms", "ms"),
    ("fastft_gbs", "GB/s", "gbs"),
    ("fastft_pct_copy", "% of copy", "pct"),
    ("fastft_kernel_pct_copy", "kernel alone % of copy", "pct"),
    ("eager_ms", "eager ms", "ms"),
    ("liger_ms", "liger ms", "ms"),
    ("liger_pct_copy", "liger % of copy", "pct"),
    ("bitsandbytes_ms", "bnb ms", "ms"),
    ("fastft_over_eager", "fastft/eager", "ratio"),
    ("fastft_over_liger", "fastft/liger", "ratio"),
    ("fastft_over_bitsandbytes", "fastft/bnb", "ratio"),
]

MEMORY_COLUMNS = [
    ("workload", "workload", None),
    ("system", "system", None),
    ("ms", "fwd+bwd ms", "ms"),
    ("tflops", "TFLOP/s", "gbs"),
    ("peak_extra_bytes", "peak extra GiB", "gib"),
    ("time_over_eager", "time / eager", "ratio"),
    ("memory_over_eager", "memory / eager", "ratio"),
]


def format_table(rows: list[dict], columns: list[tuple[str, str, str | None]]) -> str:
    """``rows`` as a markdown table, each value formatted by its column's kind (ms, gbs, pct, ratio, gib)."""
    shown = [{key: _fmt(row.get(key), kind) for key, _, kind in columns} for row in rows]
    return markdown_table(shown, [(key, header) for key, header, _ in columns])


def target_lines(result: dict) -> list[str]:
    """The issue's bars, checked: each kernel row at >= 80 % of copy; fused CE memory <= 1/8 and time <= eager."""
    lines = []
    for row in result["rows"]:
        pct = row["fastft_pct_copy"]
        if pct is None:
            continue
        verdict = "meets" if pct >= TARGET_PERCENT_OF_COPY else "BELOW"
        alone = row.get("fastft_kernel_pct_copy")
        kernel = "" if alone is None else f"; the kernel alone {alone:.1f} %"
        lines.append(
            f"{row['op']} {row['direction']}: {pct:.1f} % of copy through autograd ({verdict} "
            f"{TARGET_PERCENT_OF_COPY:.0f} %){kernel}"
        )
    by_workload: dict[str, dict[str, dict]] = {}
    for row in result["memory_rows"]:
        by_workload.setdefault(row["workload"], {})[row["system"]] = row
    for workload, systems in by_workload.items():
        fastft, eager = systems.get("fastft"), systems.get("eager")
        if not workload.startswith("flce") or fastft is None or eager is None:
            continue
        memory, speed = fastft["memory_over_eager"], fastft["time_over_eager"]
        if memory is not None:
            verdict = "meets" if memory <= TARGET_FLCE_MEMORY_SHARE else "MISSES"
            lines.append(f"{workload}: peak extra memory {memory:.3f} x eager ({verdict} <= 1/8)")
        if speed is not None:
            verdict = "meets" if speed <= 1.0 else "MISSES"
            lines.append(f"{workload}: time {speed:.2f} x eager ({verdict} <= 1)")
    return lines


def report(result: dict) -> str:
    """The whole result as text: header, kernel table, memory table, the issue's bars, notes."""
    env, copy = result["environment"], result["copy"]
    libraries = ("torch", "triton", "liger_kernel", "bitsandbytes")
    head = (
        f"kernels — {environment_line(env, *libraries)}\n"
        f"copy bandwidth (copy_ of {copy['bytes'] / 2**30:g} GiB, read + write): {copy['gbs']:,.0f} GB/s; "
        f"kernel ratios are times (fastft / baseline, < 1 = fastft faster)"
    )
    parts = [head]
    if result["rows"]:
        parts.append(format_table(result["rows"], KERNEL_COLUMNS))
    if result["memory_rows"]:
        parts.append(format_table(result["memory_rows"], MEMORY_COLUMNS))
    targets = target_lines(result)
    if targets:
        parts.append("\n".join(f"- {line}" for line in targets))
    if result["notes"]:
        parts.append("notes:\n" + "\n".join(f"- {note}" for note in result["notes"]))
    return "\n\n".join(parts)

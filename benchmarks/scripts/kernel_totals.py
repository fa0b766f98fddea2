"""Kernel totals of one `fastft bench step` worker: where two commits' steps differ, kernel by kernel.

`fastft bench step` gives a step's time; when two commits differ by a percent (issue 23: the NF4 step at
2x2048 is 0.7-1.4 % slower than at the issue's filing, bf16 is not), this says in which kernels. It runs the
bench's worker (`fastft.bench.step.run_worker`, with the arguments `fastft bench step` gives it) in this
process under `torch.profiler` and lists the device kernels by total time, with their launch counts (on a
CPU, the operators by their own CPU time). The totals cover the whole worker: loading, warm-up and the timed
steps; per step is the total over ``--warmup + --steps``, less what loading ran (its kernels have their own
names: quantisation, initialisation).

fastft is imported from the current directory, so the same script profiles an archived commit:

    python benchmarks/scripts/kernel_totals.py --workload nf4:2x2048 --cuda-graph off --out /tmp/nf4_new.json
    (cd old && python ../benchmarks/scripts/kernel_totals.py --workload nf4:2x2048 --cuda-graph off --out /tmp/nf4_old.json)
    python benchmarks/scripts/kernel_totals.py --compare /tmp/nf4_old.json /tmp/nf4_new.json

The checkpoint folder must exist (`fastft bench step` saves it on its first run). `--adapter-copies` and
`--dh-slice-mib` set fastft's two speed-for-memory switches as `fastft bench step`'s do; a commit older than
them ignores both, which is also why this script defines its options itself rather than importing fastft's.
Kernels inside a replayed CUDA graph may not reach the profiler: compare ``--cuda-graph off`` runs, the same
device work launched eagerly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_FOLDER = "/dev/shm/fastft-bench-step/meta-llama--Llama-3.1-8B-Instruct-all-layers"


def kernel_rows(profile, device: bool) -> list[dict]:
    """``[{name, count, total_ms}]`` from a finished ``torch.profiler.profile``, longest first: device kernels
    by their device time when `device`, else operators by their own CPU time."""
    rows = []
    for event in profile.key_averages():
        if device:
            total = getattr(event, "self_device_time_total", None)
            if total is None:  # torch < 2.4
                total = event.self_cuda_time_total
        else:
            total = event.self_cpu_time_total
        if total > 0:
            rows.append({"name": event.key, "count": int(event.count), "total_ms": total / 1000})
    return sorted(rows, key=lambda row: -row["total_ms"])


def compare(before: dict, after: dict, top: int = 25) -> list[dict]:
    """The kernels whose total time moved most between two runs of this script (after - before), by name."""
    old = {row["name"]: row for row in before["kernels"]}
    new = {row["name"]: row for row in after["kernels"]}
    moved = []
    for name in old.keys() | new.keys():
        a, b = old.get(name, {"count": 0, "total_ms": 0.0}), new.get(name, {"count": 0, "total_ms": 0.0})
        moved.append(
            {
                "name": name,
                "count_before": a["count"],
                "count_after": b["count"],
                "ms_before": a["total_ms"],
                "ms_after": b["total_ms"],
                "delta_ms": b["total_ms"] - a["total_ms"],
            }
        )
    return sorted(moved, key=lambda row: -abs(row["delta_ms"]))[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--folder", default=DEFAULT_FOLDER, help="the saved random checkpoint")
    parser.add_argument("--system", default="fastft")
    parser.add_argument("--workload", default="nf4:2x2048", help="PRECISION:BATCHxSEQ")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--checkpointing", default="auto")
    parser.add_argument("--lora-targets", default="all")
    parser.add_argument("--cuda-graph", default="off", choices=("on", "off"))
    parser.add_argument("--keep-attention", default="auto")
    parser.add_argument(
        "--adapter-copies", default=None, choices=("on", "off"), help="as fastft bench step's"
    )
    parser.add_argument("--dh-slice-mib", type=int, default=None, help="as fastft bench step's")
    parser.add_argument("--top", type=int, default=30, help="rows printed")
    parser.add_argument("--out", default=None, help="JSON with every kernel")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two --out files to diff")
    args = parser.parse_args(argv)

    if args.compare:
        before, after = (json.loads(Path(path).read_text(encoding="utf-8")) for path in args.compare)
        print("| kernel | launches before | after | ms before | after | after - before |")
        print("| --- | --- | --- | --- | --- | --- |")
        for row in compare(before, after, args.top):
            print(
                f"| {row['name'][:90]} | {row['count_before']} | {row['count_after']} | {row['ms_before']:.2f} "
                f"| {row['ms_after']:.2f} | {row['delta_ms']:+.2f} |"
            )
        return 0

    sys.path.insert(0, os.getcwd())  # the fastft of the current directory (an archived commit, say)
    from torch.profiler import ProfilerActivity, profile

    from fastft.bench.step import run_worker

    worker = argparse.Namespace(
        system=args.system,
        workload=args.workload,
        attention=args.attention,
        folder=args.folder,
        warmup=args.warmup,
        steps=args.steps,
        peak_flops=776e12,
        device=args.device,
        checkpointing=args.checkpointing,
        lora_targets=args.lora_targets,
        cuda_graph=args.cuda_graph,
        keep_attention=args.keep_attention,
        adapter_copies=args.adapter_copies,  # an older commit's worker ignores the two switches
        dh_slice_mib=args.dh_slice_mib,
    )
    device = args.device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CUDA] if device else [ProfilerActivity.CPU]) as recorded:
        result = run_worker(worker)
    kernels = kernel_rows(recorded, device)
    import fastft

    report = {
        "fastft": os.path.dirname(fastft.__file__),
        "worker": vars(worker),
        "step": {key: result.get(key) for key in ("tokens_per_s", "step_ms", "peak_gib")},
        "kernels": kernels,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1), encoding="utf-8")
    total = sum(row["total_ms"] for row in kernels)
    print(
        f"{report['fastft']}: {result.get('tokens_per_s', 0):,.0f} tokens/s, {total:,.1f} ms in {len(kernels)} kernels"
    )
    for row in kernels[: args.top]:
        print(f"{row['total_ms']:10.2f} ms {row['count']:7d}x  {row['name'][:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

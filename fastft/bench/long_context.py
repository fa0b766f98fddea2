"""`fastft bench long-context`: the longest sequence that trains two full steps under a memory cap, its
speed, `max_context`'s answer beside it, and what holds the device memory at the peak.

Protocol (issue 24's): a catalog architecture with random weights (Llama-3.1-8B by default), NF4 with
double quantisation, LoRA r=32 alpha=32 on the seven projections, batch 1 x L random tokens (all trained),
AdamW, fastft's checkpointing "auto" (offload at these lengths). The cap is
``torch.cuda.set_per_process_memory_fraction`` (24 GiB by default, standing in for an RTX 4090). A length
counts only if `--steps` (2) full steps complete; tokens/s is the last step's.

`--gpu NAME` stands in for a preset card (`fastft.vram.GPUS`, e.g. "t4"): the cap is what that card leaves
PyTorch's allocator (its memory less its CUDA context, `GpuSpec.usable_bytes`: a T4's 15,095 MiB less 512),
the compute dtype fp16 where the card has no bf16, and the prediction is `max_context(model, NAME)` itself,
so the length trained is the card's answer. The answer depends on the host too: offloading pins the layer
inputs in host memory, and where this host cannot pin them all (`host_memory="auto"`), some layers recompute
instead and the answer is shorter (Llama-3.1-8B QLoRA on a T4: 65,536 asked with 16 GiB to pin, 69,632 with
96 GiB); ``host_pinnable_gib`` records this host's.

Trials, in order: each of `--lengths`; then `max_context`'s prediction for the cap (which must train), and
the prediction + 5 % (whether it trains says if the prediction is within 5 % of the longest length that
trains). `--snapshot L` records one step at L with ``torch.cuda.memory._record_memory_history`` and reports
the tensors alive at that step's peak, grouped by the fastft (or torch) line that allocated them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from fastft.atomic import write_text_atomically
from fastft.bench.common import environment
from fastft.models.random_model import split_precision
from fastft.vram.measure import TrainingProbe, is_out_of_memory

# Function-local imports: tests replace these names on their modules, so they are looked up when called.

GiB = 2**30


def live_at_peak(trace: list[dict], top: int = 20) -> dict:
    """Replays one device's allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``): the
    allocations alive when the traced bytes peaked, grouped by the first frame in fastft (else the first
    frame), largest first. A trace that ran out of memory is read up to that request, which counts as
    alive (``out_of_memory`` gives its size). Only what was allocated while recording counts (weights and
    optimizer states made before are outside)."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    oom = None
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            live[addr] = (size, _site(event.get("frames") or []))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_requested" and addr in live:
            total -= live.pop(addr)[0]
        elif action == "oom":
            # the request that ran out counts as alive: the picture is the one at the failure
            oom = {"request_bytes": size, "device_free_bytes": int(event.get("device_free", 0))}
            live[-1] = (size, "(the request that ran out of memory) " + _site(event.get("frames") or []))
            peak, at_peak = total + size, dict(live)
            break
    groups: dict[str, list[int]] = defaultdict(list)
    for size, site in at_peak.values():
        groups[site].append(size)
    rows = sorted(
        ({"site": site, "bytes": sum(sizes), "tensors": len(sizes)} for site, sizes in groups.items()),
        key=lambda row: -row["bytes"],
    )
    result = {"peak_bytes": peak, "sites": rows[:top], "other_bytes": sum(r["bytes"] for r in rows[top:])}
    if oom is not None:
        result["out_of_memory"] = oom
    return result


_RECORDING: StepRecording | None = None  # the recording whose step is running (`_on_out_of_memory`)
_OBSERVING = False  # whether `_on_out_of_memory` is attached (once per process: observers cannot be removed)


def _on_out_of_memory(device: int, requested: int, device_allocated: int, device_free: int) -> None:
    """The allocator's out-of-memory observer: the running recording's segments as they are at the failure,
    before the error unwinds the step and frees its tensors (what `StepRecording.stop` would read)."""
    recording = _RECORDING
    if recording is not None and recording.at_out_of_memory is None:
        segments = torch.cuda.memory._snapshot().get("segments") or []
        recording.at_out_of_memory = segment_summary(segments, device)


class StepRecording:
    """The CUDA allocator's history between `start` and `stop`, reduced to the tensors alive at its peak
    (`live_at_peak`): ``live``. Only what is allocated while recording counts. If the step runs out of memory,
    ``live["segments_at_out_of_memory"]`` holds the allocator's segments at that moment (`segment_summary`);
    ``live["segments"]`` are read at `stop`, after the error unwound the step."""

    def __init__(self, device: torch.device):
        self.device, self.live, self.resident = device, None, None
        self.at_out_of_memory: dict | None = None

    def start(self, model: torch.nn.Module | None = None, optimizer=None) -> None:
        """Start recording; with `model` (and its `optimizer`), first itemise what the device holds before the
        step (``resident``: `fastft.vram.measure.resident_memory`), which the recording does not see."""
        torch.cuda.synchronize(self.device)
        if model is not None:
            from fastft.vram.measure import resident_memory

            self.resident = resident_memory(model, optimizer, self.device)
        global _RECORDING, _OBSERVING
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if not _OBSERVING and attach is not None:
            attach(_on_out_of_memory)
            _OBSERVING = True
        self.at_out_of_memory = None
        _RECORDING = self
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python", context="alloc")

    def stop(self) -> None:
        global _RECORDING
        _RECORDING = None
        torch.cuda.synchronize(self.device)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        traces = snapshot.get("device_traces") or [[]]
        self.live = live_at_peak(traces[self.device.index or 0])
        self.live["segments"] = segment_summary(snapshot.get("segments") or [], self.device.index or 0)
        if self.at_out_of_memory is not None:
            self.live["segments_at_out_of_memory"] = self.at_out_of_memory
        if self.resident is not None:
            self.live["resident_before"] = self.resident


def segment_summary(segments: list[dict], device: int = 0, top: int = 8) -> dict:
    """The caching allocator's segments (``torch.cuda.memory._snapshot()["segments"]``): what is reserved,
    what of it is free, the largest free block, and the segments holding the most free bytes, each as its
    blocks in address order (MiB, ``+`` allocated, ``-`` free). Read by the out-of-memory observer, it is the
    fragmentation a failed request ran into; read when a recording stops after a failure, the step's tensors
    the error unwound are free already (2026-12-06: Qwen2.5-1.5B's "free" 310 MiB segments)."""
    mine = [seg for seg in segments if seg.get("device", device) == device]
    free_blocks = [
        int(block["size"])
        for seg in mine
        for block in seg.get("blocks", [])
        if block.get("state") == "inactive"
    ]

    def layout(seg: dict) -> str:
        return " ".join(
            ("-" if block.get("state") == "inactive" else "+") + f"{int(block['size']) / 2**20:.0f}"
            for block in seg.get("blocks", [])
        )

    def free_of(seg: dict) -> int:
        return sum(int(b["size"]) for b in seg.get("blocks", []) if b.get("state") == "inactive")

    most_free = sorted(mine, key=free_of, reverse=True)[:top]
    return {
        "reserved_bytes": sum(int(seg.get("total_size", 0)) for seg in mine),
        "allocated_bytes": sum(int(seg.get("allocated_size", 0)) for seg in mine),
        "free_bytes": sum(free_blocks),
        "largest_free_block_bytes": max(free_blocks, default=0),
        "segments": len(mine),
        "most_free": [
            {
                "stream": seg.get("stream"),
                "size_mib": int(seg.get("total_size", 0)) / 2**20,
                "blocks": layout(seg),
            }
            for seg in most_free
            if free_of(seg)
        ],
    }


def _site(frames: list[dict]) -> str:
    for frame in frames:
        name = frame.get("filename", "")
        if "/fastft/" in name or "/kernels/" in name:
            return (
                f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.get('line')} {frame.get('name')}"
            )
    # elsewhere (Unsloth, PEFT, transformers, TRL): the innermost frame outside torch
    outside = [f for f in frames if "/torch/" not in f.get("filename", "")] or frames
    if outside:
        frame = outside[0]
        return f"{frame.get('filename', '?').rsplit('/', 1)[-1]}:{frame.get('line')} {frame.get('name')}"
    return "?"


def stand_in(precision: str, cap_gib: float | None, card: str | None):
    """``(gpu, cap_bytes, precision)`` of a run: the `GpuSpec` the estimate is asked for, the allocator cap and
    the precision trained. With `card` (a preset name): the card itself, its usable bytes as the cap, and fp16
    compute where it has no bf16 ("nf4" becomes "nf4-fp16"); else a `capped_gpu` of `cap_gib` (24 GiB when
    None) that computes in bf16 unless `precision` says fp16."""
    from fastft.vram import capped_gpu, get_gpu

    base, compute = split_precision(precision)
    if card is None:
        cap = int((24.0 if cap_gib is None else cap_gib) * GiB)
        # "nf4-fp16": a card without bf16 (a T4) computes in fp16; the estimate is asked for such a card
        return dataclasses.replace(capped_gpu(cap), bf16=compute != torch.float16), cap, precision
    if cap_gib is not None:
        raise ValueError(
            f"--gpu {card} sets the cap to what that card leaves the allocator; leave out --cap-gib {cap_gib:g} "
            "(or leave out --gpu to cap at any size)."
        )
    gpu = get_gpu(card)
    if not gpu.bf16 and compute == torch.bfloat16:  # a card without bf16 computes in fp16
        precision = "fp16" if base == "bf16" else f"{base}-fp16"
    return gpu, gpu.usable_bytes, precision


def run(
    model: str,
    precision: str,
    lora_r: int,
    cap_gib: float | None,
    lengths: list[int],
    steps: int,
    snapshot: int | None,
    check_prediction: bool,
    granularity: int,
    save=None,
    card: str | None = None,
) -> dict:
    """The trials; `save(result)` (if given) runs after each, so a call cut by its time limit keeps what
    it measured. `card`: a preset the run stands in for (`stand_in`), which sets the cap."""
    from fastft.runtime.host_memory import pinnable_bytes
    from fastft.vram import estimate_vram, max_context

    gpu, cap, precision = stand_in(precision, cap_gib, card)
    trained_precision = precision
    precision = split_precision(precision)[0]
    predicted = max_context(
        model, gpu, precision=precision, lora_r=lora_r, checkpointing="auto", multiple_of=granularity
    )
    result = {
        "environment": environment(),
        "model": model,
        "precision": trained_precision,
        "lora_r": lora_r,
        "cap_gib": cap / GiB,
        "gpu": card,
        "host_pinnable_gib": pinnable_bytes(0, None) / GiB,
        "predicted": predicted,
        "trials": [],
    }
    probe = TrainingProbe(model, trained_precision, lora_r, "all-linear", "auto")
    result["free_in_pinned_segments_after_setup_gib"] = probe.setup_pinned_free / GiB
    total = torch.cuda.get_device_properties(probe.device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), probe.device)

    def trial(length: int, record: bool = False) -> dict:
        estimate = estimate_vram(
            model, length, gpu=gpu, precision=precision, lora_r=lora_r, checkpointing="auto"
        )
        row = {"length": length, "estimated_gib": estimate.allocated_bytes / GiB, "steps": []}
        for index in range(steps):
            gc.collect()
            torch.cuda.empty_cache()
            recording = StepRecording(probe.device) if record and index == 0 else None
            if recording is not None:
                recording.start()
            try:
                memory = probe.step(length)
            except RuntimeError as error:
                if not is_out_of_memory(error):
                    raise
                row.update(trained=False, failed_step=index + 1)
                break
            finally:
                if recording is not None:
                    recording.stop()
                    row["live_at_peak"] = recording.live
            row["steps"].append(
                {
                    "seconds": memory.seconds,
                    "peak_gib": memory.peak / GiB,
                    "reserved_gib": memory.reserved / GiB,
                }
            )
        else:
            row.update(trained=True, tokens_per_s=length / row["steps"][-1]["seconds"])
        print(json.dumps({k: v for k, v in row.items() if k != "live_at_peak"}), flush=True)
        result["trials"].append(row)
        if save is not None:
            save(result)
        return row

    try:
        if snapshot:
            trial(snapshot, record=True)
        for length in lengths:
            trial(length)
        if check_prediction and predicted:
            result["prediction_trains"] = trial(predicted)["trained"]
            above = (predicted * 105 // 100 + granularity - 1) // granularity * granularity
            result["above_5pct"] = above
            result["above_5pct_trains"] = trial(above)["trained"]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, probe.device)
        probe.close()
    return result


def report(result: dict) -> str:
    lines = [
        f"{result['model']} {result['precision']} LoRA r={result['lora_r']}, cap {result['cap_gib']:g} GiB"
        + (f" (a {result['gpu']}'s allocator room)" if result.get("gpu") else "")
        + f": max_context predicts {result['predicted']:,}",
        "",
        "| length | trains 2 steps | tokens/s | peak GiB (allocated) | estimated GiB |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in result["trials"]:
        peak = max((s["peak_gib"] for s in row["steps"]), default=None)
        trained = "yes" if row.get("trained") else f"no (OOM in step {row.get('failed_step')})"
        lines.append(
            f"| {row['length']:,} | {trained} "
            f"| {row.get('tokens_per_s', 0):,.0f} | {'' if peak is None else f'{peak:.2f}'} "
            f"| {row['estimated_gib']:.2f} |"
        )
        if "live_at_peak" in row:
            live = row["live_at_peak"]
            lines.append(
                f"|  live at the peak of step 1 ({live['peak_bytes'] / GiB:.2f} GiB traced): | | | | |"
            )
            for site in live["sites"][:12]:
                lines.append(f"|  {site['site']} | {site['tensors']} | | {site['bytes'] / GiB:.2f} | |")
            for key, when in (
                ("segments_at_out_of_memory", "at the out-of-memory"),
                ("segments", "when it stopped"),
            ):
                segments = live.get(key)
                if segments:
                    lines.append(
                        f"|  allocator {when}: {segments['reserved_bytes'] / GiB:.2f} GiB reserved in "
                        f"{segments['segments']} segments, {segments['free_bytes'] / GiB:.2f} GiB of it free, "
                        f"the largest free block {segments['largest_free_block_bytes'] / GiB:.2f} GiB | | | | |"
                    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fastft bench long-context",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    parser.add_argument(
        "--precision",
        default="nf4",
        help="nf4, int8, bf16, fp16; nf4-fp16: NF4 computed in fp16 (a T4's way)",
    )
    parser.add_argument("--lora-r", type=int, default=32)
    parser.add_argument("--cap-gib", type=float, default=None, help="allocator cap (default 24 GiB)")
    parser.add_argument(
        "--gpu",
        default=None,
        help="stand in for a preset card (t4, rtx4090, ...): its allocator room, its dtype",
    )
    parser.add_argument("--lengths", type=int, nargs="*", default=[131072], help="lengths to try first")
    parser.add_argument("--steps", type=int, default=2, help="full steps a length must complete")
    parser.add_argument(
        "--snapshot", type=int, default=None, help="record the memory of one step at this length"
    )
    parser.add_argument(
        "--no-prediction", action="store_true", help="skip max_context's prediction and +5 %%"
    )
    parser.add_argument("--granularity", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the cap is a CUDA allocator fraction)")
    started = time.perf_counter()

    def save(result: dict) -> None:
        if args.json:
            write_text_atomically(Path(args.json), json.dumps(result, indent=1))

    result = run(
        args.model,
        args.precision,
        args.lora_r,
        args.cap_gib,
        args.lengths,
        args.steps,
        args.snapshot,
        not args.no_prediction,
        args.granularity,
        save,
        card=args.gpu,
    )
    result["seconds"] = time.perf_counter() - started
    print(report(result))
    save(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

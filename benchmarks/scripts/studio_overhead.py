"""What the studio's Run tab costs per training step over `fastft.train` in a script (issue #25: at most 5 %).

Both ways run in one real Jupyter kernel (jupyter_client, no browser attached): the same tiny-llama LoRA, the
same packed rows, the same seed and steps. "script": ``fastft.train(...)`` on the kernel's main thread with
its progress bar. "studio": a `RunPanel` of the same settings, training on its background thread while its
ticker moves the events into the live plots (FigureWidget updates sent over the kernel's iopub, as in
JupyterLab), the progress line and the step-timing chart. Runs are interleaved (script, studio, script, …) so
the machine's load falls on both alike; each run's figure is the median `StepEvent.step_seconds` of its steps
after the first two (allocation, warm-up), and the median whole run by the wall clock (from start to the
last event shown, so the work between steps counts too).

    python benchmarks/scripts/studio_overhead.py [--steps 40] [--repeats 5] [--live widget] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

SETUP = """
import statistics, time
import fastft
from fastft.studio.run import RunPanel
from fastft.studio.state import StudioState

SEQ = 128
_, _tokenizer = fastft.load_model("tiny-llama", max_seq_length=SEQ)
_rows = fastft.load_dataset("bundled:skills").select(range(400))
DATA = fastft.pack(_rows, _tokenizer, SEQ)

def fresh():
    model, tokenizer = fastft.load_model("tiny-llama", max_seq_length=SEQ)
    return fastft.add_lora(model, r=8, alpha=16, seed=5), tokenizer

def median_step(events):
    steps = [e.step_seconds for e in events if hasattr(e, "step_seconds")][2:]
    return statistics.median(steps)

def script(steps):
    model, tokenizer = fresh()
    started = time.perf_counter()
    result = fastft.train(model, tokenizer, DATA, max_steps=steps, learning_rate=2e-4, output_dir=None)
    return median_step(result.steps), time.perf_counter() - started

def studio(steps, live):
    model, tokenizer = fresh()
    state = StudioState(model_name="tiny-llama", model=model, tokenizer=tokenizer, packed=DATA)
    panel = RunPanel(state, live=live)
    panel.steps.value = steps
    panel.learning_rate.value = 2e-4
    panel.output_dir.value = ""
    started = time.perf_counter()
    panel.start()
    panel.wait()
    seconds = time.perf_counter() - started
    assert panel.run.error is None, panel.run.error_message
    assert len(panel.series) == steps  # the plots did receive every step
    panel.close()
    return median_step(panel.run.events), seconds
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--live", default="widget", choices=("widget", "display", "auto"))
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads of the kernel")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("TRITON_INTERPRET", None)  # the plain-PyTorch paths, as a CPU user's notebook takes
    # One intra-op thread for every thread of the kernel: torch's thread count is per calling thread, and on a
    # busy machine a main-thread run at two threads is several times slower than a worker thread's run (see
    # the report), which would measure thread scheduling instead of the studio's own work.
    env.setdefault("OMP_NUM_THREADS", str(args.threads))
    env.setdefault("MKL_NUM_THREADS", str(args.threads))
    manager, client = start_new_kernel(kernel_name="python3", env=env)
    try:
        _run(client, SETUP)
        runs: dict[str, list[tuple[float, float]]] = {"script": [], "studio": []}
        for repeat in range(args.repeats):
            for way in ("script", "studio") if repeat % 2 == 0 else ("studio", "script"):
                call = f"script({args.steps})" if way == "script" else f"studio({args.steps}, {args.live!r})"
                median, seconds = _run(client, f"print(repr({call}))", value=True)
                runs[way].append((median, seconds))
                print(
                    f"repeat {repeat + 1} {way:6s}: median step {median * 1000:7.1f} ms, run {seconds:6.1f} s"
                )
                sys.stdout.flush()
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    script_ms = statistics.median(m for m, _ in runs["script"]) * 1000
    studio_ms = statistics.median(m for m, _ in runs["studio"]) * 1000
    paired = [s[0] / p[0] - 1 for s, p in zip(runs["studio"], runs["script"], strict=True)]
    # the whole run by the wall clock, from start to the last event shown: the work between steps counts too
    script_s = statistics.median(s for _, s in runs["script"])
    studio_s = statistics.median(s for _, s in runs["studio"])
    summary = {
        "steps": args.steps,
        "repeats": args.repeats,
        "live": args.live,
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "script_median_step_ms": round(script_ms, 2),
        "studio_median_step_ms": round(studio_ms, 2),
        "overhead": round(studio_ms / script_ms - 1, 4),
        "paired_overheads": [round(x, 4) for x in paired],
        "script_median_run_s": round(script_s, 3),
        "studio_median_run_s": round(studio_s, 3),
        "wall_overhead": round(studio_s / script_s - 1, 4),
        "runs": runs,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print(
        f"script {script_ms:.1f} ms/step, studio {studio_ms:.1f} ms/step: overhead {summary['overhead']:+.1%} "
        f"(paired per repeat: {', '.join(f'{x:+.1%}' for x in paired)}); whole run {script_s:.2f} s against "
        f"{studio_s:.2f} s: {summary['wall_overhead']:+.1%}"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=1)


def _run(client, code: str, value: bool = False):
    """Execute `code` in the kernel; with `value`, the literal it printed last."""
    reply = client.execute_interactive(code, timeout=900, output_hook=_hook(printed := []))
    if reply["content"]["status"] != "ok":
        raise RuntimeError("\n".join(reply["content"].get("traceback", [])))
    if value:
        import ast

        return ast.literal_eval(printed[-1].strip().splitlines()[-1])
    return None


def _hook(printed: list[str]):
    def hook(message):
        if message["msg_type"] == "stream" and message["content"]["name"] == "stdout":
            printed.append(message["content"]["text"])
        elif message["msg_type"] == "error":
            print("\n".join(message["content"]["traceback"]), file=sys.stderr)

    return hook


if __name__ == "__main__":
    main()

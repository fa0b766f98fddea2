"""Interleaved A/B of `fastft bench step` between two source trees, with the noise beside the difference.

Issue 23 asks that nothing regress against its filing's step figures. Single runs of two commits, one after
the other, cannot answer that at the percent level: on H100s, in two device calls of one session, the same
code read 11,669 and 11,752 NF4 tokens/s, and the filing code 12,648 and 12,764 bf16
(`benchmarks/results/step/llama3.1-8b_bf16+nf4_h100_2026-12-06_variants.json`). This script runs each tree's `fastft bench step` worker
alternately, in ABBA order (before, after, after, before, ...), so that drift in the machine's clocks or
temperature falls on both sides, and reports for every workload:

- each round's ratio after / before, and their median;
- each side's own spread (its slowest run against its fastest): the noise a ratio is read against;
- a verdict: "slower" or "faster" only where the median ratio lies outside the larger of the two spreads,
  else "within noise".

fastft is imported from each tree (``python -m fastft.bench.step`` runs with the tree as its working
directory), so a tree can be a `git archive` of any commit:

    mkdir filing && git archive e9acf47^ | tar -x -C filing
    cp -r filing/kernels filing/fastft/kernels   # trees from before the re-layering kept kernels/ at the top
    python benchmarks/scripts/step_ab.py --before filing --after . --workloads nf4:2x2048,bf16:2x2048 --rounds 3

Arguments after ``--`` go to both sides' `fastft bench step` (``-- --cuda-graph off``). Each run is a fresh
process, so every run loads its model again; the first run saves the random checkpoint both sides reuse. The
record is rewritten after every run, so an A/B cut off by a time limit keeps its complete rounds; a run past
``--timeout`` is killed with the bench's worker processes and named in the record.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIDES = ("before", "after")


def order(rounds: int) -> list[tuple[int, str]]:
    """``(round, side)`` in ABBA order: before, after in even rounds, after, before in odd ones."""
    runs = []
    for round_ in range(rounds):
        sides = SIDES if round_ % 2 == 0 else SIDES[::-1]
        runs.extend((round_, side) for side in sides)
    return runs


def tree_env(tree: Path) -> dict[str, str]:
    """The environment a run of `tree` gets: its fastft first on ``PYTHONPATH``."""
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def import_error(tree: Path) -> str | None:
    """Why `tree`'s fastft cannot run its step bench (its last error line), or None when it imports: checked
    before the first run, so that a tree missing a package fails in seconds, not after the other side's runs."""
    check = (
        "import importlib.util, fastft, fastft.kernels; "
        "print(fastft.__file__, fastft.kernels.__file__, importlib.util.find_spec('fastft.bench.step').origin)"
    )
    done = subprocess.run(
        [sys.executable, "-c", check], cwd=tree, env=tree_env(tree), capture_output=True, text=True
    )
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or [f"rc {done.returncode}"])[-1]
    # an editable install elsewhere can lend a package the tree lacks (``fastft.kernels`` before the re-layering)
    for file in done.stdout.split():
        if not Path(file).resolve().is_relative_to(tree):
            return f"{file} comes from outside the tree"
    return None


def run_side(tree: Path, workloads: str, extra: list[str], timeout: float) -> dict[str, dict]:
    """One `fastft bench step` run of fastft in `tree`: ``{workload: {tokens_per_s, peak_gib}}`` (a failed
    workload carries ``error``)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "step.json"
        command = [sys.executable, "-m", "fastft.bench.step", "--systems", "fastft", "--workloads", workloads]
        command += [*extra, "--out", str(out)]
        # its own session, so that a timeout kills the bench's worker processes too (left running, they
        # would hold the GPU under the next run)
        process = subprocess.Popen(
            command,
            cwd=tree,
            env=tree_env(tree),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return {w: {"error": f"timed out after {timeout:g} s"} for w in workloads.split(",")}
        except BaseException:  # Ctrl-C: its own session does not get the terminal's signal, so end it here
            os.killpg(process.pid, signal.SIGKILL)
            raise
        if process.returncode != 0 or not out.exists():
            tail = (stderr or stdout).strip().splitlines()[-3:]
            return {
                w: {"error": f"rc {process.returncode}: {' | '.join(tail)}"} for w in workloads.split(",")
            }
        results = json.loads(out.read_text())["results"]
    figures = {}
    for result in results:
        if result.get("system") != "fastft":
            continue
        if "error" in result:
            figures[result["workload"]] = {"error": result["error"]}
        else:
            figures[result["workload"]] = {
                "tokens_per_s": result["tokens_per_s"],
                "peak_gib": result["peak_gib"],
            }
    return figures


def summarise(runs: list[dict], workloads: list[str]) -> list[dict]:
    """Per workload: both sides' runs, the rounds' ratios, their median, the sides' spreads and a verdict."""
    rows = []
    for workload in workloads:
        speeds: dict[str, dict[int, float]] = {side: {} for side in SIDES}
        peaks: dict[str, list[float]] = {side: [] for side in SIDES}
        errors = []
        for run in runs:
            figure = run["figures"].get(workload, {"error": "no result"})
            if "error" in figure:
                errors.append(f"{run['side']} round {run['round']}: {figure['error']}")
                continue
            speeds[run["side"]][run["round"]] = figure["tokens_per_s"]
            peaks[run["side"]].append(figure["peak_gib"])
        rounds = sorted(set(speeds["before"]) & set(speeds["after"]))
        row: dict = {"workload": workload, "errors": errors}
        if not rounds:
            rows.append({**row, "verdict": "no complete round"})
            continue
        ratios = [speeds["after"][r] / speeds["before"][r] for r in rounds]
        spreads = {side: max(speeds[side].values()) / min(speeds[side].values()) - 1 for side in SIDES}
        median = statistics.median(ratios)
        noise = max(spreads.values())
        verdict = "within noise"
        if abs(median - 1) > noise:
            verdict = "faster" if median > 1 else "slower"
        row.update(
            {
                "tokens_per_s": {side: [speeds[side][r] for r in sorted(speeds[side])] for side in SIDES},
                "peak_gib": {side: max(peaks[side]) for side in SIDES},
                "ratios": ratios,
                "median_ratio": median,
                "spread": spreads,
                "verdict": verdict
                if len(rounds) > 1
                else verdict + " (one round: no spread to read against)",
            }
        )
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """The summary as markdown (`fastft.bench.common.markdown_table`, from this script's own repository)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from fastft.bench.common import markdown_table

    cells = []
    for row in rows:
        cell = {"workload": row["workload"], "verdict": row["verdict"]}
        if "ratios" in row:
            for side in SIDES:
                cell[side] = ", ".join(f"{v:,.0f}" for v in row["tokens_per_s"][side])
            cell["ratios"] = ", ".join(f"{r:.3f}" for r in row["ratios"])
            cell["median"] = f"{row['median_ratio']:.3f}"
            cell["noise"] = " / ".join(f"{100 * row['spread'][side]:.1f} %" for side in SIDES)
        cells.append(cell)
    columns = [("workload", "workload"), ("before", "before tokens/s"), ("after", "after tokens/s")]
    columns += [("ratios", "ratios after/before"), ("median", "median"), ("noise", "noise (spread)")]
    return markdown_table(cells, [*columns, ("verdict", "verdict")])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="source tree of the reference (holds fastft/)")
    parser.add_argument("--after", default=".", help="source tree under test (default: this one)")
    parser.add_argument("--workloads", default="nf4:2x2048,bf16:2x2048", help="as fastft bench step's")
    parser.add_argument("--rounds", type=int, default=3, help="before/after pairs, in ABBA order")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--out", default="benchmarks/step_ab.json")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give 1 or more")
    trees = {side: Path(getattr(args, side)).resolve() for side in SIDES}
    for side, tree in trees.items():
        if not (tree / "fastft" / "bench" / "step.py").exists():
            parser.error(f"--{side} {tree}: no fastft/bench/step.py there (give a source tree of fastft)")
        problem = import_error(tree)
        if problem:
            parser.error(f"--{side} {tree}: its fastft does not import ({problem}); fix the tree first")
    runs: list[dict] = []
    workloads = args.workloads.split(",")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for round_, side in order(args.rounds):
        print(f"round {round_ + 1}/{args.rounds}: {side} ({trees[side]})", flush=True)
        started = time.monotonic()
        figures = run_side(trees[side], args.workloads, extra, args.timeout)
        seconds = round(time.monotonic() - started, 1)  # what a run costs, to size the next device call
        runs.append({"round": round_, "side": side, "seconds": seconds, "figures": figures})
        for workload, figure in figures.items():
            shown = (
                figure.get("error") or f"{figure['tokens_per_s']:,.0f} tokens/s, {figure['peak_gib']:.2f} GiB"
            )
            print(f"  {workload}: {shown}", flush=True)
        print(f"  ({seconds:.0f} s)", flush=True)
        output = {
            "benchmark": "step_ab",
            "trees": {side: str(tree) for side, tree in trees.items()},
            "bench_step_args": ["--workloads", args.workloads, *extra],
            "runs": runs,
            "summary": summarise(runs, workloads),
        }
        out.write_text(json.dumps(output, indent=2) + "\n")  # after every run: a cut-off A/B keeps its rounds
    print(table(output["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``fastft launch --gpus N script.py [args]``: the script on N processes through PyTorch's own launcher.

A thin wrapper over torchrun (``python -m torch.distributed.run --standalone --nproc_per_node=N``): one machine,
a free rendezvous port picked by torchrun, the script and its arguments passed on unchanged. Inside the script
`fastft.train` finds torchrun's environment and trains one run across the processes
(`fastft.training.distributed`): NCCL on GPUs, gloo on a CPU machine, where ``--gpus 2`` (or its alias
``--nproc 2``) means two CPU processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


class LaunchError(ValueError):
    """The launch cannot start as asked; the message names the fix."""


def torchrun_command(script: str | os.PathLike, args: list[str], processes: int) -> list[str]:
    """The torchrun command line that runs `script` with `args` on `processes` local processes."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        str(script),
        *args,
    ]


def check_launch(script: str | os.PathLike, processes: int) -> None:
    """Refuse a launch that cannot work, before any process starts: a missing script, a process count below 1,
    or more GPUs than this machine has."""
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise LaunchError(f"--gpus {processes!r}: give a whole number of processes, 1 or more.")
    if not Path(script).is_file():
        raise LaunchError(f"{script} is not a file: give the path of the Python script to run on every rank.")
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available and processes > available:
        raise LaunchError(
            f"--gpus {processes}, but this machine has {available} GPU(s): use --gpus {available} or fewer "
            "(each rank needs its own GPU)."
        )


def launch(script: str | os.PathLike, args: list[str] = (), processes: int = 1) -> int:
    """Run `script` on `processes` ranks through torchrun and return its exit status."""
    check_launch(script, processes)
    return subprocess.run(torchrun_command(script, list(args), processes), check=False).returncode

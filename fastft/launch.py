"""``fastft launch --gpus N script.py [args]``: the script on N processes through PyTorch's own launcher.

A thin wrapper over torchrun (``torch.distributed.run``) on one machine: the script and its arguments
passed on unchanged. Inside the script `fastft.train` finds torchrun's environment and trains one run across
the processes (`fastft.training.distributed`): NCCL on GPUs, gloo on a CPU machine, where ``--gpus 2`` (or its
alias ``--nproc 2``) means two CPU processes.

Nothing listens beyond this machine. torchrun's ``--standalone`` puts its rendezvous store (a TCPStore, no
authentication) on every interface: anyone who reaches the port can read and write the run's keys. The
store's server has no bind-address option, so torchrun runs here inside ``python -m fastft.launch``
(`run_torchrun_on_loopback`), where every TCPStore server it starts listens on a socket bound to 127.0.0.1
(the store's own ``master_listen_fd``), with the rendezvous endpoint and the workers' MASTER_ADDR on
127.0.0.1; gloo and NCCL bind their sockets to the loopback interface (``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME``, unless set already). A run over several machines is torchrun's own (``torchrun
--nnodes ...``): it has to open ports to the network, which fastft does not do for the user.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import torch

# Function-local imports: imported after the environment they read is set (environment variables, offline mode).

LOOPBACK = "127.0.0.1"


class LaunchError(ValueError):
    """The launch cannot start as asked; the message names the fix."""


def torchrun_command(script: str | os.PathLike, args: list[str], processes: int) -> list[str]:
    """The command line that runs `script` with `args` on `processes` local processes: torchrun's arguments
    for one machine (``--standalone``'s, with the rendezvous on 127.0.0.1), run through
    ``python -m fastft.launch`` so that nothing it starts listens beyond 127.0.0.1."""
    return [
        sys.executable,
        "-m",
        "fastft.launch",
        "--nnodes=1",
        f"--nproc_per_node={processes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={LOOPBACK}:0",
        f"--rdzv-id={uuid.uuid4()}",
        f"--local-addr={LOOPBACK}",
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


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS), None if none is found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    return next((name for name in names if name in ("lo", "lo0")), None)


# TCPStore's arguments in order (torch.distributed.TCPStore's signature), to read positional ones by name
_STORE_ARGUMENTS = (
    "host_name",
    "port",
    "world_size",
    "is_master",
    "timeout",
    "wait_for_workers",
    "multi_tenant",
    "master_listen_fd",
    "use_libuv",
)


def _loopback_store_class(base):
    """A `torch.distributed.TCPStore` whose server listens on 127.0.0.1 only: the server side gets a socket
    already bound there (``master_listen_fd``), as TCPStore's own documentation describes, instead of binding
    every interface itself."""

    class LoopbackTCPStore(base):
        def __init__(self, *args, **kwargs):
            kwargs.update(zip(_STORE_ARGUMENTS[: len(args)], args, strict=True))
            if kwargs.get("is_master") and kwargs.get("master_listen_fd") is None:
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                listener.bind((LOOPBACK, int(kwargs.get("port") or 0)))
                kwargs["master_listen_fd"] = listener.detach()  # the store owns the socket from here on
                kwargs["host_name"] = LOOPBACK
            super().__init__(**kwargs)

    LoopbackTCPStore.__name__ = LoopbackTCPStore.__qualname__ = "TCPStore"
    return LoopbackTCPStore


def run_torchrun_on_loopback(argv: list[str]) -> None:
    """torchrun's ``main(argv)`` in this process, every TCPStore server it starts bound to 127.0.0.1, and its
    workers' gloo / NCCL sockets on the loopback interface. Only ``python -m fastft.launch`` calls it: the
    TCPStore name is replaced in torch.distributed's modules of this process, which runs nothing else."""
    interface = loopback_interface()
    if interface is not None:
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, interface)
    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401 - holds its own name
    import torch.distributed.run as torchrun

    base = dist.TCPStore
    store = _loopback_store_class(base)
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(module, "TCPStore", None) is base:
            module.TCPStore = store
    torchrun.main(argv)


if __name__ == "__main__":
    run_torchrun_on_loopback(sys.argv[1:])

"""``fastft launch``: on one machine nothing it starts listens beyond 127.0.0.1 (torchrun's ``--standalone``
put its unauthenticated rendezvous store on every interface), and what cannot start is refused before any
process does, naming the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Rank 0 lists, while the process group is up, every listening TCP socket of torchrun's process and its
# children (the ranks): psutil where it is installed, else /proc (each process's socket inodes, matched
# against /proc/net/tcp and tcp6, state 0A = LISTEN).
PROBE = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist

    def tree(root):
        children = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = open(f"/proc/{entry}/stat").read()
                except OSError:
                    continue
                children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry))
        found, todo = [], [root]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += children.get(pid, [])
        return found

    def proc_listening(pids):
        inodes = set()
        for pid in pids:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        found = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in open(table).read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)
                    if len(raw) == 4:
                        host = ".".join(str(b) for b in raw[::-1])
                    else:
                        import socket
                        words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                        host = socket.inet_ntop(socket.AF_INET6, words)
                    found.append([host, int(port, 16)])
        return found

    def listening(root):
        try:
            import psutil
        except ImportError:
            return proc_listening(tree(root))
        found = []
        process = psutil.Process(root)
        for p in [process, *process.children(recursive=True)]:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.append([c.laddr.ip, c.laddr.port])
        return found

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 0:
        agent = os.getppid()
        with open(sys.argv[1], "w") as out:
            json.dump({"agent": listening(agent), "own": listening(os.getpid())}, out)
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_a_one_machine_launch_listens_on_loopback_only(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = tmp_path / "listening.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(variable, None)
    done = subprocess.run(
        [sys.executable, "-m", "fastft", "launch", "--nproc", "2", str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(out.read_text())
    everything, own = found["agent"], found["own"]
    # the rendezvous store in torchrun's process and each rank's gloo listener: something to check
    assert own and len(everything) > len(own), found
    assert all(host in ("127.0.0.1", "::1") for host, _ in everything), everything


def test_launch_refuses_what_cannot_start(tmp_path):
    from fastft.launch import LaunchError, check_launch

    with pytest.raises(LaunchError, match="is not a file"):
        check_launch(tmp_path / "missing.py", 2)
    with pytest.raises(LaunchError, match="is not a file"):
        check_launch(tmp_path, 2)  # a folder
    script = tmp_path / "train.py"
    script.write_text("")
    for processes in (0, -1, 1.5, True, "2"):
        with pytest.raises(LaunchError, match="1 or more"):
            check_launch(script, processes)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "0", "{script}"], "1 or more"),
        (["--gpus", "2", "{missing}"], "is not a file"),
        (["--gpus", "two", "{script}"], "invalid int value: 'two'"),
        ([], "the following arguments are required: script"),
    ],
)
def test_the_cli_names_what_cannot_start(tmp_path, capsys, argv, message):
    from fastft.cli import main

    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('should never run')")
    argv = [a.format(script=script, missing=tmp_path / "missing.py") for a in argv]
    try:
        code = main(["launch", *argv])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_command_keeps_the_rendezvous_on_loopback():
    from fastft.launch import torchrun_command

    command = torchrun_command("train.py", ["--lr", "1e-4"], 4)
    assert command[:3] == [sys.executable, "-m", "fastft.launch"]
    assert "--standalone" not in command  # it binds the store on every interface
    assert "--nproc_per_node=4" in command and "--nnodes=1" in command
    assert "--rdzv-endpoint=127.0.0.1:0" in command and "--local-addr=127.0.0.1" in command
    assert command[-3:] == ["train.py", "--lr", "1e-4"]

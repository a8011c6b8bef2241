"""The two-process torchrun command line shared by the distributed tests (gloo on this CPU)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, *args: str, nproc: int = 2) -> list[str]:
    """argv running ``script args`` on ``nproc`` local processes under torch.distributed.run."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port())]
    return [*launcher, str(script), *args]


def run_logged(cmd: list[str], out: Path, env: dict, timeout_s: float) -> tuple[int, str]:
    """Run ``cmd`` in its own session with its output in ``out/launch.log``; past ``timeout_s`` the
    launcher and every rank it started are killed (a hang fails the test, never stalls it).
    Returns (return code, the log's text)."""
    with open(out / "launch.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    return rc, (out / "launch.log").read_text()

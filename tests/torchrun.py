"""The two-process torchrun command line shared by the distributed tests (gloo on this CPU)."""

from __future__ import annotations

import socket
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

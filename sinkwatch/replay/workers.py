"""Who this replay worker is, whatever launched it (docs/design.md §8): torchrun, srun, a Slurm array, or a plain process.

The index and count give a worker its stride of the manifest's tasks (``run``), its name (records, W&B run), its GPU,
and the plan's split; each launcher says who a process is only in its own variables. The first that matches decides:

- torchrun / ``accelerate launch``: ``RANK`` and ``WORLD_SIZE``;
- ``srun`` inside a Slurm array task: array index x tasks + ``SLURM_PROCID``;
- ``srun -n K`` (or an ``sbatch --ntasks K`` step): ``SLURM_PROCID`` of ``SLURM_NTASKS``;
- a Slurm array (``sbatch --array``): ``SLURM_ARRAY_TASK_ID`` - ``SLURM_ARRAY_TASK_MIN`` of ``SLURM_ARRAY_TASK_COUNT``;
- ``LOCAL_RANK`` alone (a launcher that sets no world size): one worker of an unknown number, said so;
- nothing: one worker.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Worker:
    """One replay worker. ``count`` None: the launcher did not say how many there are."""

    index: int
    count: int | None
    launcher: str  # torchrun | srun | slurm-array | slurm-array+srun | local-rank | single
    host: str
    pid: int
    local_rank: int | None = None

    @property
    def id(self) -> str:
        """Readable: ``srun-1of3.node7.4242``; names the worker's W&B run and its records."""
        of = f"{self.index}of{self.count}" if self.count is not None else f"{self.index}"
        tag = "" if self.launcher == "single" else f"{self.launcher}-{of}."
        return _safe(f"{tag}{self.host}.{self.pid}")

    def describe(self) -> str:
        if self.launcher == "single":
            return "one worker"
        n = f"{self.count}" if self.count is not None else "an unknown number of"
        return f"worker {self.index} of {n} ({self.launcher})"


def detect_worker(env: Mapping[str, str] | None = None) -> Worker:
    """This process as a replay worker, from its launcher's environment variables."""
    env = os.environ if env is None else env
    host, pid = socket.gethostname().split(".")[0] or "host", os.getpid()
    local = _int(env, "LOCAL_RANK")
    if _int(env, "RANK") is not None and _int(env, "WORLD_SIZE") is not None:
        return Worker(_int(env, "RANK"), max(1, _int(env, "WORLD_SIZE")), "torchrun", host, pid, local)
    array_id, procid = _int(env, "SLURM_ARRAY_TASK_ID"), _int(env, "SLURM_PROCID")
    ntasks = _int(env, "SLURM_NTASKS") or _int(env, "SLURM_NPROCS")
    if array_id is not None:
        index = array_id - (_int(env, "SLURM_ARRAY_TASK_MIN") or 0)
        count = _int(env, "SLURM_ARRAY_TASK_COUNT")
        if procid is not None and ntasks and ntasks > 1:  # srun -n K inside each array task
            return Worker(index * ntasks + procid, count * ntasks if count else None, "slurm-array+srun", host, pid, _local(env, local))
        return Worker(index, count, "slurm-array", host, pid, local)
    if procid is not None and ntasks is not None:
        return Worker(procid, max(1, ntasks), "srun", host, pid, _local(env, local))
    if local is not None:
        return Worker(local, None, "local-rank", host, pid, local)
    return Worker(0, 1, "single", host, pid, None)


def _local(env: Mapping[str, str], local: int | None) -> int | None:
    """The task's GPU slot on its node: LOCAL_RANK, else Slurm's SLURM_LOCALID."""
    return local if local is not None else _int(env, "SLURM_LOCALID")


def _int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer: a launcher sets it to one; unset it to run as one worker") from None


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text)


def parse_shard(text: str) -> tuple[int, int]:
    """``--shard K/N``: this worker's stride of the tasks given by hand, where no launcher says it."""
    m = re.fullmatch(r"(\d+)/(\d+)", text.strip())
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"--shard must be K/N with 0 <= K < N, got {text!r}")
    return int(m.group(1)), int(m.group(2))

"""SIGTERM (a Slurm time limit, ``scancel``, preemption) as an exception, so a replay writes its failed rows.

Inside ``terminate_cleanly()`` a SIGTERM raises ``Terminated`` in the main thread: the workers' loop or the per-task
unit writes the failed rows of the task being measured, empties its folder, ends its attempt and leaves with
``exit_terminated`` (status 128 + 15, not waiting for a download thread). Another's handler (Ray's, submitit's) is kept.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator


class Terminated(BaseException):
    """This process got SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name} (a time limit, scancel or preemption)")
        self.signum = signum


@contextlib.contextmanager
def terminate_cleanly() -> Iterator[bool]:
    """Turn SIGTERM into ``Terminated`` while inside; yields whether the handler is ours."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous not in (signal.SIG_DFL, None):
        yield False
        return

    def handler(signum, frame):
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield True
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_terminated(exc: Terminated) -> None:
    """Leave now, as a process killed by the signal would be counted (128 + signum)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + exc.signum)

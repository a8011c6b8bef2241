"""The vocabulary of the rank protocol (``agreement.py``, ``forwards.py``): the codes an agreement
carries, and what a rank raises when a probe cannot go on."""

from __future__ import annotations

from ..probe.memory import ProbeNotReady  # noqa: F401 - the engine's check raises it; the protocol carries its verdict

# How long a rank that faulted inside a collective stretch waits for the other ranks' verdicts, unless
# told otherwise (``LiveConfig.fault_timeout_s``, which says it to every adapter).
FAULT_TIMEOUT_S = 60.0

# The codes of one agreement: every rank must send the same one (FAIL never agrees).
FAIL, DONE, FORWARD, START, COMBINE = 0, 1, 2, 3, 4


class PeerFailed(RuntimeError):
    """Another rank could not go on with this probe; this rank stops it too (no message of its own)."""


class ProbeForwardBroken(RuntimeError):
    """A probe forward failed on this rank while the other ranks are inside that forward's
    collectives: nothing can pair them again, so the run must stop."""


class ProbeFaultEverywhere(RuntimeError):
    """Every rank of the group raised the same fault at the same place of a probe forward (the
    verdict on the c10d store): no collective was left unpaired, so the probe is skipped everywhere
    and training goes on."""

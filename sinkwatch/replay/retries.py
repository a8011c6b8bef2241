"""Hub calls that survive the network (docs/design.md §8): 5xx answers, 429s and dropped, refused or timed-out
connections are retried with exponential backoff and jitter (tenacity); after the retries the call
fails with ``FetchError`` naming what it was, and the replay records that revision failed and goes on.
Used by everything that talks to the hub: listing refs, file metadata, configs, downloads."""

from __future__ import annotations

import warnings
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How often and how patiently a hub call is retried. Waits grow as backoff_s x 2^k (with jitter) up to backoff_max_s."""

    retries: int = 5  # attempts after the first, per hub call
    backoff_s: float = 2.0
    backoff_max_s: float = 120.0

    def __post_init__(self) -> None:
        name = type(self).__name__
        if not isinstance(self.retries, int) or isinstance(self.retries, bool) or self.retries < 0:
            raise ValueError(f"{name}.retries must be an int >= 0, got {self.retries!r}")
        for field_name in ("backoff_s", "backoff_max_s"):
            v = getattr(self, field_name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}.{field_name} must be a number of seconds >= 0, got {v!r}")


class FetchError(RuntimeError):
    """A revision could not be downloaded after the retries."""


# ---- what is transient -------------------------------------------------------------------------------------
def is_transient(exc: BaseException) -> bool:
    """A failure worth retrying: a 5xx or 429 answer, a dropped, refused or timed-out connection —
    anywhere in the exception's chain (huggingface_hub wraps some in LocalEntryNotFoundError)."""
    import httpx

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
        if isinstance(status, int) and (status >= 500 or status == 429):
            return True
        if isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def call_with_retries(fn, config: RetryPolicy, what: str):
    """``fn()`` retried on transient failures (``is_transient``) with exponential backoff and jitter;
    the last failure is raised as ``FetchError`` naming ``what`` and the attempts."""
    import tenacity

    def say(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception()
        warnings.warn(
            f"sinkwatch replay: {what}: {type(exc).__name__}: {_short(exc)}; retry {state.attempt_number} of {config.retries} "
            f"in {state.next_action.sleep:.1f} s",
            RuntimeWarning,
            stacklevel=1,  # tenacity calls this: the line to read is here
        )

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(config.retries + 1),
        # backoff_s x 2^k up to backoff_max_s, plus up to backoff_s of jitter (the same in every tenacity >= 8.2)
        wait=tenacity.wait_exponential(multiplier=config.backoff_s, max=config.backoff_max_s) + tenacity.wait_random(0, config.backoff_s),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=say,
        reraise=True,
    )
    try:
        return retrying(fn)
    except Exception as exc:
        if is_transient(exc):
            raise FetchError(f"{what}: {type(exc).__name__}: {_short(exc)} (after {config.retries + 1} attempts)") from exc
        raise


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:300] if str(exc) else ""

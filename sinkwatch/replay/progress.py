"""The replay progress bar and its status line (tqdm, when enabled)."""

from __future__ import annotations


def _counter(total: int, enabled: bool, model: str):
    """A bar over this worker's revisions, advanced to how many are done in the whole store (None: off)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"replay {model}", unit="rev")


def _status(bar, rev: str, phase: str) -> None:
    if hasattr(bar, "set_postfix_str"):
        bar.set_postfix_str(f"{rev}: {phase}")

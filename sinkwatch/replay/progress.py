"""The replay progress bar and its status line (tqdm, when enabled)."""

from __future__ import annotations


def _progress(items, enabled: bool, model: str):
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"replay {model}", unit="rev")


def _status(bar, rev: str, phase: str) -> None:
    if hasattr(bar, "set_postfix_str"):
        bar.set_postfix_str(f"{rev}: {phase}")

"""The pieces every markdown section writes: numbers as the tables write them (token counts as 6.29B,
short floats, yes/no, a dash for none), a figure's line, and the ``report.md`` file itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return _tokens(v) if abs(v) >= 1e4 else f"{v:.3g}"
    return str(v)


def _tokens(v) -> str:
    """Token counts as people write them: 6.29B, 614K."""
    if v is None:
        return "—"
    v = float(v)
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{unit}"
    return f"{v:.0f}"


def _value(v: Any, has_tokens: bool) -> str:
    """A milestone: tokens (6.29B), or the step when the store's tokens are unknown."""
    if isinstance(v, float) and not has_tokens:
        return f"step {v:.0f}"
    return _fmt(v)


def _image(name: str) -> str:
    """The markdown line that shows the figure ``name`` (a PNG beside ``report.md``)."""
    return f"![{name}]({name})"


def _write_markdown(out: Path, lines: list[str]) -> Path:
    """``out/report.md`` from its lines; returns its path."""
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path

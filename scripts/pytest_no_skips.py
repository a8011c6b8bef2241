"""A pytest plugin for ``scripts/test.sh --system``: there every package the suite uses is installed, so a
skipped test means a missing install step or a broken one. Any skip of a test not marked ``gpu`` (those need
a CUDA device) fails the run, listed with its reason."""

from __future__ import annotations

import pytest

_skipped: list[str] = []


def _reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def pytest_collectreport(report):
    if report.skipped:  # a module-level importorskip: the whole file skipped
        _skipped.append(f"{report.nodeid}: {_reason(report)}")


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail") and "gpu" not in report.keywords:
        _skipped.append(f"{report.nodeid}: {_reason(report)}")


def pytest_sessionfinish(session, exitstatus):
    if _skipped and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _skipped:
        terminalreporter.section("skipped though every package is installed (scripts/test.sh --system)", red=True)
        for line in _skipped:
            terminalreporter.write_line(line)

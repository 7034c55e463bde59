"""Shared pytest fixtures and hooks for the hybridq test suite.

Informative output goes to the terminal summary, once, never between the progress dots: tests hand tables to
the `summary_table` fixture (carried by the test reports, so it also works under pytest-xdist), and the
round-trip rows to `roundtrip_report`. Tests skipped for want of a CUDA device are summarised in one line;
other skips are listed one by one.
"""

from __future__ import annotations

import pytest

_ROUNDTRIP_ROWS = pytest.StashKey[list]()
_TABLE_PROPERTY = "hybridq_summary_table"


@pytest.fixture(scope="session")
def roundtrip_report(pytestconfig):
    """A list to append (format, direction, relative error, bound) rows to; printed in the terminal summary
    so round-trip errors show in CI output and can be compared over time."""
    return pytestconfig.stash.setdefault(_ROUNDTRIP_ROWS, [])


@pytest.fixture
def summary_table(request):
    """`summary_table(title, text)`: print `text` under `title` in the terminal summary."""
    def add(title: str, text: str) -> None:
        request.node.user_properties.append((_TABLE_PROPERTY, (title, text)))
    return add


def _is_gpu_skip(report) -> bool:
    reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return "gpu" in report.keywords or "CUDA" in reason


def _skip_line(report) -> str:
    if isinstance(report.longrepr, tuple):
        path, line, reason = report.longrepr
        return f"SKIPPED {report.nodeid} ({path}:{line}): {reason.removeprefix('Skipped: ')}"
    return f"SKIPPED {report.nodeid}: {report.longrepr}"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    tables: dict[str, str] = {}
    for reports in tr.stats.values():
        for rep in reports:
            for name, value in getattr(rep, "user_properties", ()):
                if name == _TABLE_PROPERTY:
                    title, text = value
                    tables[title] = text
    for title, text in tables.items():
        tr.section(title)
        for line in text.splitlines():
            tr.write_line(line)

    rows = config.stash.get(_ROUNDTRIP_ROWS, [])
    if rows:
        tr.section("round-trip relative error ||dq(q(x)) - x|| / ||x||  (x ~ N(0,1), 256x512, seed 0)")
        tr.write_line(f"{'format':<22} {'direction':<11} {'rel. error':>11} {'bound':>8}")
        for fmt, direction, err, bound in sorted(rows):
            tr.write_line(f"{fmt:<22} {direction:<11} {err:>11.6f} {bound:>8.4f}")

    skipped = [r for r in tr.stats.get("skipped", []) if getattr(r, "skipped", False)]
    gpu = [r for r in skipped if _is_gpu_skip(r)]
    others = [r for r in skipped if not _is_gpu_skip(r)]
    if gpu or others:
        tr.section("skipped")
        if gpu:
            tr.write_line(f"{len(gpu)} GPU tests skipped (no CUDA device, not enough of them, or no built extension)")
        for r in others:
            tr.write_line(_skip_line(r))

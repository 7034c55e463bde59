"""Shared pytest fixtures and hooks for the hybridq test suite.

Informative output goes to a file, never between the progress dots: tests hand tables to the `summary_table`
fixture (carried by the test reports, so it also works under pytest-xdist) and the round-trip rows to
`roundtrip_report`; at the end the tables and every skipped test with its reason are written to
.pytest_cache/d/hybridq/test-report.txt, and the terminal gets two lines: the skip counts and that path.
"""

from __future__ import annotations

import pathlib
import tempfile

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


def _report_lines(tr, config) -> list[str]:
    """The informative tables tests handed in, the round-trip errors and the skipped tests, as text lines."""
    lines: list[str] = []
    tables: dict[str, str] = {}
    for reports in tr.stats.values():
        for rep in reports:
            for name, value in getattr(rep, "user_properties", ()):
                if name == _TABLE_PROPERTY:
                    title, text = value
                    tables[title] = text
    for title, text in tables.items():
        lines += [f"== {title}", *text.splitlines(), ""]

    rows = config.stash.get(_ROUNDTRIP_ROWS, [])
    if rows:
        lines.append("== round-trip relative error ||dq(q(x)) - x|| / ||x||  (x ~ N(0,1), 256x512, seed 0)")
        lines.append(f"{'format':<22} {'direction':<11} {'rel. error':>11} {'bound':>8}")
        lines += [f"{fmt:<22} {direction:<11} {err:>11.6f} {bound:>8.4f}" for fmt, direction, err, bound in sorted(rows)]
        lines.append("")

    skipped = [r for r in tr.stats.get("skipped", []) if getattr(r, "skipped", False)]
    if skipped:
        lines.append("== skipped")
        lines += [_skip_line(r) for r in skipped]
    return lines


def _report_path(config) -> pathlib.Path:
    # .pytest_cache/d/hybridq (pytest's cache folder ignores itself in git); no cache under -p no:cacheprovider
    if getattr(config, "cache", None) is not None:
        return config.cache.mkdir("hybridq") / "test-report.txt"
    return pathlib.Path(tempfile.gettempdir()) / "hybridq-test-report.txt"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Two lines at most after the dots: the skips in one line, and where the tables and skip reasons went."""
    tr = terminalreporter
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    lines = _report_lines(tr, config)
    if not lines:
        return
    path = _report_path(config)
    path.write_text("\n".join(lines) + "\n")
    skipped = [r for r in tr.stats.get("skipped", []) if getattr(r, "skipped", False)]
    gpu = sum(_is_gpu_skip(r) for r in skipped)
    if skipped:
        tr.write_line(f"hybridq: {len(skipped)} skipped ({gpu} need a CUDA device, more GPUs or the built extension; "
                      f"{len(skipped) - gpu} other)")
    tr.write_line(f"hybridq: the tests' tables and every skip reason: {path}")


def pytest_sessionfinish(session, exitstatus):
    """The distributed tests' pooled ranks (tests/distributed/_pool.py) leave with the session."""
    import sys
    pool = sys.modules.get("_pool")
    if pool is not None:
        pool.close_all()

"""Shared pytest fixtures and hooks for the hybridq test suite."""

from __future__ import annotations

import pytest

_ROUNDTRIP_ROWS = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def roundtrip_report(pytestconfig):
    """A list to append (format, direction, relative error, bound) rows to; printed in the terminal summary
    so round-trip errors show in CI output and can be compared over time."""
    return pytestconfig.stash.setdefault(_ROUNDTRIP_ROWS, [])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    rows = config.stash.get(_ROUNDTRIP_ROWS, [])
    if not rows:
        return
    tr = terminalreporter
    tr.section("round-trip relative error ||dq(q(x)) - x|| / ||x||  (x ~ N(0,1), 256x512, seed 0)")
    tr.write_line(f"{'format':<22} {'direction':<11} {'rel. error':>11} {'bound':>8}")
    for fmt, direction, err, bound in sorted(rows):
        tr.write_line(f"{fmt:<22} {direction:<11} {err:>11.6f} {bound:>8.4f}")

"""hybridq's on/off switches (hybridq/switches.py): one mechanism for the alternative paths kept for A/B runs and
bitwise comparisons -- read from the environment at import, changed with `set`, every one documented."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import hybridq.distributed.grouped_blocks_batched  # noqa: F401 (the modules that hold switches)
import hybridq.distributed.grouped_blocks_payload  # noqa: F401
import hybridq.distributed.unit_cast  # noqa: F401
import hybridq.kernels.grouped_blocks  # noqa: F401
import hybridq.kernels.grouped_emulated  # noqa: F401
import hybridq.kernels.grouped_slots  # noqa: F401
import hybridq.nn.float8_graph  # noqa: F401
from hybridq.switches import Switch, switches

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
EXPECTED = {"HYBRIDQ_GROUPED_BLOCK_CUBLAS", "HYBRIDQ_GROUPED_BLOCK_GEMM", "HYBRIDQ_GROUPED_EMULATED_GEMM",
            "HYBRIDQ_GROUPED_SLOT_QUANTIZE", "HYBRIDQ_LINEAR_CPP_OPS", "HYBRIDQ_STACKED_BLOCK_GATHER",
            "HYBRIDQ_STACKED_BLOCK_PAYLOAD", "HYBRIDQ_UNIT_CAST"}


def test_every_switch_is_registered_and_named_in_the_docs():
    found = set(switches())
    assert EXPECTED <= found, f"switches not registered: {sorted(EXPECTED - found)}"
    text = "\n".join(p.read_text() for p in DOCS.glob("*.md"))
    undocumented = sorted(env for env in found if env not in text)
    assert not undocumented, f"switches no page in docs/ names: {undocumented}"


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False)])
def test_a_switch_reads_its_environment_variable_at_import(value, on):
    env = {k: v for k, v in __import__("os").environ.items() if k != "HYBRIDQ_UNIT_CAST"}
    if value is not None:
        env["HYBRIDQ_UNIT_CAST"] = value
    code = "from hybridq.distributed import unit_cast; print(unit_cast.unit_cast_enabled())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(on), f"HYBRIDQ_UNIT_CAST={value!r}: the switch is {out.strip()}, expected {on}"


def test_set_changes_the_switch_and_returns_the_previous_setting():
    s = next(iter(switches().values()))
    was = s["on"]
    try:
        assert s.set(not was) is was and s["on"] is (not was) and s.on is (not was)
        assert s.set(was) is (not was) and s["on"] is was
    finally:
        s["on"] = was
    assert isinstance(s, Switch) and s.env in repr(s)

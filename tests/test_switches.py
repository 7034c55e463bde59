"""hybridq's on/off switches (hybridq/switches.py): one mechanism for the alternative paths kept for A/B runs and
bitwise comparisons -- read from the environment at import, changed with `set` / `turned`, every one
documented."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import hybridq.distributed.grouped_blocks_batched  # noqa: F401 (the modules that hold switches)
import hybridq.distributed.grouped_blocks_payload  # noqa: F401
import hybridq.distributed.grouped_fast  # noqa: F401
import hybridq.distributed.unit_cast  # noqa: F401
import hybridq.kernels.grouped_blocks  # noqa: F401
import hybridq.kernels.grouped_emulated  # noqa: F401
import hybridq.kernels.grouped_slots  # noqa: F401
import hybridq.kernels.native_gemm  # noqa: F401
import hybridq.kernels.triton_launch  # noqa: F401
import hybridq.kernels.triton_slot_layout  # noqa: F401
import hybridq.kernels.triton_tile_payload  # noqa: F401
import hybridq.nn.compiled_linear  # noqa: F401
import hybridq.nn.float8_graph  # noqa: F401
import hybridq.nn.linear_function  # noqa: F401
from hybridq.switches import Switch, switches

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"
SWITCHES_PY = DOCS.parent / "hybridq" / "switches.py"
EXPECTED = {"HYBRIDQ_BLOCK_GEMM_OP", "HYBRIDQ_BLOCK_LINEAR_OP", "HYBRIDQ_SLOT_LAYOUT_KERNEL",
            "HYBRIDQ_TILE_PAYLOAD_KERNEL", "HYBRIDQ_EAGER_FAST_PATH", "HYBRIDQ_GROUPED_BLOCK_CUBLAS",
            "HYBRIDQ_GROUPED_BLOCK_GEMM", "HYBRIDQ_GROUPED_FAST_HOOKS", "HYBRIDQ_GROUPED_EMULATED_GEMM", "HYBRIDQ_GROUPED_SLOT_QUANTIZE",
            "HYBRIDQ_LINEAR_CPP_OPS", "HYBRIDQ_NATIVE_GEMMS", "HYBRIDQ_STACKED_BLOCK_GATHER",
            "HYBRIDQ_SHARED_INPUT_QUANTIZATION", "HYBRIDQ_STACKED_BLOCK_PAYLOAD", "HYBRIDQ_TRITON_DEQUANT_GEMM",
            "HYBRIDQ_TRITON_CACHED_LAUNCH", "HYBRIDQ_TRITON_MXFP8", "HYBRIDQ_UNIT_CAST",
            "HYBRIDQ_GATHERED_PLANS", "HYBRIDQ_DELAYED_LINEAR_OP", "HYBRIDQ_CHECK_DATA_WRITES"}


def test_every_switch_is_registered_and_named_in_the_docs():
    found = set(switches())
    assert EXPECTED <= found, f"switches not registered: {sorted(EXPECTED - found)}"
    text = "\n".join(p.read_text() for p in DOCS.glob("*.md"))
    undocumented = sorted(env for env in found if env not in text)
    assert not undocumented, f"switches no page in docs/ names: {undocumented}"


def test_a_module_s_switch_is_read_from_the_environment_when_it_is_imported():
    """One module end to end (the rule for every value: the table below, on switches.py alone)."""
    env = dict(os.environ, HYBRIDQ_UNIT_CAST="0")
    code = "from hybridq.distributed import unit_cast; print(unit_cast.unit_cast_enabled())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", f"HYBRIDQ_UNIT_CAST=0: the switch is {out.strip()}, expected False"


def _a_switch() -> Switch:
    return switches()["HYBRIDQ_UNIT_CAST"]


@pytest.mark.parametrize("default,value,on", [(True, None, True), (True, "1", True), (True, "0", False),
                                              (True, "yes", True), (False, None, False), (False, "1", True),
                                              (False, "0", False), (False, "yes", False)])
def test_only_the_other_setting_s_value_flips_a_switch_s_default(default, value, on):
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDQ_SWITCH_PROBE"}
    if value is not None:
        env["HYBRIDQ_SWITCH_PROBE"] = value
    # (switches.py alone, a leaf: importing the package would take seconds per case)
    code = (f"import importlib.util as u; s = u.spec_from_file_location('switches', r'{SWITCHES_PY}'); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            f"print(m.Switch('HYBRIDQ_SWITCH_PROBE', {default}).on)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(on), f"default {default}, HYBRIDQ_SWITCH_PROBE={value!r}: {out.strip()}, expected {on}"


def test_set_changes_the_switch_and_returns_the_previous_setting(monkeypatch):
    s = _a_switch()
    monkeypatch.setattr(s, "on", True)
    assert s.set(False) is True and s.on is False
    assert s.set(True) is False and s.on is True
    assert isinstance(s, Switch) and s.env in repr(s)


def test_turned_sets_the_switch_from_then_on(monkeypatch):
    s = _a_switch()
    monkeypatch.setattr(s, "on", True)
    s.turned(False)
    assert s.on is False, "turned(False) outside a with block did not turn the switch off"


@pytest.mark.parametrize("start", [True, False])
def test_turned_as_a_block_restores_the_setting_before_it_at_its_end(start, monkeypatch):
    s = _a_switch()
    monkeypatch.setattr(s, "on", start)
    with s.turned(not start):
        assert s.on is (not start), "the block did not run with the switch turned"
        with s.turned(start):
            assert s.on is start
        assert s.on is (not start), "the inner block did not restore the outer block's setting"
        s.set(start)  # (a change inside the block is undone too)
    assert s.on is start, "the block's end did not restore the setting before it"
    with pytest.raises(RuntimeError), s.turned(not start):
        raise RuntimeError
    assert s.on is start, "a block left by an exception did not restore the setting before it"


def test_the_mapping_form_reads_and_writes_the_same_setting(monkeypatch):
    s = _a_switch()
    monkeypatch.setattr(s, "on", True)
    monkeypatch.setitem(s, "on", False)
    assert s.on is False and s["on"] is False and s.get("on") is False
    monkeypatch.undo()
    assert s.on is True, "monkeypatch.setitem's undo did not restore the switch"
    with pytest.raises(KeyError, match="HYBRIDQ_UNIT_CAST.*one setting, 'on', not 'enabled'"):
        s["enabled"] = False


def test_a_switch_has_no_truth_value():
    """`if switch:` would hold whatever the setting (the mistake of reading the switch for its setting)."""
    with pytest.raises(TypeError, match=r"HYBRIDQ_UNIT_CAST.*no truth value: read its setting, `\.on`"):
        bool(_a_switch())


def test_the_package_reads_switches_as_attributes():
    """Hot paths read `switch.on`; the mapping form `switch["on"]` (a Python call, several times the cost: [Note:
    switch reads] in hybridq/switches.py) is kept for tests written against it, not for the package."""
    pkg = SWITCHES_PY.parent
    found = [f"{f.relative_to(pkg.parent)}:{i}" for f in sorted(pkg.rglob("*.py")) if f != SWITCHES_PY
             for i, line in enumerate(f.read_text().splitlines(), 1) if '["on"]' in line or "['on']" in line]
    assert not found, f"switches read through the mapping form (read `.on`): {found}"

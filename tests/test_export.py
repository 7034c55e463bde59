"""`hybridq.export_state_dict`: one high-precision state_dict file that a plain nn.Module loads; an existing file is
replaced only with overwrite=True. (Under FSDP2: tests/distributed/test_dcp.py.)"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn

import hybridq as hq

from _compare import assert_bitwise

HAVE_SAFETENSORS = importlib.util.find_spec("safetensors") is not None


def _plain(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))


def _converted():
    m = _plain()
    hq.convert_linears(m, hq.recipe("fp8_delayed"), on_incompatible="error")
    m(torch.randn(8, 64)).sum().backward()  # some delayed-scaling state: not exported
    return m


def _load(path, fmt):
    if fmt == "safetensors":
        import safetensors.torch
        return safetensors.torch.load_file(str(path))
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("fmt", ["torch", pytest.param("safetensors", marks=pytest.mark.skipif(
    not HAVE_SAFETENSORS, reason="safetensors not installed"))])
def test_exported_file_loads_strictly_into_a_plain_module(tmp_path, fmt):
    m = _converted()
    path = hq.export_state_dict(m, tmp_path / f"model.{fmt}", format=fmt)
    plain = _plain(seed=1)
    plain.load_state_dict(_load(path, fmt))  # strict: no hybridq keys
    sd = m.state_dict()
    for k, a in plain.state_dict().items():
        assert_bitwise(a, sd[k], f"exported {k}")


def test_export_never_replaces_a_file_without_overwrite(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"user data")
    with pytest.raises(FileExistsError, match="model.pt exists; pass overwrite=True"):
        hq.export_state_dict(_converted(), path, format="torch")
    assert path.read_bytes() == b"user data"
    hq.export_state_dict(_converted(), path, format="torch", overwrite=True)
    assert set(torch.load(path, weights_only=True)) == set(_plain().state_dict())
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"], "no temporary file left behind"


@pytest.mark.skipif(HAVE_SAFETENSORS, reason="safetensors is installed")
def test_asking_for_safetensors_without_the_package_raises_before_writing(tmp_path):
    with pytest.raises(ImportError, match="needs the safetensors package"):
        hq.export_state_dict(_converted(), tmp_path / "m.safetensors", format="safetensors")
    assert not list(tmp_path.iterdir())


def test_auto_format_is_torch_save_without_safetensors(tmp_path):
    path = hq.export_state_dict(_converted(), tmp_path / "m.bin")
    if not HAVE_SAFETENSORS:
        assert set(torch.load(path, weights_only=True)) == set(_plain().state_dict())
    else:
        assert set(_load(path, "safetensors")) == set(_plain().state_dict())

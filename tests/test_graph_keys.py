"""Configuration keys (hybridq/nn/graph_keys.py, [Note: configuration keys]): the plain strings by which the compiled
graph's custom ops name a layer's configuration."""

from __future__ import annotations

import types

from hybridq.distributed import compiled_tp
from hybridq.nn.graph_keys import PROCESS, ConfigurationKeys


def test_equal_content_shares_one_key_and_the_first_value():
    keys = ConfigurationKeys("test-config-")
    a = keys.key("content", lambda: "first layer")
    b = keys.key("content", lambda: "second layer")
    assert a == b and keys[a] == "first layer", (a, b, keys[a])


def test_keys_name_their_registry_and_this_process():
    keys = ConfigurationKeys("test-config-")
    k = keys.key(("x", 1), lambda: None)
    assert k.startswith("test-config-") and k.endswith(f"@{PROCESS}") and keys.owns(k), k
    assert not keys.owns("other-config-0@" + PROCESS) and not keys.owns(None)


def test_a_replaced_value_gets_a_new_key_that_no_later_content_reuses():
    """Content whose value may not be kept gets a new key; a key once given names one value. (compiled_tp once
    numbered keys by the count of contents: re-registering content gave the number the next new content got, and the
    two configurations shared one key -- the first's ops read the second's group and shapes.)"""
    keys = ConfigurationKeys("test-config-")
    first = keys.key("a", lambda: "old group")
    renewed = keys.key("a", lambda: "new group", keep=lambda v: v == "new group")
    other = keys.key("b", lambda: "b's group")
    assert len({first, renewed, other}) == 3, (first, renewed, other)
    assert (keys[first], keys[renewed], keys[other]) == ("old group", "new group", "b's group")


def _tp(group, kind="colwise", in_features=64, out_features=128):
    # (register reads these fields only: a TensorParallelLinear needs a real mesh to build)
    return types.SimpleNamespace(kind=kind, group=group, in_features=in_features, out_features=out_features)


def test_tensor_parallel_keys_stay_distinct_when_a_process_group_name_is_reused():
    g1, g2 = types.SimpleNamespace(group_name="graph-keys-test"), types.SimpleNamespace(group_name="graph-keys-test")
    k1 = compiled_tp.register(_tp(g1))
    k2 = compiled_tp.register(_tp(g2))  # a new group of the same name (the process group made anew)
    k3 = compiled_tp.register(_tp(g2, out_features=256))
    assert len({k1, k2, k3}) == 3, (k1, k2, k3)
    assert compiled_tp._TP[k2].group is g2 and compiled_tp._TP[k3].out_features == 256
    assert compiled_tp.register(_tp(g2)) == k2

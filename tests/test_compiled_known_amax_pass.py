"""The Inductor post-grad pass that hands a norm's / SwiGLU's max|y| to the Linears' shared input cast in a compiled
graph ([Note: known max|y| in the graph], hybridq/nn/compiled_amax.py): which casts it rewrites, that a handed max|x|
gives the cast's own bytes, and how it is installed next to a user's pass. (The compiled training step with it,
bitwise eager: tests/distributed/test_fsdp_compile_known_amax.py.)"""

from __future__ import annotations

import operator

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

import hybridq  # noqa: F401 (registers the ops, installs the pass)
from hybridq.nn import compiled_amax

from _compare import assert_bitwise

ops = torch.ops.hybridq
CAST = ops.linear_input_quantize.default
NORM, SWIGLU = ops.compiled_norm_forward.default, ops.compiled_swiglu_forward.default


def _graph(source: str) -> tuple[torch.fx.Graph, torch.fx.Node]:
    """A graph whose one cast reads `source`: the norm's y, a view of it, its rstd (not y), the SwiGLU's y, or a
    placeholder; returns (graph, the cast node)."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    if source.startswith("swiglu"):
        prod = g.call_function(SWIGLU, (x, w))
    else:
        prod = g.call_function(NORM, (x, w, None, 1e-5, False))
    y = g.call_function(operator.getitem, (prod, 2 if source == "norm rstd" else 0))
    read = {"norm y": y, "swiglu y": y, "norm rstd": y, "placeholder": x,
            "norm y viewed": g.call_function(torch.ops.aten.view.default, (y, [-1, 8]))}[source]
    cast = g.call_function(CAST, (read, torch.float8_e4m3fn, 0.0, False, True))
    g.output((cast,))
    return g, cast


@pytest.mark.parametrize("source, handed_index", [("norm y", 3), ("norm y viewed", 3), ("swiglu y", 1),
                                                  ("norm rstd", None), ("placeholder", None)])
def test_pass_hands_the_producers_max_to_casts_of_its_y(source, handed_index):
    g, cast = _graph(source)
    compiled_amax.KnownAmaxPass()(g)
    amax = cast.kwargs.get("amax")
    if handed_index is None:
        assert amax is None, f"a cast of {source} was handed {amax}: only a norm's / SwiGLU's y (or views) are"
    else:
        assert amax is not None and amax.target is operator.getitem and amax.args[1] == handed_index, \
            f"a cast of {source}: handed {amax}, want output {handed_index} of its producer"
        g.lint()  # (the new getitem comes before the cast)


def test_pass_reuses_the_graphs_own_read_of_max():
    g, cast = _graph("norm y")
    prod = cast.args[0].args[0]
    with g.inserting_after(prod):
        own = g.call_function(operator.getitem, (prod, 3))
    compiled_amax.KnownAmaxPass()(g)
    assert cast.kwargs["amax"] is own, "the pass made a second getitem of max|y| where the graph had one"


def test_pass_does_nothing_with_the_switch_off():
    g, cast = _graph("norm y")
    with compiled_amax.ENABLED.turned(False):
        compiled_amax.KnownAmaxPass()(g)
    assert cast.kwargs.get("amax") is None, "the pass rewrote a cast with HYBRIDQ_COMPILED_KNOWN_AMAX off"


@pytest.mark.parametrize("columnwise", [True, False])
@pytest.mark.parametrize("values", ["random", "with inf", "with nan", "zeros"])
def test_cast_handed_max_is_bitwise_the_cast(values, columnwise):
    x = torch.randn(4, 16, 32).bfloat16()
    if values == "with inf":
        x[1, 2, 3] = float("inf")
    elif values == "with nan":
        x[2, 0, 1] = float("nan")
    elif values == "zeros":
        x.zero_()
    amax = x.float().abs().amax().reshape(1)
    want = CAST(x, torch.float8_e4m3fn, 0.0, False, columnwise)
    got = CAST(x, torch.float8_e4m3fn, 0.0, False, columnwise, amax=amax)
    for name, a, b in zip(("rowwise data", "scale_inv", "columnwise data"), got, want):
        assert_bitwise(a, b, f"{values}: {name} with max|x| handed vs computed")


class _UserPass(CustomGraphPass):
    def __init__(self, uuid):
        self.calls, self._uuid = 0, uuid

    def __call__(self, graph):
        self.calls += 1

    def uuid(self):
        return self._uuid


@pytest.mark.parametrize("user_uuid", ["user-pass-1", None])
def test_install_chains_after_a_users_pass_once(user_uuid):
    before = inductor_config.post_grad_custom_post_pass
    try:
        user = _UserPass(user_uuid)
        inductor_config.post_grad_custom_post_pass = user
        compiled_amax.install()
        compiled_amax.install()  # (idempotent)
        chained = inductor_config.post_grad_custom_post_pass
        g, cast = _graph("norm y")
        chained(g)
        assert user.calls == 1, f"the user's pass ran {user.calls} times in the chain, want once"
        assert cast.kwargs.get("amax") is not None, "hybridq's pass did not run after the user's"
        if user_uuid is None:
            assert chained.uuid() is None, "a chain with a user pass without uuid must bypass the FX graph cache"
        else:
            assert chained.uuid() == (user_uuid, compiled_amax.KnownAmaxPass().uuid()), f"uuid {chained.uuid()}"
    finally:
        inductor_config.post_grad_custom_post_pass = before


def test_hybridq_import_installs_the_pass():
    current = inductor_config.post_grad_custom_post_pass
    assert isinstance(current, compiled_amax.KnownAmaxPass), \
        f"after `import hybridq` Inductor's post-grad custom pass is {current!r}, want hybridq's KnownAmaxPass"

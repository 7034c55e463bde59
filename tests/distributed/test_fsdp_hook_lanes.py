"""The pre-all-gather hook's steady-state lane (`distributed/lane.py`): one per FSDP2 training state, reused while
every input it was derived from is the same (FSDP2's mesh, the unsharded shape, the module, the mixed-precision
policy, the sharded tensor and parameter, the resharding settings, the backward extras, the quantizer and the backward
override); any other input derives a new one, and training with lanes is bitwise training without them. In-process
FSDP2 on one gloo rank (the hooks run as in a job; other world sizes: test_fsdp.py, test_large_world.py)."""

from __future__ import annotations

import copy
import datetime
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

import hybridq as hq
from hybridq.distributed import lane as lanes
from hybridq.distributed import weights as W
from hybridq.torch_private import local_tensor

pytestmark = pytest.mark.distributed

D = 64


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = hq.GroupedLinear(4, D, D, recipe="fp8_tensorwise", name="up")

    def forward(self, x):
        return self.up(x, [x.shape[0] // 4] * 4)


def _model(mesh, grouped: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(D, D, bias=False), nn.ReLU(), _Experts() if grouped else nn.Linear(D, D, bias=False))
    hq.apply_hybrid_fsdp(m, hq.recipe("fp8_tensorwise"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for i in (0, 2):
        fully_shard(m[i], mesh=mesh, mp_policy=mp)
    fully_shard(m, mesh=mesh, mp_policy=mp)
    return m


def _steps(m, n: int, seed: int = 1) -> list:
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        loss = m(torch.randn(16, D, generator=g)).float().square().mean()
        loss.backward()
        out.append((loss.detach(), [p.grad.full_tensor().clone() for p in m.parameters()]))
        opt.step()
        opt.zero_grad()
    return out


def _local(m, i: int) -> W.HybridWeight:
    mod = m[i] if isinstance(m[i], hq.Linear) else m[i].up
    return local_tensor(mod.weight)  # (the sharded tensor itself: to_local() gives an alias)


@pytest.mark.parametrize("grouped", [False, True], ids=["linear", "grouped"])
def test_training_with_lanes_is_training_without(mesh, grouped, monkeypatch):
    """Four optimizer steps: losses and gradients bitwise those of a run whose every unshard derives its setup anew;
    from the second step on no unshard derives one (each training state's lane is reused)."""
    got = _steps(_model(mesh, grouped), 1)
    derived = []
    for cls in (W.HybridWeight, W.GroupedHybridWeight):
        orig = cls.__dict__["_derive_lane"]
        monkeypatch.setattr(cls, "_derive_lane", lambda self, *a, _o=orig: derived.append(1) or _o(self, *a))
    m = _model(mesh, grouped)
    got = _steps(m, 1)
    n_first = len(derived)
    got += _steps(m, 3, seed=2)
    assert n_first > 0 and len(derived) == n_first, \
        f"unshards after the first step derived their setup again ({len(derived) - n_first} times): lanes not reused"
    monkeypatch.setattr(lanes, "lookup", lambda *a: None)
    monkeypatch.setattr(W, "lookup", lambda *a: None)
    m = _model(mesh, grouped)
    want = _steps(m, 1) + _steps(m, 3, seed=2)
    for step, ((gl, gg), (wl, wg)) in enumerate(zip(got, want)):
        assert torch.equal(gl, wl), f"step {step}: loss {gl.item()} with lanes, {wl.item()} without"
        for i, (a, b) in enumerate(zip(gg, wg)):
            assert torch.equal(a, b), f"step {step}: gradient of parameter {i} differs with lanes"


def test_a_lane_is_reused_only_for_its_inputs(mesh):
    """`lane.lookup` finds the forward state's lane for the inputs it was made for, and not that one once any one input
    is another: the mesh, the unsharded shape, the module, the mixed-precision policy, the sharded tensor, the parameter
    the module holds (or its local tensor), the FSDP2 link, the training state, reshard after forward / backward, the
    backward extras."""
    m = _model(mesh)
    _steps(m, 1)
    local = _local(m, 0)
    st = local._hq
    g = st.fsdp.group
    lane = next(ln for ln in st.pre_lanes.values() if ln.ts is TrainingState.FORWARD)
    args = dict(st=st, local=local, mesh=lane.mesh, outer_size=lane.outer_size, module=m[0], mp_policy=lane.mp_policy,
                attr="weight")
    g._training_state = TrainingState.FORWARD
    try:
        assert lanes.lookup(**args) is lane, "the forward lane was not found for its own inputs"
        other_mesh = init_device_mesh("cpu", (1,))
        for name, value in (("mesh", other_mesh), ("outer_size", torch.Size((2 * D, D))), ("module", m[2]),
                            ("mp_policy", MixedPrecisionPolicy(param_dtype=torch.float32)),
                            ("local", W.HybridWeight(torch.zeros(D, D), st))):
            assert lanes.lookup(**{**args, name: value}) is None, f"the lane was reused for another {name}"

        def changed(what, set_, undo):
            set_()
            try:
                assert lanes.lookup(**args) is not lane, f"the forward lane was reused after {what}"
            finally:
                undo()
            assert lanes.lookup(**args) is lane, f"the lane was not found again after {what} was undone"

        holder = nn.Module()
        holder._parameters = m[0]._parameters
        assert lanes.lookup(**{**args, "module": holder}) is None, \
            "the lane was reused for another module holding the same parameter"
        param = m[0]._parameters["weight"]
        other = types.SimpleNamespace(_local_tensor=local)  # (another parameter object around the same shard)
        changed("another parameter on the module", lambda: m[0]._parameters.__setitem__("weight", other),
                lambda: m[0]._parameters.__setitem__("weight", param))
        changed("another local tensor of the parameter", lambda: setattr(param, "_local_tensor", _local(m, 2)),
                lambda: setattr(param, "_local_tensor", local))
        fresh = W.HybridWeight(local._data.clone(), st)  # (FSDP2's reset_sharded_param: a new local tensor)
        param._local_tensor = fresh
        try:
            assert lanes.lookup(**{**args, "local": fresh}) is None, \
                "the lane was reused for the parameter's new local tensor"
        finally:
            param._local_tensor = local
        link = st.fsdp
        changed("another FSDP2 link", lambda: setattr(st, "fsdp", copy.copy(link)), lambda: setattr(st, "fsdp", link))
        changed("the backward state", lambda: setattr(g, "_training_state", TrainingState.PRE_BACKWARD),
                lambda: setattr(g, "_training_state", TrainingState.FORWARD))
        pfm = g.post_forward_mesh_info
        changed("reshard_after_forward changed", lambda: setattr(g, "post_forward_mesh_info", None if pfm else 1),
                lambda: setattr(g, "post_forward_mesh_info", pfm))
        rab = g.reshard_after_backward
        changed("reshard_after_backward changed", lambda: setattr(g, "reshard_after_backward", not rab),
                lambda: setattr(g, "reshard_after_backward", rab))
        extra = st.backward_extra
        changed("new backward extras", lambda: setattr(st, "backward_extra", frozenset({"rowwise"})),
                lambda: setattr(st, "backward_extra", extra))
    finally:
        g._training_state = TrainingState.IDLE
    g._training_state = TrainingState.IDLE
    assert lanes.lookup(**args) is None, "a state that names no phase (IDLE) has no lane"


def test_a_new_quantizer_or_override_derives_a_new_lane(mesh, monkeypatch):
    """The module's weight quantizer replaced (another object) and the backward override set through the environment
    between steps: the next unshards use the new quantizer and the new override's plan (backward_override=
    "dequantized": backward gathers the rowwise form)."""
    m = _model(mesh)
    _steps(m, 1)
    st = _local(m, 0)._hq
    q = copy.deepcopy(m[0].weight_quantizer)
    m[0].weight_quantizer = q
    _steps(m, 1)
    assert all(ln.quant is q for ln in st.pre_lanes.values()), "a lane kept the replaced quantizer"
    monkeypatch.setenv("HYBRIDQ_BACKWARD_OVERRIDE", "dequantized")
    _steps(m, 1)
    back = next(ln for ln in st.pre_lanes.values() if ln.ts is not TrainingState.FORWARD)
    assert back.override == "dequantized" and back.setup.plan.materialize == ("rowwise",), \
        f"the backward unshard kept the lane of no override: {back.override!r}, {back.setup.plan}"

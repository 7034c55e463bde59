"""Jobs of test_fsdp_unit_cast.py (spawned by _harness.spawn, or run in-process on one rank): a model of two blocks,
each one FSDP2 unit of six Linears of mixed shapes whose weights FSDP2 gathers quantized, trained with the unit cast
([Note: unit cast], hybridq/distributed/unit_cast.py) on and off; every gathered weight (each forward's rowwise part,
bytes and scales), loss and gradient is recorded for a bitwise comparison."""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.nn as nn

import hybridq as hq
from hybridq.distributed import precompute_scales, unit_cast
from hybridq.enums import TensorType
from hybridq.formats import MXFP8Quantizer
from hybridq.torch_private import local_tensor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from _compare import assert_training_runs_bitwise  # noqa: E402

D = 64
NAMES = ("q", "k", "v", "o", "up", "down")


class Block(nn.Module):
    """Six Linears of five shapes: q [64, 64], k [48, 64], v [80, 64], o [64, 192], up [192, 64], down [64, 192]."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, 48, bias=False)
        self.v = nn.Linear(D, 80, bias=False)
        self.o = nn.Linear(192, D, bias=False)
        self.up = nn.Linear(D, 3 * D, bias=False)
        self.down = nn.Linear(3 * D, D, bias=False)

    def forward(self, x):
        x = x + self.o(torch.cat([self.q(x), self.k(x), self.v(x)], -1))
        return x + self.down(torch.relu(self.up(x)))


def recipe(mixed: bool):
    """fp8_tensorwise; `mixed`: each block's `o` weight MXFP8 instead (a weight of the unit the batch leaves out)."""
    base = hq.recipe("fp8_tensorwise")
    if not mixed:
        return base

    def pick(role):
        if role.tensor_type == TensorType.WEIGHT and role.name.endswith(".o"):
            return MXFP8Quantizer()
        return base.quantizer(role)

    return hq.CustomRecipe(pick, name="fp8_tensorwise_o_mxfp8")


def build(device, world_size: int, mixed: bool = False, nonfinite: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(Block(), Block()).to(device)
    if nonfinite:  # one weight with an inf, another with a NaN (their siblings finite)
        with torch.no_grad():
            m[0].k.weight[3, 5] = float("inf")
            m[1].up.weight[7, 1] = float("nan")
    return shard_blocks(m, recipe(mixed), device, world_size)


def shard_blocks(m: nn.Sequential, weights_recipe, device, world_size: int, reshard_after_forward: bool | None = None
                 ) -> nn.Module:
    """`m`'s weights converted by `weights_recipe` and put under FSDP2 on a 1-D mesh of `world_size` ranks: each block
    one unit (with `reshard_after_forward`; None: FSDP2's default), the model another; bf16 param dtype, fp32
    gradient reduction."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    hq.apply_hybrid_fsdp(m, weights_recipe, on_incompatible="error")
    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in m:
        fully_shard(b, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(m, mesh=mesh, mp_policy=mp)
    return m


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).clone().contiguous().view(torch.uint8).cpu()


def record_gathered(m: nn.Module, into: list) -> list:
    """Forward pre-hooks on every Linear appending (name, {tensor name: bytes}) of its gathered rowwise part."""
    handles = []
    for name, mod in m.named_modules():
        if isinstance(mod, hq.Linear):
            def hook(mod, args, name=name):
                part = mod.weight.part("rowwise")
                into.append((name, {n: _bits(t) for n, t in part.tensors().items() if t is not None}))
            handles.append(mod.register_forward_pre_hook(hook))
    return handles


def counters(m: nn.Module, key: str) -> dict:
    return {n: int(local_tensor(p)._hq.counters[key]) for n, p in m.named_parameters()}


def train(m: nn.Module, device, steps: int, precompute: bool, width: int = D) -> dict:
    """`steps` AdamW steps (precompute_scales after each where asked) on inputs of `width` features: every forward's
    gathered weights, the losses and the gradients, as bytes."""
    gathered: list = []
    handles = record_gathered(m, gathered)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    if precompute:
        precompute_scales(m)
    for _ in range(steps):
        loss = m(torch.randn(16, width, generator=g).to(device)).float().square().mean()
        loss.backward()
        losses.append(_bits(loss))
        grads.append([_bits(p.grad.full_tensor()) for p in m.parameters()])
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_scales(m)
    for h in handles:
        h.remove()
    return {"gathered": gathered, "losses": losses, "grads": grads}


def compare(got: dict, want: dict, where: str) -> None:
    assert_training_runs_bitwise(got, want, where, "with the unit cast")


def parity_of(build_model, train_model, where: str) -> dict:
    """Training (`train_model(build_model())`) with the unit cast on is bitwise training with it off; returns the
    batch counters of the on run."""
    was = unit_cast.set_unit_cast(False)
    try:
        off = train_model(build_model())
        unit_cast.set_unit_cast(True)
        m = build_model()
        on = train_model(m)
    finally:
        unit_cast.set_unit_cast(was)
    compare(on, off, where)
    return {"unit_batches": counters(m, "unit_batches"), "payload_unit": counters(m, "payload_unit")}


def parity(rank, world_size, device, precompute: bool, mixed: bool = False, steps: int = 3) -> dict:
    """Training with the unit cast on is bitwise training with it off; returns the batch counters of the on run."""
    return parity_of(lambda: build(device, world_size, mixed), lambda m: train(m, device, steps, precompute),
                     f"rank {rank} of {world_size}, precompute={precompute}, mixed={mixed}")


def forward_after_new_versions(build_model, device, width: int, precompute: bool, where: str) -> tuple[list, int]:
    """With the unit cast off and on: a forward (the first unshard of each state is per weight), new versions of the
    masters (same values: the kept payloads are not those of these masters), precompute_scales where asked, and a
    recorded forward -- its gathered weights bitwise the same either way. Returns the on run's gathered weights and
    its unit batches in the recorded forward."""
    out, batches = {}, 0
    was = unit_cast.set_unit_cast(False)
    try:
        for on in (False, True):
            unit_cast.set_unit_cast(on)
            m = build_model()
            gathered: list = []
            with torch.no_grad():
                m(torch.ones(4, width, device=device))
                for p in m.parameters():
                    p.mul_(1.0)
                if precompute:
                    precompute_scales(m)
                before = sum(counters(m, "unit_batches").values())
                handles = record_gathered(m, gathered)
                m(torch.ones(4, width, device=device))
            for h in handles:
                h.remove()
            out[on] = gathered
            batches = sum(counters(m, "unit_batches").values()) - before
    finally:
        unit_cast.set_unit_cast(was)
    compare({"gathered": out[True], "losses": [], "grads": []}, {"gathered": out[False], "losses": [], "grads": []},
            where)
    return out[True], batches


def nonfinite(rank, world_size, device) -> dict:
    """One forward after a first step: weights with an inf / a NaN gathered as with the unit cast off (their FP8 bytes
    non-finite, scale 1), their siblings' scales finite and unchanged; returns each gathered rowwise scale_inv."""
    gathered, batches = forward_after_new_versions(lambda: build(device, world_size, nonfinite=True), device, D,
                                                   False, f"rank {rank} of {world_size}, non-finite weights")
    return {"scale_inv": {n: t["scale_inv"].view(torch.float32).tolist() for n, t in gathered},
            "data": {n: t["data"].tolist() for n, t in gathered if n in ("0.k", "1.up")},
            "batches": batches}


def assert_stale_payload_not_used(m: nn.Module, width: int, target: str, monkeypatch) -> None:
    """The master of block 0's `target` weight changed in place after its unit's batch (led by q) prepared its payload
    (its version counter moves): its hook prepares its own from the new values, so the weight gathered is the
    quantization of those; every other weight of the unit sent the batch's payload."""
    x = torch.randn(4, width)
    with torch.no_grad():
        m(x)  # (lanes for the forward state)
        for p in m.parameters():
            p.mul_(1.0)  # (new versions: the kept payloads are not those of these masters)
    module = getattr(m[0], target)
    param = module._parameters["weight"]
    real, leader = unit_cast._prepare_unit, local_tensor(m[0].q.weight)

    def then_change(local, lane, key):
        out = real(local, lane, key)
        if out is not None and local is leader:
            with torch.no_grad():
                param.mul_(-2.0)
        return out

    monkeypatch.setattr(unit_cast, "_prepare_unit", then_change)
    st = local_tensor(param)._hq
    before = st.counters["payload_unit"]
    gathered: list = []
    handles = record_gathered(m, gathered)
    with torch.no_grad():
        m(x)
    for h in handles:
        h.remove()
    assert st.counters["payload_unit"] == before and st.counters["unit_batches"] == 0, \
        "the stale payload prepared before the change was sent (or re-prepared by a batch of its own)"
    got = dict(gathered)[f"0.{target}"]
    master = local_tensor(param)._data
    want = module.weight_quantizer.quantize_parts(master.to(torch.bfloat16), True, False)[0]
    assert torch.equal(got["data"], want.data.reshape(-1).view(torch.uint8)) and torch.equal(
        got["scale_inv"], want.scale_inv.reshape(-1).view(torch.uint8)), \
        f"the gathered {target} weight is not the quantization of its changed master"
    for n, _ in m[0].named_children():
        if n != target:
            c = local_tensor(getattr(m[0], n).weight)._hq.counters
            assert (c["payload_unit"], c["unit_batches"]) == (1, int(n == "q")), \
                f"{n}: {c['payload_unit']} unit payloads sent, {c['unit_batches']} batches (expected q's batch only)"

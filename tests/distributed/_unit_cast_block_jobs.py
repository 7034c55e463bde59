"""Jobs of test_fsdp_unit_cast_block.py (spawned by _harness.spawn, or run in-process on one rank): the unit cast of
FP8 128x128-tile weights ([Note: unit cast], hybridq/distributed/unit_cast.py). A model of two blocks, each one FSDP2
unit of six Linears whose shapes put tiles where the batch must get them right -- a partial last tile row, partial
tile columns, a shard boundary that splits a tile (at two ranks: left to the per-weight path) -- trained with the
fp8_block preset with the unit cast on and off; every gathered weight (each forward's rowwise part, bytes and tile
scales), loss and gradient recorded for a bitwise comparison (_unit_cast_jobs.train / compare)."""

from __future__ import annotations

import torch
import torch.nn as nn

import hybridq as hq
from hybridq.enums import TensorType
from hybridq.formats import Float8BlockQuantizer, Float8Quantizer

import _unit_cast_jobs as base

D = 256
NAMES = ("q", "k", "v", "o", "up", "down")
# weights whose shard splits a tile at two ranks (200 rows: 100 each): never batched there
CUT_AT_TWO = ("v",)
# weights of per-tensor FP8 in the `mixed` recipe (their own batch: one kind per batch)
PER_TENSOR = ("q", "o")


class Block(nn.Module):
    """q [256, 256], k [255, 256] (a partial last tile row; at two ranks 128 + 127 rows), v [200, 256] (two ranks: a
    tile split by the shard boundary), o [256, 711] (partial tile columns), up [512, 256], down [256, 512]."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(D, 256, bias=False)
        self.k = nn.Linear(D, 255, bias=False)
        self.v = nn.Linear(D, 200, bias=False)
        self.o = nn.Linear(711, D, bias=False)
        self.up = nn.Linear(D, 2 * D, bias=False)
        self.down = nn.Linear(2 * D, D, bias=False)

    def forward(self, x):
        x = x + self.o(torch.cat([self.q(x), self.k(x), self.v(x)], -1))
        return x + self.down(torch.relu(self.up(x)))


def recipe(mixed: bool | str):
    """fp8_block (weights in 128x128 tiles); `mixed`: each block's q and o weights per-tensor FP8 instead (a second
    kind in the unit, batched on its own); "no_pow2": their tiles without power-of-two scales instead (a second
    quantizer of the same kind: its own scale computation in the batch)."""
    base_recipe = hq.recipe("fp8_block")
    if not mixed:
        return base_recipe

    def pick(role):
        if role.tensor_type == TensorType.WEIGHT and role.name.rsplit(".", 1)[-1] in PER_TENSOR:
            if mixed == "no_pow2":
                return Float8BlockQuantizer(block_dim=2, power_2_scale=False)
            return Float8Quantizer()
        return base_recipe.quantizer(role)

    return hq.CustomRecipe(pick, name=f"fp8_block_q_o_{'no_pow2' if mixed == 'no_pow2' else 'tensorwise'}")


def build(device, world_size: int, mixed: bool | str = False, nonfinite: bool = False) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(Block(), Block()).to(device)
    with torch.no_grad():
        for b in m:
            b.up.weight[128:256, :128].zero_()  # (a tile of zeros: amax 0, scale 1)
        if nonfinite:  # an inf in one weight, a NaN in another (in a tile of a shard of two ranks' second rank)
            m[0].k.weight[200, 5] = float("inf")
            m[1].up.weight[300, 1] = float("nan")
            m[1].down.weight[3, 400] = -float("inf")
    return base.shard_blocks(m, recipe(mixed), device, world_size)


def train(m: nn.Module, device, steps: int, precompute: bool) -> dict:
    return base.train(m, device, steps, precompute, width=D)


def parity(rank, world_size, device, precompute: bool, mixed: bool | str = False, steps: int = 3) -> dict:
    """Training with the unit cast on is bitwise training with it off; returns the batch counters of the on run."""
    return base.parity_of(lambda: build(device, world_size, mixed), lambda m: train(m, device, steps, precompute),
                          f"fp8_block: rank {rank} of {world_size}, precompute={precompute}, mixed={mixed}")


def nonfinite(rank, world_size, device, precompute: bool = True) -> dict:
    """Forwards after a first one (the first unshard of each state is per weight): weights with an inf / a NaN and a
    tile of zeros gathered as with the unit cast off; returns each gathered rowwise tile scale_inv and the batch count
    of the recorded forward."""
    gathered, batches = base.forward_after_new_versions(
        lambda: build(device, world_size, nonfinite=True), device, D, precompute,
        f"fp8_block: rank {rank} of {world_size}, non-finite weights")
    return {"scale_inv": {n: t["scale_inv"].view(torch.float32).tolist() for n, t in gathered}, "batches": batches}

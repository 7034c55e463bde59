"""GroupedLinear's packed path against its per-expert path, for the tests that compare the two bit for bit (not a test
module): the layer, tokens whose magnitude differs by expert, one forward + backward. Users:
tests/test_grouped_packed_blocks.py, tests/test_grouped_packed_nvfp4.py."""

from __future__ import annotations

import torch

import hybridq as hq


def expert_layer(recipe, experts: int, k: int, out: int, packed: bool, dtype=torch.bfloat16, device="cpu",
                 **kw) -> hq.GroupedLinear:
    """A GroupedLinear "moe" of `experts` [out, k] experts (weights from seed 1), its packed path on or off."""
    torch.manual_seed(1)
    m = hq.GroupedLinear(experts, k, out, recipe=recipe, dtype=dtype, device=device, name="moe", **kw)
    m.packed_path = packed
    return m


def tokens_by_expert(splits: list, k: int, out: int, dtype, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [sum(splits), k] and gradients [sum(splits), out] whose magnitude differs by expert (10^-2 .. 10^2): a
    scaling block or a global amax shared by two experts would change a scale, hence bytes."""
    gen = torch.Generator().manual_seed(2)
    mag = torch.cat([torch.full((m,), 10.0 ** (e - 2)) for e, m in enumerate(splits)])[:, None]
    x = torch.randn(sum(splits), k, generator=gen) * mag
    dy = torch.randn(sum(splits), out, generator=gen) * mag.flip(0)
    return x.to(device, dtype), dy.to(device, dtype)


def expert_step(m: hq.GroupedLinear, splits: list, x: torch.Tensor, dy: torch.Tensor, x_grad: bool = True,
                w_grad: bool = True, grad: bool = True, seed: int | None = None) -> dict:
    """{"y", "dx", "dW"} of one forward, and backward where a gradient is asked for. `seed`: torch's default
    generators seeded just before the forward (stochastic rounding draws from them: the same stream for both
    paths)."""
    m.weight.requires_grad_(w_grad)
    x.requires_grad_(x_grad)
    if seed is not None:
        torch.manual_seed(seed)
        if x.device.type == "cuda":
            torch.cuda.manual_seed(seed)
    with torch.set_grad_enabled(grad):
        y = m(x, splits)
    if grad and (x_grad or w_grad):
        y.backward(dy)
    return {"y": y.detach(), "dx": x.grad, "dW": m.weight.grad}

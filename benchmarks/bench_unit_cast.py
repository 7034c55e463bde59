"""Host time of FSDP2's pre-all-gather hooks per unit, with the unit cast ([Note: unit cast],
hybridq/distributed/unit_cast.py) on and off, interleaved: a model of transformer-like blocks (q, k, v, o and a SwiGLU
feed-forward: 7 Linears, one `fully_shard` unit per block), fp8_tensorwise (or `--recipe fp8_block`: 128x128 tiles)
weights gathered quantized, one process (world 1, NCCL on a GPU, gloo on the CPU), AdamW steps at few tokens
(host-bound).

    python3 benchmarks/bench_unit_cast.py --layers 8 --dim 2048 --hidden 5632 --tokens 512 --rounds 3 --steps 5
    python3 benchmarks/bench_unit_cast.py --recipe fp8_block --layers 8 --dim 2048 --hidden 5632 --tokens 512

Prints, per round and setting: the hooks' host time per unit per step (every `fsdp_pre_all_gather` call of a step,
forward and backward unshards, summed with time.perf_counter, divided by the units) and the step's wall time."""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from fsdp_setup import exit_without_finalization


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.w2 = nn.Linear(h, d, bias=False)

    def forward(self, x):
        a = self.q(x) * torch.sigmoid(self.k(x)) + self.v(x)  # (no attention: the weights' unshards are measured)
        x = x + self.o(a)
        return x + self.w2(F.silu(self.w1(x)) * self.w3(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=5632)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--recipe", default="fp8_tensorwise", choices=("fp8_tensorwise", "fp8_block"))
    args = p.parse_args()

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import hybridq as hq
    from hybridq.distributed import unit_cast
    from hybridq.distributed import weights as W

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    tmp = tempfile.mkdtemp()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.dim, args.hidden) for _ in range(args.layers))).to(device)
    hq.apply_hybrid_fsdp(model, hq.recipe(args.recipe))
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model:
        fully_shard(b, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    x = torch.randn(args.tokens, args.dim, device=device, dtype=torch.bfloat16)

    hook_s = [0.0]
    real = W.HybridWeight._pre_hook

    def timed(self, *a):
        t0 = time.perf_counter()
        try:
            return real(self, *a)
        finally:
            hook_s[0] += time.perf_counter() - t0

    W.HybridWeight._pre_hook = timed

    def step() -> tuple[float, float]:
        hook_s[0] = 0.0
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return hook_s[0], time.perf_counter() - t0

    for on in (False, True, False, True):  # warm-up (each setting's first unshards derive their lanes)
        unit_cast.set_unit_cast(on)
        step()
    res = {False: ([], []), True: ([], [])}
    for r in range(args.rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            unit_cast.set_unit_cast(on)
            hooks, walls = zip(*(step() for _ in range(args.steps)))
            res[on][0].append(statistics.median(hooks) / args.layers * 1e6)
            res[on][1].append(statistics.median(walls) * 1e3)
            print(f"round {r} unit_cast={'on ' if on else 'off'}: hooks {res[on][0][-1]:8.1f} us per unit per step, "
                  f"step {res[on][1][-1]:8.2f} ms", flush=True)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"\n{name}, torch {torch.__version__}, {args.layers} units x 7 Linears, d {args.dim}, hidden {args.hidden}, "
          f"{args.tokens} tokens, {args.recipe}, world 1, {now:%Y-%m-%d %H:%M} UTC")
    for on in (False, True):
        rounds = ", ".join(f"{v:.1f}" for v in res[on][0])
        print(f"unit_cast={'on ' if on else 'off'}: hooks median {statistics.median(res[on][0]):8.1f} us per unit per "
              f"step (rounds {rounds}); step median {statistics.median(res[on][1]):.2f} ms")
    from hybridq.torch_private import local_tensor
    batches = sum(local_tensor(q)._hq.counters["unit_batches"] for q in model.parameters())
    print(f"unit batches run: {batches}")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
    exit_without_finalization()

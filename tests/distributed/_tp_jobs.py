"""Jobs for the tensor-parallel tests (run in spawned gloo process groups; see test_tensor_parallel.py)."""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridq
import hybridq.nn.linear_function as hq_linear
from hybridq import NVFP4Quantizer
from hybridq.nn.float8_graph import eager_fast_path

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from _compare import close_diff, tensor_diff  # noqa: E402
from _conversion_models import SwiGLU  # noqa: E402


def deterministic_recipe(preset: str, override: str | None = None) -> hybridq.CustomRecipe:
    """The preset without stochastic rounding (whose draws depend on how a tensor is split), with `override`."""
    base = hybridq.recipe(preset)

    def factory(role):
        q = base.quantizer(role)
        for name in ("rowwise", "columnwise"):
            sub = getattr(q, name, None)
            if isinstance(sub, NVFP4Quantizer) and sub.stochastic_rounding:
                setattr(q, name, dataclasses.replace(sub, stochastic_rounding=False))
        if isinstance(q, NVFP4Quantizer) and q.stochastic_rounding:
            q = dataclasses.replace(q, stochastic_rounding=False)
        return q

    return hybridq.CustomRecipe(factory, backward_override=override, name=f"{preset}-no-sr")


class Block(nn.Module):
    """A norm (sequence-parallel), then a SwiGLU MLP: the MLP half of a transformer block."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.mlp = SwiGLU(d, h)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Attention(nn.Module):
    """Multi-head self-attention whose q/k/v projections read one input and whose output projection is wo."""

    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.head_dim = d // heads
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x):  # x [B, S, d]; under TP each rank computes its heads (the local d / tp features)
        b, s = x.shape[0], x.shape[1]
        q, k, v = (w(x) for w in (self.wq, self.wk, self.wv))
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class AttentionBlock(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.attn = Attention(d)

    def forward(self, x):
        return x + self.attn(self.norm(x))


def attention_plan(seq_dim: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    from hybridq.distributed import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return {"norm": SequenceParallel(sequence_dim=seq_dim),
            "attn": PrepareModuleInput(input_layouts=(Shard(seq_dim),), desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(seq_dim))}


BLOCKS = {"mlp": (Block, lambda sd: tp_plan(sd), ("mlp.w1", "mlp.w3"), "mlp.w2"),
          "attention": (AttentionBlock, lambda sd: attention_plan(sd), ("attn.wq", "attn.wk", "attn.wv"), "attn.wo")}


def tp_plan(seq_dim: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel

    from hybridq.distributed import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    return {"norm": SequenceParallel(sequence_dim=seq_dim),
            "mlp": PrepareModuleInput(input_layouts=(Shard(seq_dim),), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=Shard(seq_dim))}


class GemmRecorder:
    """Records the dequantized operands of every fprop GEMM (what reaches the GEMM, by layer). The eager FP8 fast
    path (nn/float8_graph.py, bitwise the general path) is off meanwhile: its GEMMs are not linear_function's."""

    def __init__(self):
        self.seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.orig = hq_linear.gemm

    def __enter__(self):
        def gemm(a, b, dtype, what):
            if what.startswith("fprop of "):
                self.seen.setdefault(what[len("fprop of "):], (a.dequantize_2d(), b.dequantize_2d()))
            return self.orig(a, b, dtype, what)
        hq_linear.gemm = gemm
        self.fast_path = eager_fast_path(False)
        return self

    def __exit__(self, *exc):
        hq_linear.gemm = self.orig
        self.fast_path.__exit__(*exc)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _cmp(out: list, what: str, got, want, *, exact: bool = True, rtol: float = 0.0) -> None:
    if exact:
        d = tensor_diff(got, want, what)
        if d is not None:
            out.append(d)
        return
    d = close_diff(got, want, what, rtol)[1]
    if d is not None:
        out.append(d)


def tp_block_job(rank: int, world_size: int, device, cases: list) -> dict:
    """Each case: (preset, override, save_original_input, shape, seq_dim). A single-process hybridq Block and its
    tensor-parallel copy (sequence-parallel norm, quantized all-gather into w1/w3, row-parallel w2) train two SGD
    steps on the same data; returns what differed (operands, outputs, input grads, parameters) per case."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from hybridq.nn.linear import shared_input_quantization

    mesh = init_device_mesh(device.type, (world_size,))
    report = {}
    for block, preset, override, save_original, shape, seq_dim in cases:
        key = f"{block}/{preset}/{override}/soi={save_original}/{tuple(shape)}/seq{seq_dim}"
        cls, plan, colwise, rowwise = BLOCKS[block]
        diffs: list[str] = []
        torch.manual_seed(0)
        d = shape[-1]
        ref = cls(d, 2 * d).to(device)
        tp = cls(d, 2 * d).to(device)
        tp.load_state_dict(ref.state_dict())
        r = deterministic_recipe(preset, override)
        for m in (ref, tp):
            hybridq.convert_linears(m, r)
            for lin in m.modules():
                if isinstance(lin, hybridq.Linear):
                    lin.save_original_input = save_original
        parallelize_module(tp, mesh, plan(seq_dim))
        opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
        opt_t = torch.optim.SGD(tp.parameters(), lr=0.05)
        sl = [slice(None)] * len(shape)
        chunk = shape[seq_dim] // world_size
        sl[seq_dim] = slice(rank * chunk, (rank + 1) * chunk)
        sl = tuple(sl)
        gathers = []
        import hybridq.distributed.sequence as seq_mod
        orig_gather = seq_mod.all_gather_single

        for step in range(2):
            x = torch.randn(shape, generator=torch.Generator().manual_seed(10 + step)).to(device)
            xr = x.clone().requires_grad_()
            xl = x[sl].clone().requires_grad_()
            with GemmRecorder() as rec_r:
                yr = ref(xr)
            (yr.float().square().mean()).backward()

            def recording_gather(out, inp, group=None, **kw):
                gathers.append((inp.dtype, inp.numel()))
                return orig_gather(out, inp, group=group, **kw)
            seq_mod.all_gather_single = recording_gather
            try:
                with GemmRecorder() as rec_t:
                    yl = tp(xl)
                yl_full = yl  # the block's output is sequence-sharded (local)
                # the loss of the whole output: every rank's local mean, summed over ranks as the reference's
                loss = yl_full.float().square().sum() / yr.numel()
                loss.backward()
            finally:
                seq_mod.all_gather_single = orig_gather
            if step == 0:
                for name in colwise:  # column-parallel: whole input, this rank's weight rows
                    (a_t, b_t), (a_r, b_r) = rec_t.seen[name], rec_r.seen[name]
                    n = b_r.shape[0] // world_size
                    _cmp(diffs, f"{key} {name} fprop input operand", a_t, a_r)
                    _cmp(diffs, f"{key} {name} fprop weight operand", b_t, b_r[rank * n:(rank + 1) * n])
                (a_t, b_t), (a_r, b_r) = rec_t.seen[rowwise], rec_r.seen[rowwise]
                k = b_r.shape[1] // world_size  # row-parallel: this rank's K columns of both operands
                _cmp(diffs, f"{key} {rowwise} fprop input operand", a_t, a_r[:, rank * k:(rank + 1) * k])
                _cmp(diffs, f"{key} {rowwise} fprop weight operand", b_t, b_r[:, rank * k:(rank + 1) * k])
            # the row-parallel output sums two partial products: TP changes the summation order there
            _cmp(diffs, f"{key} step {step} output", yl, yr.detach()[sl], exact=False, rtol=1e-5)
            _cmp(diffs, f"{key} step {step} input grad", xl.grad, xr.grad[sl], exact=False, rtol=1e-5)
            for (n, p_t), (_, p_r) in zip(tp.named_parameters(), ref.named_parameters()):
                _cmp(diffs, f"{key} step {step} grad of {n}", _full(p_t.grad), p_r.grad, exact=False, rtol=1e-5)
            opt_r.step(), opt_t.step(), opt_r.zero_grad(), opt_t.zero_grad()
        for (n, p_t), (_, p_r) in zip(tp.named_parameters(), ref.named_parameters()):
            _cmp(diffs, f"{key} {n} after 2 steps", _full(p_t.detach()), p_r.detach(), exact=False, rtol=1e-5)
        report[key] = {"diffs": diffs, "gathers": [(str(dt), n) for dt, n in gathers]}
    return report


def tp_errors_job(rank: int, world_size: int, device) -> dict:
    """The errors users meet: torch's stock styles on a hybridq Linear, a K split inside a block, delayed
    scaling, sequence runs that split a block. Returns {case: error message (or "no error")}."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise, parallelize_module

    from hybridq.distributed import ColwiseParallel, RowwiseParallel

    mesh = init_device_mesh(device.type, (world_size,))
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 - the message is the result
            out[name] = f"{type(e).__name__}: {e}"

    def stock():
        m = nn.Sequential(nn.Linear(64, 128))
        hybridq.convert_linears(m, hybridq.recipe("mxfp8"))
        parallelize_module(m, mesh, {"0": TorchColwise()})
        m(torch.randn(4, 64))
    attempt("stock_style", stock)

    def k_split():
        m = nn.Sequential(nn.Linear(96, 64))  # K = 96 over 2 ranks: 48 columns each, MXFP8 blocks are 32
        hybridq.convert_linears(m, hybridq.recipe("mxfp8"))
        parallelize_module(m, mesh, {"0": RowwiseParallel()})
    attempt("k_split", k_split)

    def delayed():
        m = nn.Sequential(nn.Linear(64, 64))
        hybridq.convert_linears(m, hybridq.recipe("fp8_delayed"))
        parallelize_module(m, mesh, {"0": ColwiseParallel()})
    attempt("delayed", delayed)

    def runs():
        from torch.distributed.tensor import Shard

        m = nn.Sequential(nn.Linear(64, 64))
        hybridq.convert_linears(m, hybridq.recipe("mxfp8"))
        parallelize_module(m, mesh, {"0": ColwiseParallel(input_layouts=Shard(1))})
        m(torch.randn(2, 24, 64, requires_grad=True)).sum().backward()  # 2 runs of 24 tokens: blocks are 32
    attempt("runs", runs)
    return out


def tp_fsdp_job(rank: int, world_size: int, device, mesh_shape: tuple, presets: list, steps: int = 2) -> dict:
    """2-D meshes in torchtitan's order: apply_hybrid_fsdp, parallelize_module over "tp", fully_shard over "dp".
    Each dp rank trains on its own micro-batch (sequence-sharded over tp); the single-process reference runs the
    micro-batches one by one and averages the gradients (FSDP2's mean). Returns what differed per preset: the
    weight operand of every fprop (the quantized all-gather over dp of a TP piece, against the piece of the
    single-process quantization), parameter gradients and parameters after `steps` SGD steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=("dp", "tp"))
    dp, tp = mesh_shape
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    # B = 1: each rank's tokens are a row shard of the whole input. 128 tokens and 128 weight rows / columns per
    # TP rank (d = 64 tp, at least 128): whole 128-row / 128x128 blocks (fp8_block) in every TP piece
    shape = (1, 128 * max(tp, 2), 64 * max(tp, 2))
    # Linear weight gradients are bitwise on the CPU where FSDP2 averages at most two dp ranks (a sum of two,
    # halved) and tp <= 2. Elsewhere within rtol: a mean over 4 ranks is summed in another order than the
    # reference's; a TP piece's GEMM has another shape than the reference's, which at tp = 4 moved 27 of 131072
    # elements of fp8_tensorwise's w2 gradient by an ulp on the CPU, and on CUDA may pick another cuBLAS kernel
    exact_grads = dp <= 2 and tp <= 2 and device.type == "cpu"
    report = {}
    for preset in presets:
        diffs: list[str] = []
        torch.manual_seed(0)
        d = shape[-1]
        ref, model = Block(d, 2 * d).to(device), Block(d, 2 * d).to(device)
        model.load_state_dict(ref.state_dict())
        r = deterministic_recipe(preset)
        hybridq.convert_linears(ref, r)
        hybridq.apply_hybrid_fsdp(model, r)
        parallelize_module(model, mesh["tp"], tp_plan(1))
        fully_shard(model, mesh=mesh["dp"])
        opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        chunk = shape[1] // tp
        for step in range(steps):
            xs = [torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + i)).to(device)
                  for i in range(dp)]
            recs = []
            for x in xs:
                with GemmRecorder() as rec:
                    y = ref(x)
                recs.append(rec)
                (y.float().square().sum() / y.numel() / dp).backward()
            with GemmRecorder() as rec_t:
                y = model(xs[dp_rank][:, tp_rank * chunk:(tp_rank + 1) * chunk].clone())
            (y.float().square().sum() / (y.numel() * tp)).backward()
            if step == 0:
                for name, cols in (("mlp.w1", False), ("mlp.w3", False), ("mlp.w2", True)):
                    want = recs[dp_rank].seen[name][1]
                    n = (want.shape[1] if cols else want.shape[0]) // tp
                    piece = want[:, tp_rank * n:(tp_rank + 1) * n] if cols else want[tp_rank * n:(tp_rank + 1) * n]
                    _cmp(diffs, f"{preset} {mesh_shape} {name} weight operand", rec_t.seen[name][1], piece)
            for (n, p), (_, p_r) in zip(model.named_parameters(), ref.named_parameters()):
                exact = exact_grads and n != "norm.weight"  # the norm's gradient sums over ranks' tokens in another order
                _cmp(diffs, f"{preset} {mesh_shape} step {step} grad of {n}", _full(p.grad), p_r.grad,
                     exact=exact, rtol=1e-5)
            opt_r.step(), opt.step(), opt_r.zero_grad(), opt.zero_grad()
        for (n, p), (_, p_r) in zip(model.named_parameters(), ref.named_parameters()):
            _cmp(diffs, f"{preset} {mesh_shape} {n} after {steps} steps", _full(p.detach()), p_r.detach(),
                 exact=False, rtol=1e-5)
        report[preset] = diffs
    return report

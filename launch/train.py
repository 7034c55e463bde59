"""The hybridq training job: a small Llama-style decoder trained with FSDP2 under torchrun.

    torchrun --standalone --nproc-per-node 2 launch/train.py --recipe mxfp8_fwd_nvfp4_bwd --compare bf16

CPU (gloo) when no GPU is present, one process per GPU with NCCL otherwise; the same code either way.
`--recipe` is any hybridq preset or `bf16` (the unquantized baseline: bf16 parameters and activations, fp32
gradient reduction, exactly what the quantized runs use around their GEMMs). The quantized Linear layers
are set up by `hybridq.apply_hybrid_fsdp` before `fully_shard` (per block, then the root), and
`hybridq.precompute_scales` runs after every optimizer step.

Determinism: the initial weights, the batches (a pure function of seed and step), the learning rate (a pure
function of step) and the random stream of each step (reseeded from seed, step and rank) do not depend on
where a run started, so `--resume` from a checkpoint continues bit for bit like the uninterrupted run.

Checkpoints are world-size independent: model and optimizer go through DCP (which reshards), and the rest of
the job's state is one file written by rank 0 (`train_state.json`: step, loss history, seed, the saving
run's dp). Nothing per-rank is saved: the data of step s on rank r is a pure function of (seed, s, r, dp)
and every step reseeds the random stream from (seed, s, r). So a run saved with dp=2 resumes with dp=1 (and
1 -> 2): the parameters and AdamW state after loading are bitwise those saved, the loss history carries
over, and the following steps are exactly those of a dp=1 run started from that state (the global batch is
now dp x --batch sequences, so the losses are not those of the uninterrupted dp=2 run).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import pathlib
import shutil
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hybridq  # noqa: E402
from data import VOCAB_SIZE, ByteBatches, load_tokens  # noqa: E402
from model import ALIGN, ModelConfig, Transformer  # noqa: E402

BASELINE = "bf16"
TORCHAO = "torchao_float8"  # baseline: torchao float8 training (tensorwise, float8 all-gather); needs torchao


# ---- arguments -----------------------------------------------------------------------------------

class _Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None/False)" noise
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    names = [BASELINE] + hybridq.preset_names() + [TORCHAO]
    p = argparse.ArgumentParser(description="Train a small Llama-style decoder with FSDP2 and a hybridq recipe.",
                                formatter_class=_Help)
    g = p.add_argument_group("recipe")
    g.add_argument("--recipe", default="mxfp8_fwd_nvfp4_bwd", choices=names, metavar="NAME",
                   help=f"hybridq preset or '{BASELINE}' (one of: {', '.join(names)})")
    g.add_argument("--compare", default=None, choices=names, metavar="NAME",
                   help=f"also train NAME (usually '{BASELINE}') in the same invocation, same data and "
                        "initial weights, and print the loss gap")
    g.add_argument("--quantize-head", action="store_true",
                   help="also convert the output head (kept in high precision by default)")
    g.add_argument("--param-dtype", default="bf16", choices=["bf16", "fp32"],
                   help="FSDP2 MixedPrecisionPolicy param_dtype (gradients reduce in fp32)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--dp", type=int, default=None, help="data-parallel (FSDP) size; default: world size / tp")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (only 1 for now: see the error)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: one GPU per process with NCCL when CUDA is available, else CPU with gloo")
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int, default=128, help=f"model width (multiple of {ALIGN})")
    g.add_argument("--n-layers", type=int, default=2, help="decoder blocks (one FSDP2 unit each)")
    g.add_argument("--n-heads", type=int, default=4, help="attention heads")
    g.add_argument("--n-kv-heads", type=int, default=None,
                   help="key/value heads for grouped-query attention (default: n-heads)")
    g.add_argument("--hidden", type=int, default=None, help="SwiGLU hidden size (default: ~8/3 d-model, "
                   f"rounded up to {ALIGN})")
    g.add_argument("--tie-embeddings", action="store_true", help="the head reuses the embedding matrix")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=100, help="optimizer steps (sets the lr schedule)")
    g.add_argument("--seq", type=int, default=128, help="sequence length")
    g.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank per step")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay ends at lr * this")
    g.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default: 10%% of --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: off)")
    g.add_argument("--seed", type=int, default=0, help="initial weights, batches, random rounding")
    g.add_argument("--eval-batches", type=int, default=4, help="held-out batches for the final val loss")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=None,
                   help="DCP checkpoints (model + optimizer) go to DIR/<recipe>/step_NNNNNN")
    g.add_argument("--save-every", type=int, default=0, help="save every N steps (and after the last step)")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in "
                   "--checkpoint-dir (a run with none starts from step 0)")
    g.add_argument("--stop-after", type=int, default=None,
                   help="stop after this step as if interrupted (for testing resume)")
    # testing aids (not in --help): dump the gathered full state at each save and after a resume, and start a
    # run from such a dump (a path to the state that does not go through DCP resharding)
    g.add_argument("--dump-state", default=None, help=argparse.SUPPRESS)
    g.add_argument("--init-state", default=None, help=argparse.SUPPRESS)
    g = p.add_argument_group("output")
    g.add_argument("--log-every", type=int, default=1, help="per-step line every N steps")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal)")
    g.add_argument("--plot", default=None, metavar="OUT.png",
                   help="write loss curves (recipe vs compare) to OUT.png and the metrics to OUT.json")
    g.add_argument("--timeout", type=float, default=600, help="process-group timeout in seconds")
    return p.parse_args(argv)


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB_SIZE, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                       n_kv_heads=args.n_kv_heads, hidden=args.hidden, max_seq=max(args.seq, 1),
                       tie_embeddings=args.tie_embeddings)


def check_args(args, world: int) -> None:
    """Everything that can be wrong with the flags, checked identically on every rank before any collective."""
    errors = []
    if args.tp != 1:
        errors.append(
            f"--tp {args.tp}: tensor parallelism needs hybridq's tensor-parallel support for its quantized "
            "Linear (DTensor-sharded weights and sequence-parallel quantized all-gathers), which has not landed "
            "yet; plain DTensor TP over hybridq.Linear is not correct (it fails for NVFP4 and delayed scaling "
            "and gives wrong MXFP8 results). Use --tp 1 (FSDP2 only) for now.")
    dp = args.dp if args.dp is not None else world // max(args.tp, 1)
    if dp * args.tp != world:
        errors.append(f"--dp {dp} x --tp {args.tp} = {dp * args.tp} must equal the number of processes ({world})")
    args.dp = dp
    if args.steps < 1:
        errors.append("--steps must be >= 1")
    if args.seq < 1 or args.batch < 1:
        errors.append("--seq and --batch must be >= 1")
    if (args.seq * args.batch) % ALIGN:
        errors.append(f"--seq {args.seq} x --batch {args.batch} = {args.seq * args.batch} tokens per rank per step "
                      f"must be a multiple of {ALIGN} (MXFP8 and NVFP4 quantize activations in blocks of 32 "
                      "along the token dimension for the weight-gradient GEMM)")
    if args.compare == args.recipe:
        errors.append(f"--compare {args.compare} is the same as --recipe")
    if (args.save_every or args.resume) and not args.checkpoint_dir:
        errors.append("--save-every / --resume need --checkpoint-dir")
    try:
        model_config(args).check()
    except ValueError as e:
        errors.append(str(e))
    if TORCHAO in (args.recipe, args.compare):
        try:
            import torchao.float8  # noqa: F401
        except Exception as e:  # identical on every rank
            errors.append(f"{TORCHAO} (the torchao float8 baseline) needs torchao, which is not importable here "
                          f"({type(e).__name__}: {e}); install it (pip install torchao) or pick another recipe")
    if errors:
        raise SystemExit("train.py: " + "\n  ".join(["invalid arguments:"] + errors))


# ---- distributed set-up --------------------------------------------------------------------------

@dataclasses.dataclass
class Env:
    rank: int
    world: int
    device: torch.device
    backend: str
    mesh: object

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(args) -> Env:
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    world = int(os.environ["WORLD_SIZE"])
    check_args(args, world)
    use_cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if use_cuda:
        if not torch.cuda.is_available():
            raise SystemExit("train.py: --device cuda but CUDA is not available")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    kw = {"device_id": device} if device.type == "cuda" else {}  # NCCL: bind the rank to its GPU up front
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout), **kw)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(device.type, (args.dp,), mesh_dim_names=("dp",))
    return Env(dist.get_rank(), world, device, backend, mesh)


# ---- output helpers ------------------------------------------------------------------------------

class Printer:
    """Rank 0 prints; on a terminal a progress bar stays on the last line under the per-step lines."""

    def __init__(self, env: Env, bar: bool):
        self.on = env.main
        self.bar = bar and env.main and sys.stdout.isatty()
        self._bar_shown = False

    def __call__(self, *msg) -> None:
        if not self.on:
            return
        if self._bar_shown:
            sys.stdout.write("\r\033[K")
            self._bar_shown = False
        print(*msg, flush=True)

    def progress(self, name: str, done: int, total: int, eta_s: float) -> None:
        if not self.bar:
            return
        width = 30
        fill = int(width * done / max(total, 1))
        eta = str(datetime.timedelta(seconds=int(eta_s)))
        sys.stdout.write(f"\r\033[K{name} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} eta {eta}")
        sys.stdout.flush()
        self._bar_shown = True

    def end_progress(self) -> None:
        if self._bar_shown:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
            self._bar_shown = False


def peak_memory(env: Env) -> tuple[float, str]:
    """(bytes, label): peak allocated GPU memory on a GPU, else the process's peak resident set size."""
    if env.device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(env.device)), "peak GPU mem"
    import resource
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "peak RSS"


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def table(rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return "\n".join(out)


# ---- the per-layer report ------------------------------------------------------------------------

def head_filter(args):
    """module_filter_fn: every Linear but the output head unless --quantize-head."""
    if args.quantize_head:
        return None
    return lambda module, fqn: fqn != "output"


def convert(model: nn.Module, recipe_name: str, args) -> tuple[list[list[str]], str]:
    """Convert the model's Linears for `recipe_name` (before fully_shard); return the report rows and a
    one-line summary."""
    linear_names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    filt = head_filter(args)
    report = hybridq.apply_hybrid_fsdp(model, hybridq.recipe(recipe_name), module_filter_fn=filt,
                                       on_incompatible="skip")
    by_name = {l.name: l for l in report.layers}
    rows = [["layer", "status", "input (row / col)", "weight (row / col)", "grad_output (row / col)", "why"]]
    n_conv = 0
    for name in linear_names:
        l = by_name.get(name)
        if l is None:
            why = ("output head kept in high precision (--quantize-head converts it)" if name == "output"
                   else "excluded by module_filter_fn")
            rows.append([name, "skipped", "-", "-", "-", why])
        elif l.converted:
            n_conv += 1
            f = l.formats
            rows.append([name, "converted", f.get("input", "?"), f.get("weight", "?"), f.get("grad_output", "?"),
                         ""])
        else:
            rows.append([name, "skipped", "-", "-", "-", l.reason])
    if args.tie_embeddings:
        rows.append(["output (tied)", "skipped", "-", "-", "-",
                     "tied to tok_embeddings (F.linear, not a Linear module)"])
    summary = (f"{n_conv} of {len(linear_names)} Linear layers converted by hybridq.apply_hybrid_fsdp "
               "(FSDP2 all-gathers their weights quantized). "
               "Directions: forward y = x.row @ W.row; dgrad = dy.row @ W.col; wgrad = dy.col @ x.col "
               "(hybrid[row / col] names both; a plain format serves both).")
    return rows, summary


def convert_torchao(model: nn.Module, args, out) -> None:
    """The torchao float8 baseline (before fully_shard): torchao.float8.convert_to_float8_training, tensorwise
    dynamic scaling, enable_fsdp_float8_all_gather=True, same head filter as the hybridq recipes; build()
    adds precompute_float8_dynamic_scale_for_fsdp after each optimizer step (as launch/bench_fsdp.py does)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                               module_filter_fn=head_filter(args))
    n_conv = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    out(f"\n{TORCHAO}: {n_conv} of {n_linear} Linear layers converted by torchao.float8.convert_to_float8_training "
        "(tensorwise, float8 all-gather, scales precomputed after each optimizer step)"
        + ("" if args.quantize_head else "; output head kept in high precision"))


# ---- checkpoints ---------------------------------------------------------------------------------

def latest_checkpoint(run_dir: pathlib.Path) -> pathlib.Path | None:
    f = run_dir / "latest"
    if not f.exists():
        return None
    path = run_dir / f.read_text().strip()
    return path if path.exists() else None


TRAIN_STATE = "train_state.json"
# the configuration a checkpoint must match to be resumed (the world size / dp is free: DCP reshards)
RESUME_KEYS = ("recipe", "model", "steps", "seq", "batch", "lr", "seed", "param_dtype", "quantize_head")


def save_checkpoint(run_dir: pathlib.Path, step: int, model, optimizer, train_state: dict, env: Env,
                    meta: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    path = run_dir / f"step_{step:06d}"
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    dist.barrier()
    if env.main:  # one file for the whole job: nothing in it depends on the rank or the world size
        (path / TRAIN_STATE).write_text(json.dumps(train_state))
        (path / "meta.json").write_text(json.dumps(meta, indent=1))
        tmp = run_dir / "latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, run_dir / "latest")
    dist.barrier()


def check_meta(path: pathlib.Path, saved: dict, meta: dict) -> None:
    """Fail, naming each difference, when the checkpoint's configuration differs from this run's."""
    diffs = []
    for k in RESUME_KEYS:
        a, b = saved.get(k), meta.get(k)
        if k == "model" and isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"model {f}: saved {a.get(f)!r}, now {b.get(f)!r}"
                      for f in sorted(set(a) | set(b)) if a.get(f) != b.get(f)]
        elif a != b:
            diffs.append(f"{k}: saved {a!r}, now {b!r}")
    if diffs:
        raise SystemExit(f"train.py: cannot resume from {path}: it was written by a different configuration ("
                         + "; ".join(diffs) + ")")


def load_checkpoint(path: pathlib.Path, model, optimizer, env: Env, meta: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    saved = json.loads((path / "meta.json").read_text())
    check_meta(path, saved, meta)  # before any collective: every rank reads the same file
    state_file = path / TRAIN_STATE
    if state_file.exists():
        train_state = json.loads(state_file.read_text())
    elif (path / "extra_rank0.pt").exists():  # written before train_state.json: its step and losses suffice
        old = torch.load(path / "extra_rank0.pt", weights_only=False)
        train_state = {"step": old["step"], "losses": list(old["losses"])}
    else:
        raise SystemExit(f"train.py: {state_file} is missing (an incomplete checkpoint?)")
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as e:  # a BaseException: turn it into the job's clean error exit
        raise SystemExit(f"train.py: loading {path} failed: {e}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return train_state


def full_state(model, optimizer) -> dict:
    """The gathered (unsharded) model and optimizer state dicts on the CPU; a collective on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def dump_state(args, recipe_name: str, tag: str, step: int, losses: list[float], model, optimizer,
               env: Env) -> None:
    st = full_state(model, optimizer)
    if env.main:
        d = pathlib.Path(args.dump_state)
        d.mkdir(parents=True, exist_ok=True)
        torch.save({**st, "step": step, "losses": list(losses), "world": env.world},
                   d / f"{recipe_name}_{tag}_step_{step:06d}.pt")
    dist.barrier()


def init_from_dump(path: str, model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    st = torch.load(path, weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=st["model"], optim_state_dict=st["optim"],
                   options=StateDictOptions(full_state_dict=True))
    return st


# ---- one training run ----------------------------------------------------------------------------

def lr_at(step: int, args) -> float:
    warm = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    if step < warm:
        return args.lr * (step + 1) / warm
    t = (step - warm) / max(1, args.steps - warm)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def build(recipe_name: str, args, env: Env, out: Printer):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(args.seed)
    model = Transformer(model_config(args))  # identical initial weights on every rank and for every recipe
    if recipe_name == TORCHAO:
        convert_torchao(model, args, out)
    elif recipe_name != BASELINE:
        try:
            rows, summary = convert(model, recipe_name, args)
        except ValueError as e:  # raised identically on every rank, before any collective
            raise SystemExit(f"train.py: recipe {recipe_name}: {e}") from None
        out(f"\nper-layer report, recipe {recipe_name}:")
        out(table(rows))
        out(summary)
    model.to(env.device)
    pdt = torch.bfloat16 if args.param_dtype == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=env.mesh, mp_policy=mp)
    fully_shard(model, mesh=env.mesh, mp_policy=mp)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    if recipe_name == TORCHAO:  # the next float8 all-gathers' scales, one fused all-reduce (a collective)
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    return model, optimizer


def all_mean(x: torch.Tensor, env: Env) -> float:
    x = x.detach().float().reshape(1).clone()
    dist.all_reduce(x)
    return x.item() / env.world


def evaluate(model, data: ByteBatches, args, env: Env) -> float:
    model.eval()
    total = torch.zeros(1, device=env.device)
    with torch.no_grad():
        for x, y in data.val_batches(args.eval_batches):
            x, y = x.to(env.device), y.to(env.device)
            total += F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    model.train()
    return all_mean(total / max(args.eval_batches, 1), env)


def train_one(recipe_name: str, args, env: Env, out: Printer, tokens: torch.Tensor) -> dict:
    model, optimizer = build(recipe_name, args, env, out)
    data = ByteBatches(tokens, args.seq, args.batch, dp_rank=env.rank, dp_size=args.dp, seed=args.seed)
    quantized = recipe_name != BASELINE
    run_dir = pathlib.Path(args.checkpoint_dir) / recipe_name if args.checkpoint_dir else None
    meta = {"recipe": recipe_name, "model": dataclasses.asdict(model_config(args)), "steps": args.steps,
            "seq": args.seq, "batch": args.batch, "lr": args.lr, "seed": args.seed,
            "param_dtype": args.param_dtype, "quantize_head": args.quantize_head,
            "dp": args.dp}  # recorded only: a checkpoint resumes under any dp
    losses: list[float] = []
    start = 0
    if args.resume:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            others = [p.parent.name for p in sorted(pathlib.Path(args.checkpoint_dir).glob("*/latest"))
                      if p.parent.name not in (args.recipe, args.compare) and latest_checkpoint(p.parent)]
            if others:
                raise SystemExit(f"train.py: --resume with recipe {recipe_name}, but {args.checkpoint_dir} holds "
                                 f"checkpoints of recipe(s) {', '.join(others)} only (recipe mismatch: pass "
                                 f"--recipe {others[0]}, or drop --resume to start a fresh run)")
            out(f"[{recipe_name}] --resume: no checkpoint in {run_dir}, starting from step 0")
        else:
            saved = load_checkpoint(ckpt, model, optimizer, env, meta)
            start, losses = saved["step"], list(saved["losses"])
            saved_dp = saved.get("dp")
            across = f" (saved with dp={saved_dp}, now dp={args.dp})" if saved_dp not in (None, args.dp) else ""
            out(f"[{recipe_name}] resumed from {ckpt} at step {start}{across}")
            if args.dump_state:
                dump_state(args, recipe_name, "loaded", start, losses, model, optimizer, env)
    elif args.init_state:
        st = init_from_dump(args.init_state, model, optimizer)
        start, losses = st["step"], list(st["losses"])
        out(f"[{recipe_name}] started from the full state in {args.init_state} at step {start}")
    if start >= args.steps:
        out(f"[{recipe_name}] already trained for {start} >= --steps {args.steps} steps")

    tokens_per_step = args.dp * args.batch * args.seq
    times, tps = [], []
    mem_label = peak_memory(env)[1]
    end = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    t_run = time.perf_counter()
    for step in range(start, end):
        t0 = time.perf_counter()
        lr = lr_at(step, args)
        for gr in optimizer.param_groups:
            gr["lr"] = lr
        # stochastic rounding and anything else random: a function of (seed, step, rank) only
        torch.manual_seed((args.seed * 1_000_003 + step) * 4099 + env.rank)
        x, y = data.get(step)
        x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
        logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if quantized:  # the next all-gathers' global amaxes, one fused all-reduce
            hybridq.precompute_scales(model)
        loss_val = all_mean(loss, env)  # also a sync point for the timing
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        dt = time.perf_counter() - t0
        losses.append(loss_val)
        times.append(dt)
        tps.append(tokens_per_step / dt)
        if not math.isfinite(loss_val):
            raise SystemExit(f"train.py: [{recipe_name}] loss is {loss_val} at step {step + 1}")
        n = step + 1
        if n % args.log_every == 0 or n == end or n == start + 1:
            mem = peak_memory(env)[0]
            out(f"[{recipe_name}] step {n:>{len(str(args.steps))}}/{args.steps} | loss {loss_val:.4f} | "
                f"lr {lr:.2e} | {tokens_per_step / dt:>9,.0f} tok/s | step {dt * 1e3:7.1f} ms | "
                f"{mem_label} {fmt_bytes(mem)}")
        done = n - start
        out.progress(recipe_name, n, args.steps, (time.perf_counter() - t_run) / done * (end - n))
        if run_dir is not None and args.save_every and (n % args.save_every == 0 or n == args.steps):
            # no RNG state: step s reseeds from (seed, s, rank); no loader state: batches are a pure function
            # of (seed, s, rank, dp); so this is the whole job state, for any world size that resumes it
            train_state = {"step": n, "losses": losses, "seed": args.seed, "dp": args.dp, "world": env.world}
            save_checkpoint(run_dir, n, model, optimizer, train_state, env, meta)
            if args.dump_state:
                dump_state(args, recipe_name, "saved", n, losses, model, optimizer, env)
            out(f"[{recipe_name}] saved checkpoint {run_dir / f'step_{n:06d}'}")
    out.end_progress()
    val = evaluate(model, data, args, env) if end == args.steps and args.eval_batches > 0 else float("nan")
    steady = times[1:] if len(times) > 1 else times  # the first step includes warm-up work
    result = {
        "recipe": recipe_name, "start_step": start, "steps_run": len(times), "losses": losses,
        "step_times_s": times, "tokens_per_s": tps, "tokens_per_step": tokens_per_step,
        "final_loss": statistics.fmean(losses[-max(1, len(losses) // 10):]) if losses else float("nan"),
        "val_loss": val,
        "median_step_s": statistics.median(steady) if steady else float("nan"),
        "median_tokens_per_s": tokens_per_step / statistics.median(steady) if steady else float("nan"),
        "peak_memory_bytes": peak_memory(env)[0], "peak_memory_kind": mem_label,
        "wall_s": time.perf_counter() - t_run,
    }
    del model, optimizer
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---- summary, plot -------------------------------------------------------------------------------

def summarize(results: list[dict], args, out: Printer) -> dict:
    rows = [["run", "steps", "first loss", "final loss", "val loss", "tokens/s", "step ms", "peak mem", "wall s"]]
    for r in results:
        first = f"{r['losses'][0]:.4f}" if r["losses"] else "-"
        rows.append([r["recipe"], f"{r['start_step'] + r['steps_run']}", first, f"{r['final_loss']:.4f}",
                     f"{r['val_loss']:.4f}", f"{r['median_tokens_per_s']:,.0f}", f"{r['median_step_s'] * 1e3:.1f}",
                     fmt_bytes(r["peak_memory_bytes"]), f"{r['wall_s']:.1f}"])
    out("\nsummary (final loss: mean of the last 10% of steps; tokens/s and step ms: medians after step 1; "
        f"{results[0]['peak_memory_kind']} of rank 0):")
    out(table(rows, right=set(range(1, 9))))
    n = max(len(r["losses"]) for r in results)
    marks = sorted({max(1, round(n * k / 10)) for k in range(1, 11)} | {1})
    curve = [["step"] + [str(m) for m in marks]]
    for r in results:
        curve.append([r["recipe"]] + [f"{r['losses'][m - 1]:.3f}" if m <= len(r["losses"]) else "-" for m in marks])
    out("\nloss curve:")
    out(table(curve, right=set(range(1, len(marks) + 1))))
    gap = {}
    if len(results) == 2:
        a, b = results
        gap = {"final_loss": a["final_loss"] - b["final_loss"], "val_loss": a["val_loss"] - b["val_loss"],
               "final_loss_rel": a["final_loss"] / b["final_loss"] - 1,
               "val_loss_rel": a["val_loss"] / b["val_loss"] - 1,
               "speed_ratio": a["median_tokens_per_s"] / b["median_tokens_per_s"]}
        out(f"\nloss gap {a['recipe']} - {b['recipe']}: final {gap['final_loss']:+.4f} "
            f"({gap['final_loss_rel']:+.2%}), "
            f"val {gap['val_loss']:+.4f} ({gap['val_loss_rel']:+.2%}); tokens/s ratio {gap['speed_ratio']:.2f}x"
            + (" (CPU: quantization is emulated in PyTorch, so slower than bf16 here)"
               if results[0]["peak_memory_kind"] == "peak RSS" else ""))
    return gap


def write_plot(path: str, results: list[dict], gap: dict, args, env: Env, out: Printer) -> None:
    p = pathlib.Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    js = p.with_suffix(".json")
    metrics = {"config": {k: v for k, v in vars(args).items()}, "world_size": env.world, "backend": env.backend,
               "device": str(env.device), "torch": torch.__version__, "runs": {r["recipe"]: r for r in results},
               "gap": gap}
    js.write_text(json.dumps(metrics, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        out(f"wrote metrics {js}; no plot: matplotlib is not installed (pip install matplotlib) -- "
            f"{p} was not written")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["recipe"], lw=1.4)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/byte)")
    title = f"{args.n_layers}x{args.d_model} decoder, seq {args.seq}, {env.world} x {env.backend}"
    if gap:
        title += f"; final gap {gap['final_loss']:+.3f}"
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(p, dpi=120)
    plt.close(fig)
    out(f"wrote {p} and {js}")


# ---- main ----------------------------------------------------------------------------------------

def main(argv=None) -> None:
    # hybridq.Linear returns a reshaped (view) output; the job never modifies a module output in place
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    args = parse_args(argv)
    try:
        env = init_distributed(args)
    except SystemExit as e:  # a flag error: every rank finds it, rank 0 says it
        if isinstance(e.code, str) and os.environ.get("RANK", "0") != "0":
            raise SystemExit(1) from None
        raise
    out = Printer(env, bar=not args.no_progress)
    try:
        cfg = model_config(args)
        tokens = load_tokens()
        runs = [args.recipe] + ([args.compare] if args.compare else [])
        out(f"hybridq {hybridq.__version__}, torch {torch.__version__}: {env.world} process(es), {env.backend} on "
            f"{env.device.type}, FSDP2 dp={args.dp} tp={args.tp}; runs: {', '.join(runs)}")
        out(f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, hidden {cfg.hidden}, heads {cfg.n_heads}"
            f"/{cfg.n_kv_heads} kv, vocab {cfg.vocab_size} (bytes), {cfg.num_params() / 1e6:.2f}M params, "
            f"{'tied' if cfg.tie_embeddings else 'untied'} head; data: {len(tokens):,} bytes; "
            f"{args.dp * args.batch * args.seq:,} tokens/step (seq {args.seq} x batch {args.batch} x dp {args.dp})")
        if args.checkpoint_dir and not args.resume and env.main:
            for r in runs:  # a fresh run does not mix with an older run's checkpoints
                old = pathlib.Path(args.checkpoint_dir) / r
                if old.exists():
                    out(f"removing {old}: checkpoints of an earlier run (pass --resume to continue it)")
                    shutil.rmtree(old)
        dist.barrier()
        results = [train_one(name, args, env, out, tokens) for name in runs]
        gap = summarize(results, args, out)
        if args.plot and env.main:
            write_plot(args.plot, results, gap, args, env, out)
        dist.barrier()
    except SystemExit as e:  # raised identically on every rank (e.g. a recipe the FSDP2 path rejects)
        if isinstance(e.code, str) and not env.main:
            raise SystemExit(1) from None
        raise
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_code = 0
    try:
        main()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        exit_code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    # Leave without interpreter finalization. DTensor objects that outlive the run still reference the device
    # mesh, which keeps the gloo process group and its worker threads alive past destroy_process_group; a worker
    # still releasing the last collective's tensors then needs the GIL while the interpreter shuts down, and the
    # process aborts ("terminate called without an active exception"; about 1 run in 8 on loaded CPUs here;
    # pytorch/pytorch PR 179291 describes it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)

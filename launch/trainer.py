"""The hybridq training job's body (launch/train.py is the entry point: it answers --help and refused flags before
torch is imported, then runs `main` here): a small Llama-style decoder trained with FSDP2 under torchrun.

    torchrun --standalone --nproc-per-node 2 launch/train.py --recipe mxfp8_fwd_nvfp4_bwd --compare bf16

CPU (gloo) when no GPU is present, one process per GPU with NCCL otherwise; the same code either way.
`--recipe` is any hybridq preset or `bf16` (the unquantized baseline: bf16 parameters and activations, fp32
gradient reduction, exactly what the quantized runs use around their GEMMs). The quantized Linear layers
are set up by `hybridq.apply_hybrid_fsdp` before `fully_shard` (per block, then the root), and
`hybridq.precompute_scales` runs after every optimizer step (with the next forward's all-gather payloads:
`--precompute-payloads`).

Determinism: the initial weights, the batches (a pure function of seed and step), the learning rate (a pure
function of step) and the random stream of each step (reseeded from seed, step and rank) do not depend on
where a run started, so `--resume` from a checkpoint continues bit for bit like the uninterrupted run.

Module map: train.py (entry point), config.py (flags, validation; no torch), model_config.py (the model's shape),
checkpoint.py (save and load, collective) and checkpoint_files.py (layout, manifest through hybridq.checkpoint,
verify, resume choice, prune), lock.py (one job per checkpoint folder), parallel.py (the tensor-parallel plan and its
layout rules), convert.py (the Linear conversion and per-layer report), torchao_moe.py (the torchao MoE baseline),
comm.py (bytes per wire), compile_report.py (the graphs and graph breaks of --compile), metrics.py (console,
JSON-lines metrics, summary, plot), preflight.py (everything refused before a process group exists), dist_env.py (the
process group, peak memory, rank-0 decisions); this file has the training loop and main.

Checkpoints are world-size independent: model and optimizer go through DCP (which reshards), and the rest of
the job's state is one file written by rank 0 (`train_state.json`: step, loss history, seed, the saving
run's dp). Nothing per-rank is saved: the data of step s on rank r is a pure function of (seed, s, r, dp)
and every step reseeds the random stream from (seed, s, r). So a run saved with dp=2 resumes with dp=1 (and
1 -> 2): the parameters and AdamW state after loading are bitwise those saved, the loss history carries
over, and the following steps are exactly those of a dp=1 run started from that state (the global batch is
now dp x --batch sequences, so the losses are not those of the uninterrupted dp=2 run).
"""

from __future__ import annotations

import gc
import math
import os
import pathlib
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hybridq  # noqa: E402
import checkpoint  # noqa: E402
import compile_report  # noqa: E402
from comm import KINDS, CommCounter  # noqa: E402
from config import (BASELINE, TORCHAO, TORCHAO_MOE, TORCHAO_RECIPES, ConfigError, check_args,  # noqa: E402
                    model_config, run_meta, runs)
from convert import convert_torchao  # noqa: E402
from parallel import apply_tensor_parallel, sequence_bytes_line  # noqa: E402
from data import ByteBatches, load_tokens  # noqa: E402
from metrics import MetricsFile, Printer, fmt_bytes, summarize, table, write_plot  # noqa: E402
from model import Transformer  # noqa: E402
# the pre-flight and the distributed set-up (re-exported: train.py, profile_step.py and the tests reach them here)
from preflight import (REFUSALS, convert_refusing, describe_plan, preflight, release_locks,  # noqa: E402,F401
                       take_locks)
from dist_env import Env, PeakMemory, all_mean, init_distributed, on_rank0_then_broadcast  # noqa: E402,F401


# ---- one training run ----------------------------------------------------------------------------

def lr_at(step: int, args) -> float:
    warm = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    if step < warm:
        return args.lr * (step + 1) / warm
    t = (step - warm) / max(1, args.steps - warm)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def expert_placement(args):
    """FSDP2's shard_placement_fn for MoE expert weights [E, out, in]: whole experts per rank (Shard(0), the
    default) unless there are more data-parallel ranks than experts, then rows of every expert (Shard(1), as
    torchtitan does) where `out` divides evenly (FSDP2 shards dim 1 evenly only)."""
    if not args.moe or args.dp <= args.moe:
        return None
    from torch.distributed.tensor import Shard
    return lambda p: Shard(1) if p.dim() == 3 and p.shape[1] % args.dp == 0 else None


def step_wires(args) -> tuple[str, ...]:
    """The wires (comm.KINDS) a step of this job uses: tp only with tensor parallelism."""
    return tuple(k for k in KINDS if k != "tp" or args.tp > 1)


def grad_reduce_of(recipe_name: str, args) -> str:
    """The gradient reduce-scatter wire of a run: --grad-reduce for a hybridq recipe (apply_hybrid_fsdp installs it),
    fp32 (FSDP2's own) for the bf16 / torchao baselines."""
    return "fp32" if recipe_name in (BASELINE, *TORCHAO_RECIPES) else args.grad_reduce


def reshard_after_forward(args, i: int, blocks: int) -> bool:
    """--reshard-after-forward for block i of `blocks` (torchtitan's policy names): the last block's backward is the
    first to run, right after the forward, so by default its gathered weights stay (one all-gather and, for the
    quantized gather, one set of post-all-gather fills fewer per step). Under CUDA graphs (--compile-mode
    reduce-overhead / max-autotune) the default reshards every block: a block that is not resharded makes the graphs
    record again every step (docs/compile.md, benchmarks/cudagraph_rerecords.py)."""
    cuda_graphs = args.compile and args.compile_mode in ("reduce-overhead", "max-autotune")
    return {"always": True, "never": False, "default": cuda_graphs or i < blocks - 1}[args.reshard_after_forward]


def build(recipe_name: str, args, env: Env, out: Printer):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(args.seed)
    model = Transformer(model_config(args))  # identical initial weights on every rank and for every recipe
    if recipe_name in (BASELINE, *TORCHAO_RECIPES) and args.norms == "hybridq":
        swapped = [l.replacement for l in hybridq.convert_norms(model) if l.converted]
        out(f"\n{len(swapped)} modules run as {' / '.join(sorted(set(swapped)))} (--norms hybridq)")
    if recipe_name == TORCHAO:
        convert_torchao(model, args, out)
    elif recipe_name == TORCHAO_MOE:
        from torchao_moe import convert_torchao_moe
        convert_torchao_moe(model, args, out)
    elif recipe_name != BASELINE:
        rows, summary = convert_refusing(model, recipe_name, args)
        out(f"\nper-layer report, recipe {recipe_name}:")
        out(table(rows))
        out(summary)
    model.to(env.device)
    if args.tp > 1:  # torchtitan's order: convert (above), tensor-parallelize, then fully_shard over dp
        apply_tensor_parallel(model, env.mesh["tp"])
        line = sequence_bytes_line(model, args)
        if line:
            out(line)
    if args.compile:  # per block, before fully_shard; the compiled forward leaves parameter names and hooks as they are
        for block in model.layers:
            block.forward = torch.compile(block.forward, mode=args.compile_mode)
    pdt = torch.bfloat16 if args.param_dtype == "bf16" else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=pdt, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        fully_shard(block, mesh=env.mesh["dp"], mp_policy=mp, shard_placement_fn=expert_placement(args),
                    reshard_after_forward=reshard_after_forward(args, i, len(model.layers)))
    fully_shard(model, mesh=env.mesh["dp"], mp_policy=mp)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **adamw_impl(args.adamw_impl))
    if recipe_name in TORCHAO_RECIPES:  # the next float8 all-gathers' scales, one fused all-reduce (a collective)
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(model))
    return model, optimizer


def adamw_impl(name: str) -> dict:
    """torch.optim.AdamW's keyword for --adamw-impl. fused: one kernel per group of tensors per step; foreach (the
    default of torch.optim on CUDA) runs a kernel per operation over every parameter, ~3x the GPU time: 25.3 of the
    1B step's 245 GPU ms (one H200, 2026-11-28), the same for every recipe."""
    return {"fused": True} if name == "fused" else {"foreach": True}


def mark_cuda_graph_step(args) -> None:
    """With CUDA graphs (--compile-mode reduce-overhead / max-autotune) a new forward starts a new graph step: the
    previous step's outputs may be overwritten from here on."""
    if args.compile and args.compile_mode in ("reduce-overhead", "max-autotune"):
        torch.compiler.cudagraph_mark_step_begin()


def evaluate(model, data: ByteBatches, args, env: Env) -> float:
    model.eval()
    total = torch.zeros(1, device=env.device)
    with torch.no_grad():
        for x, y in data.val_batches(args.eval_batches):
            x, y = x.to(env.device), y.to(env.device)
            mark_cuda_graph_step(args)
            total += F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    model.train()
    return all_mean(total / max(args.eval_batches, 1), env)


def start_state(recipe_name: str, ck: dict, model, optimizer, args, env: Env, out: Printer) -> tuple[int, list]:
    """(first step, loss history) of this run: from the verified checkpoint chosen by the pre-flight, from
    --init-state, or step 0."""
    if ck["resume_from"] is not None:
        folder, saved = ck["resume_from"], ck["train_state"]
        checkpoint.load(folder, model, optimizer)
        # the optimizer's param groups come back as saved: this run's weight decay applies from here on
        optimizer.param_groups[0]["weight_decay"] = args.weight_decay
        start, losses = saved["step"], list(saved["losses"])
        saved_dp, saved_tp = saved.get("dp"), saved.get("tp", 1)
        across = ""
        if saved_dp not in (None, args.dp) or saved_tp != args.tp:  # DCP reshards the DTensors to this layout
            across = (f" (saved with dp={saved_dp}, now dp={args.dp})" if saved_tp == args.tp == 1 else
                      f" (saved with dp={saved_dp} x tp={saved_tp}, now dp={args.dp} x tp={args.tp})")
        out(f"[{recipe_name}] resumed from {folder} at step {start}{across}")
        for note in ck["notes"]:
            out(f"[{recipe_name}] changed since the checkpoint: {note}")
        if args.dump_state:
            checkpoint.dump_full_state(pathlib.Path(args.dump_state), f"{recipe_name}_loaded", start, losses, model,
                                       optimizer, env.world, env.main)
        return start, losses
    if args.init_state:
        st = checkpoint.init_from_full_state(pathlib.Path(args.init_state), model, optimizer)
        out(f"[{recipe_name}] started from the full state in {args.init_state} at step {st['step']}")
        return st["step"], list(st["losses"])
    return 0, []


def train_step(model, optimizer, x: torch.Tensor, y: torch.Tensor, args, quantized: bool) -> torch.Tensor:
    """One optimizer step on the batch (x, y) already on the device: forward, cross-entropy, backward, gradient
    clipping, AdamW, and (quantized runs) the next all-gathers' scales and forward payloads. Returns the loss tensor without waiting
    for it (benchmarks/profile_step.py times and profiles exactly this)."""
    mark_cuda_graph_step(args)
    logits = model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    aux = model.aux_loss()  # MoE load balancing (logged: the cross-entropy alone)
    (loss if aux is None else loss + args.moe_aux_weight * aux).backward()
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if quantized:  # the next all-gathers' global amaxes, one fused all-reduce (and the next forward's payloads)
        hybridq.precompute_scales(model, payloads=args.precompute_payloads != "off",
                                  per_unit=args.precompute_payloads == "per_unit")
    return loss


def issue_step(step: int, model, optimizer, data: ByteBatches, args, env: Env, quantized: bool,
               lr: float | None = None) -> torch.Tensor:
    """Step `step` issued to the device without waiting for it: its random stream reseeded, its batch copied from
    pinned host memory (a copy from pageable memory would make the host wait for the device's queue to drain), then
    `train_step`. Returns the loss tensor. lr: set on every param group first (None: left as it is)."""
    if lr is not None:
        for gr in optimizer.param_groups:
            gr["lr"] = lr
    # stochastic rounding and anything else random: a function of (seed, step, rank) only
    torch.manual_seed((args.seed * 1_000_003 + step) * 4099 + env.dp_rank)  # (TP ranks share a batch)
    x, y = data.get(step)
    if env.device.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
    return train_step(model, optimizer, x, y, args, quantized)


class StepWindow:
    """The losses of the steps issued since the host last read them. [Note: the host runs ahead]: a step's loss is
    read (all-reduced, copied to the host) only for a window of steps -- closed every --sync-every steps, on the
    first and last step and before a checkpoint -- as torchtitan reads it only on its logging steps. Between reads
    nothing waits, so the host issues the next steps while the device still runs the earlier ones, and a phase where
    the host is slower than the device (the forward's FSDP2 hooks) overlaps device work queued before it.

    A closed window's losses are all-reduced and copied to pinned host memory behind its last step, with an event
    after them, and read only once the NEXT step is issued: the host then waits for that event alone, while the next
    step stays queued, so the device does not drain at a read (a read right after the window's last step would leave
    it idle until the host issued enough of the next step). Only a checkpoint and the last step read at once (the
    checkpoint must not see the next step's updates). A non-finite loss is reported with its step when its window is
    read -- one step later, before anything is saved.

    A step's time is the device's: from the end of the previous step's work on the device to the end of its own (an
    event recorded after each step), so it counts the time the device waited for the host within the step and not
    when the host happened to read; on the CPU, where the host runs the work, the host's."""

    def __init__(self, env: Env):
        self.env = env
        self.cuda = env.device.type == "cuda"
        self.steps: list[tuple] = []  # (step, loss, lr, bytes, end mark)
        self.closed = None  # (steps, losses on the host or on their way, event or None)
        self.restart()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def restart(self) -> None:
        """The next step's time starts here (not, e.g., before a checkpoint's save)."""
        self.prev = self._mark()

    @staticmethod
    def due(n: int, start: int, end: int, every: int) -> bool:
        return n % every == 0 or n == end or n == start + 1

    def step_issued(self, n: int, loss: torch.Tensor, lr: float, sent: dict, close: bool,
                    read_now: bool = False) -> list[tuple[int, float, float, dict, float]]:
        """Step n was just issued (its loss tensor, lr, bytes sent): returns (step, loss, lr, bytes, seconds) of
        every step whose loss is read now -- the window closed before step n (now that step n is queued behind it),
        and with `read_now` this step's window too (close: this step ends its window)."""
        end = self._mark()
        rows = self._read() if self.closed is not None else []
        self.steps.append((n, loss.detach(), lr, sent, end))
        if close or read_now:
            self._close()
            if read_now:
                rows += self._read()
        return rows

    def _close(self) -> None:
        losses = torch.stack([s[1].float() for s in self.steps])
        dist.all_reduce(losses)
        event = None
        if self.cuda:
            host = torch.empty(losses.shape, dtype=losses.dtype, pin_memory=True)
            host.copy_(losses, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            losses = host
        self.closed, self.steps = (self.steps, losses, event), []

    def _read(self) -> list[tuple[int, float, float, dict, float]]:
        steps, losses, event = self.closed
        self.closed = None
        if event is not None:
            event.synchronize()  # (the window's last step and its copy; later steps stay queued)
        rows = []
        for (n, _, lr, sent, end), v in zip(steps, losses.tolist()):
            dt = self.prev.elapsed_time(end) / 1e3 if self.cuda else end - self.prev
            rows.append((n, v / self.env.world, lr, sent, dt))
            self.prev = end
        return rows


class GarbageCollection:
    """Python's garbage collector during training, as torchtitan runs it: what set-up allocated (modules,
    parameters, optimizer state) is frozen, the automatic collector is off, and the young generations are
    collected every `every` steps at a step boundary. With it on, a full collection walks every object of the
    process and lands on whichever step crosses its threshold (a quantized step allocates more short-lived Python
    objects, so it crosses more often): tens of ms on random steps. every=0 leaves Python's automatic collection."""

    def __init__(self, every: int):
        self.every = every
        if every > 0:
            gc.collect()
            gc.freeze()
            gc.disable()

    def step(self, n: int) -> None:
        if self.every > 0 and n % self.every == 0:
            gc.collect(1)

    def close(self) -> None:
        if self.every > 0:
            gc.enable()
            gc.unfreeze()


def train_one(recipe_name: str, args, env: Env, out: Printer, tokens: torch.Tensor, ck: dict,
              metrics: MetricsFile) -> dict:
    memory = PeakMemory(env)
    memory.reset()  # this run's peak, not the previous run's of this process
    if args.compile:
        compile_report.reset()
    model, optimizer = build(recipe_name, args, env, out)
    data = ByteBatches(tokens, args.seq, args.batch, dp_rank=env.dp_rank, dp_size=args.dp, seed=args.seed)
    quantized = recipe_name != BASELINE
    run_dir = ck["run_dir"]
    meta = run_meta(recipe_name, args)
    start, losses = start_state(recipe_name, ck, model, optimizer, args, env, out)
    end = args.steps if args.stop_after is None else min(args.steps, args.stop_after)
    if start >= end:
        out(f"[{recipe_name}] nothing to do: the run is at step {start}, "
            + (f"--steps is {args.steps}" if end == args.steps else f"--stop-after is {args.stop_after}")
            + " (pass a larger --steps to train further); the summary shows the saved state")

    tokens_per_step = args.dp * args.batch * args.seq
    times, tps = [], []
    sent = {k: [] for k in KINDS}  # this rank's bytes per step and wire (comm.py)
    mem_label = memory.label
    t_run = time.perf_counter()
    collector = GarbageCollection(args.gc_every)
    window = StepWindow(env)
    with CommCounter(env.mesh["tp"].get_group() if args.tp > 1 else None) as comms:
        for step in range(start, end):
            sent0 = dict(comms.bytes)
            collector.step(step)
            lr = lr_at(step, args)
            loss = issue_step(step, model, optimizer, data, args, env, quantized, lr)
            n = step + 1
            saving = run_dir is not None and args.save_every and (n % args.save_every == 0 or n == args.steps)
            for n_i, loss_val, lr_i, sent_i, dt in window.step_issued(
                    n, loss, lr, {k: comms.bytes[k] - sent0[k] for k in KINDS},
                    close=window.due(n, start, end, args.sync_every), read_now=saving or n == end):
                losses.append(loss_val)
                times.append(dt)
                tps.append(tokens_per_step / dt)
                for k in KINDS:
                    sent[k].append(sent_i[k])
                if not math.isfinite(loss_val):
                    raise ConfigError(f"[{recipe_name}] loss is {loss_val} at step {n_i}")
                if n_i % args.log_every == 0 or n_i == end or n_i == start + 1:
                    mem = memory.read()
                    out(f"[{recipe_name}] step {n_i:>{len(str(args.steps))}}/{args.steps} | loss {loss_val:.4f} | "
                        f"lr {lr_i:.2e} | {tokens_per_step / dt:>9,.0f} tok/s | step {dt * 1e3:7.1f} ms | "
                        f"{mem_label} {fmt_bytes(mem)}")
                    metrics.write("step", recipe=recipe_name, step=n_i, steps=args.steps, loss=loss_val, lr=lr_i,
                                  tokens_per_s=tokens_per_step / dt, step_ms=dt * 1e3, peak_memory_bytes=mem,
                                  peak_memory_kind=mem_label,
                                  **{f"{k}_bytes": sent_i[k] for k in step_wires(args)})
                if args.compile and n_i == start + 1:  # (the first step compiled every block)
                    out(compile_report.line(recipe_name, compile_report.summary()))
            done = n - start
            out.progress(recipe_name, n, args.steps, (time.perf_counter() - t_run) / done * (end - n))
            if saving:
                # no RNG state: step s reseeds from (seed, s, rank); no loader state: batches are a pure function
                # of (seed, s, rank, dp); so this is the whole job state, for any world size that resumes it
                train_state = {"step": n, "losses": losses, "seed": args.seed, "dp": args.dp, "tp": args.tp,
                               "world": env.world}
                folder, pruned = checkpoint.save(run_dir, n, model, optimizer, train_state, meta, env.main,
                                                 args.keep_last)
                if args.dump_state:
                    checkpoint.dump_full_state(pathlib.Path(args.dump_state), f"{recipe_name}_saved", n, losses, model,
                                               optimizer, env.world, env.main)
                removed = f" (removed {', '.join(p.name for p in pruned)}: --keep-last {args.keep_last})"
                out(f"[{recipe_name}] saved checkpoint {folder}" + (removed if pruned else ""))
                window.restart()  # (the save's time is not a step's)
    out.end_progress()
    collector.close()
    val = evaluate(model, data, args, env) if end == args.steps and args.eval_batches > 0 else float("nan")
    steady = times[1:] if len(times) > 1 else times  # the first step includes warm-up work
    result = {
        "recipe": recipe_name, "start_step": start, "steps_run": len(times), "losses": losses,
        "step_times_s": times, "tokens_per_s": tps, "tokens_per_step": tokens_per_step,
        "final_loss": statistics.fmean(losses[-max(1, len(losses) // 10):]) if losses else float("nan"),
        "val_loss": val,
        "median_step_s": statistics.median(steady) if steady else None,
        "median_tokens_per_s": tokens_per_step / statistics.median(steady) if steady else None,
        "peak_memory_bytes": memory.read(), "peak_memory_kind": mem_label,
        # rank 0's bytes per step (the metrics file's), per wire; tp: None without tensor parallelism
        **{f"{k}_bytes_per_step": statistics.median(sent[k]) if sent[k] and k in step_wires(args) else None
           for k in KINDS},
        "grad_reduce": grad_reduce_of(recipe_name, args),
        **(compile_report.summary() if args.compile else {}),
        "wall_s": time.perf_counter() - t_run,
    }
    metrics.write("summary", **result)
    del model, optimizer
    if env.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# ---- main ----------------------------------------------------------------------------------------

def check_only(args, world: int) -> int:
    plan = preflight(args, world)
    print(describe_plan(args, world, plan), flush=True)
    return 0


def run(args, world: int) -> int:
    """The job on this rank; returns its exit code. A refusal met after the process group exists is reported here,
    by rank 0, before any rank exits: every rank meets it at the same point (each refusal is a pure function of the
    flags or was agreed in a collective), and torchrun stops the other ranks as soon as one exits with an error."""
    check_args(args, world)  # pure: every rank refuses the same flags before any collective
    env = init_distributed(args, world)
    out = Printer(env.main, bar=not args.no_progress)
    locked: list[pathlib.Path] = []  # (rank 0's)
    try:
        plan = on_rank0_then_broadcast(lambda: preflight(args, world), env)
        if args.save_every or args.overwrite:  # one job per checkpoint folder, before anything is deleted or written
            for note in on_rank0_then_broadcast(lambda: take_locks(plan, locked), env):
                out(note)
        if args.overwrite and env.main:
            for name, e in plan.items():
                if e["run_dir"] is not None and checkpoint.holds_checkpoints(e["run_dir"]):
                    out(f"removing the checkpoints in {e['run_dir']} (--overwrite)")
                    checkpoint.clear_for_fresh_run(e["run_dir"])
        dist.barrier()
        cfg = model_config(args)
        tokens = load_tokens(corpus_bytes=args.corpus_bytes)
        names = runs(args)
        metrics_path = args.metrics or (str(pathlib.Path(args.plot).with_suffix(".jsonl")) if args.plot else None)
        metrics = MetricsFile(metrics_path, env.main)
        metrics.write("config", args=vars(args), world_size=env.world, backend=env.backend, device=str(env.device),
                      device_name=(torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu"),
                      torch=torch.__version__, hybridq=hybridq.__version__)
        out(f"hybridq {hybridq.__version__}, torch {torch.__version__}: {env.world} process(es), {env.backend} on "
            f"{env.device.type}, FSDP2 dp={args.dp} tp={args.tp}; runs: {', '.join(names)}")
        out(f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, hidden {cfg.hidden}, heads {cfg.n_heads}"
            f"/{cfg.n_kv_heads} kv, vocab {cfg.vocab_size} (bytes), {cfg.num_params() / 1e6:.2f}M params, "
            f"{'tied' if cfg.tie_embeddings else 'untied'} head"
            + (f", MoE {cfg.moe_experts} experts top-{cfg.moe_top_k} (expert weights sharded "
               f"{'Shard(1): rows of every expert' if expert_placement(args) else 'Shard(0): whole experts'}, "
               f"load-balancing loss x {args.moe_aux_weight})" if cfg.moe_experts else "")
            + f"; data: {len(tokens):,} bytes; "
            f"{args.dp * args.batch * args.seq:,} tokens/step (seq {args.seq} x batch {args.batch} x dp {args.dp})")
        results = [train_one(name, args, env, out, tokens, plan[name], metrics) for name in names]
        gap = summarize(results, out)
        if gap:
            metrics.write("gap", **gap)
        metrics.close()
        if metrics_path:
            out(f"metrics: {metrics_path}")
        if args.plot and env.main:
            write_plot(args.plot, pathlib.Path(metrics_path), out)
        dist.barrier()
        return 0
    except REFUSALS as e:
        if env.main:
            print(f"train.py: {e}", file=sys.stderr, flush=True)
        release_locks(locked)
        dist.barrier()  # rank 0 has reported and released its locks: now every rank may exit
        return 1
    finally:
        release_locks(locked)
        dist.destroy_process_group()


def main(args, world: int) -> int:
    """The job for parsed `args` (train.py parsed and checked them) on `world` processes; returns the exit code. A
    known refusal is one message on stderr (rank 0 only) and exit 1."""
    # hybridq.Linear returns a reshaped (view) output; the job never modifies a module output in place
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    try:
        if args.check_only:
            return check_only(args, world)
        return run(args, world)
    except REFUSALS as e:  # (refused before the process group existed)
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: {e}", file=sys.stderr, flush=True)
        return 1

"""The training job's flags and their validation: everything checked before any process group exists.

Nothing here imports torch: `train.py --help` and a refused flag are answered before torch is imported (seconds on a
loaded machine). The checks that need torch (the format and tensor-parallel layout rules on a meta-device model, the
checkpoint folder) are train.py's pre-flight (trainer.preflight). `train.py --check-only` runs both in a single
process; launch/run.sh calls it before torchrun, so a refusal is one message and a non-zero exit. The workers run
the same checks again (users also call torchrun directly).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util

from model_config import ALIGN, HIDDEN_MULTIPLE, VOCAB_SIZE, ModelConfig, default_hidden

BASELINE = "bf16"
TORCHAO = "torchao_float8"  # baseline: torchao float8 training (tensorwise, float8 all-gather); needs torchao
# baseline for --moe: TORCHAO's Linears plus torchao's MoE training conversion of the experts (FP8 rowwise grouped
# GEMMs, torchao.prototype.moe_training); needs torchao and CUDA (torchao_moe.py)
TORCHAO_MOE = "torchao_moe"
TORCHAO_RECIPES = (TORCHAO, TORCHAO_MOE)
# --grad-reduce: the wire of FSDP2's gradient reduce-scatter (hybridq.apply_hybrid_fsdp(grad_reduce=...))
GRAD_WIRES = {"fp32": "in fp32 (FSDP2's own)", "bf16": "as bf16, summed in fp32 by the receiving rank (hybridq)",
              "mxfp8": "as mxfp8 (MXFP8 blocks of 32), summed in fp32 by the receiving rank (hybridq)"}
# hybridq.preset_names(), listed here so that --help needs no torch (tests/test_train_job.py keeps them equal)
PRESETS = ("fp8_tensorwise", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd",
           "fp8_block_fwd_mxfp8_bwd", "fp8_fwd_high_precision_bwd", "fp8_rowwise")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # no "(default: None/False)" noise
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    names = [BASELINE, *PRESETS, *TORCHAO_RECIPES]
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
    g.add_argument("--reshard-after-forward", default="default", choices=["default", "always", "never"],
                   help="FSDP2's reshard_after_forward per block, torchtitan's policy: default = every block but the "
                        "last (whose backward starts right after the forward: no second all-gather of it; every "
                        "block under CUDA graphs, where a kept block re-records the graphs each step), always, never "
                        "(every block's gathered weights kept from forward to backward: more memory)")
    g.add_argument("--norms", default="auto", choices=["auto", "hybridq", "model"],
                   help="the RMSNorm and SwiGLU feed-forward modules: auto: hybridq.nn.RMSNorm / SwiGLU in hybridq "
                        "recipes' runs (their conversion swaps them in), the model's own in "
                        f"'{BASELINE}' / torchao runs; hybridq: in every run (to measure their kernels apart from "
                        "quantization); model: never")
    g = p.add_argument_group("parallelism")
    g.add_argument("--dp", type=int, default=None, help="data-parallel (FSDP) size; default: world size / tp")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (sequence parallelism included; hybridq's styles)")
    g.add_argument("--grad-reduce", default="fp32", choices=list(GRAD_WIRES),
                   help="the wire of FSDP2's gradient reduce-scatter in the hybridq recipes' runs (apply_hybrid_fsdp's "
                        "grad_reduce): fp32 (FSDP2's own, reduce_dtype), bf16 (0.5x the bytes) or mxfp8 (~0.26x); each "
                        "rank sums what it receives in fp32. The bf16 / torchao baselines reduce in fp32")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: one GPU per process with NCCL when CUDA is available, else CPU with gloo")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder block before fully_shard (torchtitan's practice); the hybridq "
                        "Linears compile into the block's graph with either --weight-gather (quantized: the gathered "
                        "weight enters the graph as a handle, no graph break)")
    g.add_argument("--compile-mode", default=None, choices=["default", "reduce-overhead", "max-autotune",
                                                            "max-autotune-no-cudagraphs"],
                   help="torch.compile's mode for --compile (reduce-overhead: CUDA graphs)")
    g.add_argument("--weight-gather", default="quantized", choices=["quantized", "high_precision"],
                   help="quantized: FSDP2 all-gathers each converted weight in the recipe's weight format "
                        "(hybridq.apply_hybrid_fsdp); high_precision: in param_dtype, each Linear quantizing its "
                        "gathered weight itself every call (hybridq.convert_linears; twice the all-gather bytes of "
                        "FP8). Not with --moe")
    g.add_argument("--precompute-payloads", default="per_unit", choices=["per_unit", "per_model", "off"],
                   help="after each optimizer step, prepare the next forward's all-gather payloads of the weights the "
                        "unit cast takes (per-tensor FP8, 128x128 tiles) with hybridq.precompute_scales(payloads=True): "
                        "one cast + quantize per FSDP2 unit (per_unit) or per model (per_model), so the forward's "
                        "hooks quantize nothing; held until the forward unshard (~1 byte per local weight element); "
                        "off: each forward unshard quantizes")
    g = p.add_argument_group("model")
    g.add_argument("--d-model", type=int, default=128, help=f"model width (multiple of {ALIGN})")
    g.add_argument("--n-layers", type=int, default=2, help="decoder blocks (one FSDP2 unit each)")
    g.add_argument("--n-heads", type=int, default=4, help="attention heads")
    g.add_argument("--n-kv-heads", type=int, default=None,
                   help="key/value heads for grouped-query attention (default: n-heads)")
    g.add_argument("--hidden", type=int, default=None, help="SwiGLU hidden size (default: ~8/3 d-model, "
                   f"rounded up to a multiple of {HIDDEN_MULTIPLE}: {default_hidden(128)} for d-model 128)")
    g.add_argument("--tie-embeddings", action="store_true", help="the head reuses the embedding matrix")
    g.add_argument("--moe", type=int, default=0, metavar="E",
                   help="replace every SwiGLU MLP by a routed mixture of E SwiGLU experts (grouped GEMMs)")
    g.add_argument("--top-k", type=int, default=1, metavar="K", help="experts per token (with --moe)")
    g.add_argument("--moe-aux-weight", type=float, default=0.01,
                   help="weight of the load-balancing loss added to the cross-entropy (with --moe)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=100, help="optimizer steps (sets the lr schedule)")
    g.add_argument("--seq", type=int, default=128, help="sequence length")
    g.add_argument("--batch", type=int, default=8, help="sequences per data-parallel rank per step")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay ends at lr * this")
    g.add_argument("--warmup", type=int, default=None, help="linear warm-up steps (default: 10%% of --steps)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    g.add_argument("--adamw-impl", default="fused", choices=["fused", "foreach"],
                   help="AdamW's implementation: fused (one kernel per group of tensors and step, torchtitan's "
                        "default) or foreach (a kernel per operation: ~3x the optimizer's GPU time)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: off)")
    g.add_argument("--seed", type=int, default=0, help="initial weights, batches, random rounding")
    g.add_argument("--eval-batches", type=int, default=4, help="held-out batches for the final val loss")
    g.add_argument("--corpus-bytes", type=int, default=0, metavar="N",
                   help="train on N bytes from the corpus generator (data.py, same grammar and seed) instead of the "
                        "shipped 200 KB corpus.txt, for runs long enough to memorize that (e2e_report --parity); "
                        "0: corpus.txt")
    g.add_argument("--gc-every", type=int, default=50, metavar="N",
                   help="Python garbage collection: freeze what set-up allocated, turn the automatic collector off "
                        "and collect the young generations every N steps (torchtitan's practice); 0: automatic")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", default=None,
                   help="DCP checkpoints (model + optimizer) go to DIR/<recipe>/step_NNNNNN")
    g.add_argument("--save-every", type=int, default=0, help="save every N steps (and after the last step)")
    g.add_argument("--keep-last", type=int, default=0, metavar="N",
                   help="keep only the newest N checkpoints of each recipe (0: keep all)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --checkpoint-dir, after verifying it; refused "
                        "when there is none, when it is damaged or when its configuration does not fit")
    g.add_argument("--overwrite", action="store_true",
                   help="without --resume: delete the checkpoints an earlier run left in --checkpoint-dir "
                        "(refused without this flag)")
    g.add_argument("--stop-after", type=int, default=None,
                   help="stop after this step as if interrupted (for testing resume)")
    g.add_argument("--dump-state", default=None, metavar="DIR",
                   help="also write the gathered full model + optimizer state (torch.save, one file per event) "
                        "to DIR at every save and right after a resume, for comparing states across world sizes")
    g.add_argument("--init-state", default=None, metavar="FILE",
                   help="start from a --dump-state file (its step, losses, model and optimizer) instead of step "
                        "0; the reference path that does not go through DCP resharding")
    g = p.add_argument_group("output")
    g.add_argument("--log-every", type=int, default=1, help="per-step line every N steps")
    g.add_argument("--sync-every", type=int, default=10, metavar="N",
                   help="read the losses (check them, print their lines) every N steps, and on the first and last "
                        "step and before a checkpoint; in between the host issues the next steps while the device "
                        "runs (torchtitan reads the loss on its logging steps only); a window is read once the next "
                        "step is queued; a step's time is the device's, end of step to end of step; 1: every step")
    g.add_argument("--no-progress", action="store_true", help="no progress bar (shown only on a terminal)")
    g.add_argument("--metrics", default=None, metavar="FILE.jsonl",
                   help="write the metrics as JSON lines (config, one record per logged step, a summary per run, "
                        "the gap) to FILE.jsonl")
    g.add_argument("--plot", default=None, metavar="OUT.png",
                   help="write loss curves (recipe vs compare) to OUT.png (needs matplotlib); the metrics go to "
                        "--metrics, or OUT.jsonl")
    g.add_argument("--timeout", type=float, default=600, help="process-group timeout in seconds")
    g.add_argument("--check-only", action="store_true",
                   help="check the flags and the checkpoint folder for a world of $WORLD_SIZE processes "
                        "(default 1), say what the run would do, and exit (run.sh does this before torchrun)")
    return p.parse_args(argv)


def model_config(args) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB_SIZE, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                       n_kv_heads=args.n_kv_heads, hidden=args.hidden, max_seq=max(args.seq, 1),
                       tie_embeddings=args.tie_embeddings, moe_experts=args.moe, moe_top_k=args.top_k)


class ConfigError(Exception):
    """A refused configuration; the message says which flag and why."""


def runs(args) -> list[str]:
    return [args.recipe] + ([args.compare] if args.compare else [])


def check_args(args, world: int) -> None:
    """Everything that can be wrong with the flags, checked identically on every rank before any collective
    (ConfigError listing every problem). Sets args.dp when it was left to the default."""
    errors = []
    if args.tp < 1:
        errors.append(f"--tp {args.tp} must be >= 1")
    dp = args.dp if args.dp is not None else world // max(args.tp, 1)
    if dp * args.tp != world:
        errors.append(f"--dp {dp} x --tp {args.tp} = {dp * args.tp} must equal the number of processes ({world})")
    args.dp = dp
    if args.steps < 1:
        errors.append("--steps must be >= 1")
    if args.seq < 1 or args.batch < 1:
        errors.append("--seq and --batch must be >= 1")
    if args.corpus_bytes < 0:
        errors.append(f"--corpus-bytes must be >= 0, got {args.corpus_bytes}")
    if (args.seq * args.batch) % ALIGN:
        errors.append(f"--seq {args.seq} x --batch {args.batch} = {args.seq * args.batch} tokens per rank per step "
                      f"must be a multiple of {ALIGN} (MXFP8 and NVFP4 quantize activations in blocks of 32 "
                      "along the token dimension for the weight-gradient GEMM)")
    if args.moe < 0 or (args.moe and not 1 <= args.top_k <= args.moe) or (not args.moe and args.top_k != 1):
        errors.append(f"--moe {args.moe} --top-k {args.top_k}: --moe must be >= 0 and --top-k in [1, --moe] "
                      f"(--top-k only with --moe)")
    if args.compile_mode is not None and not args.compile:
        errors.append(f"--compile-mode {args.compile_mode}: needs --compile")
    if args.grad_reduce != "fp32" and args.weight_gather == "high_precision":
        errors.append(f"--grad-reduce {args.grad_reduce}: needs --weight-gather quantized (the wire is installed by "
                      "hybridq.apply_hybrid_fsdp; --weight-gather high_precision converts with convert_linears)")
    if args.grad_reduce != "fp32" and all(r in (BASELINE, *TORCHAO_RECIPES) for r in runs(args)):
        errors.append(f"--grad-reduce {args.grad_reduce}: applies to hybridq recipes only (the bf16 / torchao "
                      f"baselines reduce in fp32), and this invocation runs none ({', '.join(runs(args))})")
    if args.moe and args.weight_gather == "high_precision":
        errors.append("--weight-gather high_precision: not with --moe (the expert weights are converted by "
                      "apply_hybrid_fsdp only); use --weight-gather quantized")
    if args.compare == args.recipe:
        errors.append(f"--compare {args.compare} is the same as --recipe")
    for flag in ("save_every", "keep_last", "eval_batches"):
        if getattr(args, flag) < 0:
            errors.append(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 0")
    for flag in ("log_every", "sync_every"):  # (steps between lines / reads: 0 or less has no meaning)
        if getattr(args, flag) < 1:
            errors.append(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    if args.stop_after is not None and args.stop_after < 1:
        errors.append(f"--stop-after {args.stop_after}: must be >= 1")
    if (args.save_every or args.resume or args.keep_last or args.overwrite) and not args.checkpoint_dir:
        errors.append("--save-every / --resume / --keep-last / --overwrite need --checkpoint-dir")
    if args.resume and args.overwrite:
        errors.append("--resume and --overwrite contradict each other (continue the run, or delete it)")
    if args.resume and args.init_state:
        errors.append("--resume and --init-state both set the starting state: pass one")
    try:
        cfg = model_config(args)
        cfg.check()
        errors += tp_problems(args, cfg)
    except ValueError as e:
        errors.append(str(e))
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        errors.append(f"--plot {args.plot} needs matplotlib, which is not installed here: pip install matplotlib (or "
                      "pip install -e '.[launch]'), or drop --plot (--metrics FILE.jsonl keeps the numbers)")
    if TORCHAO in (args.recipe, args.compare):
        try:
            import torchao.float8  # noqa: F401
        except Exception as e:  # identical on every rank
            errors.append(f"{TORCHAO} (the torchao float8 baseline) needs torchao, which is not importable here "
                          f"({type(e).__name__}: {e}); install it (pip install torchao) or pick another recipe")
    if TORCHAO_MOE in (args.recipe, args.compare):
        errors += torchao_moe_problems(args)
    if errors:
        raise ConfigError("\n  ".join(["invalid arguments:"] + errors))


def torchao_moe_problems(args) -> list[str]:
    """Why the torchao_moe baseline cannot run with these flags here (identical on every rank): it needs an MoE
    model, torchao's MoE training (torchao.prototype.moe_training, torchao >= 0.18) and a CUDA device (its FP8
    grouped GEMMs, torch._scaled_grouped_mm, run on CUDA only). torch is imported only when it is asked for."""
    what = f"{TORCHAO_MOE} (torchao's MoE training conversion of the experts)"
    if not args.moe:
        return [f"{what} needs an MoE model: pass --moe E (it converts the expert weights)"]
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig  # noqa: F401
    except Exception as e:
        return [f"{what} needs torchao >= 0.18 with torchao.prototype.moe_training, which is not importable here "
                f"({type(e).__name__}: {e}); install it (pip install torchao) or pick another recipe"]
    import torch
    if args.device == "cpu" or not torch.cuda.is_available():
        return [f"{what} needs a CUDA device (torchao's FP8 grouped GEMMs, torch._scaled_grouped_mm, run on CUDA "
                f"only); {'--device cpu' if args.device == 'cpu' else 'no CUDA device is visible here'}"]
    return []


def tp_problems(args, cfg: ModelConfig) -> list[str]:
    """What the model and flags must satisfy for --tp, before any format rule (the pre-flight's
    parallel.layout_problems checks those on the converted model)."""
    tp, out = args.tp, []
    if tp == 1:
        return out
    for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads), ("--seq", args.seq)):
        if n % tp:
            out.append(f"--tp {tp}: {what}={n} must be a multiple of the tensor-parallel size")
    if cfg.tie_embeddings:
        out.append(f"--tp {tp}: tied embeddings are not tensor-parallelized here; drop --tie-embeddings")
    for name in TORCHAO_RECIPES:
        if name in (args.recipe, args.compare):
            out.append(f"--tp {tp}: the {name} baseline is not tensor-parallelized here")
    if args.moe:
        out.append(f"--tp {tp}: MoE layers are not tensor-parallelized yet; use --tp 1 with --moe")
    return out


def run_meta(recipe: str, args) -> dict:
    """The configuration record saved with each checkpoint (checkpoint.compare_config reads it on resume)."""
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    return {"recipe": recipe, "model": dataclasses.asdict(model_config(args)), "seq": args.seq,
            "batch": args.batch, "seed": args.seed, "param_dtype": args.param_dtype,
            "quantize_head": args.quantize_head, "steps": args.steps, "lr": args.lr,
            "min_lr_ratio": args.min_lr_ratio, "warmup": warmup, "weight_decay": args.weight_decay,
            "grad_clip": args.grad_clip, "moe_aux_weight": args.moe_aux_weight,
            "dp": args.dp}  # dp recorded only: a checkpoint resumes under any dp

"""Activation-memory benchmark: the launch model (launch/model.py) in bf16 vs every hybridq preset, each in three
modes, one process, forward + backward (no optimizer step: its memory is the same in every mode).

Modes:
- plain: what each block saves stays in device memory until its backward;
- offload: each block under `hybridq.CPUOffload(pin_memory=True).layer()` (saved tensors copied to pinned CPU
  memory after the block's forward, brought back one block ahead in backward);
- recompute: each block under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` (only the block's
  inputs are kept; the block runs again in backward).

Per (preset, mode): saved bytes per block (measured with saved_tensors_hooks by benchmarks/saved_bytes.py: the distinct
storages a block saves for backward, quantized activations counted part by part, parameters excluded; a hybridq
layer's quantized copy of its weight, held from forward to backward for dgrad, counts too: at small token counts
it can outweigh the activation savings; under
offload the same tensors are saved, and "offloaded/block" says how many bytes went to CPU memory), peak device
memory of a step (torch.cuda.max_memory_allocated; the CPU has no allocator statistics: "-"), both as ratios to
bf16 plain measured in the same run, and the median step time. The bf16 model is the same module with no
conversion; parameters are bf16 in every mode.

    python benchmarks/bench_memory.py                              # 1B config on the GPU: d 2048, 20 layers, seq 4096
    python benchmarks/bench_memory.py --presets mxfp8,nvfp4 --modes plain,recompute --json memory.json
    python benchmarks/bench_memory.py --smoke --device cpu         # tiny sizes on the CPU (the test suite runs this)

The default size is the end-to-end report's ~1B model and per-GPU batch (benchmarks/e2e_report.py: d_model 2048,
20 layers, 16 heads, SwiGLU hidden 5632, batch 4 x seq 4096); `--batch 2` halves the activations if a GPU is short.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch"))  # the job's modules

import hybridq  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from saved_bytes import SavedBytes  # noqa: E402

BF16 = "bf16"
MODES = ("plain", "offload", "recompute")
FULL = {"dim": 2048, "layers": 20, "heads": 16, "hidden": 5632, "seq": 4096, "batch": 4, "steps": 3}
SMOKE = {"dim": 64, "layers": 2, "heads": 2, "hidden": 192, "seq": 64, "batch": 2, "steps": 1}
GIB = 2 ** 30


def build(preset: str, cfg: ModelConfig, device: torch.device) -> Transformer:
    """The same initial weights for every preset (seeded), bf16 parameters; converted unless bf16."""
    torch.manual_seed(0)
    with device:
        model = Transformer(cfg)
    rope = (model.rope_cos, model.rope_sin)
    model.to(torch.bfloat16)
    model.rope_cos, model.rope_sin = rope  # (the rotary tables stay fp32, as in training)
    if preset != BF16:
        hybridq.convert_linears(model, hybridq.recipe(preset), on_incompatible="error")
    return model


def block_context(mode: str, offload: hybridq.CPUOffload | None, counter: SavedBytes | None):
    """The context a block runs in: the counter's (measuring pass), the offload's block, or nothing."""
    if counter is not None:
        return counter.layer()
    if mode == "offload":
        return offload.layer()
    import contextlib
    return contextlib.nullcontext()


def step(model: Transformer, tokens: torch.Tensor, mode: str, offload: hybridq.CPUOffload | None,
         counter: SavedBytes | None = None) -> None:
    """One forward + backward of next-token cross entropy, the blocks run as `mode` says."""
    from torch.utils.checkpoint import checkpoint

    s = tokens.shape[1]
    h = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos[:s], model.rope_sin[:s]
    for block in model.layers:
        with block_context(mode, offload, counter):
            if mode == "recompute":
                h = checkpoint(block, h, cos, sin, use_reentrant=False)
            else:
                h = block(h, cos, sin)
    logits = model.output(model.norm(h))
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    model.zero_grad(set_to_none=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(preset: str, mode: str, cfg: ModelConfig, tokens: torch.Tensor, steps: int,
            plain_saved: int | None) -> dict:
    """Saved bytes per block (a counting step; under offload, the plain mode's count `plain_saved` plus what the
    offload moved), peak memory and median time of `steps` timed steps after it."""
    device = tokens.device
    model = build(preset, cfg, device)
    offload = hybridq.CPUOffload(pin_memory=device.type == "cuda") if mode == "offload" else None
    if mode == "offload":  # the offload's own hooks would hide the tensors from the counter: warm up without it
        step(model, tokens, mode, offload)
        saved = plain_saved
    else:
        counter = SavedBytes(model)
        step(model, tokens, mode, offload, counter)
        saved = statistics.mean(counter.per_layer)
    times, peak, offloaded = [], None, 0.0
    for _ in range(steps):
        if offload is not None:
            offload.reset_stats()
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        step(model, tokens, mode, offload)
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            peak = max(peak or 0, torch.cuda.max_memory_allocated(device))
        if offload is not None:
            offloaded = offload.stats()["offloaded_bytes"] / cfg.n_layers
    del model, offload
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"preset": preset, "mode": mode, "saved_bytes_per_layer": saved, "offloaded_bytes_per_layer": offloaded,
            "peak_bytes": peak, "ms": statistics.median(times)}


def table(rows: list[dict]) -> str:
    base = next(r for r in rows if r["preset"] == BF16 and r["mode"] == "plain")
    lines = ["| preset | mode | saved bytes/layer | saved vs bf16 plain | offloaded/layer | peak GiB | "
             "peak vs bf16 plain | step ms |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = f"{r['peak_bytes'] / GIB:.2f}" if r["peak_bytes"] is not None else "-"
        peak_ratio = (f"{r['peak_bytes'] / base['peak_bytes']:.3f}"
                      if r["peak_bytes"] is not None and base["peak_bytes"] else "-")
        saved_ratio = f"{r['saved_bytes_per_layer'] / base['saved_bytes_per_layer']:.3f}"
        lines.append(f"| {r['preset']} | {r['mode']} | {r['saved_bytes_per_layer']:,.0f} | {saved_ratio} | "
                     f"{r['offloaded_bytes_per_layer']:,.0f} | {peak} | {peak_ratio} | {r['ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(hybridq.preset_names()),
                    help=f"comma list of hybridq presets ({BF16} always runs first, the reference)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    for k, v in FULL.items():
        ap.add_argument(f"--{k}", type=int, default=None, help=f"default {v} ({SMOKE[k]} with --smoke)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 timed step (CI on the CPU)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args(argv)
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else (SMOKE if args.smoke else FULL)[k]
             for k in FULL}
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES] + [p for p in args.presets.split(",")
                                                     if p not in hybridq.preset_names()]
    if unknown:
        ap.error(f"unknown mode or preset: {', '.join(unknown)}")
    if "plain" not in modes:
        modes.insert(0, "plain")  # the reference row, and the saved bytes of the offload rows
    warnings.filterwarnings("ignore", category=FutureWarning)
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = ModelConfig(d_model=sizes["dim"], n_layers=sizes["layers"], n_heads=sizes["heads"], hidden=sizes["hidden"],
                      max_seq=sizes["seq"])
    tokens = torch.randint(0, cfg.vocab_size, (sizes["batch"], sizes["seq"]),
                           generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for preset in [BF16, *args.presets.split(",")]:
        plain_saved = None
        for mode in modes:
            r = measure(preset, mode, cfg, tokens, sizes["steps"], plain_saved)
            plain_saved = r["saved_bytes_per_layer"] if mode == "plain" else plain_saved
            rows.append(r)
            print(f"{preset} {mode}: {r['saved_bytes_per_layer']:,.0f} saved bytes/layer, {r['ms']:.1f} ms",
                  file=sys.stderr, flush=True)
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"\nActivation memory, {name}, torch {torch.__version__}: {cfg.n_layers} layers, d_model {cfg.d_model}, "
          f"hidden {cfg.hidden}, {cfg.n_heads} heads, batch {sizes['batch']} x seq {sizes['seq']}, bf16 parameters; "
          f"forward + backward, median of {sizes['steps']} steps")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "sizes": sizes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

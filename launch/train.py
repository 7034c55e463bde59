"""The hybridq training job: a small Llama-style decoder trained with FSDP2 under torchrun.

    torchrun --standalone --nproc-per-node 2 launch/train.py --recipe mxfp8_fwd_nvfp4_bwd --compare bf16

This file is the entry point: it parses and checks the flags without importing torch (so `--help` and a refused
flag answer at once), then runs the job in trainer.py (its docstring describes the job; `import train;
train.build(...)` still reaches trainer's functions).
"""

from __future__ import annotations

import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from config import ConfigError, check_args, parse_args  # noqa: E402,F401 (parse_args: also train.parse_args)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_from_environment() -> int:
    if "RANK" not in os.environ:  # plain `python train.py`: a world of one, on a free port (runs side by side)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(_free_port()))
    return int(os.environ["WORLD_SIZE"])


def main(argv=None) -> int:
    """The job; returns the exit code. A refused flag is one message on stderr (rank 0 only) and exit 1, before
    torch is imported; argparse's own errors exit 2 as usual."""
    args = parse_args(argv)
    # --check-only checks for $WORLD_SIZE processes (run.sh sets it to torchrun's) without becoming a process group
    world = int(os.environ.get("WORLD_SIZE", "1")) if args.check_only else world_from_environment()
    try:
        check_args(args, world)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"train.py: {e}", file=sys.stderr, flush=True)
        return 1
    import trainer
    return trainer.main(args, world)


def __getattr__(name: str):
    """The job's functions (build, train_step, init_distributed, ...) live in trainer.py; reach them from here too
    (importing torch then)."""
    import trainer
    try:
        return getattr(trainer, name)
    except AttributeError:
        raise AttributeError(f"module 'train' has no attribute {name!r}") from None


if __name__ == "__main__":
    exit_code = main()
    # Leave without interpreter finalization. DTensor objects that outlive the run still reference the device
    # mesh, which keeps the gloo process group and its worker threads alive past destroy_process_group; a worker
    # still releasing the last collective's tensors then needs the GIL while the interpreter shuts down, and the
    # process aborts ("terminate called without an active exception"; about 1 run in 8 on loaded CPUs here;
    # pytorch/pytorch PR 179291 describes it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)

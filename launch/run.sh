#!/usr/bin/env bash
# The main job on a fresh machine, in one command:  bash launch/run.sh [train.py flags...]
#
# Installs what it needs (torch 2.13.0 only when torch is not importable -- a machine that has torch keeps
# it -- then this repository in editable mode), and trains the small Llama-style decoder with FSDP2 under
# torchrun: the hybrid recipe mxfp8_fwd_nvfp4_bwd against the bf16 baseline, same data and initial weights.
# CPU: 2 processes on gloo (a couple of minutes on 2 cores). GPUs: one process per GPU on NCCL.
# Extra arguments pass through to launch/train.py and override the defaults below (e.g. --steps 300,
# --recipe fp8_block, --plot loss.png, --checkpoint-dir ckpt --save-every 50, --resume).
set -euo pipefail
cd "$(dirname "$0")/.."

# the interpreter: $PYTHON, else the first of python3 / python that has torch, else python3 (and install torch)
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for c in python3 python; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" 2>/dev/null; then PY="$c"; break; fi
    done
fi
if [ -z "$PY" ]; then
    PY="$(command -v python3 || command -v python)"
    "$PY" -m pip install -q torch==2.13.0
fi

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")

# hybridq itself: skip when `import hybridq` (from outside the checkout) already finds this checkout
REPO="$(pwd -P)"
if ! (cd / && "$PY" -c "import hybridq, os, sys; sys.exit(0 if os.path.realpath(hybridq.__file__).startswith(sys.argv[1] + os.sep) else 1)" "$REPO") 2>/dev/null; then
    if [ "$NGPU" -gt 0 ]; then
        # against the installed CUDA torch, so the CUDA extension builds (see setup.py)
        "$PY" -m pip install -q --no-build-isolation -e .
    else
        "$PY" -m pip install -q -e . || "$PY" -m pip install -q --no-build-isolation -e .
    fi
fi

# torch.distributed.checkpoint (the job's checkpoints) needs numpy
"$PY" -c "import numpy" 2>/dev/null || "$PY" -m pip install -q numpy

# torch's OpenMP threads spin-wait: one thread per process is much faster on a few shared cores
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
NPROC=$(( NGPU > 0 ? NGPU : 2 ))

exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" launch/train.py \
    --recipe mxfp8_fwd_nvfp4_bwd --compare bf16 --steps 120 --log-every 10 "$@"

#!/usr/bin/env bash
# The main job on a fresh machine, in one command:  bash launch/run.sh [train.py flags...]
#
# Installs what it needs, saying what and why (numpy first: torch warns at import without it; torch 2.13.0
# only when torch is not importable -- a machine that has torch keeps it; then this repository in editable
# mode), checks the flags, the layout and the checkpoint folder (train.py --check-only: a refusal is one message and
# a non-zero exit, before any worker starts; e.g. --plot without matplotlib, a --hidden that does not split across
# --tp ranks, a read-only or busy --checkpoint-dir), and trains the small Llama-style decoder with FSDP2 under
# torchrun: the hybrid recipe mxfp8_fwd_nvfp4_bwd against the bf16 baseline, same data and initial weights.
# CPU: 2 processes on gloo (a couple of minutes on 2 cores). GPUs: one process per GPU on NCCL.
# Extra arguments pass through to launch/train.py and override the defaults below (e.g. --steps 300,
# --recipe fp8_block, --plot loss.png, --checkpoint-dir ckpt --save-every 50, --resume).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { echo "run.sh: $*" >&2; }
has() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)" "$1" 2>/dev/null; }

# the interpreter: $PYTHON, else the first of python3 / python that has torch, else python3 (and install torch);
# found without importing torch (an import before numpy is installed prints "Failed to initialize NumPy")
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for c in python3 python; do
        if command -v "$c" >/dev/null 2>&1 && PY="$c" has torch; then PY="$c"; break; fi
        PY=""
    done
fi
if [ -z "$PY" ]; then
    PY="$(command -v python3 || command -v python)"
fi

if ! has numpy; then
    say "installing numpy (torch.distributed.checkpoint, the job's checkpoints, needs it)"
    "$PY" -m pip install -q numpy
fi
if ! has torch; then
    say "installing torch 2.13.0 (no torch is importable by $PY; a few minutes on a slow link)"
    "$PY" -m pip install -q torch==2.13.0
fi

NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")

# hybridq itself: skip when `import hybridq` (from outside the checkout) already finds this checkout
REPO="$(pwd -P)"
if ! (cd / && "$PY" -c "import hybridq, os, sys; sys.exit(0 if os.path.realpath(hybridq.__file__).startswith(sys.argv[1] + os.sep) else 1)" "$REPO") 2>/dev/null; then
    if [ "$NGPU" -gt 0 ]; then
        say "installing hybridq from $REPO (pip install -e ., built against the installed CUDA torch: a few minutes)"
        "$PY" -m pip install -q --no-build-isolation -e .
    else
        say "installing hybridq from $REPO (pip install -e ., CPU: no CUDA extension to build)"
        "$PY" -m pip install -q -e . || "$PY" -m pip install -q --no-build-isolation -e .
    fi
fi

# torch's OpenMP threads spin-wait: one thread per process is much faster on a few shared cores
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
NPROC=$(( NGPU > 0 ? NGPU : 2 ))
ARGS=(--recipe mxfp8_fwd_nvfp4_bwd --compare bf16 --steps 120 --log-every 10 "$@")

# the pre-flight: flags and checkpoint folder, for the world torchrun will start; a refusal ends here
WORLD_SIZE="$NPROC" "$PY" launch/train.py --check-only "${ARGS[@]}" >/dev/null || exit 1

exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" launch/train.py "${ARGS[@]}"

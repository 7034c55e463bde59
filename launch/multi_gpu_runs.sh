#!/usr/bin/env bash
# Issue 18's multi-GPU runs in one call on a machine with >= 2 GPUs (the device tool's nvidia-h200-x2 or larger):
# the NCCL suite, the FSDP2 and tensor-parallel benchmarks, and the end-to-end report on all GPUs. Each stage has a
# time limit so that the whole fits in ~9 minutes; logs go to $OUT (default out/multi_gpu).
#   bash launch/multi_gpu_runs.sh
# Not yet run: no multi-GPU machine has been lent since these stages were written (see BENCHMARKS.md for the
# last 2-GPU numbers, 2026-11-22/24).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/multi_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH=$PWD
start=$(date +%s)
stage() { echo "=== $1: exit $2, $(( $(date +%s) - start )) s since start ==="; }
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$N" -lt 2 ]; then echo "multi_gpu_runs.sh: needs >= 2 CUDA devices, found $N" >&2; exit 2; fi
nvidia-smi -L; date -u
if ! ls hybridq/_C*.so >/dev/null 2>&1; then
  python3 setup.py build_ext --inplace -j 16 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
fi
stage build 0

timeout 180 python3 -m pytest -q -m distributed tests/distributed -k nccl > "$OUT/nccl_suite.log" 2>&1
stage "NCCL suite (pytest -m distributed tests/distributed -k nccl)" $?
tail -3 "$OUT/nccl_suite.log"

timeout 150 torchrun --standalone --nproc_per_node "$N" launch/bench_fsdp.py --batch 4 --steps 5 --warmup 2 \
  > "$OUT/bench_fsdp.log" 2>&1
stage "bench_fsdp.py, $N GPUs" $?
grep -E "^\|" "$OUT/bench_fsdp.log"

timeout 90 torchrun --standalone --nproc_per_node "$N" launch/bench_tp.py > "$OUT/bench_tp.log" 2>&1
stage "bench_tp.py, $N GPUs" $?
grep -E "^\|" "$OUT/bench_tp.log"

timeout 100 python3 launch/e2e_report.py --recipes bf16,fp8_tensorwise --nproc "$N" --steps 15 \
  --out-dir "$OUT/e2e" > "$OUT/e2e.log" 2>&1
stage "e2e_report.py, $N GPUs" $?
grep -E "^\|" "$OUT/e2e.log"

#!/usr/bin/env bash
# Issue 18's multi-GPU runs on a machine with >= 2 GPUs (the device tool's nvidia-h200-x2 or larger), in stages that
# each fit one device command together (<= ~9 minutes per call; each stage has its own time limit). Logs go to $OUT
# (default out/multi_gpu), one folder per stage.
#
#   bash benchmarks/multi_gpu_runs.sh                    # = fsdp tp e2e: the 2-GPU benchmarks (<= 7 min)
#   bash benchmarks/multi_gpu_runs.sh nccl gpu_suite     # the NCCL test suites, then the whole GPU suite (~2 + ~3 min)
#   bash benchmarks/multi_gpu_runs.sh compiled           # the 1B job eager + compiled on all GPUs (<= 9 min)
#   bash benchmarks/multi_gpu_runs.sh large profile      # 4 / 8 GPUs: world-4/8 NCCL tests, all-gather time (<= 8 min)
#   bash benchmarks/multi_gpu_runs.sh scaling            # 4 / 8 GPUs: weak scaling 1 -> 2 -> 4 -> 8 (<= 7.5 min)
#   bash benchmarks/multi_gpu_runs.sh 7b                 # 4 / 8 GPUs: the Llama-2-7B shape (<= 7 min; repeat it: each
#                                                    # call runs the recipes earlier calls did not finish)
# A fresh machine first builds the extension (~1 min) unless hybridq/_C*.so is carried. The torchao float8 rows need
# torchao, which the device machines lack (no internet there): download the wheel where there is internet
# (`pip download torchao==0.18.0 --no-deps -d .devrun/wheels`; its float8 training is Python over torch._scaled_mm),
# carry it, and set TORCHAO_WHEEL=.devrun/wheels/torchao-0.18.0-...whl: the script installs it first (--no-deps).
#
# Stages (approximate limits):
#   nccl      300 s  the NCCL suites: pytest -m distributed -k nccl (world 2; test_large_world apart) on 6 pytest-xdist
#                    workers, -v: a run cut by the limit still shows every result it reached (2026-11-28: 162 tests, 135 s)
#   gpu_suite 420 s  the single-GPU suite, pytest -m gpu -n 12 -v: a 32-core two-GPU machine runs it in ~3 min (a
#                    16-core one-GPU machine needs ~8)
#   fsdp      150 s  benchmarks/bench_fsdp.py on all GPUs (bf16 vs presets vs torchao where installed)
#   tp         90 s  benchmarks/bench_tp.py on all GPUs
#   e2e       150 s  benchmarks/e2e_report.py, bf16 vs fp8_tensorwise, all GPUs, eager (quantized all-gathers)
#   compiled  540 s  benchmarks/e2e_report.py --compile: bf16 / fp8_tensorwise / fp8_block eager and compiled (each
#                    Linear in its block's graph: --weight-gather high_precision)
#   large     240 s  tests/distributed/test_large_world.py -k nccl: sharding invariance and training parity at world
#                    4 and 8 (FSDP2, HSDP, FSDP2 x TP); the 8-rank cases skip on 4 GPUs
#   scaling   450 s  benchmarks/e2e_report.py --scaling 1,2,4,8 (sizes above the GPUs skipped): bf16 vs fp8_tensorwise
#   7b        420 s  benchmarks/e2e_report.py --size 7b on all GPUs: bf16, every preset, torchao float8 where installed,
#                    as many as fit; rows finished by an earlier call are read back (--reuse-finished)
#   profile   240 s  benchmarks/profile_step.py under torchrun on all GPUs: the collectives split by kind (all-gather
#                    GPU time per step), bf16 vs fp8_tensorwise
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/multi_gpu}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH=$PWD
KNOWN="nccl gpu_suite fsdp tp e2e compiled large scaling 7b profile"
STAGES=${*:-fsdp tp e2e}
for s in $STAGES; do
  case " $KNOWN " in *" $s "*) ;; *) echo "multi_gpu_runs.sh: unknown stage '$s'; stages: $KNOWN" >&2; exit 2;; esac
done
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$N" -lt 2 ]; then echo "multi_gpu_runs.sh: needs >= 2 CUDA devices, found $N" >&2; exit 2; fi
mkdir -p "$OUT"
start=$(date +%s)
report() { echo "=== $1: exit $2, $(( $(date +%s) - start )) s since start ==="; }
nvidia-smi -L; date -u
if ! ls hybridq/_C*.so >/dev/null 2>&1; then
  python3 setup.py build_ext --inplace -j 16 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  report build 0
fi
if [ -n "${TORCHAO_WHEEL:-}" ]; then
  python3 -m pip install -q --no-deps "$TORCHAO_WHEEL" > "$OUT/torchao_install.log" 2>&1
  report "torchao install from $TORCHAO_WHEEL" $?
fi
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc_per_node $N"
E2E="python3 benchmarks/e2e_report.py"

for s in $STAGES; do
  d="$OUT/$s"
  mkdir -p "$d"
  case $s in
    nccl)
      timeout 300 python3 -m pytest -m distributed -k nccl -n 6 -v -rfE --tb=short -p no:cacheprovider tests/distributed \
        --ignore=tests/distributed/test_large_world.py > "$d/log" 2>&1
      rc=$?; grep -E " (FAILED|ERROR) " "$d/log" | sort -u | head -30; tail -1 "$d/log" ;;
    gpu_suite)
      timeout 420 python3 -m pytest -m gpu -n 12 -v -rfE --tb=short -p no:cacheprovider tests > "$d/log" 2>&1
      rc=$?; grep -E " (FAILED|ERROR) " "$d/log" | sort -u | head -30; tail -1 "$d/log" ;;
    fsdp)
      timeout 150 $TORCHRUN benchmarks/bench_fsdp.py --batch 4 --steps 5 --warmup 2 > "$d/log" 2>&1
      rc=$?; grep -E "^\|" "$d/log" ;;
    tp)
      timeout 90 $TORCHRUN benchmarks/bench_tp.py > "$d/log" 2>&1
      rc=$?; grep -E "^\|" "$d/log" ;;
    e2e)
      timeout 150 $E2E --recipes bf16,fp8_tensorwise --nproc "$N" --steps 15 --total-budget-s 140 \
        --out-dir "$d" > "$d/log" 2>&1
      rc=$?; grep -E "^\|" "$d/log" ;;
    compiled)
      timeout 540 $E2E --recipes bf16,fp8_tensorwise,fp8_block --compile --nproc "$N" --steps 15 \
        --time-limit-s 100 --total-budget-s 520 --train-args "--weight-gather high_precision" \
        --out-dir "$d" > "$d/log" 2>&1
      rc=$?; grep -E "^\|" "$d/log" ;;
    large)
      timeout 240 python3 -m pytest -q -m distributed tests/distributed/test_large_world.py -k nccl > "$d/log" 2>&1
      rc=$?; tail -3 "$d/log" ;;
    scaling)
      timeout 450 $E2E --recipes bf16,fp8_tensorwise --scaling 1,2,4,8 --steps 10 --time-limit-s 70 \
        --total-budget-s 440 --out-dir "$d" > "$d/log" 2>&1
      rc=$?; grep -E "^\|" "$d/log" ;;
    7b)
      timeout 420 $E2E --size 7b --recipes all --reuse-finished --nproc "$N" --steps 12 \
        --time-limit-s 200 --total-budget-s 410 --out-dir "$d" > "$d/log" 2>&1
      rc=$?; grep -E "^\|" "$d/log" ;;
    profile)
      timeout 240 $TORCHRUN benchmarks/profile_step.py --recipes bf16,fp8_tensorwise --timed-steps 4 \
        --json "$d/profile.json" > "$d/log" 2>&1
      rc=$?; sed -n '/by category/,/^## top/p' "$d/log" ;;
  esac
  report "$s ($N GPUs)" "$rc"
done

#!/usr/bin/env bash
# Every GPU-side check in one go, for a lent GPU machine that has torch + triton but not our other packages:
#   bash scripts/gpu_all.sh                 # all stages; STAGES="tests bench" picks some
# Stages: tests (pytest -m gpu), bench (attention, train step, emulator, monitors), e2e (a sweep through run.py on
# CUDA), ddp (2 GPUs vs 1 with grad accumulation), probe (short high-lr runs looking for a fast divergence).
# Logs go to $OUT (default results/bench/gpu_all); benchmark JSONs to results/bench/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/bench/gpu_all}
mkdir -p "$OUT" results/bench
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STAGES=${STAGES:-"tests bench e2e ddp"}
PY=${PY:-python3}
[ -d .ffcache ] && export FLASH_FORENSICS_CACHE=${FLASH_FORENSICS_CACHE:-$PWD/.ffcache}
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$OUT/env.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
rc=0
if has tests; then
  XD=""; $PY -c "import xdist" 2>/dev/null && XD="-n 4"
  timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -m gpu tests $XD -p no:cacheprovider -o addopts="-ra" \
    > "$OUT/pytest_gpu.log" 2>&1 || rc=1
  tail -15 "$OUT/pytest_gpu.log"
fi
if has bench; then
  timeout 200 $PY benchmarks/attention.py --rounds 3 --out "$OUT/attention.json" > "$OUT/bench_attention.log" 2>&1 || rc=1
  grep -E "^\|" "$OUT/bench_attention.log"
  timeout 300 $PY benchmarks/train_step.py --shapes 16x1024 --steps 12 --out "$OUT/train-step.json" > "$OUT/bench_train.log" 2>&1 || rc=1
  tail -8 "$OUT/bench_train.log"
  timeout 120 $PY benchmarks/emulator.py --device cuda --reps 3 > "$OUT/bench_emulator.log" 2>&1 || rc=1
  tail -8 "$OUT/bench_emulator.log"
  timeout 150 $PY benchmarks/monitors.py --model gpt2_s > "$OUT/bench_monitors.log" 2>&1 || rc=1
  tail -8 "$OUT/bench_monitors.log"
  timeout 150 $PY benchmarks/monitors.py --model gpt2_s --impl flash > "$OUT/bench_monitors_flash.log" 2>&1 || rc=1
  tail -8 "$OUT/bench_monitors_flash.log"
fi
if has e2e; then
  timeout 240 $PY run.py -m experiment=smoke train.device=cuda intervention=baseline,fp32,sfa,pv_fp32 \
    results_dir=$PWD/results/gpu_e2e > "$OUT/e2e.log" 2>&1 || rc=1
  tail -20 "$OUT/e2e.log"
fi
if has ddp; then
  timeout 300 $PY benchmarks/ddp.py --steps ${DDP_STEPS:-200} > "$OUT/ddp.log" 2>&1 || rc=1
  tail -15 "$OUT/ddp.log"
fi
exit $rc

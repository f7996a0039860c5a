#!/usr/bin/env bash
# Issue 12's GPU evidence in one call: GPU tests, the side-by-side attention benchmark (committed launch tables;
# TUNE=1 times the speed-only configs first), the GPT-2S training-step comparison. Logs and JSONs to $OUT.
#   OUT=/tmp/out bash scripts/gpu_speed.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/bench/gpu_speed}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > "$OUT/env.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/env.txt"
rc=0
XD=""; $PY -c "import xdist" 2>/dev/null && XD="-n ${TEST_WORKERS:-4}"
timeout ${TEST_TIMEOUT:-150} $PY -m pytest -q -m gpu tests/unit/test_ops.py tests/unit/test_triton.py tests/unit/test_emulator.py \
  tests/unit/test_models.py $XD -p no:cacheprovider -o addopts="-ra" > "$OUT/pytest_gpu.log" 2>&1 || rc=1
tail -4 "$OUT/pytest_gpu.log"
timeout ${ATTN_TIMEOUT:-170} $PY benchmarks/attention.py ${TUNE:+--tune} --rounds 3 --out "$OUT/attention.json" \
  > "$OUT/attention.log" 2>&1 || rc=1
grep -E "^\|" "$OUT/attention.log"
timeout ${TRAIN_TIMEOUT:-150} $PY benchmarks/train_step.py --shapes 16x1024 --steps 12 \
  --variants sdpa+compile,triton_fa2+compile,triton_paper_bf16+compile,sdpa,triton_fa2,triton_paper_bf16 \
  --out "$OUT/train_T1024.json" > "$OUT/train_T1024.log" 2>&1 || rc=1
timeout ${TRAIN_TIMEOUT:-130} $PY benchmarks/train_step.py --shapes 32x256 --steps 12 \
  --variants sdpa+compile,triton_fa2+compile,triton_paper_bf16+compile,triton_paper_bf16 \
  --out "$OUT/train_T256.json" > "$OUT/train_T256.log" 2>&1 || rc=1
grep -h '"variant"' "$OUT"/train_T*.log | cut -c1-230
exit $rc

#!/usr/bin/env bash
# Everything GPU-side for the Triton flash attention in one go (one H200): GPU tests, attention benchmark,
# GPT-2S train-step benchmark. Logs and JSON go to $OUT (default results/bench/gpu_check) and results/bench/.
#   bash scripts/gpu_check.sh            # all stages
#   STAGES="tests bench" bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/bench/gpu_check}
mkdir -p "$OUT" results/bench
export PYTHONUNBUFFERED=1
STAGES=${STAGES:-"tests bench train"}
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"
rc=0
if [[ " $STAGES " == *" tests "* ]]; then
  XDIST=""; $PY -c "import xdist" 2>/dev/null && XDIST="-n 6"
  timeout ${TEST_TIMEOUT:-280} $PY -m pytest -q -m gpu tests/unit/test_triton.py $XDIST -p no:cacheprovider \
    -o addopts="-ra" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40 || rc=1
fi
if [[ " $STAGES " == *" bench "* ]]; then
  timeout ${BENCH_TIMEOUT:-200} $PY benchmarks/attention.py ${BENCH_ARGS-} --out results/bench/attention-h200.json \
    2>&1 | tee "$OUT/bench_attention.log" || rc=1
  cp results/bench/attention-h200.json "$OUT/" 2>/dev/null
fi
if [[ " $STAGES " == *" train "* ]]; then
  timeout ${TRAIN_TIMEOUT:-150} $PY benchmarks/train_step.py --batch 16 --steps 15 \
    --out results/bench/train-step-h200.json 2>&1 | tee "$OUT/bench_train_step.log" || rc=1
  cp results/bench/train-step-h200.json "$OUT/" 2>/dev/null
fi
exit $rc

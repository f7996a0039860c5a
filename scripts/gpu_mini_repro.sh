#!/usr/bin/env bash
# Issue 7's GPU work in one go, for a lent GPU machine (2 GPUs preferred) with torch + triton:
#   STAGES="tune seeds tests" bash scripts/gpu_mini_repro.sh     # default: tune seeds tests
# Stages: tune (fp32 recipe launch configs at the mini_repro shape, + an attention table there), seeds
# (sweeps/mini_repro_seeds: baseline vs fp32 over 3 seeds, all 6 at once), tests (pytest -m gpu, beside the seeds),
# isolation (scripts/paper_isolation.sh, beside the seeds; SEEDS_URI gives the seeds their own MLflow store). Logs go to $LOG (default $OUT, else results/bench/gpu_mini_repro).
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${LOG:-${OUT:-results/bench/gpu_mini_repro}}
mkdir -p "$LOG" results/bench
export PYTHONUNBUFFERED=1
STAGES=${STAGES:-"tune seeds tests"}
PY=${PY:-python3}
URI=${URI:-sqlite:///$PWD/results/mlflow.db}
[ -d .ffcache ] && export FLASH_FORENSICS_CACHE=${FLASH_FORENSICS_CACHE:-$PWD/.ffcache}
has() { [[ " $STAGES " == *" $1 "* ]]; }
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$LOG/env.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$LOG/env.txt"
rc=0
t0=$(date +%s)
if has tune; then
  timeout ${TUNE_TIMEOUT:-240} $PY benchmarks/attention.py --tune --tune-recipe fp32 --tune-shape mini --shapes mini \
    --skip emulator_paper_bf16 --rounds 2 --out results/bench/attention-mini-h200.json > "$LOG/tune_fp32.log" 2>&1 || rc=1
  grep -v "it/s\]" "$LOG/tune_fp32.log" | tail -30
  echo "[gpu_mini_repro] tune done at $(( $(date +%s) - t0 )) s"
fi
pids=()
if has isolation; then  # beside the seeds: the forks spread over the GPUs with them
  ( timeout ${ISO_TIMEOUT:-560} env URI="$URI" bash scripts/paper_isolation.sh > "$LOG/isolation.log" 2>&1
    echo "[gpu_mini_repro] isolation exit $? at $(( $(date +%s) - t0 )) s" ) &
  pids+=($!)
fi
if has seeds; then
  ( timeout ${SEEDS_TIMEOUT:-480} $PY run.py +sweep=mini_repro_seeds experiment=mini_repro hydra/launcher=local \
      train.ckpt_every=0 tracking.uri="${SEEDS_URI:-$URI}" hydra.sweep.dir=results/runs/mini_repro_seeds \
      > "$LOG/seeds.log" 2>&1
    echo "[gpu_mini_repro] seeds exit $? at $(( $(date +%s) - t0 )) s" ) &
  pids+=($!)
fi
if has tests; then
  ( XD=""; $PY -c "import xdist" 2>/dev/null && XD="-n 4"
    timeout ${TEST_TIMEOUT:-400} $PY -m pytest -q -m gpu tests $XD -p no:cacheprovider -o addopts="-ra" \
      > "$LOG/pytest_gpu.log" 2>&1; echo "[gpu_mini_repro] tests exit $? at $(( $(date +%s) - t0 )) s"
    tail -15 "$LOG/pytest_gpu.log" ) &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p" || rc=1; done
if has seeds; then
  grep -v "it/s" "$LOG/seeds.log" | tail -40
  for d in results/runs/mini_repro_seeds/*/; do
    [ -f "$d/result.json" ] && $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1], r['intervention'], r['observed'], r['divergence_step'], r['steps_done'], r['final_loss'], r['wall_s'])" "$d/result.json"
  done
fi
if has isolation; then
  grep -v "it/s" "$LOG/isolation.log" | tail -60
fi
echo "[gpu_mini_repro] all done in $(( $(date +%s) - t0 )) s (rc $rc)"
exit $rc

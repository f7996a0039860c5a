#!/usr/bin/env bash
# This round's GPU work in ONE lease on ONE H200 (issues 13, 14, 17): checkpoints cannot leave the machine, so every
# baseline and its forks run here together, and the session's 30 device minutes hold all of it.
#   bash scripts/gpu_round3.sh start     # quiet benchmarks, then every run in the background (setsid), then GPU tests
#   bash scripts/gpu_round3.sh status    # one progress line per pipeline
#   bash scripts/gpu_round3.sh collect   # reports, logs and the MLflow stores (xz) into $OUT
# What runs (priority order; all at once, the GPU time-sliced between them):
#   mini:  python -m flash_forensics.orchestrator.analysis.isolate --experiment mini_repro --sweeps rounding_refs rounding_points stabilizers
#          (baseline with monitor.probes on, the rounding-point forks, then the forkable stabilizers)
#   paper: scripts/paper_1gpu.sh, seeds 1337 1 2: each baseline to 300 steps past its divergence, then the FP32
#          reference fork; seed 1337 also fa2/SDPA numerics and the key isolation rows (pv_fp32, sfa)
# Runs live under $R (default /tmp/r3, outside the synced checkout: a later call re-sends the tree, never under a
# running job); the code they run is a copy taken at start.
set -uo pipefail
cd "$(dirname "$0")/.."
R=${R:-/tmp/r3}
L=$R/logs
PY=${PY:-python3}
mode=${1:-start}

env_setup() {
  export PYTHONPATH=/tmp/site:$R/src FLASH_FORENSICS_CACHE=$R/src/.ffcache TIKTOKEN_CACHE_DIR=$R/src/.ffcache/tiktoken PYTHONUNBUFFERED=1
}

janitor() {  # disk (64 GB): finished forks' checkpoints go at once; paper baselines keep their newest 8 (2000 steps)
  while true; do
    find "$R" -path '*/forks/*/result.json' 2>/dev/null | while read -r r; do rm -f "$(dirname "$r")"/checkpoints/*.pt; done
    for d in "$R"/paper/seed*/baseline/checkpoints; do
      [ -d "$d" ] || continue
      ls "$d"/step_*.pt 2>/dev/null | sed 's/.*step_\([0-9]*\)\.pt/\1 &/' | sort -n | head -n -8 | cut -d' ' -f2 | xargs -r rm -f
    done
    sleep 20
  done
}

if [ "$mode" = start ]; then
  mkdir -p "$L" "$R/src"
  cp -a . "$R/src" 2>/dev/null; rm -rf "$R/src/.whl"
  cd "$R/src"
  tar -xJf .stage/ffcache.tar.xz && mkdir -p data && tar -xJf .stage/debian_docs-*.tar.xz -C data/ || exit 1
  env_setup
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$L/env.txt"
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$L/env.txt"
  t0=$(date +%s)
  # 1. quiet benchmarks first (nothing else on the GPU): probe cost, stabilizer throughput
  timeout 90 $PY benchmarks/probes.py --out "$L/probes-h200.json" > "$L/bench_probes.log" 2>&1
  tail -6 "$L/bench_probes.log"
  timeout 130 $PY benchmarks/stabilizers.py --shapes mini,gpt2s --rounds 2 --out "$L/stabilizers-h200.json" > "$L/bench_stabilizers.log" 2>&1
  tail -12 "$L/bench_stabilizers.log"
  echo "[round3] benchmarks done at $(( $(date +%s) - t0 )) s"
  # 2. every run, in the background
  setsid nohup $PY -m flash_forensics.orchestrator.analysis.isolate --experiment mini_repro --sweeps rounding_refs rounding_points stabilizers \
    --root "$R/mini" --out "$R/mini/report" --uri "sqlite:///$R/mini/mlflow.db" --per-gpu "${MINI_PER_GPU:-3}" \
    > "$L/mini.log" 2>&1 < /dev/null &
  setsid nohup env ROOT="$R/paper" SEEDS="1337 1 2" CONTROL_SWEEPS=paper_1gpu_fp32 \
    ISOLATION_SWEEPS="paper_1gpu_numerics paper_1gpu_key" PER_GPU_FIRST=2 PER_GPU_OTHERS=1 CKPT_EVERY_OTHERS=250 \
    PROGRESS_EVERY=60 bash scripts/paper_1gpu.sh > "$L/paper.log" 2>&1 < /dev/null &
  setsid nohup bash -c "$(declare -f janitor); R=$R; janitor" > /dev/null 2>&1 < /dev/null &
  # 3. the GPU tests beside them (correctness only: nothing here is timed)
  timeout 420 $PY -m pytest -q -m gpu tests -n 6 -p no:cacheprovider -o addopts="-ra" > "$L/pytest_gpu.log" 2>&1
  tail -25 "$L/pytest_gpu.log"
  echo "[round3] started; tests done at $(( $(date +%s) - t0 )) s"
  exit 0
fi

if [ "$mode" = status ]; then
  date -u +%T; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; df -h "$R" | tail -1
  grep -a '^\[paper_isolation\|^\[isolate\|/5 ' "$L/mini.log" | tail -4
  ls "$R"/mini/forks/*/result.json 2>/dev/null | wc -l | sed 's/^/mini forks done: /'
  tail -4 "$L/paper.log"
  exit 0
fi

if [ "$mode" = collect ]; then
  : "${OUT:?collect writes into \$OUT}"
  cd "$R"
  # reports, logs, result.json files and job.json of every run (small), then each MLflow store xz-compressed
  find . \( -path ./src -prune \) -o \( -name '*.json' -o -name '*.md' -o -name '*.png' -o -name '*.log' \
       -o -name '*.txt' \) -type f -size -4M -print | grep -v '/checkpoints/' > /tmp/r3_files
  tar -cJf "$OUT/round3-reports.tar.xz" -T /tmp/r3_files
  # each store copied consistently while its writers run (sqlite's backup API), xz-compressed, cut into 15 MB parts
  i=0
  for db in $(find . -path ./src -prune -o -name 'mlflow*.db' -print); do
    i=$((i+1)); name="db$i-$(echo "${db#./}" | tr '/.' '__')"
    $PY -c "import sqlite3,sys; d=sqlite3.connect(sys.argv[2]); sqlite3.connect(sys.argv[1]).backup(d); d.close()" \
      "$db" "/tmp/$name.sqlite" && xz -T16 -6 -c "/tmp/$name.sqlite" | split -b 15M -d - "$OUT/$name.xz.part"
  done
  ls -la "$OUT"
  exit 0
fi
echo "usage: $0 start|status|collect" >&2; exit 2

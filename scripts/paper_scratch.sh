#!/usr/bin/env bash
# The paper's regime from step 0, every run at once on one GPU: what a fork cannot give.
#   - the stabilizers that change the model (qk_norm, gated_attn: a fork from a baseline checkpoint is refused), with
#     the baseline and the FP32 reference beside them on the same seed and batches (sweeps/stabilizers_scratch);
#   - the baseline at other learning rates: with the FP32 reference and the stabilizers, the early warning's healthy
#     negatives from step 0 (every negative so far was a fork taken 200-350 steps before a divergence).
# Each run is its own `python run.py` (one process each, all on this machine's first GPU), its job folder
# $ROOT/<name>; one MLflow store; reports at the end: $ROOT/report (the stabilizers sweep) and $ROOT/report_lr.
#
#   bash scripts/paper_scratch.sh [hydra overrides for every run]
#   DRY_RUN=1 bash scripts/paper_scratch.sh             # print the commands, run nothing
#
# Env, each optional:
#   SEED          train.seed = data.seed (1: seed 1 diverges at step 2,288, the earliest of the three seeds measured)
#   MAX_STEPS     steps per run (2598 = seed 1's divergence + 310; seed 2: 4652, seed 1337: 10007)
#   INTERVENTIONS the stabilizers sweep's runs ("baseline fp32 qk_norm gated_attn", sweeps/stabilizers_scratch);
#                 "qk_norm gated_attn" only when a report of the same seed AND the same GPU model already holds the
#                 baseline and the FP32 reference: a baseline repeats bit for bit on one GPU model (seed 1 on H200s,
#                 2026-12-04 and -05), not across models (on an H100 seed 1 left the H200's bits at step 1 and did not
#                 diverge by 7,610: results/paper_1gpu/h100-2026-12-05; `gpu.sh first-steps` tells which record a
#                 GPU repeats). Then `flash-forensics stabilizers` takes steps gained from that report's baseline and
#                 two runs share the GPU, not four (four shared one H200 at 2.7-4.0 it/s each)
#   LRS           baselines at these learning rates (lr = min_lr, the preset's constant schedule; "5e-4"; "" none)
#   EXPERIMENT    the preset (paper_1gpu)        ROOT  where everything goes (results/runs/paper_scratch/<date>)
#   STOP_AFTER    a run stops this many steps after its divergence (20: nothing more is needed of it)
#   OVERRIDES_ALL Hydra overrides for every run, before the arguments ("attention.fp32_gemm=tf32x3": the FP32
#                 reference at 0.62x of paper_bf16's speed; it changes only GEMMs with FP32 operands)
#   PROGRESS_EVERY seconds between progress lines (60)
# No checkpoints are written (train.ckpt_every=0): nothing forks from these runs, and five GPT-2S runs' checkpoints
# would fill a 64 GB disk. A run's metrics are in MLflow and its job folder as it goes.
set -euo pipefail
cd "$(dirname "$0")/.."
EXPERIMENT=${EXPERIMENT:-paper_1gpu}
SEED=${SEED:-1}
MAX_STEPS=${MAX_STEPS:-2598}
INTERVENTIONS=${INTERVENTIONS-baseline fp32 qk_norm gated_attn}
LRS=${LRS-5e-4}
STOP_AFTER=${STOP_AFTER:-20}
OVERRIDES_ALL=${OVERRIDES_ALL-attention.fp32_gemm=tf32x3}
PROGRESS_EVERY=${PROGRESS_EVERY:-60}
ROOT=$(realpath -m "${ROOT:-results/runs/paper_scratch/$(date +%Y-%m-%d_%H-%M-%S)}")
URI="sqlite:///$ROOT/mlflow.db"
T0=$(date +%s)
[ -n "${DRY_RUN:-}" ] || mkdir -p "$ROOT"

say() {
  local line="[paper_scratch $(( $(date +%s) - T0 ))s] $*"
  echo "$line"
  [ -n "${DRY_RUN:-}" ] || echo "$line" >> "$ROOT/progress.log"
}

# shellcheck disable=SC2206
common=(experiment="$EXPERIMENT" train.seed="$SEED" data.seed="$SEED" train.max_steps="$MAX_STEPS" train.ckpt_every=0
        train.early_stop=true verdict.early_stop_after="$STOP_AFTER" tracking.uri="$URI" $OVERRIDES_ALL "$@")
declare -A PIDS=()
NAMES=()
start() {  # $1: job name, then its own overrides
  local name=$1; shift
  local cmd=(python run.py "${common[@]}" "$@" "hydra.run.dir=$ROOT/$name")
  say "$name: ${cmd[*]}"
  NAMES+=("$name")
  [ -n "${DRY_RUN:-}" ] && return 0
  setsid "${cmd[@]}" > "$ROOT/$name.log" 2>&1 < /dev/null &  # its own process group: stopping this script stops it
  PIDS[$name]=$!
}

say "root $ROOT; experiment $EXPERIMENT; seed $SEED; $MAX_STEPS steps; runs: $INTERVENTIONS; lr: ${LRS:-none}"
for iv in $INTERVENTIONS; do
  start "$iv" "intervention=$iv" sweep_name=paper_scratch tracking.experiment=paper_scratch
done
for lr in $LRS; do
  start "baseline_lr$lr" intervention=baseline "optimizer.lr=$lr" "optimizer.min_lr=$lr" sweep_name=paper_scratch_lr \
    tracking.experiment=paper_scratch_lr
done
[ -n "${DRY_RUN:-}" ] && exit 0
[ "${#NAMES[@]}" -gt 0 ] || { say "nothing to run (INTERVENTIONS and LRS are empty)"; exit 2; }
stop_all() { for p in "${PIDS[@]}"; do kill -- "-$p" 2>/dev/null || true; done; }
trap 'say "interrupted: stopping every run"; stop_all; exit 130' INT TERM
trap stop_all EXIT  # this script ending for any reason leaves no run behind

progress() {  # one line per run: state, its progress bar's last update
  for n in "${NAMES[@]}"; do
    local state=running last
    kill -0 "${PIDS[$n]}" 2>/dev/null || state=ended
    last=$( (tail -c 3000 "$ROOT/$n.log" 2>/dev/null || true) | tr '\r' '\n' | (grep -a "it/s\|s/it\|\[job\]" || true) \
            | tail -1 | cut -c1-150)
    say "$n ($state): ${last:-starting}"
  done
}
alive() { for n in "${NAMES[@]}"; do kill -0 "${PIDS[$n]}" 2>/dev/null && return 0; done; return 1; }
next=$(( $(date +%s) + PROGRESS_EVERY ))
while alive; do
  sleep 2
  if [ "$(date +%s)" -ge "$next" ]; then progress; next=$(( $(date +%s) + PROGRESS_EVERY )); fi
done
rc=0
for n in "${NAMES[@]}"; do
  code=0; wait "${PIDS[$n]}" || code=$?
  if [ "$code" = 0 ]; then say "$n: done"
  else rc=1; say "$n: FAILED (exit $code); its log: $ROOT/$n.log"; tail -n 5 "$ROOT/$n.log" | sed 's/^/    /'; fi
done
progress

# The reports: one per question, each with its runs' histories from the one store. A failed report is said, and the
# other still runs (a missing job folder is the report's to say).
main=(); lrs=()
for iv in $INTERVENTIONS; do main+=("$ROOT/$iv"); done
for lr in $LRS; do lrs+=("$ROOT/baseline_lr$lr"); done
# the store, when a run made it: report refuses a --tracking-uri it cannot read, and every run dying before its first
# MLflow call (a bad override) leaves none; the rows then come from the job folders alone, without histories
store=(--tracking-uri "$URI")
[ -f "$ROOT/mlflow.db" ] || { store=(); say "no MLflow store at $ROOT/mlflow.db: reports from the job folders only"; }
if [ "${#main[@]}" -gt 0 ]; then
  python -m flash_forensics.cli report "${main[@]}" --out "$ROOT/report" --sweep paper_scratch "${store[@]}" \
    > "$ROOT/report.log" 2>&1 || { rc=1; say "report FAILED: $ROOT/report.log"; }
fi
if [ "${#lrs[@]}" -gt 0 ]; then
  python -m flash_forensics.cli report "${lrs[@]}" --out "$ROOT/report_lr" --sweep paper_scratch_lr "${store[@]}" \
    > "$ROOT/report_lr.log" 2>&1 || { rc=1; say "lr report FAILED: $ROOT/report_lr.log"; }
fi
for v in "$ROOT/report/verdicts.json" "$ROOT/report_lr/verdicts.json"; do
  [ -f "$v" ] && python - "$v" <<'EOF'
import json, sys
for r in json.load(open(sys.argv[1]))["runs"]:
    print(f"  {r['job']:<22} {str(r.get('intervention')):<12} expected {str(r.get('expected')):<9}"
          f" observed {str(r.get('observed')):<9} divergence {r.get('divergence_step')} final {r.get('final_loss')}")
EOF
done
say "all done in $(( $(date +%s) - T0 )) s (exit $rc); progress log $ROOT/progress.log"
exit $rc

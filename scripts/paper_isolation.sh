#!/usr/bin/env bash
# The paper's isolation experiments on the miniature, end to end (issue 7), one command:
#   bash scripts/paper_isolation.sh [hydra overrides for every run, e.g. train.seed=2]
# 1. the BF16 flash baseline (experiment=mini_repro): batch order recorded, every checkpoint kept, no early stop;
# 2. the newest checkpoint at or before its lowest loss preceding the divergence (python -m orchestrator.fork pick
#    --at-min): the last point where training was still at its best;
# 3. the layer and heads its own W_Q growth and repeated maxima point at (python -m orchestrator.localize);
# 4. every job of sweeps/paper_isolation.yaml and sweeps/beta_sweep.yaml forked from that checkpoint on the same
#    batches to the baseline's last step (or FORK_STEPS steps), each as its own run, PER_GPU at a time per GPU;
# 5. one table over all of it: $OUT/verdicts.{md,json} + plots (python -m orchestrator.report).
# Env: ROOT (run folder), ISOLATION_OUT (report folder, default results/paper_isolation), FORK_STEPS, MARGIN
# (steps before the picked step, default 0), PER_GPU (forks at once per GPU; default GPU memory / 16 GiB: each
# mini_repro fork holds ~12.5 GiB), URI (MLflow store).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${ROOT:-results/runs/paper_isolation/$(date +%Y-%m-%d_%H-%M-%S)}
OUT=${ISOLATION_OUT:-results/paper_isolation}
FORK_STEPS=${FORK_STEPS:-0}  # 0: to the end of the baseline's recorded batches
MARGIN=${MARGIN:-0}
URI=${URI:-sqlite:///$PWD/results/mlflow.db}
t0=$(date +%s)
mkdir -p "$ROOT/forks" "$OUT"
say() { echo "[paper_isolation $(( $(date +%s) - t0 ))s] $*"; }
say "1/5 baseline -> $ROOT/baseline"
# no early stop: the forks replay its recorded batches, so it records as many steps as they may need
python run.py experiment=mini_repro intervention=baseline "$@" train.keep_checkpoints=0 train.early_stop=false \
  tracking.uri="$URI" tracking.experiment=paper_isolation sweep_name=paper_isolation_runs/baseline \
  hydra.run.dir="$ROOT/baseline"
IFS=$'\t' read -r STEP CKPT < <(python -m orchestrator.fork pick "$ROOT/baseline" --at-min --margin "$MARGIN" \
  --with-step)
[ -n "$CKPT" ] || { echo "[paper_isolation] no checkpoint to fork from (see the error above)" >&2; exit 1; }
DONE=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['steps_done'])" "$ROOT/baseline/result.json")
END=$(( FORK_STEPS > 0 && STEP + FORK_STEPS < DONE ? STEP + FORK_STEPS : DONE ))
say "2/5 fork from $CKPT (step $STEP) to step $END"
LOC=$(python -m orchestrator.localize "$ROOT/baseline" --tracking-uri "$URI" --out "$OUT/localize.json" --plot \
  --sweep-overrides)
say "3/5 localized: $LOC (details: $OUT/localize.json)"
# visible GPUs, and forks per GPU by memory (one mini_repro fork holds ~12.5 GiB; 1 at a time without a GPU)
read -r NGPU MEM_SLOTS < <(python -c "import torch; ok = torch.cuda.is_available(); print(torch.cuda.device_count()
  if ok else 0, max(1, torch.cuda.get_device_properties(0).total_memory // 2**34) if ok else 1)")
PER_GPU=${PER_GPU:-$MEM_SLOTS}
SLOTS=$(( NGPU > 0 ? NGPU * PER_GPU : PER_GPU ))
VIS=(); [ "$NGPU" -gt 0 ] && IFS=, read -r -a VIS <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(( NGPU - 1 )))}"
mapfile -t JOBS < <(python -m orchestrator.fork jobs paper_isolation beta_sweep)
say "4/5 ${#JOBS[@]} forks, $SLOTS at a time ($NGPU GPU(s) x $PER_GPU); logs: $ROOT/forks/<job>.log"
fork() {  # fork <index> <job name> <overrides...>: one run; a failure is the report's to show, not fatal here
  local i=$1 name=$2; shift 2
  local env=(); [ "$NGPU" -gt 0 ] && env=(CUDA_VISIBLE_DEVICES="${VIS[$(( i % NGPU ))]}")  # round-robin, visible GPUs
  env "${env[@]}" python run.py experiment=mini_repro "$@" from_checkpoint="$CKPT" train.max_steps=$END \
    train.ckpt_every=0 tracking.uri="$URI" tracking.experiment=paper_isolation \
    sweep_name="paper_isolation_runs/$name" hydra.run.dir="$ROOT/forks/$name" > "$ROOT/forks/$name.log" 2>&1 \
    && say "  $name done" || say "  $name FAILED (exit $?): $ROOT/forks/$name.log"
}
i=0
for line in "${JOBS[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$SLOTS" ]; do wait -n || true; done
  name=${line%%$'\t'*}
  read -r -a ov <<< "${line#*$'\t'}"
  extra=(); [[ $name == paper_isolation-* ]] && read -r -a extra <<< "$LOC"
  fork "$i" "$name" "${ov[@]}" "${extra[@]}" "$@" &
  i=$(( i + 1 ))
done
wait
say "5/5 report -> $OUT"
python -m orchestrator.report --out "$OUT" --sweep paper_isolation --tracking-uri "$URI" \
  --meta "command=bash scripts/paper_isolation.sh $*" --meta "fork_checkpoint=$CKPT" --meta "fork_step=$STEP" \
  --meta "localized=$LOC" --meta "wall_s=$(( $(date +%s) - t0 ))" "$ROOT/baseline" "$ROOT/forks"
say "done: the full table in $(( $(date +%s) - t0 )) s"

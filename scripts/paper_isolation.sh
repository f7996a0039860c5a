#!/usr/bin/env bash
# The paper's isolation experiments on the miniature, end to end (issue 7), one command:
#   bash scripts/paper_isolation.sh [hydra overrides for every run, e.g. train.seed=2]
# 1. the BF16 flash baseline (experiment=mini_repro): batch order recorded, every checkpoint kept;
# 2. the newest checkpoint at least MARGIN steps before its divergence (python -m orchestrator.fork pick);
# 3. every intervention of sweeps/paper_isolation and sweeps/beta_sweep forked from it on the same batches for
#    FORK_STEPS steps, all at once through the submitit local launcher, spread over the GPUs;
# 4. one table over all of it: results/paper_isolation/verdicts.{md,json} + plots (python -m orchestrator.report).
# Env: ROOT (run folder), MARGIN (default 200), FORK_STEPS (default 600), OUT (report folder), LAUNCHER (local).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${ROOT:-results/runs/paper_isolation/$(date +%Y-%m-%d_%H-%M-%S)}
MARGIN=${MARGIN:-200}
FORK_STEPS=${FORK_STEPS:-600}
OUT=${OUT:-results/paper_isolation}
LAUNCHER=${LAUNCHER:-local}
URI=${URI:-sqlite:///$PWD/results/mlflow.db}
t0=$(date +%s)
mkdir -p "$ROOT"
echo "[paper_isolation] 1/4 baseline -> $ROOT/baseline"
# no early stop: the forks replay its recorded batches, so it records as many steps as they may need
python run.py experiment=mini_repro intervention=baseline "$@" train.keep_checkpoints=0 train.early_stop=false \
  tracking.uri="$URI" sweep_name=paper_isolation_baseline hydra.run.dir="$ROOT/baseline"
CKPT=$(python -m orchestrator.fork pick "$ROOT/baseline" --margin "$MARGIN")
read -r STEP DONE < <(python - "$CKPT" "$ROOT/baseline/result.json" <<'PY'
import json, sys, torch
print(int(torch.load(sys.argv[1], map_location="cpu", weights_only=False)["step"]),
      int(json.load(open(sys.argv[2]))["steps_done"]))
PY
)
END=$(( STEP + FORK_STEPS < DONE ? STEP + FORK_STEPS : DONE ))
echo "[paper_isolation] 2/4 fork from $CKPT (step $STEP) to step $END"
mkdir -p "$OUT"
# the layer and heads the baseline's own W_Q growth and repeated maxima point at (not the paper's indices)
LOC=$(python -m orchestrator.localize "$ROOT/baseline" --tracking-uri "$URI" --out "$OUT/localize.json" --plot \
  --sweep-overrides)
echo "[paper_isolation] localized: $LOC (details: $OUT/localize.json)"
pids=()
for sweep in paper_isolation beta_sweep; do  # both at once (with the local launcher: every fork at once)
  echo "[paper_isolation] 3/4 +sweep=$sweep (log: $ROOT/$sweep.log)"
  # shellcheck disable=SC2086  # $LOC: several overrides
  python run.py +sweep=$sweep experiment=mini_repro hydra/launcher="$LAUNCHER" "$@" from_checkpoint="$CKPT" \
    train.max_steps=$END train.ckpt_every=0 tracking.uri="$URI" sweep_name=${sweep}_fork \
    hydra.sweep.dir="$ROOT/$sweep" $([ "$sweep" = paper_isolation ] && echo "$LOC") > "$ROOT/$sweep.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || echo "[paper_isolation] a sweep exited with an error: see $ROOT/*.log"; done
echo "[paper_isolation] 4/4 report -> $OUT"
python -m orchestrator.report --out "$OUT" --sweep paper_isolation --tracking-uri "$URI" \
  --meta "command=bash scripts/paper_isolation.sh $*" --meta "fork_checkpoint=$CKPT" \
  --meta "wall_s=$(( $(date +%s) - t0 ))" "$ROOT/baseline" "$ROOT/paper_isolation" "$ROOT/beta_sweep"
echo "[paper_isolation] done in $(( $(date +%s) - t0 )) s"

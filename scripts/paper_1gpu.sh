#!/usr/bin/env bash
# The paper's regime on ONE GPU, in one lease: checkpoints cannot leave the machine, so every baseline and
# every fork from it run here, in one go. One `python -m flash_forensics.orchestrator.analysis.isolate` per seed, all at once:
#   seed 1337: baseline -> pre-divergence checkpoint -> controls (sweeps/paper_1gpu_controls) + the isolation table
#              (sweeps/paper_isolation, sweeps/beta_sweep), localized by its own monitors;
#   seeds 1, 2: baseline -> the controls only (train.seed = data.seed = the seed; same batches as their forks).
# Each isolate has its own --root, report (--out) and MLflow store (sqlite, one per seed: no lock contention).
#
#   bash scripts/paper_1gpu.sh [hydra overrides for every run]          # e.g. train.compile=true
#   DRY_RUN=1 bash scripts/paper_1gpu.sh                                # print the plan, run nothing
#   RACE=1 SEEDS="2 1337" bash scripts/paper_1gpu.sh ...                # the first seed to diverge keeps the GPU
#
# Env, each optional:
#   ROOT          where everything goes (default results/runs/paper_1gpu/<date>): seed<S>/{baseline,forks,report,
#                 mlflow.db}, seed<S>.log (that isolate's whole output), progress.log (the lines printed here)
#   EXPERIMENT    the preset (paper_1gpu)          SEEDS        "1337 1 2" (the first also gets the isolation table)
#   STOP_AFTER    steps each baseline runs past its divergence (300; the forks need no more of it: past its end they
#                 continue its seeded batch order, data.replay_past_end=regenerate)
#   FORK_STEPS    steps per fork from the picked checkpoint (0: to the baseline's end = divergence + STOP_AFTER)
#   PAST_DIVERGENCE  forks run to the baseline's divergence + N steps ("" : FORK_STEPS decides)
#   PICK / MARGIN the fork checkpoint (isolate --pick at-min|before-divergence --margin N; at-min, 0)
#   KEEP_CHECKPOINTS  checkpoints each baseline keeps (its train.keep_checkpoints; 0 = all)
#   FORK_OVERRIDES Hydra overrides of the forks only, space-separated (e.g. attention.fp32_gemm=tf32x3)
#   FORK_MEMORY   GiB a fork needs free on its GPU before it starts ("" : no check)
#   PER_GPU_FIRST forks at once for the first seed (2)        PER_GPU_OTHERS  for the other seeds (1)
#                 (runs at once = seeds while the baselines train, then <= PER_GPU_FIRST + PER_GPU_OTHERS x (seeds-1);
#                 GPT-2S at B=16, T=1024 holds a small part of an H200, but nothing here measured it: stay <= 4)
#   CKPT_EVERY_OTHERS  checkpoint interval of the other seeds' baselines (500; the first keeps the preset's 250):
#                 a GPT-2S checkpoint (weights + AdamW moments) is ~1.5 GB, and all are kept until the forks start
#   CONTROL_SWEEPS (paper_1gpu_controls)   ISOLATION_SWEEPS (paper_isolation beta_sweep; "" for none)
#   PROGRESS_EVERY seconds between progress lines (60)
#   RACE          1: a race for a GPU on which no seed's divergence step is known (0). Every seed gets what the first
#                 gets (its sweeps, PER_GPU_FIRST, the preset's checkpoint interval); as soon as one seed's baseline
#                 has diverged (its result.json says so), every seed whose baseline has not ended yet is stopped
#                 (its isolate's process group; the baseline checkpoints where it stops, its result.json says
#                 "stopped by SIGTERM") and said at the end as stopped by the race, not failed; seeds whose
#                 baselines had already ended keep going
#   OVERRIDES_<S> Hydra overrides of seed S's runs only (baseline and forks), space-separated, after the arguments
#                 (e.g. OVERRIDES_1337="train.ckpt_start=8500"). Hydra takes the last value of a key given twice
#                 (key=value, group=option: the seed's wins over the arguments'); a +key appended twice is refused
# Each finished fork's own final checkpoint is deleted as soon as its result.json exists (it is never forked from).
set -euo pipefail
cd "$(dirname "$0")/.."
EXPERIMENT=${EXPERIMENT:-paper_1gpu}
SEEDS=${SEEDS:-"1337 1 2"}
STOP_AFTER=${STOP_AFTER:-300}
FORK_STEPS=${FORK_STEPS:-0}
PER_GPU_FIRST=${PER_GPU_FIRST:-2}
PER_GPU_OTHERS=${PER_GPU_OTHERS:-1}
CKPT_EVERY_OTHERS=${CKPT_EVERY_OTHERS:-500}
PAST_DIVERGENCE=${PAST_DIVERGENCE:-}
PICK=${PICK:-at-min}
MARGIN=${MARGIN:-0}
KEEP_CHECKPOINTS=${KEEP_CHECKPOINTS:-0}
FORK_OVERRIDES=${FORK_OVERRIDES:-}
FORK_MEMORY=${FORK_MEMORY:-}
CONTROL_SWEEPS=${CONTROL_SWEEPS:-paper_1gpu_controls}
ISOLATION_SWEEPS=${ISOLATION_SWEEPS-paper_isolation beta_sweep}
PROGRESS_EVERY=${PROGRESS_EVERY:-60}
RACE=${RACE:-0}  # checked before anything is made or printed
case "$RACE" in 0|1) ;; *) echo "paper_1gpu.sh: RACE=$RACE is not allowed: expected 0 or 1" >&2; exit 2;; esac
for v in $(compgen -v OVERRIDES_); do  # a seed's overrides for a seed not in the plan would be silently unused
  [[ " $SEEDS " == *" ${v#OVERRIDES_} "* ]] || { echo "paper_1gpu.sh: $v is set, but seed ${v#OVERRIDES_} is not in SEEDS=\"$SEEDS\": expected OVERRIDES_<seed> for one of them" >&2; exit 2; }
done
ROOT=$(realpath -m "${ROOT:-results/runs/paper_1gpu/$(date +%Y-%m-%d_%H-%M-%S)}")
[ -n "${DRY_RUN:-}" ] || mkdir -p "$ROOT"
T0=$(date +%s)

say() {
  local line="[paper_1gpu $(( $(date +%s) - T0 ))s] $*"
  echo "$line"
  [ -n "${DRY_RUN:-}" ] || echo "$line" >> "$ROOT/progress.log"
}

first=${SEEDS%% *}
declare -A PIDS=()
say "root $ROOT; experiment $EXPERIMENT; seeds $SEEDS; baselines stop $STOP_AFTER steps after their divergence"
[ -z "${DRY_RUN:-}" ] && command -v df >/dev/null && say "disk free under $ROOT: $(df -h --output=avail "$ROOT" | tail -1 | tr -d ' ')"
for s in $SEEDS; do
  dir="$ROOT/seed$s"
  if [ "$s" = "$first" ] || [ "$RACE" = 1 ]; then
    sweeps="$CONTROL_SWEEPS $ISOLATION_SWEEPS" per=$PER_GPU_FIRST extra=()
  else
    sweeps="$CONTROL_SWEEPS" per=$PER_GPU_OTHERS extra=("train.ckpt_every=$CKPT_EVERY_OTHERS")
  fi
  opts=(--pick "$PICK" --margin "$MARGIN" --keep-checkpoints "$KEEP_CHECKPOINTS")
  [ -n "$PAST_DIVERGENCE" ] && opts+=(--past-divergence "$PAST_DIVERGENCE")
  [ -n "$FORK_MEMORY" ] && opts+=(--fork-memory "$FORK_MEMORY")
  for o in $FORK_OVERRIDES; do opts+=(--fork-override "$o"); done
  ov_var=OVERRIDES_$s; read -ra mine <<< "${!ov_var:-}"  # this seed's own overrides, after everyone's
  # shellcheck disable=SC2206
  cmd=(python -m flash_forensics.orchestrator.analysis.isolate --experiment "$EXPERIMENT" --root "$dir" --out "$dir/report"
       --uri "sqlite:///$dir/mlflow.db" --stop-after "$STOP_AFTER" --fork-steps "$FORK_STEPS" --per-gpu "$per"
       "${opts[@]}" --sweeps $sweeps -- "train.seed=$s" "data.seed=$s" train.keep_last=false ${extra[@]+"${extra[@]}"} "$@"
       ${mine[@]+"${mine[@]}"})
  say "seed $s: ${cmd[*]}"
  [ -n "${DRY_RUN:-}" ] && continue
  mkdir -p "$dir"
  setsid "${cmd[@]}" > "$ROOT/seed$s.log" 2>&1 &  # its own process group: stopping this script stops its runs
  PIDS[$s]=$!
done
[ "$RACE" = 1 ] && say "race: the first seed whose baseline diverges keeps the GPU; the others stop"
[ -n "${DRY_RUN:-}" ] && exit 0
stop_all() { for p in "${PIDS[@]}"; do kill -- "-$p" 2>/dev/null || true; done; }
trap 'say "interrupted: stopping every isolate and its runs"; stop_all; exit 130' INT TERM

newest_ckpt() {  # the newest checkpoint step of seed $1's baseline (empty: none)
  (find "$ROOT/seed$1/baseline/checkpoints" -name 'step_*.pt' 2>/dev/null || true) | sed 's/.*step_\([0-9]*\)\.pt/\1/' \
    | sort -n | tail -1
}

progress() {  # one line per seed: the baseline's newest checkpoint, forks done, the isolate's last step line
  for s in $SEEDS; do
    dir="$ROOT/seed$s"
    ck=$(newest_ckpt "$s")
    nf=$( (find "$dir/forks" -maxdepth 1 -name '*.log' 2>/dev/null || true) | wc -l)
    nd=$( (find "$dir/forks" -mindepth 2 -maxdepth 2 -name result.json 2>/dev/null || true) | wc -l)
    last=$( (grep -a '^\[paper_isolation' "$ROOT/seed$s.log" 2>/dev/null || true) | tail -1)
    last=${last:-starting}
    state=running; kill -0 "${PIDS[$s]}" 2>/dev/null || state=ended
    [ -n "${STOPPED[$s]+x}" ] && state="stopped by the race"
    say "seed $s ($state): baseline checkpoint step ${ck:-none} | forks done $nd/$nf | $(echo "${last//$ROOT\//}" | cut -c1-140)"
  done
}

janitor() {  # a finished fork's final checkpoint is never forked from: free its ~1.5 GB at once
  (find "$ROOT" -path '*/forks/*/result.json' 2>/dev/null || true) | while read -r r; do
    rm -f "$(dirname "$r")"/checkpoints/*.pt
  done
}

# RACE=1: each baseline's result.json is read once, when it appears; the first that says "diverged" wins, and every
# isolate whose baseline has not ended yet is stopped: TERM to its process group, KILL 90 s later if still there. The
# baseline's run.py takes TERM as a preemption: it waits for a checkpoint write in flight, writes one at its next step
# boundary (a GPT-2S checkpoint took ~6 s on an H200), then a result.json "failed" whose error says "stopped by
# SIGTERM after N steps" (resume it from there on this machine with resume=...)
declare -A ENDED=() STOPPED=()
winner="" won_at=""
race() {
  local s o r ck stopped=()
  for s in $SEEDS; do
    [ -n "${ENDED[$s]+x}" ] && continue
    r="$ROOT/seed$s/baseline/result.json"
    [ -f "$r" ] || continue
    ENDED[$s]=$(python -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["observed"], r.get("divergence_step"))' \
                "$r" 2>/dev/null || echo "unreadable -")
    if [ -z "$winner" ] && [ "${ENDED[$s]%% *}" = diverged ]; then winner=$s won_at=${ENDED[$s]#* }; fi
  done
  [ -n "$winner" ] || return 0
  for o in $SEEDS; do
    [ -n "${ENDED[$o]+x}" ] || [ -f "$ROOT/seed$o/baseline/result.json" ] && continue
    kill -0 "${PIDS[$o]}" 2>/dev/null || continue  # ended on its own (a crash): said as such at the end
    STOPPED[$o]=none
    kill -- "-${PIDS[$o]}" 2>/dev/null || true
  done
  for _ in $(seq 180); do
    local left=0
    for o in "${!STOPPED[@]}"; do kill -0 -- "-${PIDS[$o]}" 2>/dev/null && left=1; done
    [ "$left" = 0 ] && break
    sleep 0.5
  done
  for o in "${!STOPPED[@]}"; do
    kill -KILL -- "-${PIDS[$o]}" 2>/dev/null || true
    ck=$(newest_ckpt "$o"); STOPPED[$o]=${ck:-none}; stopped+=("seed $o at baseline checkpoint step ${ck:-none}")
  done
  local list; list=$(printf '%s, ' ${stopped[@]+"${stopped[@]}"}); list=${list%, }
  say "race: seed $winner diverged first, at step $won_at; stopped: ${list:-none (every other baseline had ended)}"
}

alive() { for s in $SEEDS; do kill -0 "${PIDS[$s]}" 2>/dev/null && return 0; done; return 1; }
next=$(( $(date +%s) + PROGRESS_EVERY ))
while alive; do
  sleep 2
  janitor
  [ "$RACE" = 1 ] && [ -z "$winner" ] && race
  if [ "$(date +%s)" -ge "$next" ]; then progress; next=$(( $(date +%s) + PROGRESS_EVERY )); fi
done
janitor
rc=0
for s in $SEEDS; do
  if [ -n "${STOPPED[$s]+x}" ]; then
    wait "${PIDS[$s]}" 2>/dev/null || true
    say "seed $s: stopped by the race (seed $winner diverged first at step $won_at)"
  elif wait "${PIDS[$s]}"; then say "seed $s: done, table $ROOT/seed$s/report/verdicts.md"
  else
    code=$?; rc=1
    # a baseline that never diverged has no fork point: a finding (its result.json says so), not a crash
    obs=$(python -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["observed"], r.get("steps_done"))' \
          "$ROOT/seed$s/baseline/result.json" 2>/dev/null || echo "no result")
    say "seed $s: FAILED (exit $code; baseline: $obs); its log: $ROOT/seed$s.log"
    tail -n 5 "$ROOT/seed$s.log" | sed 's/^/    /'
  fi
done
progress
for s in $SEEDS; do
  v="$ROOT/seed$s/report/verdicts.json"
  [ -f "$v" ] && python - "$v" "$s" <<'EOF'
import json, sys
doc = json.load(open(sys.argv[1]))
for r in doc["runs"]:
    print(f"  seed {sys.argv[2]:>4} {r['job']:<34} {str(r.get('intervention')):<18} expected {str(r.get('expected')):<9}"
          f" observed {str(r.get('observed')):<9} divergence {r.get('divergence_step')}")
EOF
done
say "all done in $(( $(date +%s) - T0 )) s (exit $rc); progress log $ROOT/progress.log"
exit $rc

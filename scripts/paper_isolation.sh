#!/usr/bin/env bash
# The paper's isolation experiments on the miniature, end to end, one command:
#   bash scripts/paper_isolation.sh [hydra overrides for every run, e.g. train.seed=2 data.seed=2]
# A thin wrapper of `python -m flash_forensics.orchestrator.analysis.isolate` (baseline -> checkpoint pick -> localization -> forks, PER_GPU
# at a time per GPU -> one report; the steps are documented there). Env, each optional: ROOT (run folder),
# ISOLATION_OUT (report folder, default $ROOT/report; results/paper_isolation refreshes the committed table),
# FORK_STEPS, MARGIN, PER_GPU, URI (MLflow store).
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
[ -n "${ROOT:-}" ] && args+=(--root "$ROOT")
[ -n "${ISOLATION_OUT:-}" ] && args+=(--out "$ISOLATION_OUT")
[ -n "${FORK_STEPS:-}" ] && args+=(--fork-steps "$FORK_STEPS")
[ -n "${MARGIN:-}" ] && args+=(--margin "$MARGIN")
[ -n "${PER_GPU:-}" ] && args+=(--per-gpu "$PER_GPU")
[ -n "${URI:-}" ] && args+=(--uri "$URI")
exec python -m flash_forensics.orchestrator.analysis.isolate "${args[@]}" "$@"

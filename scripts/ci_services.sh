#!/usr/bin/env bash
# Services the integration tests need, for .ci/run: Debian slurm-wlm + munge (installed once), then the one-node
# SLURM of scripts/slurm_local.sh. Idempotent and quick when everything is already there. MLflow servers are
# started by the tests themselves on free ports.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "ci_services: not root; skipping SLURM (tests marked slurm will skip)" >&2
  exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge >/dev/null
fi
bash scripts/slurm_local.sh start

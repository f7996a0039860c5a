#!/usr/bin/env bash
# A real single-node SLURM on this machine (Debian slurm-wlm + munge), for the cluster tests and for trying the
# hydra/launcher=slurm path on one box. Runs the daemons as root; no accounting database (sacct warns; harmless).
#   scripts/slurm_local.sh start|stop|status|restart
# Env: SLURM_LOCAL_CPUS (CPUs the node advertises, default max(8, nproc): smoke jobs are tiny, so several share a
#      core), SLURM_LOCAL_STATE (state/log dir, default /var/spool/slurm-local).
set -euo pipefail

CONF=/etc/slurm/slurm.conf
MARK="# written by flash-forensics scripts/slurm_local.sh"
STATE=${SLURM_LOCAL_STATE:-/var/spool/slurm-local}
NODE=$(hostname -s)
NPROC=$(nproc)
CPUS=${SLURM_LOCAL_CPUS:-$(( NPROC > 8 ? NPROC : 8 ))}
MEM_MB=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)

die() { echo "slurm_local: $*" >&2; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "must run as root (the daemons run as root on this single-node setup)"; }

need_bins() {
  for b in munged slurmctld slurmd scontrol sbatch; do
    command -v "$b" >/dev/null || die "$b not found: install the Debian packages first (scripts/ci_services.sh does: apt-get install slurm-wlm munge)"
  done
}

write_conf() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; refusing to overwrite a real cluster's config"
  fi
  mkdir -p "$STATE"/{ctld,d} /var/log/slurm-local /run/slurm-local
  cat >"$CONF" <<EOF
$MARK
ClusterName=localcluster
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=/run/slurm-local/slurmctld.pid
SlurmdPidFile=/run/slurm-local/slurmd.pid
SlurmctldLogFile=/var/log/slurm-local/slurmctld.log
SlurmdLogFile=/var/log/slurm-local/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
SlurmdParameters=config_overrides
MpiDefault=none
KillWait=10
MinJobAge=3600  # completed jobs stay visible to scontrol (and sacct_local.sh) for an hour
InactiveLimit=0
Waittime=0
NodeName=$NODE CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

SHIM=/usr/local/bin/sacct
SHIM_MARK="# sacct for the one-node SLURM of scripts/slurm_local.sh"
install_sacct_shim() {
  # no accounting database here: submitit's watcher asks sacct for job states; answer it from scontrol
  if [ -e "$SHIM" ] && ! grep -qF "$SHIM_MARK" "$SHIM"; then
    echo "slurm_local: $SHIM exists and is not ours; leaving it (hard-killed jobs may stall a submitit sweep)" >&2
    return 0
  fi
  install -m 0755 "$(dirname "$0")/sacct_local.sh" "$SHIM"
}

munge_up() { pgrep -x munged >/dev/null; }
ctld_up() { [ -f /run/slurm-local/slurmctld.pid ] && kill -0 "$(cat /run/slurm-local/slurmctld.pid)" 2>/dev/null; }
slurmd_up() { [ -f /run/slurm-local/slurmd.pid ] && kill -0 "$(cat /run/slurm-local/slurmd.pid)" 2>/dev/null; }

start() {
  need_root; need_bins; write_conf
  if ! munge_up; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    [ -f /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
    chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
    chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key
    runuser -u munge -- munged || munged --force
  fi
  install_sacct_shim
  ctld_up || slurmctld
  slurmd_up || slurmd
  # wait until the controller answers and the node is usable
  for _ in $(seq 1 60); do
    if scontrol ping 2>/dev/null | grep -q UP; then
      state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
      case "$state" in
        idle*|mixed*|allocated*) echo "slurm_local: up (node $NODE, $CPUS CPUs, partition debug)"; return 0 ;;
        down*|drain*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
      esac
    fi
    sleep 1
  done
  die "SLURM did not come up in 60 s; see /var/log/slurm-local/*.log"
}

stop() {
  need_root
  for f in slurmd slurmctld; do
    if [ -f /run/slurm-local/$f.pid ]; then
      pid=$(cat /run/slurm-local/$f.pid)
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      rm -f /run/slurm-local/$f.pid
    fi
  done
  if [ -e "$SHIM" ] && grep -qF "$SHIM_MARK" "$SHIM"; then rm -f "$SHIM"; fi
  echo "slurm_local: stopped (munged left running)"
}

status() {
  if command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q UP; then
    scontrol ping; sinfo; return 0
  fi
  echo "slurm_local: down"; return 3
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  restart) stop; start ;;
  status) status ;;
  *) echo "usage: $0 start|stop|restart|status" >&2; exit 2 ;;
esac

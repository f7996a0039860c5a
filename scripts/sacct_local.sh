#!/usr/bin/env bash
# sacct for the one-node SLURM of scripts/slurm_local.sh, which has no accounting database: answers the query
# submitit's job watcher makes (`sacct -o JobID,State,NodeList --parsable2 -j ID ...`) from `scontrol show job`,
# so a job that dies without a result (OOM kill, scancel, node trouble) is seen as FAILED/CANCELLED and the sweep
# goes on, instead of waiting forever on state UNKNOWN. Any other use goes to the real sacct.
# slurm_local.sh installs it as /usr/local/bin/sacct (ahead of /usr/bin on PATH) and removes it on stop.
set -uo pipefail
REAL=/usr/bin/sacct

ids=()
fields=""
parsable=0
args=("$@")
while [ $# -gt 0 ]; do
  case "$1" in
    -o|--format) fields=$2; shift 2 ;;
    --format=*) fields=${1#--format=}; shift ;;
    -j|--jobs) IFS=, read -ra more <<<"$2"; ids+=("${more[@]}"); shift 2 ;;
    --jobs=*) IFS=, read -ra more <<<"${1#--jobs=}"; ids+=("${more[@]}"); shift ;;
    --parsable2|-P) parsable=1; shift ;;
    *) exec "$REAL" "${args[@]}" ;;
  esac
done
if [ "$fields" != "JobID,State,NodeList" ] || [ "$parsable" != 1 ] || [ ${#ids[@]} = 0 ]; then
  exec "$REAL" "${args[@]}"
fi

echo "JobID|State|NodeList"
for id in "${ids[@]}"; do
  scontrol show job -o "$id" 2>/dev/null | awk '
    {
      jid = ""; arr = ""; task = ""; state = ""; nodes = "None assigned"
      for (i = 1; i <= NF; i++) {
        split($i, kv, "=")
        if (kv[1] == "JobId") jid = kv[2]
        else if (kv[1] == "ArrayJobId") arr = kv[2]
        else if (kv[1] == "ArrayTaskId") task = kv[2]
        else if (kv[1] == "JobState") state = kv[2]
        else if (kv[1] == "NodeList" && kv[2] != "(null)") nodes = kv[2]
      }
      if (arr != "" && task != "") jid = arr "_" task
      if (jid != "") print jid "|" state "|" nodes
    }'
done
exit 0

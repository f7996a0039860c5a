#!/usr/bin/env bash
# A shared MLflow tracking server for multi-job sweeps (SLURM jobs on several nodes log to one place).
#   scripts/mlflow_server.sh start|stop|status [--port P] [--root DIR] [--host H] [--backend URI] [--workers N]
# --root: a folder every node can reach (shared filesystem); holds the sqlite db (unless --backend is given, e.g.
#         postgresql://user@dbhost/mlflow for many writers), the artifacts and the server log.
# Jobs log to it with `tracking.uri=http://<this host>:<port>` (printed on start).
set -euo pipefail

HERE=$(cd "$(dirname "$0")/.." && pwd)
CMD=${1:-}; shift || true
PORT=5000
ROOT=${MLFLOW_SHARED_ROOT:-$HERE/results/mlflow-server}
HOST=0.0.0.0
BACKEND=""
WORKERS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT=$2; shift 2 ;;
    --root) ROOT=$2; shift 2 ;;
    --host) HOST=$2; shift 2 ;;
    --backend) BACKEND=$2; shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;
    *) echo "mlflow_server: unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
BACKEND=${BACKEND:-sqlite:///$ROOT/mlflow.db}
PIDF=$ROOT/server-$PORT.pid
LOGF=$ROOT/server-$PORT.log
NAME=$(hostname -f 2>/dev/null || hostname)
URL=http://$NAME:$PORT

healthy() { python - "$PORT" <<'EOF'
import sys, urllib.request
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
EOF
}
running() { [ -f "$PIDF" ] && kill -0 "$(cat "$PIDF")" 2>/dev/null; }

start() {
  if running && healthy; then echo "mlflow_server: already up: tracking.uri=$URL (pid $(cat "$PIDF"))"; return 0; fi
  if healthy; then echo "mlflow_server: port $PORT already serves something else; pick --port" >&2; exit 1; fi
  mkdir -p "$ROOT/artifacts"
  # setsid: the server outlives this shell and is stopped as one process group
  setsid mlflow server --backend-store-uri "$BACKEND" --artifacts-destination "$ROOT/artifacts" \
    --serve-artifacts --host "$HOST" --port "$PORT" --workers "$WORKERS" \
    --allowed-hosts "localhost,localhost:$PORT,127.0.0.1,127.0.0.1:$PORT,$NAME,$NAME:$PORT,$(hostname),$(hostname):$PORT" \
    >"$LOGF" 2>&1 < /dev/null &
  echo $! >"$PIDF"
  for _ in $(seq 1 120); do
    if healthy; then echo "mlflow_server: up: tracking.uri=$URL (backend $BACKEND, artifacts $ROOT/artifacts, log $LOGF)"; return 0; fi
    running || { echo "mlflow_server: server exited; last log lines:" >&2; tail -20 "$LOGF" >&2; exit 1; }
    sleep 0.5
  done
  echo "mlflow_server: no answer on port $PORT after 60 s; see $LOGF" >&2; exit 1
}

stop() {
  if running; then
    pid=$(cat "$PIDF")
    kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -9 -- -"$pid" 2>/dev/null || true
  fi
  rm -f "$PIDF"; echo "mlflow_server: stopped (port $PORT)"
}

status() {
  if running && healthy; then echo "mlflow_server: up: tracking.uri=$URL (pid $(cat "$PIDF"))"; return 0; fi
  echo "mlflow_server: down (port $PORT)"; return 3
}

case "$CMD" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status [--port P] [--root DIR] [--host H] [--backend URI] [--workers N]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Run N CPU processes of train.py on this machine, joined by JAX's distributed runtime on 127.0.0.1 (gloo
# collectives): the multi-host code path, testable on one host.
#   launch/local.sh N [train.py arguments...]
#   e.g. MTPJAX_LOCAL_DEVICES=2 launch/local.sh 2 --config configs/tiny.yaml mesh.data=2 mesh.fsdp=2
# Environment: MTPJAX_LOCAL_DEVICES (CPU devices per process, default 1), MTPJAX_INIT_TIMEOUT (seconds,
# default 300), MTPJAX_HEARTBEAT_TIMEOUT (default 30), PYTHON (default python3). Waits for all; if one process
# fails or is lost (killed), it is named, the others are stopped and its exit status is returned.
set -u

usage() { echo "usage: launch/local.sh N [train.py arguments...]  (N: number of processes, >= 1)" >&2; exit 2; }
[ $# -ge 1 ] || usage
N=$1; shift
[[ "$N" =~ ^[1-9][0-9]*$ ]] || usage

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null; then
  echo "local.sh: PYTHON=$PY is not a command here; set PYTHON to the interpreter that has mtpjax" >&2
  exit 2
fi
# A free port picked by the kernel; it is released right away, so a race with another program is possible
# but harmless here: process 0 would fail to bind and every process would stop with an error.
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])') || exit 1

export JAX_PLATFORMS=cpu
export MTPJAX_COORDINATOR="127.0.0.1:$PORT" MTPJAX_NUM_PROCESSES="$N"
export MTPJAX_LOCAL_DEVICES="${MTPJAX_LOCAL_DEVICES:-1}"

PIDS=()
stop_all() {  # stop_all GRACE_SECONDS
  local pid
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  # SIGTERM asks train.py for a checkpoint at a step all processes agree on; a dead process cannot agree
  for _ in $(seq $(($1 * 10))); do
    local alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && return
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
}
on_interrupt() {  # every process checkpoints and exits; status 0 when all of them managed to
  echo "local.sh: interrupted; asking every process to checkpoint and stop" >&2
  stop_all 120
  local pid rc=0
  for pid in "${running[@]}"; do wait "$pid" || rc=$?; done
  exit $rc
}

for ((i = 0; i < N; i++)); do
  MTPJAX_PROCESS_ID=$i "$PY" "$HERE/../train.py" "$@" &
  PIDS+=($!)
done
running=("${PIDS[@]}")
trap on_interrupt INT TERM

status=0
while [ ${#running[@]} -gt 0 ]; do
  wait -n -p done_pid "${running[@]}"
  rc=$?
  left=()
  for pid in "${running[@]}"; do [ "$pid" = "$done_pid" ] || left+=("$pid"); done
  running=("${left[@]}")
  if [ "$rc" -ne 0 ]; then
    for ((i = 0; i < N; i++)); do [ "${PIDS[$i]}" = "$done_pid" ] && who=$i; done
    how="exited with status $rc"
    [ "$rc" -gt 128 ] && how="was lost (killed by signal $((rc - 128)), SIG$(kill -l $((rc - 128)) 2>/dev/null))"
    next="run the same command again to resume from the last complete checkpoint"
    # status 2: train.py refused its input (its line above says what to change); the same command is refused again
    [ "$rc" = 2 ] && next="it refused the command (its line above names the fix); nothing to resume"
    echo "local.sh: process ${who:-?} of $N $how; stopping the others; $next" >&2
    status=$rc
    stop_all 5
    wait
    break
  fi
done
exit $status

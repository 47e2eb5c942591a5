#!/usr/bin/env bash
# Train on a Cloud TPU pod slice: the same command on every worker, joined by JAX's own TPU detection.
#   launch/tpu_vm.sh TPU_NAME ZONE [train.py arguments...]
#   e.g. launch/tpu_vm.sh my-v5e-32 us-west4-a --config configs/small.yaml train.run_dir=gs://bucket/runs/small
# Every worker needs the repository at $MTPJAX_DIR (default ~/mtpjax) with its dependencies installed and a
# run dir they all see (a gs:// bucket or a shared mount). Optional: PROJECT (gcloud project), PYTHON.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: launch/tpu_vm.sh TPU_NAME ZONE [train.py arguments...]" >&2
  exit 2
fi
TPU=$1 ZONE=$2
shift 2

args=$(printf ' %q' "$@")  # quoted once more for the remote shell
remote="cd ${MTPJAX_DIR:-~/mtpjax} && MTPJAX_CLUSTER=tpu MTPJAX_INIT_TIMEOUT=${MTPJAX_INIT_TIMEOUT:-300}"
remote+=" ${PYTHON:-python3} train.py$args"
exec gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" ${PROJECT:+--project="$PROJECT"} --worker=all \
  --command="$remote"

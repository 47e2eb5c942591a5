#!/bin/bash
# Sourced by the lent-GPU scripts (bench/lease.sh, bench/lease_profile.sh): the device, the wheels carried in .whl
# (bench/lease.sh's header says how to download them), and a PYTHONPATH under which mtpjax imports.
set -u
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
OUT=${OUT:-/tmp/lease}; mkdir -p "$OUT"
date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
lscpu | grep -E "Model name|L3"; nproc
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pydantic*.whl \
  .whl/annotated*.whl .whl/typing_insp*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pin .whl/flax*.whl .whl/optax*.whl
python3 -c "import jax, flax, optax; print('image: jax', jax.__version__, 'flax', flax.__version__, 'optax',
optax.__version__, jax.devices())"
probe='from mtpjax.config import ModelConfig; from mtpjax.nn.model import build_model; import mtpjax.train.step
import mtpjax.decode, flax; build_model(ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2))
print("mtpjax imports; flax", flax.__version__)'
# Our pinned flax/optax first; the image's own if those do not import under the image's jax.
if PYTHONPATH=/tmp/pin:/tmp/site python3 -c "$probe"; then export PYTHONPATH=/tmp/pin:/tmp/site
elif PYTHONPATH=/tmp/site python3 -c "$probe"; then export PYTHONPATH=/tmp/site
else echo "mtpjax does not import here"; exit 3; fi

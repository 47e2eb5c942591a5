#!/bin/bash
# What a session lent a GPU runs first, in one call (docs/accelerators.md, "Accelerator check"): the accelerator
# check on gpu_1b beside its compiled estimate, the MoE's grouped-matmul kernel against ragged_dot, and a 4-block
# gpu_moe train step beside its estimate. Each part has its own time limit; everything lands in $OUT.
#
# Here first (the lent machine has jax, flax, optax, numpy, yaml, but no pydantic; flax/optax at our pins), once:
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl pydantic==2.13.4 \
#     pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 flax==0.12.8 optax==0.2.8
# (.whl ignored by git), then the device tool's run: command `bash bench/lease.sh 2>&1 | tee $OUT/log.txt`,
# carry [".whl"], timeout_s 560. The estimates were compiled here (PYTHONPATH=.:.aot/site), train.batch_size=8
# train.micro_batches=1 as accelerator.py's train rows run:
#   python -m mtpjax compile --config configs/gpu_1b.yaml --target h200:1 --no-decode --json E/gpu_1b.h200_1.batch8.json
#   python -m mtpjax compile --config configs/gpu_moe.yaml --target h200:1 --no-decode model.n_layers=4 --json ...
source bench/lease_env.sh
E=bench/estimates
echo "== accelerator.py (gpu_1b)"; date -u
timeout 250 python3 bench/accelerator.py --json "$OUT/acc_1b.json" --estimate $E/gpu_1b.h200_1.batch8.json --budget 215
echo "== gmm_gpu.py"; date -u
timeout 100 python3 bench/gmm_gpu.py --json "$OUT/gmm.json"
echo "== accelerator.py (gpu_moe, 4 blocks, train step)"; date -u
timeout 140 python3 bench/accelerator.py --config configs/gpu_moe.yaml --set model.n_layers=4 --backends auto \
  --sections train --estimate $E/gpu_moe.4blocks.h200_1.batch8.json --json "$OUT/acc_moe.json" --budget 120
date -u

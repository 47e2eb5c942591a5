#!/bin/bash
# A lent GPU's second call: where the train steps' time goes (bench/profile_step.py on gpu_1b with cuDNN attention
# and on 4-block gpu_moe, each at accelerator.py's 8 x 4096 batch; the compiled HLO and the trace kept in $OUT for
# reading here), then the decode rows at batch 8 and 32 that the first call's budget skipped.
#   device run: command `bash bench/lease_profile.sh 2>&1 | tee $OUT/log.txt`, carry [".whl"], timeout_s 440
source bench/lease_env.sh
B="train.batch_size=8 train.micro_batches=1"
# With CUDA graphs (command buffers) on, a trace shows one command_buffer per graph, not the kernels inside it.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
echo "== profile gpu_1b (cudnn)"; date -u
timeout 120 python3 -m bench.profile_step --config configs/gpu_1b.yaml --steps 2 --top 25 --save "$OUT/p1b" \
  $B model.attention=cudnn
echo "== profile gpu_moe (4 blocks)"; date -u
timeout 150 python3 -m bench.profile_step --config configs/gpu_moe.yaml --steps 2 --top 25 --save "$OUT/pmoe" \
  $B model.n_layers=4
echo "== decode, batch 8 and 32"; date -u
export XLA_FLAGS=
timeout 130 python3 bench/accelerator.py --sections decode --batches 8,32 --budget 110 --json "$OUT/decode.json"
date -u

#!/usr/bin/env bash
# Issue #8: sharded training of the 130M Falcon-1A LM preset on one host's GPUs, against one GPU.
#
#   OUT=/some/dir bash experiments/multi_gpu.sh            # needs 2 GPUs; about 9.5 minutes on 2 H200s
#   RUNS="g1 g2-fsdp g2to1" OUT=... bash experiments/multi_gpu.sh; RUNS="g2-data g2-proc" OUT=... bash ...
#                                                          # the same in two calls of a 10-minute lease
#   CPU_SMOKE=1 STEPS=6 EXTRA="--set model.d_model=64 ..." bash experiments/multi_gpu.sh   # the script on CPU
#
# Five runs of the same job (lm-130m preset: Falcon-1A.3, 12 layers, d_model 768, BPE vocab 50,304;
# shortened to STEPS steps of a global batch of BATCH x 1,024 tokens on data/python-docs.jsonl):
#   g1        1 GPU, one process
#   g2-fsdp   2 GPUs, one process, mesh data=1 x fsdp=2 (parameters and optimizer state sharded)
#   g2-data   2 GPUs, one process, mesh data=2 (pure data parallelism)
#   g2-proc   2 GPUs, two processes through jax.distributed (python -m falcon_jax.train.launch), mesh data=2
#   g2to1     g2-fsdp's checkpoint of step RESUME_FROM restored on 1 GPU (orbax reshards) and continued
# (g2to1 runs before g2-data and g2-proc, so a cut-off call still has the restore), then
# experiments/multi_gpu_summary.py prints the table for docs/results.md and writes JSON.
set -u
out=${OUT:-runs/mgpu-out}
RUNS=${RUNS:-g1 g2-fsdp g2to1 g2-data g2-proc}
for r in $RUNS; do
  case $r in g1|g2-fsdp|g2to1|g2-data|g2-proc) ;; *) echo "RUNS: unknown run '$r' (g1 g2-fsdp g2to1 g2-data g2-proc)"; exit 2 ;; esac
done
wanted() { [[ " $RUNS " == *" $1 "* ]]; }
STEPS=${STEPS:-200}
BATCH=${BATCH:-32}
RESUME_FROM=${RESUME_FROM:-100}
CKPT_EVERY=${CKPT_EVERY:-100}
runs=runs/mgpu
mkdir -p "$out" "$runs"
# NVLink multicast stays off (the lending machines require it; see the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "warning: installing .whl/ failed"
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -5

common=(--preset lm-130m --set 'data.paths=["data/python-docs.jsonl"]' --set data.cache_dir=/tmp/falcon-cache
        --set train.steps="$STEPS" --set train.batch_size="$BATCH" --set optim.warmup_steps=30
        --set train.log_every=25 --set train.eval_every=0 --set data.val_batches=8
        --set checkpoint.every=$CKPT_EVERY --set checkpoint.keep=3 --set train.plots=false ${EXTRA:-})
if [ "${CPU_SMOKE:-0}" = 1 ]; then  # simulated CPU devices stand in for the GPUs
  one=(env JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1)
  two=(env JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2)
  per_process=(--cpu-devices 1)
else
  one=(env CUDA_VISIBLE_DEVICES=0)
  two=(env)
  per_process=(--gpus-per-process 1)
fi
filter() { grep -v -E "slow_operation_alarm|Constant folding|The operation took|^$" | tee "$1"; }

# limits: compilation (about 50 s), 200 steps, the final evaluation and checkpoint (the fifth-session call cut
# g2-fsdp at 110 s while it wrote its step-200 checkpoint, and g2to1 at 70 s after step 150)
if wanted g1; then
  echo "== g1: 1 GPU"
  timeout 140 "${one[@]}" python3 -m falcon_jax.train "${common[@]}" --set mesh.data=1 --set mesh.fsdp=1 \
    --run-dir $runs/g1 2>&1 | filter "$out/g1.log"
fi
if wanted g2-fsdp; then
  echo "== g2-fsdp: 2 GPUs, data=1 x fsdp=2"
  timeout 150 "${two[@]}" python3 -m falcon_jax.train "${common[@]}" --set mesh.data=1 --set mesh.fsdp=2 \
    --run-dir $runs/g2-fsdp 2>&1 | filter "$out/g2-fsdp.log"
fi
if wanted g2to1; then
  echo "== g2to1: g2-fsdp's step-$RESUME_FROM checkpoint restored on 1 GPU"
  rm -rf $runs/g2to1 && cp -r $runs/g2-fsdp $runs/g2to1  # a copy: g2-fsdp's own checkpoints stay as they are
  for s in $(ls $runs/g2to1/checkpoints); do  # later steps (and unfinished saves: not a step number) go
    if ! [[ $s =~ ^[0-9]+$ ]] || [ "$s" -gt "$RESUME_FROM" ]; then rm -rf "$runs/g2to1/checkpoints/$s"; fi
  done
  timeout 100 "${one[@]}" python3 -m falcon_jax.train --run-dir $runs/g2to1 --resume --set mesh.data=1 --set mesh.fsdp=1 \
    2>&1 | filter "$out/g2to1.log"
fi
if wanted g2-data; then
  echo "== g2-data: 2 GPUs, one process, data=2"
  timeout 130 "${two[@]}" python3 -m falcon_jax.train "${common[@]}" --set mesh.data=2 --set mesh.fsdp=1 \
    --run-dir $runs/g2-data 2>&1 | filter "$out/g2-data.log"
fi
if wanted g2-proc; then
  echo "== g2-proc: 2 processes x 1 GPU, data=2"
  timeout 130 "${two[@]}" python3 -m falcon_jax.train.launch --processes 2 "${per_process[@]}" -- "${common[@]}" \
    --set mesh.data=2 --set mesh.fsdp=1 --run-dir $runs/g2-proc 2>&1 | filter "$out/g2-proc.log"
fi
python3 experiments/multi_gpu_summary.py $runs --resume-from "$RESUME_FROM" --out "$out/multi_gpu.json" \
  | tee "$out/summary.md"
tar czf "$out/mgpu-runs.tar.gz" --exclude checkpoints $runs && echo "packed $out/mgpu-runs.tar.gz"

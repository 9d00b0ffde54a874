#!/usr/bin/env bash
# Where does a two-GPU run of the lm-130m job spend its first minutes?  Each run is stopped with
# SIGABRT at its limit so Python's faulthandler prints every thread's stack (compile, collective, input).
#   OUT=/some/dir LIMIT=150 bash experiments/multi_gpu_probe.sh
set -u
out=${OUT:-runs/mgpu-probe-out}; limit=${LIMIT:-150}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD" JAX_LOG_COMPILES=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.45}
common=(--preset lm-130m --set 'data.paths=["data/python-docs.jsonl"]' --set data.cache_dir=/tmp/falcon-cache
        --set train.steps=40 --set train.batch_size=32 --set optim.warmup_steps=10 --set train.log_every=5
        --set train.eval_every=0 --set checkpoint.every=0 --set train.plots=false ${EXTRA:-})
for mesh in "data=2 fsdp=1" "data=1 fsdp=2"; do
  set -- $mesh; name="probe-${1/=/}-${2/=/}"
  echo "== $name ($(date +%T))"
  timeout -s ABRT "$limit" python3 -X faulthandler -m falcon_jax.train "${common[@]}" --set mesh.$1 --set mesh.$2 \
    --run-dir runs/$name > "$out/$name.log" 2>&1
  echo "rc $? ($(date +%T))"; grep -E "^step|Error|XLA compilation of .* in [0-9]{2,}" "$out/$name.log" | cut -c1-300 | head -20
done

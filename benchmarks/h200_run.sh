#!/usr/bin/env bash
# The GPU checks and benchmarks in priority order, each under its own time limit, for short leases:
#
#   bash benchmarks/h200_run.sh checks      # correctness on the real lowering (about 9 min at most)
#   bash benchmarks/h200_run.sh bench       # timings and memory (about 9 min at most)
#   bash benchmarks/h200_run.sh all         # both in one call of at most 9.5 min, the least-run checks first
#   bash benchmarks/h200_run.sh split       # per-pass times, peers of the regression rules, the remaining checks
#   bash benchmarks/h200_run.sh next        # after the BTHD layout and the λmax precision fix: checks, timings, memory
#   bash benchmarks/h200_run.sh next2       # then: launch tuning (fewer pieces) and the regression timings
#   bash benchmarks/h200_run.sh next3       # the regression GPU gradients (cut twice), then every shape timed
#   bash benchmarks/h200_run.sh next4       # the regression GPU gradients (reference now on the host CPU), then
#                                           # the delta rule's launch variants (C=32, 8 warps) never reached so far
#   bash benchmarks/h200_run.sh next5       # the regression gradients again (bf16 at d128; fp32 at d64, whose
#                                           # d128 compile outlasted its step), then value-column blocks 16 / 32 / 64
#   bash benchmarks/h200_run.sh next6       # the delta rule's opt-in pass choices (KernelConfig: outputs /
#                                           # chunk gradients as XLA passes, bf16 walk operands): checked, then timed
#   bash benchmarks/h200_run.sh next7       # the new defaults (bf16 walk operands, XLA chunk gradients): gradient
#                                           # checks, per-pass split, launch variants at 8x2048
#   bash benchmarks/h200_run.sh next8       # the new defaults at every shape, memory, Falcon-2/3, peers
#   bash benchmarks/h200_run.sh next9       # pieces variants at the long shapes; memory at 1x131072
#   bash benchmarks/h200_run.sh next10      # Falcon-1 and Falcon-3 with the seventh run's defaults at every shape
#   bash benchmarks/h200_run.sh next11      # the XLA chunk gradients' bf16 operands: checked, then timed
#   bash benchmarks/h200_run.sh next43      # not yet run: the chunk gradients' loops as fori loops (pipelined),
#                                           # Falcon-1 and Falcon-1A
#   bash benchmarks/h200_run.sh next42      # thirteenth run: the four diagonal inversions in one loop (triangular inverse)
#   bash benchmarks/h200_run.sh next41      # thirteenth run: the final default (next38's chunk gradients, next40's inverse)
#   bash benchmarks/h200_run.sh next40      # thirteenth run: fewer live tiles in the chunk gradients (slower: reverted) and
#                                           # the triangular inverse (kept); 8 / 2-warp variants
#   bash benchmarks/h200_run.sh next39      # thirteenth run: the same row-scale move in the inner-product walks (1A, 3A)
#   bash benchmarks/h200_run.sh next38      # thirteenth run: the walks' row scales moved onto the narrow value blocks
#                                           # (twelfth session, untimed): checked, profiled, timed; kernel resources
#   bash benchmarks/h200_run.sh next37      # not yet run: Nsight Compute again, without JAX's preallocated pool
#   bash benchmarks/h200_run.sh next36      # not yet run as it stands: registers and spills of every kernel (ptxas -v
#                                           # on the PTX Pallas compiles; the first try read XLA's dump: no PTX)
#   bash benchmarks/h200_run.sh next35      # twelfth run: the buffers live at the peak memory, ours and jla
#   bash benchmarks/h200_run.sh next34      # twelfth run, cut: ncu under JAX wrote nothing in 600 s (the call's limit)
#   bash benchmarks/h200_run.sh next33      # twelfth run: the gates' cotangents through the kernel too; the stored
#                                           # chunk gradients as two programs per chunk
#   bash benchmarks/h200_run.sh next32      # twelfth run: the gates' transpose as a Pallas kernel, checked and timed
#   bash benchmarks/h200_run.sh next31      # eleventh run: a barrier before the gates' transpose (no change; reverted)
#   bash benchmarks/h200_run.sh next30      # eleventh run: the XLA glue fusions of the whole op, printed
#   bash benchmarks/h200_run.sh next29      # eleventh run: per-kernel GPU time of ours, jla and fla (CUPTI)
#   bash benchmarks/h200_run.sh next28      # eleventh run: Falcon-2/2A gradients of both per-column solves, 2A timed
#   bash benchmarks/h200_run.sh next27      # eleventh run: Falcon-2's blocked per-column kernels, checked and timed
#   bash benchmarks/h200_run.sh next26      # eleventh run: V stored in bf16, the forward's T kept for the backward
#   bash benchmarks/h200_run.sh next25      # tenth run: fla at 2x8192 and 1x32768 in the same run as the default
#   bash benchmarks/h200_run.sh next24      # tenth run: next23's unfinished checks (gradients, pass choices), 1x131072 memory
#   bash benchmarks/h200_run.sh next23      # tenth run: the new default (bf16 T) checked in full, timed, memory
#   bash benchmarks/h200_run.sh next22      # tenth run: T stored in bf16 (tri_dtype="input"), C=128, 16-column walks
#   bash benchmarks/h200_run.sh next21      # not run (next22 covers it): the ninth-run default checked at d128, timed
#   bash benchmarks/h200_run.sh next20      # the ninth run's final default (dR fp32, dy in the chunk kernel) vs bf16 dR, key widths
#   bash benchmarks/h200_run.sh next19      # the ninth run's default pass by pass, memory at 1x32768 and 1x131072
#   bash benchmarks/h200_run.sh next18      # the ninth run's default (chunk gradients from the walks' P, dR): checks, timing
#   bash benchmarks/h200_run.sh next17      # the ninth run: chunk gradients from the walks' stored P and dR
#   bash benchmarks/h200_run.sh next16      # not yet run: chunk-gradient halves, memory at 1x131072, Falcon-2 launch variants
#   bash benchmarks/h200_run.sh next15      # the gradient checks (bf16, fp32, pass choices) of the eighth run's defaults
#   bash benchmarks/h200_run.sh next14      # the eighth run's defaults: timed at every shape, memory, all checks but Falcon-2's
#   bash benchmarks/h200_run.sh next13      # the split passes one by one (widths varied), split configs whole, memory
#   bash benchmarks/h200_run.sh next12      # the split walks and two-program chunk gradients: checked, timed at every
#                                           # shape; the per-column kernel's (Falcon-2) warps and columns
#
# Peers (jax-linear-attention, fla) are optional: wheels in .whl/ (ignored by git) are installed to /tmp/site first
# when present.  Get them on a machine with PyPI and carry .whl/ to the GPU machine:
#   pip download --no-deps --python-version 3.12 --only-binary=:all: -d .whl jax-linear-attention==0.1.0 \
#     flash-linear-attention==0.6.0 fla-core==0.6.0 equinox jaxtyping wadler-lindig einops  Logs and JSON go to $OUT (default benchmarks/results/latest) and are packed into
# $OUT/<part>.tar.gz; every script writes its JSON as it goes, so a cut-off step keeps its results.
set -u
part=${1:?usage: h200_run.sh checks|bench|all|split|next|next2|next3|next4|next5|next6|next7|next8|next9|next10|next11|next12|next13|next14|next15|next16|next17|next18|next19|next20|next21|next22|next23|next24|next25|next26|next27|next28|next29|next30|next31|next32|next33|next34|next35|next36|next37|next38|next39|next40|next41|next42|next43}
out=${OUT:-benchmarks/results/latest}
mkdir -p "$out/$part"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD"
if [ -z "${SKIP_WHEELS:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then  # SKIP_WHEELS=1: already in /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "warning: installing .whl/ failed; peers will be skipped"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

# bench_regression.py's whole-op variant rows (its WHOLE_OP_VARIANTS), which --rows "falcon-1 pallas" also picks:
# --skip "$WHOLE_OP_VARIANTS" leaves the default op and the --configs rows (named in full where a --configs row may
# share a word, e.g. walks=...)
WHOLE_OP_VARIANTS="ninth-run,bf16 V,stored split,XLA gate,8 warps,2 warps,unrolled,fori loops,walks 2 stages,walks 3 stages"

step() {  # step NAME SECONDS CMD...: run with a limit, keep a filtered log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | grep -v -E "slow_operation_alarm|Constant folding|reduce-window|constant-folding|If you'd like to file|The operation took|^$" \
    | tee "$out/$part/$name.log"
}

profile_falcon1() {  # profile_falcon1 SECONDS TOP [profile_kernels.py args...]: Falcon-1's kernels at 8x2048, 1x32768
  local limit=$1 top=$2
  shift 2
  step profile "$limit" python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128,1x32768x16x128 --impls "falcon-1" \
    "$@" --top "$top" --out "$out/$part/profile.json"
}

case $part in
  checks)
    step check_regression 270 python3 benchmarks/gpu_check_regression.py --out "$out/$part/check_regression.json"
    step check_inner 150 python3 benchmarks/gpu_check_inner_product.py --out "$out/$part/check_inner.json"
    step check_mosaic 110 python3 benchmarks/gpu_check_mosaic.py --out "$out/$part/check_mosaic.json"
    ;;
  bench)
    step bench_inner 260 python3 benchmarks/bench_inner_product.py --out "$out/$part/bench_inner.json"
    step bench_regression 260 python3 benchmarks/bench_regression.py --out "$out/$part/bench_regression.json"
    ;;
  all)
    step check_mosaic 100 python3 benchmarks/gpu_check_mosaic.py --out "$out/$part/check_mosaic.json"
    step check_regression 170 python3 benchmarks/gpu_check_regression.py --out "$out/$part/check_regression.json"
    step check_inner 60 python3 benchmarks/gpu_check_inner_product.py --out "$out/$part/check_inner.json"
    step bench_inner 140 python3 benchmarks/bench_inner_product.py --out "$out/$part/bench_inner.json"
    step bench_regression 70 python3 benchmarks/bench_regression.py --quick --out "$out/$part/bench_regression.json"
    ;;
  split)
    step check_mosaic 90 python3 benchmarks/gpu_check_mosaic.py --out "$out/$part/check_mosaic.json"
    step split_passes 120 python3 benchmarks/split_passes.py --out "$out/$part/split_passes.json"
    step bench_regression 150 python3 benchmarks/bench_regression.py --quick --skip "xla,C=32,8 warps" \
      --out "$out/$part/bench_regression.json"
    step check_regression 190 python3 benchmarks/gpu_check_regression.py --skip "falcon-2 values,falcon-3 values" \
      --out "$out/$part/check_regression.json"
    ;;
  next)
    step check_regression 200 python3 benchmarks/gpu_check_regression.py --skip "falcon-2 values" \
      --out "$out/$part/check_regression.json"
    step bench_inner 150 python3 benchmarks/bench_inner_product.py --quick --out "$out/$part/bench_inner.json"
    step memory_inner 80 python3 benchmarks/bench_inner_product.py --memory-only --out "$out/$part/memory_inner.json"
    ;;
  next2)
    step split_passes 120 python3 benchmarks/split_passes.py --out "$out/$part/split_passes.json"
    step tune_inner 150 python3 benchmarks/bench_inner_product.py --tune --quick --out "$out/$part/tune_inner.json"
    step bench_regression 120 python3 benchmarks/bench_regression.py --quick --skip "xla,falcon-2" \
      --out "$out/$part/bench_regression.json"
    ;;
  next3)
    step check_grads 200 python3 benchmarks/gpu_check_regression.py --only "fp32 grads" \
      --out "$out/$part/check_grads.json"
    step bench_inner 300 python3 benchmarks/bench_inner_product.py --out "$out/$part/bench_inner.json"
    ;;
  next4)
    step check_grads 150 python3 benchmarks/gpu_check_regression.py --only "fp32 grads" \
      --out "$out/$part/check_grads.json"
    step bench_regression 420 python3 benchmarks/bench_regression.py --quick --skip "xla,falcon-2,falcon-3,BTHD" \
      --out "$out/$part/bench_regression.json"
    ;;
  next5)
    step check_grads 250 python3 benchmarks/gpu_check_regression.py --only "bf16 grads,fp32 grads" \
      --out "$out/$part/check_grads.json"
    step bench_regression 150 python3 benchmarks/bench_regression.py --quick \
      --skip "xla,falcon-2,falcon-3,BTHD,jla,fla,C=32,8 warps" --out "$out/$part/bench_regression.json"
    ;;
  next6)
    step check_pass_choices 120 python3 benchmarks/gpu_check_regression.py --only "pass choices" \
      --out "$out/$part/check_pass_choices.json"
    step bench_regression 330 python3 benchmarks/bench_regression.py --quick \
      --skip "xla chunk,falcon-2,falcon-3,BTHD,jla 0.1.0 deltanet,fla,C=32,8 warps,value columns" \
      --out "$out/$part/bench_regression.json"
    ;;
  next7)
    step check_regression 200 python3 benchmarks/gpu_check_regression.py --skip "falcon-2 values,falcon-3 values" \
      --out "$out/$part/check_regression.json"
    step split_delta 80 python3 benchmarks/split_passes.py --ops delta --out "$out/$part/split_delta.json"
    step bench_variants 250 python3 benchmarks/bench_regression.py --quick \
      --skip "xla chunk,falcon-2,falcon-3,BTHD,jla 0.1.0 deltanet,fla" --out "$out/$part/bench_variants.json"
    ;;
  next8)
    step bench_variants 130 python3 benchmarks/bench_regression.py --quick --skip "sixth-run,fp32 walk,outputs in XLA,\
64 value,C=32,triangular inverse 2,walks 1 stage,walks 3 stages,walks 8 warps,BTHD,jla,fla,falcon-2,falcon-3,xla chunk" \
      --out "$out/$part/bench_variants.json"
    step bench_regression 420 python3 benchmarks/bench_regression.py --skip "xla chunk,kernel only," \
      --out "$out/$part/bench_regression.json"
    ;;
  next9)
    step bench_pieces 300 python3 benchmarks/bench_regression.py --shapes 2x8192x16x128,1x32768x16x128 \
      --memory-shapes "" --skip "xla chunk,sixth-run,walk operands,chunk gradients,outputs in XLA,64 value,C=32,\
triangular,warps,stage,BTHD,jla,fla" --out "$out/$part/bench_pieces.json"
    step memory 200 python3 benchmarks/bench_regression.py --shapes "" --memory-shapes 1x131072x16x128 \
      --out "$out/$part/memory.json"
    ;;
  next10)
    step bench_defaults 200 python3 benchmarks/bench_regression.py --memory-shapes "" \
      --skip "xla chunk,kernel only,jla,fla,falcon-2" --out "$out/$part/bench_defaults.json"
    ;;
  next11)
    step check_grads 120 python3 benchmarks/gpu_check_regression.py --only "bf16 grads,fp32 grads,pass choices" \
      --out "$out/$part/check_grads.json"
    step bench 100 python3 benchmarks/bench_regression.py --quick --skip "xla chunk,sixth-run,Pallas chunk,\
outputs in XLA,64 value,C=32,triangular,warps,stage,pieces,BTHD,jla,fla,falcon-2,falcon-3" --out "$out/$part/bench.json"
    ;;
  next12)
    step check_split 110 python3 benchmarks/gpu_check_regression.py --only "pass choices" \
      --out "$out/$part/check_split.json"
    step bench_split 290 python3 benchmarks/bench_regression.py --memory-shapes "" --skip "xla chunk,sixth-run,\
walk operands,one-program,outputs in XLA,64 value,C=32,triangular,warps,stage,pieces,BTHD,0.1.0 deltanet,fla,\
falcon-2,falcon-3,per-column" --out "$out/$part/bench_split.json"
    step bench_columns 120 python3 benchmarks/bench_regression.py --quick --skip "xla chunk,kernel only,falcon-1,\
falcon-2,falcon-3,jla,fla" --out "$out/$part/bench_columns.json"
    ;;
  next13)
    step check_split 100 python3 benchmarks/gpu_check_regression.py --only "pass choices" \
      --out "$out/$part/check_split.json"
    step split_passes 200 python3 benchmarks/split_passes.py --ops delta_split \
      --shapes 8x2048x16x128,2x8192x16x128,1x32768x16x128 --out "$out/$part/split_passes.json"
    step bench_split 150 python3 benchmarks/bench_regression.py --memory-shapes "" --skip "xla chunk,sixth-run,\
walk operands,one-program,outputs in XLA,64 value,C=32,triangular,warps,stage,pieces,BTHD,jla,fla,falcon-2,falcon-3,\
per-column,split forward,split state-gradient walk (V/B,split walks (both)" --out "$out/$part/bench_split.json"
    step memory 100 python3 benchmarks/bench_regression.py --shapes "" --out "$out/$part/memory.json"
    ;;
  next14)
    step bench 240 python3 benchmarks/bench_regression.py --memory-shapes "" --skip "xla chunk,sixth-run,\
walk operands,one-program,as XLA,outputs in XLA,fused state,32 columns,64 value,C=32,triangular,warps,stage,\
pieces,BTHD,0.1.0 deltanet,fla,falcon-2,per-column" --out "$out/$part/bench.json"
    step memory 90 python3 benchmarks/bench_regression.py --shapes "" --out "$out/$part/memory.json"
    step check_regression 230 python3 benchmarks/gpu_check_regression.py --skip "falcon-2 values" \
      --out "$out/$part/check_regression.json"
    ;;
  next15)  # the gradient checks next14's check step had no time left for
    step check_grads 200 python3 benchmarks/gpu_check_regression.py --only "bf16 grads,fp32 grads,pass choices" \
      --out "$out/$part/check_grads.json"
    ;;
  next16)  # for the ninth run: the chunk-gradient halves, the 131072 memory row, Falcon-2's launch variants
    step split_passes 280 python3 benchmarks/split_passes.py --ops delta_split \
      --shapes 8x2048x16x128,2x8192x16x128,1x32768x16x128 --out "$out/$part/split_passes.json"
    step memory 150 python3 benchmarks/bench_regression.py --shapes "" --memory-shapes 1x131072x16x128 \
      --out "$out/$part/memory.json"
    step bench_columns 150 python3 benchmarks/bench_regression.py --quick --skip "xla chunk,kernel only,falcon-1,\
falcon-2,falcon-3,jla,fla" --out "$out/$part/bench_columns.json"
    ;;
  next17)  # ninth run: the chunk gradients from the P and dR the walks store (checked, timed whole and by pass)
    step check_stored 150 python3 benchmarks/gpu_check_regression.py --only "pass choices" \
      --out "$out/$part/check_stored.json"
    step bench_stored 220 python3 benchmarks/bench_regression.py --memory-shapes "" --skip "xla chunk,sixth-run,\
seventh-run,walk operands,one-program,as XLA,outputs in XLA,split forward,fused forward,fused state,32 columns,\
64 value,C=32,triangular,Pallas chunk gradients 8,state walk,forward walk,pieces,walks,BTHD,0.1.0 deltanet,fla,\
falcon-2,falcon-3,per-column" --out "$out/$part/bench_stored.json"
    step split_passes 200 python3 benchmarks/split_passes.py --ops delta_split \
      --shapes 8x2048x16x128,1x32768x16x128 --out "$out/$part/split_passes.json"
    ;;
  next18)  # ninth run: the new default (chunk gradients from the walks' P and dR) checked and timed whole
    step check_default 260 python3 benchmarks/gpu_check_regression.py \
      --only "long bf16,extreme op,segments,bf16 grads,fp32 grads,pass choices" --out "$out/$part/check_default.json"
    step bench_default 240 python3 benchmarks/bench_regression.py --memory-shapes "" --skip "xla chunk,sixth-run,\
seventh-run,walk operands,one-program,as XLA,outputs in XLA,split forward,fused forward,fused state,32 columns,\
64 value,C=32,triangular,Pallas chunk gradients 8,state walk,forward walk,pieces,walks,BTHD,0.1.0 deltanet,fla,\
falcon-2,per-column" --out "$out/$part/bench_default.json"
    ;;
  next19)  # ninth run: every pass of the new default alone (block widths varied), memory at 1x32768 and 1x131072
    step split_passes 280 python3 benchmarks/split_passes.py --ops delta_split \
      --shapes 8x2048x16x128,1x32768x16x128 --out "$out/$part/split_passes.json"
    step memory 250 python3 benchmarks/bench_regression.py --shapes "" --out "$out/$part/memory.json"
    ;;
  next20)  # ninth run: dy back in the chunk-gradient kernel, dR stored fp32 (default) or bf16, 32 or 64 key columns
    step bench_dr 200 python3 benchmarks/bench_regression.py --memory-shapes "" --skip "xla chunk,sixth-run,\
seventh-run,walk operands,one-program,as XLA,outputs in XLA,split forward,fused forward,fused state,32 columns,\
64 value,C=32,triangular,Pallas chunk gradients 8,state walk,forward walk,pieces,walks,BTHD,0.1.0 deltanet,fla,\
falcon-2,falcon-3,per-column" --out "$out/$part/bench_dr.json"
    step check_grads 60 python3 benchmarks/gpu_check_regression.py --only "bf16 grads" \
      --out "$out/$part/check_grads.json"
    step memory 90 python3 benchmarks/bench_regression.py --shapes "" --memory-shapes 1x32768x16x128 \
      --out "$out/$part/memory.json"
    ;;
  next21)  # for the tenth run: the ninth run's final default (bf16 dR) checked at d128 and timed as the whole op
    step check_final 200 python3 benchmarks/gpu_check_regression.py --only "bf16 grads,fp32 grads,pass choices" \
      --out "$out/$part/check_final.json"
    step bench_final 200 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 --skip "xla chunk,\
sixth-run,seventh-run,walk operands,one-program,as XLA,outputs in XLA,split forward,fused forward,fused state,\
32 columns,64 value,C=32,triangular,Pallas chunk gradients 8,state walk,forward walk,pieces,walks,BTHD,\
0.1.0 deltanet,falcon-2,falcon-3,per-column,64 key" --out "$out/$part/bench_final.json"
    ;;
  next22)  # tenth run: T = (I + A)⁻¹ stored in bf16 checked (d64 pass choices, d128 through falcon) and timed pass by
    # pass and whole, C=128 and 16-column walks at long T; the ninth run's default checked at d128 (next21's gap)
    step check_tri 100 python3 benchmarks/gpu_check_regression.py --only "bf16,bf16 grads,pass choices" \
      --kernel-config tri_dtype=input --out "$out/$part/check_tri.json"
    step check_default 45 python3 benchmarks/gpu_check_regression.py --only "bf16 grads" \
      --out "$out/$part/check_default.json"
    step passes 130 python3 benchmarks/split_passes.py --ops delta_split --shapes 8x2048x16x128,1x32768x16x128 \
      --passes "bf16 T;P stored, 16;triangular inverse;prepare;fused fwd walk (o), the default;(h) + P stored" \
      --out "$out/$part/passes.json"
    step bench_tri 270 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 --skip "xla chunk,\
sixth-run,seventh-run,eighth-run,walk operands,one-program,as XLA,outputs in XLA,split forward,fused forward,\
fused state,split walks,64 value,C=32,triangular inverse 4,triangular inverse 2,Pallas chunk gradients 8,state walk,\
forward walk,pieces,walks 8,walks 1,walks 3,BTHD,0.1.0 deltanet,falcon-2,falcon-3,per-column,64 key,fp32 dR" \
      --out "$out/$part/bench_tri.json"
    ;;
  next23)  # tenth run: the default with T stored in bf16 — every check group but Falcon-2's (its kernel reads no T),
    # the whole op at every shape with jla and the ninth run's default, Falcon-2/3, memory at 1x32768 and 1x131072
    step check_final 280 python3 benchmarks/gpu_check_regression.py --skip "falcon-2 values" \
      --out "$out/$part/check_final.json"
    step bench_final 280 python3 benchmarks/bench_regression.py \
      --rows "falcon-1 pallas;kernel only (decayed;BTHD in place;jla 0.1.0 gated;jla gated;falcon-3 W=4;falcon-2 per-column pallas" \
      --out "$out/$part/bench_final.json"
    ;;
  next24)  # tenth run: the check groups next23's step did not reach, the memory shape its bench did not reach
    step check_grads 250 python3 benchmarks/gpu_check_regression.py --only "bf16 grads,fp32 grads,pass choices" \
      --out "$out/$part/check_grads.json"
    step memory 150 python3 benchmarks/bench_regression.py --shapes "" --memory-shapes 1x131072x16x128 \
      --rows "falcon-1 pallas;BTHD in place;jla gated" --skip "ninth-run" --out "$out/$part/memory.json"
    ;;
  next25)  # tenth run: fla 0.6.0 next to the default at the long shapes (next22 timed it at 8x2048)
    step bench_fla 260 python3 benchmarks/bench_regression.py --shapes 2x8192x16x128,1x32768x16x128 \
      --memory-shapes "" --rows "falcon-1 pallas (ours);fla 0.6.0" --skip "ninth-run" --out "$out/$part/bench_fla.json"
    ;;
  next26)  # for the eleventh run: V stored in bf16 (stored_v="input") and the forward's T kept for the backward
    # (save_tri=True), prepared in the tenth session: checked (d64 pass choices, d128 gradients through falcon),
    # passes, the op and the whole op timed with jla, memory at 1x32768; 64-column fused walks again (slower with
    # fp32 T and TF32 in the sixth run; the walks' dots are all bf16 now)
    step check_v 150 python3 benchmarks/gpu_check_regression.py --only "bf16 grads,pass choices" \
      --kernel-config stored_v=input,save_tri=True --out "$out/$part/check_v.json"
    step passes 90 python3 benchmarks/split_passes.py --ops delta_split --shapes 8x2048x16x128,1x32768x16x128 \
      --passes "prepare V, B;state-gradient walk + dR;triangular inverse, bf16 T" --out "$out/$part/passes.json"
    step bench_v 280 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 --skip "ninth-run" \
      --rows "falcon-1 pallas;bf16 V;saved inverse;kernel only (decayed;jla 0.1.0 gated;jla gated;64 value columns" \
      --out "$out/$part/bench_v.json"
    ;;
  next27)  # for the eleventh run: Falcon-2's per-column kernels in 16-row blocks (column_solve="blocked", tenth
    # session): fp32 values at T = 8192 through falcon, timed against the row-by-row kernels
    step check_col 200 python3 benchmarks/gpu_check_regression.py --only "falcon-2 values" \
      --kernel-config column_solve=blocked --out "$out/$part/check_col.json"
    step bench_col 300 python3 benchmarks/bench_regression.py --shapes 8x2048x16x128 --memory-shapes "" \
      --rows "falcon-1 pallas (ours);falcon-2 per-column pallas;per-column op" --skip "ninth-run,bf16 V" \
      --out "$out/$part/bench_col.json"
    ;;
  next28)  # eleventh run: before the blocked per-column solve becomes the default, the gradients of both solves
    # (Falcon-2 and Falcon-2A, fp32 vs float64, bf16 blocked vs rows) and Falcon-2A's timing with each
    step check_col_grads 330 python3 benchmarks/gpu_check_regression.py --only "falcon-2 grads" \
      --out "$out/$part/check_col_grads.json"
    step bench_inner_col 200 python3 benchmarks/bench_inner_product.py --quick --out "$out/$part/bench_inner_col.json"
    ;;
  next29)  # eleventh run: where the time goes, kernel by kernel, in our whole Falcon-1 op, the op alone, jla's
    # gated_deltanet and fla's chunk_delta_rule (fwd, fwd+bwd) at 8x2048 and 1x32768
    step profile 420 python3 benchmarks/profile_kernels.py --out "$out/$part/profile.json"
    ;;
  next30)  # eleventh run: the XLA fusions around our kernels that next29 timed (271 us transpose and 81 us convert
    # at 1x32768 in the whole op's forward, pad and convert-reduce fusions at 8x2048), traced to their source lines
    glue=input_transpose_fusion_1,input_transpose_fusion_3,loop_convert_fusion,loop_pad_fusion,input_convert_reduce_fusion
    step fusions_long 150 python3 benchmarks/dump_fusions.py --shape 1x32768x16x128 --names "$glue" --out "$out/$part"
    step fusions_short 100 python3 benchmarks/dump_fusions.py --shape 8x2048x16x128 --names "$glue" --out "$out/$part"
    ;;
  next31)  # eleventh run: the whole Falcon-1 op kernel by kernel with lax.optimization_barrier before the gates'
    # transpose in kernel_operands (tried: the 271 us fusion stayed, XLA's layout assignment still moved the
    # transpose into the reduction; reverted, so this now re-times the default)
    step profile_barrier 200 python3 benchmarks/profile_kernels.py --shapes 1x32768x16x128,8x2048x16x128 \
      --impls "falcon-1" --top 8 --out "$out/$part/profile_barrier.json"
    ;;
  next32)  # for the twelfth run: KernelConfig(gate_transpose="pallas") (eleventh session): the gates reach the
    # kernels through a transpose kernel, so XLA cannot fold the transpose into the ‖x‖² reduction (271 us at
    # 1x32768 in next29); checked on the real lowering, profiled kernel by kernel, timed with the default and jla
    step check_gates 200 python3 benchmarks/gpu_check_regression.py --only "fp32 values,segments,fp32 grads,bf16" \
      --kernel-config gate_transpose=pallas --out "$out/$part/check_gates.json"
    step profile_gates 120 python3 benchmarks/profile_kernels.py --shapes 1x32768x16x128,8x2048x16x128 \
      --impls "falcon-1" --top 8 --kernel-config gate_transpose=pallas --out "$out/$part/profile_gates.json"
    step bench_gates 200 python3 benchmarks/bench_regression.py --memory-shapes "" --skip "ninth-run,bf16 V" \
      --rows "falcon-1 pallas;jla 0.1.0 gated" --out "$out/$part/bench_gates.json"
    # launch choices of the stored chunk-gradient kernel, the largest pass (966 us at 8x2048 in next29)
    step bench_grads 150 python3 benchmarks/bench_regression.py --shapes 8x2048x16x128,1x32768x16x128 \
      --memory-shapes "" --skip "ninth-run,bf16 V,jla,fla,falcon-" \
      --rows "kernel only (decayed;chunk gradients 2 stages;chunk gradients 16 key;chunk gradients 8 warps" \
      --out "$out/$part/bench_grads.json"
    # pieces at 1x32768 again (they lost in the seventh run, before the walks' bf16 operands and bf16 T): jla
    # forms its piece maps with the same augmented walk, 201 us there (next29)
    step bench_pieces 120 python3 benchmarks/bench_regression.py --shapes 1x32768x16x128 --memory-shapes "" \
      --skip "ninth-run,bf16 V,jla,fla,falcon-" --rows "kernel only (decayed;pieces to" \
      --out "$out/$part/bench_pieces.json"
    ;;
  next33)  # twelfth run: next32 left the 271 us fusion in fwd+bwd (the gates' cotangents went back through an XLA
    # transpose, fused into the β/λ/‖x‖² backward); now a kernel too.  And the stored chunk gradients split in two.
    step check_gates 150 python3 benchmarks/gpu_check_regression.py --only "fp32 grads,bf16" \
      --kernel-config gate_transpose=pallas --out "$out/$part/check_gates.json"
    step check_stored_split 100 python3 benchmarks/gpu_check_regression.py --only "fp32 grads,bf16" \
      --kernel-config chunk_grads=pallas_stored_split --out "$out/$part/check_stored_split.json"
    step profile 120 python3 benchmarks/profile_kernels.py --shapes 1x32768x16x128,8x2048x16x128 \
      --impls "falcon-1" --top 10 --kernel-config gate_transpose=pallas,chunk_grads=pallas_stored_split \
      --out "$out/$part/profile.json"
    step bench_whole 200 python3 benchmarks/bench_regression.py --memory-shapes "" --skip "ninth-run,bf16 V" \
      --rows "falcon-1 pallas;jla 0.1.0 gated" --out "$out/$part/bench_whole.json"
    step bench_split 120 python3 benchmarks/bench_regression.py --shapes 8x2048x16x128,1x32768x16x128 \
      --memory-shapes "" --skip "ninth-run,bf16 V,jla,fla,falcon-" \
      --rows "kernel only (decayed;chunk gradients stored split" --out "$out/$part/bench_split.json"
    ;;
  next34)  # twelfth run: why the chunk gradients and the walks are slow (registers, occupancy, throughput, stalls;
    # ncu reads the counters on this machine's runtime), and which buffers make the peak memory (ours 1.30x jla)
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
    spills="--metrics l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"
    # shellcheck disable=SC2086
    step ncu_short 200 "$ncu_bin" --clock-control none --launch-count 5 $sections $spills \
      -k "regex:falcon_delta_(chunk_grads_stored|dstate_walk|dstate_prepare|fwd|tri_inverse)" \
      python3 benchmarks/ncu_op.py --shape 8x2048x16x128 --calls 1
    # shellcheck disable=SC2086
    step ncu_long 150 "$ncu_bin" --clock-control none --launch-count 2 $sections $spills \
      -k "regex:falcon_delta_(state_walk|dstate_walk)" python3 benchmarks/ncu_op.py --shape 1x32768x16x128 --calls 1
    step memory_ours 120 python3 benchmarks/memory_report.py --out /tmp/memdump_ours
    step memory_jla 120 python3 benchmarks/memory_report.py --peer jla --out /tmp/memdump_jla
    step bench_warps 60 python3 benchmarks/bench_regression.py --shapes 8x2048x16x128 --memory-shapes "" \
      --skip "ninth-run,bf16 V,jla,fla,falcon-" --rows "kernel only (decayed;chunk gradients 2 warps" \
      --out "$out/$part/bench_warps.json"
    ;;
  next35)  # twelfth run: next34's memory steps alone (its first step, ncu, used the whole call)
    step memory_ours 110 python3 benchmarks/memory_report.py --out /tmp/memdump_ours
    step memory_jla 110 python3 benchmarks/memory_report.py --peer jla --out /tmp/memdump_jla
    ;;
  next36)  # twelfth run: registers / spills / shared memory per kernel, from the PTX XLA compiled (no ncu needed)
    # (first try read XLA's --xla_dump_to, which holds no PTX of these kernels; now the PTX Pallas compiles)
    step resources_short 60 python3 benchmarks/kernel_resources.py --shape 8x2048x16x128 --out /tmp/kdump_short
    step resources_long 50 python3 benchmarks/kernel_resources.py --shape 1x32768x16x128 --out /tmp/kdump_long
    ;;
  next37)  # next34's ncu, made to finish: no preallocated pool (ncu's kernel replay saves and restores the memory a
    # kernel may write; with JAX's 75% pool that is ~100 GB per pass — the likely reason next34 wrote nothing),
    # no autotuning or command buffers (kernels launched plainly), and a hard kill
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    export XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer="
    step ncu_grads 150 timeout -k 5 140 "$ncu_bin" --clock-control none --launch-count 1 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
      --metrics l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum \
      -k "regex:falcon_delta_chunk_grads_stored" python3 benchmarks/ncu_op.py --shape 8x2048x16x128 --calls 1
    ;;
  next38)  # for the thirteenth run: the forward, state and reverse walks scale the narrow P / dO / dR blocks instead of
    # the [C, dk] key tiles (twelfth session, CPU-tested only); compare with next33 (same rows, same harness)
    step check 200 python3 benchmarks/gpu_check_regression.py --only "fp32 values,segments,fp32 grads,bf16" \
      --out "$out/$part/check.json"
    step profile 90 python3 benchmarks/profile_kernels.py --shapes 1x32768x16x128,8x2048x16x128 \
      --impls "falcon-1" --top 10 --out "$out/$part/profile.json"
    step bench 150 python3 benchmarks/bench_regression.py --memory-shapes "" --skip "ninth-run,bf16 V,stored split" \
      --rows "falcon-1 pallas;jla 0.1.0 gated" --out "$out/$part/bench.json"
    step resources 60 python3 benchmarks/kernel_resources.py --shape 8x2048x16x128 --out /tmp/kdump_short
    ;;
  next43)  # for the fourteenth run: KernelConfig(grad_loops="fori") — the stored chunk gradients' value / key column
    # loops as lax.fori_loop, so that with grad_stages >= 2 Triton's pipeliner prefetches the next block (the
    # unrolled loops give it nothing to pipeline; CPU: interpret-mode gradients pass, it lowers and compiles)
    step check 130 python3 benchmarks/gpu_check_regression.py --only "fp32 grads,bf16" \
      --kernel-config "grad_loops=fori,grad_stages=2" --out "$out/$part/check.json"
    step profile 60 python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128 --impls "falcon-1" --top 6 \
      --kernel-config "grad_loops=fori,grad_stages=2" --out "$out/$part/profile.json"
    step bench 150 python3 benchmarks/bench_regression.py --memory-shapes "" \
      --skip "ninth-run,bf16 V,stored split,XLA gate,8 warps,2 warps" --rows "falcon-1 pallas" --out "$out/$part/bench.json"
    step resources 40 python3 benchmarks/kernel_resources.py --shape 8x2048x16x128 --only chunk_grads \
      --kernel-config "grad_loops=fori,grad_stages=2" --out /tmp/kdump_fori --json "$out/$part/resources.json"
    # Falcon-1A's kernel alone: the default (0) against its chunk gradients' fori loop at 1 and 2 stages (7, 8)
    step tune_inner 100 python3 benchmarks/bench_inner_product.py --tune --quick --tune-configs 0,7,8 \
      --out "$out/$part/tune_inner.json"
    ;;
  next42)  # thirteenth run: the triangular inverse's four 16x16 diagonal substitutions in one 15-step loop (one
    # 60-step chain before); checks (segments: next40), profile at 8x2048, whole-op timing of ours
    step check 170 python3 benchmarks/gpu_check_regression.py --only "fp32 values,fp32 grads,bf16" \
      --out "$out/$part/check.json"
    step profile 40 python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128 --impls "falcon-1" --top 6 \
      --out "$out/$part/profile.json"
    step bench 70 python3 benchmarks/bench_regression.py --memory-shapes "" \
      --skip "ninth-run,bf16 V,stored split,XLA gate,8 warps,2 warps" --rows "falcon-1 pallas" --out "$out/$part/bench.json"
    ;;
  next41)  # thirteenth run: the final default — next38's chunk gradients (next40's lower-spill form was slower) with
    # next40's triangular inverse; profile and whole-op timing of ours only (jla: next40's rows)
    step profile 90 python3 benchmarks/profile_kernels.py --shapes 1x32768x16x128,8x2048x16x128 \
      --impls "falcon-1" --top 8 --out "$out/$part/profile.json"
    step bench 120 python3 benchmarks/bench_regression.py --memory-shapes "" \
      --skip "ninth-run,bf16 V,stored split,XLA gate,8 warps,2 warps" --rows "falcon-1 pallas" --out "$out/$part/bench.json"
    ;;
  next40)  # thirteenth run: the chunk gradients form one [C, C] tile at a time and read dO, P, dR per key block; the
    # triangular inverse reads x's blocks where used (kernel_resources.py: spills 1996 -> 428 and 456 -> 192 bytes)
    step check 200 python3 benchmarks/gpu_check_regression.py --only "fp32 values,segments,fp32 grads,bf16" \
      --out "$out/$part/check.json"
    step profile 90 python3 benchmarks/profile_kernels.py --shapes 1x32768x16x128,8x2048x16x128 \
      --impls "falcon-1" --top 10 --out "$out/$part/profile.json"
    step bench 230 python3 benchmarks/bench_regression.py --memory-shapes "" \
      --skip "ninth-run,bf16 V,stored split,XLA gate" --rows "falcon-1 pallas;jla 0.1.0 gated" --out "$out/$part/bench.json"
    step resources 40 python3 benchmarks/kernel_resources.py --shape 8x2048x16x128 --out /tmp/kdump_short \
      --json "$out/$part/resources.json"
    ;;
  next39)  # for the thirteenth run: decayed_attention's forward and reverse walks scale the value block instead of the
    # keys (twelfth session, CPU-tested only); compare with the README's inner-product rows (same script)
    step check_inner 150 python3 benchmarks/gpu_check_inner_product.py --out "$out/$part/check_inner.json"
    step bench_inner 260 python3 benchmarks/bench_inner_product.py --out "$out/$part/bench_inner.json"
    ;;
  next44)  # fourteenth run: the fori chunk gradients with 2 stages are now both families' default (next43); Falcon-1A's
    # values and gradients on them (its fp64 reference gradient on the host CPU now), Falcon-1's checks
    step check_inner 170 python3 benchmarks/gpu_check_inner_product.py --only "values,grads,bf16,segments" \
      --out "$out/$part/check_inner.json"
    step check 150 python3 benchmarks/gpu_check_regression.py --only "fp32 values,segments,bf16" \
      --out "$out/$part/check.json"
    ;;
  next45)  # fourteenth run: the other launch parameters swept under the new chunk-gradient default, whole op
    step bench 400 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas (ours)" \
      --skip "ninth-run,bf16 V,stored split,XLA gate,8 warps,2 warps,unrolled,fori loops" \
      --configs "grad_block_v=64;grad_block_v=16;grad_block_k=64;grad_block_k=16;grad_warps=8;state_warps=8;fwd_stages=3;fwd_stages=1;stored_v=input;split_block_v=32;block_v=64;block_v=16" \
      --out "$out/$part/bench.json"
    ;;
  next46)  # fourteenth run: the walks' stages picked by program count (3 up to 264 programs, else 2; next45 had
    # 3 everywhere faster at fwd+bwd but slower forward at 8x2048); checks, profile, timing with jla alongside
    step check 120 python3 benchmarks/gpu_check_regression.py --only "fp32 values,fp32 grads" \
      --out "$out/$part/check.json"
    profile_falcon1 70 8
    step bench 240 python3 benchmarks/bench_regression.py --memory-shapes "" \
      --rows "falcon-1 pallas (ours);jla 0.1.0 gated_deltanet" \
      --skip "ninth-run,bf16 V,stored split,XLA gate,8 warps,2 warps,unrolled,fori loops" \
      --configs "fwd_stages=4,state_stages=4;block_v=16;target_programs=128" --out "$out/$part/bench.json"
    ;;
  next47)  # fourteenth run, the final code: walks at 3 stages (2 for an output-writing forward of > 264 programs),
    # block_v 16 below 128 programs (the fused forward at 1x32768); checks on the GPU lowering (segments: B2 H4,
    # 16 columns), whole-op timing against the explicit 32 columns, Falcon-1A / 3A rows for the README
    step check 150 python3 benchmarks/gpu_check_regression.py --only "fp32 values,segments,fp32 grads" \
      --out "$out/$part/check.json"
    step bench 100 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas (ours)" \
      --skip "ninth-run,bf16 V,stored split,XLA gate,8 warps,2 warps,unrolled,fori loops,walks 3" \
      --configs "block_v=32" --out "$out/$part/bench.json"
    step bench_inner 120 python3 benchmarks/bench_inner_product.py --rows "falcon-1A pallas;falcon-3A pallas" \
      --skip "head-major" --out "$out/$part/bench_inner.json"
    ;;
  next48)  # fourteenth run: Falcon-1's fp32 gradients with block_v 16 (next47's step was cut), Falcon-1A's whole op
    # with the fori chunk gradients (the default) against the unrolled ones (next47 timed 1A slower than next39)
    step check 60 python3 benchmarks/gpu_check_regression.py --only "fp32 grads" --out "$out/$part/check.json"
    step inner_fori 60 python3 benchmarks/bench_inner_product.py --rows "falcon-1A pallas" --skip "head-major" \
      --out "$out/$part/inner_fori.json"
    step inner_unrolled 60 python3 benchmarks/bench_inner_product.py --rows "falcon-1A pallas" --skip "head-major" \
      --kernel-config "grad_loops=unrolled,grad_stages=1" --out "$out/$part/inner_unrolled.json"
    ;;
  next49)  # for the fifteenth run: (1) Falcon-1A's chunk gradients with the value sums before dy again (the order
    # next39 timed; 70bd2c8 put dy first, slower: next48): the default (unrolled, TTIR-identical to next39's code)
    # against the fori loop at 2 stages, in the same run, and the fori form's gradients; (2) Falcon-1 with P formed
    # from T in the chunk gradients (KernelConfig(store_p=False), fourteenth session, CPU-tested): its gradients,
    # timing, and the peak memory against the default and jax-linear-attention at 1x32768
    step inner_unrolled 45 python3 benchmarks/bench_inner_product.py --rows "falcon-1A pallas" --skip "head-major" \
      --out "$out/$part/inner_unrolled.json"
    step inner_fori 45 python3 benchmarks/bench_inner_product.py --rows "falcon-1A pallas" --skip "head-major" \
      --kernel-config "grad_loops=fori,grad_stages=2" --out "$out/$part/inner_fori.json"
    step check_inner 60 python3 benchmarks/gpu_check_inner_product.py --only "grads" \
      --kernel-config "grad_loops=fori,grad_stages=2" --out "$out/$part/check_inner.json"
    step check_inner_default 60 python3 benchmarks/gpu_check_inner_product.py --only "grads" \
      --out "$out/$part/check_inner_default.json"
    step check 60 python3 benchmarks/gpu_check_regression.py --only "fp32 grads" --kernel-config "store_p=False" \
      --out "$out/$part/check.json"
    step bench 150 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas;P formed from T;jla gated_deltanet" \
      --skip "$WHOLE_OP_VARIANTS,deltanet mosaic" \
      --out "$out/$part/bench.json"
    ;;
  next50)  # fifteenth run: the stored chunk gradients without the value half's dots with the chunk state (the gates'
    # terms through it come from the key half's dR hᵀ, P dhᵀ): GPU checks, the chunk-gradient launch parameters
    # again under it, profile, memory at 1x32768 with jla alongside; BASELINE=<dir> (an older checkout, e.g.
    # `git archive 45f990d | tar -x -C .old`, carried) times its default in the same lease
    step check 180 python3 benchmarks/gpu_check_regression.py --only "fp32 grads,bf16,segments" \
      --out "$out/$part/check.json"
    step bench 240 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated_deltanet" \
      --skip "$WHOLE_OP_VARIANTS,deltanet mosaic" \
      --configs "grad_block_k=64;grad_stages=3;grad_warps=8;grad_block_v=64" --out "$out/$part/bench.json"
    if [ -n "${BASELINE:-}" ] && [ -d "$BASELINE" ]; then
      step baseline 60 env PYTHONPATH="/tmp/site:$PWD/$BASELINE" python3 "$BASELINE/benchmarks/bench_regression.py" \
        --memory-shapes "" --rows "falcon-1 pallas (ours)" \
        --skip "$WHOLE_OP_VARIANTS,P formed" \
        --out "$out/$part/baseline.json"
    fi
    profile_falcon1 70 8
    ;;
  next51)  # fifteenth run: the output walk reading the masked scores the triangular inverse stored
    # (KernelConfig(fwd_scores="inverse"): one QXᵀ per chunk instead of one per value block), checked and timed; the
    # chunk gradients at 3 stages (the new default) checked, timed against 2 stages and 64 value columns
    step check 200 python3 benchmarks/gpu_check_regression.py --only "fp32 values,segments" \
      --kernel-config "fwd_scores=inverse,outputs=pallas" --out "$out/$part/check_scores.json"
    step check_grads 120 python3 benchmarks/gpu_check_regression.py --only "fp32 grads,bf16 grads" \
      --out "$out/$part/check_grads.json"
    step bench 260 python3 benchmarks/bench_regression.py --memory-shapes "" \
      --rows "falcon-1 pallas;jla gated_deltanet" \
      --skip "$WHOLE_OP_VARIANTS,deltanet mosaic" \
      --configs "fwd_scores=inverse;fwd_scores=inverse,tri_warps=2;grad_stages=2;grad_block_v=64" \
      --out "$out/$part/bench.json"
    profile_falcon1 70 6 --kernel-config "fwd_scores=inverse"
    ;;
  next52)  # fifteenth run, the final code (chunk gradients at 3 stages, 64 value columns): checks, timing with jla
    # alongside, peak memory at 1x32768, profile; last launch variants of the chunk gradients; P and h kept from the
    # forward walk (KernelConfig(save_states=True), no recompute walk): checked, timed, memory
    step check 220 python3 benchmarks/gpu_check_regression.py --only "fp32 values,segments,bf16 grads,fp32 grads" \
      --out "$out/$part/check.json"
    step check_saved 90 python3 benchmarks/gpu_check_regression.py --only "bf16 grads,fp32 grads" \
      --kernel-config "save_states=True,outputs=pallas" --out "$out/$part/check_saved.json"
    step bench 260 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas;jla gated_deltanet" \
      --skip "$WHOLE_OP_VARIANTS,deltanet mosaic" \
      --configs "save_states=True;grad_block_v=32;grad_stages=4;grad_block_k=16" --out "$out/$part/bench.json"
    profile_falcon1 70 8
    ;;
  next53)  # fifteenth run, the final code with every peer in the same lease: jla gated_deltanet / deltanet, fla
    # chunk_gated_delta_rule / chunk_delta_rule, Falcon-2 and Falcon-3 (8x2048) for the ratios, peak memory at
    # 1x32768 and 1x131072; Falcon-3's values on the GPU lowering (it shares the chunk gradients, group > 1)
    step check 80 python3 benchmarks/gpu_check_regression.py --only "falcon-3 values" --out "$out/$part/check.json"
    step bench 380 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128,1x131072x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0;fla 0.6.0;falcon-2 per-column pallas (ours);falcon-3 W=4;jla gated" \
      --skip "row-by-row,$WHOLE_OP_VARIANTS" \
      --out "$out/$part/bench.json"
    ;;
  next54)  # for the sixteenth run, two opt-ins of the fifteenth session (CPU-tested): the split reverse walk forming
    # B dS = Tᵀ(w ⊙ X dS) from T instead of reading a stored B (KernelConfig(dstate_b="from_t")), and the output
    # walk reading masked scores from their own parallel kernel (fwd_scores="kernel"): GPU checks, whole-op timing
    # and peak memory against the default in the same lease, profile
    step check 130 python3 benchmarks/gpu_check_regression.py --only "bf16 grads,fp32 grads,segments" \
      --kernel-config "dstate_b=from_t" --out "$out/$part/check.json"
    step check_scores 110 python3 benchmarks/gpu_check_regression.py --only "fp32 values,segments" \
      --kernel-config "fwd_scores=kernel,outputs=pallas" --out "$out/$part/check_scores.json"
    step bench 230 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" \
      --skip "$WHOLE_OP_VARIANTS" \
      --configs "dstate_b=from_t;fwd_scores=kernel;dstate_b=from_t,fwd_scores=kernel" --out "$out/$part/bench.json"
    profile_falcon1 70 8 --kernel-config "dstate_b=from_t,fwd_scores=kernel"
    ;;
  next55)  # sixteenth run, under the new defaults (dstate_b=from_t, fwd_scores=auto): launch and pass choices
    # swept again — pieces at 2x8192 / 1x32768 (target_programs=256: 2 pieces), the reverse walk's warps, stages
    # and value width, the forward walks' warps, 64-column output walks reading stored scores at 8x2048, V in
    # bf16, a 2-warp inverse — against the default and jla in the same lease
    step bench 340 python3 benchmarks/bench_regression.py \
      --rows "falcon-1 pallas (ours);jla 0.1.0 gated" --skip "$WHOLE_OP_VARIANTS" \
      --configs "target_programs=256;state_warps=8;state_stages=2;state_stages=4;split_block_v=32;split_block_v=64;block_v=64,fwd_scores=kernel;fwd_warps=8;stored_v=input;tri_warps=2" \
      --out "$out/$part/bench.json"
    ;;
  next56)  # sixteenth run, the final code (dstate_b=from_t, fwd_scores=auto, 64-column walks at >= 256 programs):
    # GPU checks on 64-column output walks reading the scores kernel (fp32 values, segments, gradients, Falcon-3),
    # Falcon-1 / Falcon-3 against jla gated_deltanet, peak memory at 1x32768 and 1x131072, two last launch
    # choices (the chunk gradients' value step over all 128 columns, 2-stage forward walks), profile
    step check 180 python3 benchmarks/gpu_check_regression.py \
      --only "fp32 values,segments,fp32 grads,bf16 grads,falcon-3 values" \
      --kernel-config "block_v=64,outputs=pallas" --out "$out/$part/check.json"
    step bench 300 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128,1x131072x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;falcon-3 W=4;jla gated" --skip "$WHOLE_OP_VARIANTS" \
      --configs "grad_block_v=128;fwd_stages=2" --out "$out/$part/bench.json"
    profile_falcon1 60 8
    ;;
  next57)  # sixteenth run: the final defaults' GPU checks (fp32 values with 32-column walks after next56's fp32
    # 64-column shared-memory overflow, bf16 values including the 64-column output walk, T=65536, extreme gates,
    # Falcon-3, pass choices)
    step check 300 python3 benchmarks/gpu_check_regression.py \
      --only "fp32 values,bf16,long bf16,extreme op,falcon-3 values,pass choices" --out "$out/$part/check.json"
    ;;
  next58)  # sixteenth run, the session's last device seconds: the forward's T kept for the backward (save_tri,
    # untimed alone since next26, when the inverse was 127 / 243 us of a 2.0 / 5.9 ms op) with and without bf16 V,
    # against the default in the same lease; peak memory at 1x32768
    step bench 150 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas" --skip "$WHOLE_OP_VARIANTS" \
      --configs "save_tri=True;save_tri=True,stored_v=input" --out "$out/$part/bench.json"
    ;;
  next59)  # sixteenth run: V stored in bf16 (stored_v=input, 1-2% faster fwd+bwd in next55 and next58) against the
    # float64 reference at d128 in bf16, gradients within 2x the XLA form's error
    step check 120 python3 benchmarks/gpu_check_regression.py --only "bf16 grads" --kernel-config "stored_v=input" \
      --out "$out/$part/check.json"
    ;;
  next60)  # for the seventeenth run: the sixteenth session's final default (bf16 V for Falcon-1, no save_tri), which
    # had no timing row of its own, with jla gated_deltanet and peak memory in one lease; dstate_prepare's warps
    # apart from the walk's (prepare_warps); profile; the buffers live at the memory peak
    step bench 260 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" --skip "$WHOLE_OP_VARIANTS" \
      --configs "prepare_warps=8;prepare_warps=2" --out "$out/$part/bench.json"
    profile_falcon1 60 8
    # the buffers live at the forward+backward's peak under today's kernels (last dumped in next35)
    step memory_ours 110 python3 benchmarks/memory_report.py --out /tmp/memdump_ours
    ;;
  next61)  # for the seventeenth run: the reverse walk adding (c ⊙ Q)ᵀ dO as dstate_prepare wrote it into dh's buffer
    # (KernelConfig(dstate_q="prepare"), CPU-tested; one piece only, so the checks' few batch·heads need
    # target_programs=1): GPU gradient checks, then whole-op timing and peak memory against the default, profile
    step check 150 python3 benchmarks/gpu_check_regression.py --only "bf16 grads,fp32 grads,segments" \
      --kernel-config "dstate_q=prepare,target_programs=1" --out "$out/$part/check.json"
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas" --skip "$WHOLE_OP_VARIANTS" --configs "dstate_q=prepare" --out "$out/$part/bench.json"
    profile_falcon1 60 8 --kernel-config "dstate_q=prepare"
    ;;
  next62)  # seventeenth run: Falcon-1's keys read one row back in place (shifted_keys; no shifted copy of k), checked
    # on the real lowering — the masked first window, odd T, segments, continuation with a carried key folded into
    # the initial state, T = 65536 — with the few-batch·head checks on the fused output walk and one piece (where
    # the keys are read in place), then with the reverse walk's q-term from dstate_prepare as well
    step check 330 python3 benchmarks/gpu_check_regression.py \
      --only "fp32 values,bf16,long bf16,segments,fp32 grads,bf16 grads" \
      --kernel-config "outputs=pallas,target_programs=1" --out "$out/$part/check.json"
    step check_prepare 150 python3 benchmarks/gpu_check_regression.py --only "segments,fp32 grads,bf16 grads" \
      --kernel-config "outputs=pallas,target_programs=1,dstate_q=prepare" --out "$out/$part/check_prepare.json"
    ;;
  next63)  # seventeenth run: the new defaults (keys in place, dstate_q=auto: prepare at 8x2048) against the shifted
    # copy (keys_in_place=False) and the walk's own q-term (dstate_q=walk), with jla and peak memory in one lease;
    # profile; the buffers live at the memory peak
    step bench 270 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" --skip "$WHOLE_OP_VARIANTS" \
      --configs "keys_in_place=False;dstate_q=walk" --out "$out/$part/bench.json"
    profile_falcon1 60 8
    step memory_ours 110 python3 benchmarks/memory_report.py --out /tmp/memdump_ours
    ;;
  next64)  # seventeenth run: today's final default (keys in place, dstate_q=auto) against jla gated_deltanet once more
    # (a second lease), peak memory at 1x32768 and 1x131072 (linear in T), and the shifted copy's for comparison
    step bench 300 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128,1x131072x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" --skip "$WHOLE_OP_VARIANTS" \
      --configs "keys_in_place=False" --out "$out/$part/bench.json"
    ;;
  next65)  # seventeenth run: the walks' first chunk taken out of their loops (only it masks its key window: the
    # 8x2048 reverse walk's spills 76 -> 48 bytes standalone), checked on the real lowering, then timed against
    # the shifted copy in the same lease (in next63 / next64 the masked walks cost 0.4% / 2% at 8x2048); no gain,
    # reverted after this run, so the part now times today's walks
    step check 240 python3 benchmarks/gpu_check_regression.py \
      --only "fp32 values,bf16,long bf16,segments,fp32 grads,bf16 grads" \
      --kernel-config "outputs=pallas,target_programs=1" --out "$out/$part/check.json"
    step bench 200 python3 benchmarks/bench_regression.py --rows "falcon-1 pallas (ours)" --memory-shapes "" \
      --skip "$WHOLE_OP_VARIANTS" --configs "keys_in_place=False" --out "$out/$part/bench.json"
    ;;
  next66)  # seventeenth run: narrower split reverse walks now that dstate_q=auto hands the q-term to dstate_prepare
    # from 256 walk programs on (2x8192: 16 columns give 256 programs; 8x2048: 32 columns give 512), and 16-column
    # output walks at 2x8192 (256 programs, still reading the scores kernel's scores), against the default
    step bench 200 python3 benchmarks/bench_regression.py --shapes 8x2048x16x128,2x8192x16x128 \
      --rows "falcon-1 pallas (ours)" --memory-shapes "" --skip "$WHOLE_OP_VARIANTS" \
      --configs "split_block_v=16;split_block_v=32;block_v=16;block_v=16,split_block_v=16" \
      --out "$out/$part/bench.json"
    ;;
  next67)  # seventeenth run (its change was reverted after it, so the part now times today's code): row 0's step
    # (the carried key's pair) folded inside the op, so that its gradient w.r.t. v's row 0 would join dv in place
    # (next63's profile had a new 42 us [B, T, H, dv] fusion at 8x2048 adding it in XLA): GPU checks on the
    # in-place path, timing and memory against the shifted copy, profile
    step check 200 python3 benchmarks/gpu_check_regression.py \
      --only "fp32 values,bf16,segments,fp32 grads,bf16 grads" \
      --kernel-config "outputs=pallas,target_programs=1" --out "$out/$part/check.json"
    step bench 150 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas" --skip "$WHOLE_OP_VARIANTS" --configs "keys_in_place=False" \
      --out "$out/$part/bench.json"
    profile_falcon1 40 10
    ;;
  next68)  # eighteenth run: row 0's step (the carried key's pair) folded inside the op again, now with its gradient
    # w.r.t. v's row 0 added by the stored chunk-gradient kernel (dy_first, replaced after next70 by an update of
    # the stored dR's row 0; the part now runs today's code), so no XLA update of dv follows; the
    # reverse walk's dR written over V's buffer. GPU checks on the in-place path; timing and memory against the
    # shifted copy and jla; profile; the temp allocation laid out (memory_report)
    step check 200 python3 benchmarks/gpu_check_regression.py \
      --only "fp32 values,bf16,segments,fp32 grads,bf16 grads" \
      --kernel-config "outputs=pallas,target_programs=1" --out "$out/$part/check.json"
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" --skip "$WHOLE_OP_VARIANTS" \
      --configs "keys_in_place=False" --out "$out/$part/bench.json"
    profile_falcon1 50 10
    step memory_ours 100 python3 benchmarks/memory_report.py --out /tmp/memdump_ours --lines 40
    ;;
  next69)  # eighteenth run: the first-row addend of the stored chunk gradients as a branch only chunk 0's program
    # takes (next68's select cost that kernel 14 / 30 us) -- it cost 623 vs 446 us and went back to the select, so
    # the part now times today's code; timing against the shifted copy; profile; the temp allocation laid out, and
    # XLA's buffer assignment kept
    step bench 120 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas (ours)" --skip "$WHOLE_OP_VARIANTS" --configs "keys_in_place=False" \
      --out "$out/$part/bench.json"
    profile_falcon1 50 10
    step memory_ours 100 python3 benchmarks/memory_report.py --out /tmp/memdump_ours --lines 40
    gzip -c /tmp/memdump_ours/*jit_both*buffer-assignment.txt > "$out/$part/buffer_assignment.txt.gz" || true
    gzip -c /tmp/memdump_ours/*jit_both*live-range.txt > "$out/$part/live_range.txt.gz" || true
    ;;
  next70)  # eighteenth run: the chunk gradients write dx over the stored P (kept in the tokens' layout for it), so
    # the backward's peak (next69's layout: h, dh, P, dR and dx at the chunk gradients) loses one [B, T, H, d]
    # buffer: GPU checks on the in-place path and on the default at the checks' shapes (the shifted copy), timing and
    # memory (1x32768 and 1x131072) against the copy and jla, profile, the temp allocation laid out
    step check 150 python3 benchmarks/gpu_check_regression.py \
      --only "fp32 values,bf16,segments,fp32 grads,bf16 grads" \
      --kernel-config "outputs=pallas,target_programs=1" --out "$out/$part/check.json"
    step check_default 80 python3 benchmarks/gpu_check_regression.py --only "fp32 grads,bf16 grads" \
      --out "$out/$part/check_default.json"
    step bench 240 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128,1x131072x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" --skip "$WHOLE_OP_VARIANTS" \
      --configs "keys_in_place=False" --out "$out/$part/bench.json"
    profile_falcon1 50 10
    step memory_ours 100 python3 benchmarks/memory_report.py --out /tmp/memdump_ours --lines 30
    gzip -c /tmp/memdump_ours/*jit_both*buffer-assignment.txt > "$out/$part/buffer_assignment.txt.gz" || true
    ;;
  next71)  # eighteenth run: y's row-0 gradient through the fold without the chunk gradients' select: the kernels
    # keep eta_0 (inert: row 0's feature is zero), XLA writes x0^T dS0 into dR's row 0 (one row of a buffer only
    # the chunk gradients read), and dy = eta * dR gives the row (next68/70: the select cost that kernel 8-14 us
    # at 8x2048, 11-30 at 1x32768). Checks on the in-place path, timing, memory, profile
    step check 150 python3 benchmarks/gpu_check_regression.py --only "fp32 values,segments,fp32 grads,bf16 grads" \
      --kernel-config "outputs=pallas,target_programs=1" --out "$out/$part/check.json"
    step bench 120 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas (ours)" --skip "$WHOLE_OP_VARIANTS" --out "$out/$part/bench.json"
    profile_falcon1 50 12
    ;;
  next72)  # eighteenth run, the session's final code (next71's dR-row-0 form, the select gone from the kernels):
    # timing and memory (1x32768, 1x131072) against the shifted copy and jla in one lease, the temp layout
    step bench 240 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128,1x131072x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" --skip "$WHOLE_OP_VARIANTS" \
      --configs "keys_in_place=False" --out "$out/$part/bench.json"
    step memory_ours 100 python3 benchmarks/memory_report.py --out /tmp/memdump_ours --lines 12
    ;;
  next73)  # eighteenth run: V and dR in the tokens' layout, and the one-program stored chunk gradients write dy over
    # dR at their end, after a barrier (every thread's dR reads done), so dy takes no buffer of its own at the
    # backward's peak (next72: 820 MB temp, all live at that kernel). Checks on the in-place path and the default,
    # timing against jla, memory and its layout, profile
    step check 150 python3 benchmarks/gpu_check_regression.py --only "fp32 values,segments,fp32 grads,bf16 grads" \
      --kernel-config "outputs=pallas,target_programs=1" --out "$out/$part/check.json"
    step check_default 60 python3 benchmarks/gpu_check_regression.py --only "fp32 grads,bf16 grads" \
      --out "$out/$part/check_default.json"
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128,1x131072x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" --skip "$WHOLE_OP_VARIANTS" --out "$out/$part/bench.json"
    profile_falcon1 40 8
    step memory_ours 80 python3 benchmarks/memory_report.py --out /tmp/memdump_ours --lines 10
    ;;
  next74)  # eighteenth run: the speed cost of next73's dy over dR (with V and dR in the tokens' layout), in one lease:
    # today's default and BASELINE=<dir> (a78b2cd, `git archive a78b2cd | tar -x -C .ab/old`, carried), twice each
    for round in 1 2; do
      step "bench_new_$round" 60 python3 benchmarks/bench_regression.py --memory-shapes "" \
        --rows "falcon-1 pallas (ours)" --skip "$WHOLE_OP_VARIANTS" --out "$out/$part/bench_new_$round.json"
      if [ -n "${BASELINE:-}" ] && [ -d "$BASELINE" ]; then
        step "bench_old_$round" 60 env PYTHONPATH="/tmp/site:$PWD/$BASELINE" \
          python3 "$BASELINE/benchmarks/bench_regression.py" --memory-shapes "" --rows "falcon-1 pallas (ours)" \
          --skip "$WHOLE_OP_VARIANTS" --out "$out/$part/bench_old_$round.json"
      fi
    done
    ;;
  next75)  # nineteenth run: the backward's dstate_prepare as a Pallas Mosaic GPU kernel (wgmma + TMA,
    # KernelConfig(prepare="mosaic")): values against float64 and the Triton pass, both timed alone; the whole op's
    # bf16 gradients and T = 65536 through it; the whole op timed with it against the default; its kernels
    step check_prepare 200 python3 benchmarks/gpu_check_mosaic_prepare.py --out "$out/$part/check_prepare.json"
    step check_grads 120 python3 benchmarks/gpu_check_regression.py --only "bf16 grads,long bf16" \
      --kernel-config "prepare=mosaic" --out "$out/$part/check_grads.json"
    step bench 150 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas (ours)" \
      --skip "$WHOLE_OP_VARIANTS" --configs "prepare=mosaic" --out "$out/$part/bench.json"
    step profile 70 python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128,2x8192x16x128 --impls "falcon-1" \
      --kernel-config "prepare=mosaic" --top 8 --out "$out/$part/profile.json"
    ;;
  next76)  # nineteenth run (as run by hand, after next75 failed to lower: one SMEM gate vector per register
    # layout, TMA row offsets multiples of 8 for the key shift): the Mosaic GPU prepare checked and timed alone,
    # the whole op timed with it, the whole op's bf16 gradients through it
    step check_prepare 300 python3 benchmarks/gpu_check_mosaic_prepare.py --out "$out/$part/check_prepare.json"
    step bench 150 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas (ours)" \
      --skip "$WHOLE_OP_VARIANTS" --configs "prepare=mosaic" --out "$out/$part/bench.json"
    step check_grads 120 python3 benchmarks/gpu_check_regression.py --only "bf16 grads" \
      --kernel-config "prepare=mosaic" --out "$out/$part/check_grads.json"
    ;;
  next77)  # nineteenth run: prepare="auto" (Mosaic GPU on Hopper) as the default: its values again, the default
    # against prepare=triton and jla in one lease with memory at 1x32768, T = 65536 and the bf16 gradients, profile
    step check_prepare 100 python3 benchmarks/gpu_check_mosaic_prepare.py --skip-timing \
      --out "$out/$part/check_prepare.json"
    step bench 150 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" --skip "$WHOLE_OP_VARIANTS" --configs "prepare=triton" \
      --out "$out/$part/bench.json"
    step check 90 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" --out "$out/$part/check.json"
    step profile 60 python3 benchmarks/profile_kernels.py --shapes 2x8192x16x128 --impls "falcon-1" --top 12 \
      --out "$out/$part/profile.json"
    ;;
  next78)  # nineteenth run: the Mosaic GPU prepare multiplies the scores as hi + lo bf16 parts (next77: the whole
    # op's bf16 v-gradient error 2.10x the XLA form's, bound 2x): values, the gradient check on the same inputs
    # with the Triton prepare beside it, 2x8192 timed against prepare=triton
    step check_prepare 60 python3 benchmarks/gpu_check_mosaic_prepare.py --skip-timing \
      --out "$out/$part/check_prepare.json"
    step check 45 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" --out "$out/$part/check.json"
    step check_triton 45 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" \
      --kernel-config "prepare=triton" --out "$out/$part/check_triton.json"
    step bench 45 python3 benchmarks/bench_regression.py --shapes 2x8192x16x128 --memory-shapes "" \
      --rows "falcon-1 pallas (ours)" --skip "$WHOLE_OP_VARIANTS" --configs "prepare=triton" \
      --out "$out/$part/bench.json"
    # then by hand in the same lease (check_fp32_dr.json): the v-gradient bound with the reverse walk's dR in fp32
    step check_fp32_dr 50 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" \
      --kernel-config "stored_dr=fp32" --out "$out/$part/check_fp32_dr.json"
    ;;
  next79)  # twentieth run: the stored chunk gradients as a Pallas Mosaic GPU kernel (mosaic_gpu.chunk_grad_stored_pass,
    # KernelConfig(chunk_grads_kernel="mosaic")): values against float64 and the Triton pass, both timed alone; the
    # whole op timed with it against the default and jla, memory at 1x32768; the bf16 gradients through it; profile
    step check_grads_kernel 300 python3 benchmarks/gpu_check_mosaic_chunk_grads.py --out "$out/$part/check_grads_kernel.json"
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" --skip "$WHOLE_OP_VARIANTS" \
      --configs "chunk_grads_kernel=mosaic" --out "$out/$part/bench.json"
    step check 90 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" \
      --kernel-config "chunk_grads_kernel=mosaic" --out "$out/$part/check.json"
    step profile 60 python3 benchmarks/profile_kernels.py --shapes 2x8192x16x128 --impls "falcon-1" --top 12 \
      --kernel-config "chunk_grads_kernel=mosaic" --out "$out/$part/profile.json"
    ;;
  next80)  # twentieth run: the Mosaic GPU chunk gradients with grouped wgmma waits and the [C, C] masks formed where
    # used (next79: values pass, but 1.25x the Triton pass's time): values and time alone, the whole op at two shapes
    step check_grads_kernel 300 python3 benchmarks/gpu_check_mosaic_chunk_grads.py --out "$out/$part/check_grads_kernel.json"
    step bench 120 python3 benchmarks/bench_regression.py --memory-shapes "" --shapes 8x2048x16x128,2x8192x16x128 \
      --rows "falcon-1 pallas" --skip "$WHOLE_OP_VARIANTS" --configs "chunk_grads_kernel=mosaic" \
      --out "$out/$part/bench.json"
    ;;
  next81)  # twentieth run: the Mosaic GPU chunk gradients one wait per product again (next80's grouped waits: 1.37x
    # the Triton pass, next79's 1.25x) with the masks formed where used: values and time alone; the default and
    # that opt-in against jla at three shapes with memory at 1x32768; the bf16 gradients with v's bound for the bf16
    # dR (default) and with fp32 dR (every bound 2x)
    step check_grads_kernel 240 python3 benchmarks/gpu_check_mosaic_chunk_grads.py --out "$out/$part/check_grads_kernel.json"
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" --skip "$WHOLE_OP_VARIANTS" \
      --configs "chunk_grads_kernel=mosaic" --out "$out/$part/bench.json"
    step check 60 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" --out "$out/$part/check.json"
    step check_fp32_dr 60 python3 benchmarks/gpu_check_regression.py --only "bf16 grads" \
      --kernel-config "stored_dr=fp32" --out "$out/$part/check_fp32_dr.json"
    ;;
  next82)  # twentieth run: today's default, per-kernel split at 8x2048 and 1x32768 (the two shapes still over the
    # fwd+bwd target) for the next session's choices
    profile_falcon1 120 14
    ;;
  next83)  # twentieth run, after the review's refactor (the key shift, token rows and check-script main shared by
    # both Mosaic kernels): both kernels' values again
    step check_prepare 150 python3 benchmarks/gpu_check_mosaic_prepare.py --skip-timing \
      --out "$out/$part/check_prepare.json"
    step check_grads_kernel 150 python3 benchmarks/gpu_check_mosaic_chunk_grads.py --skip-timing \
      --out "$out/$part/check_grads_kernel.json"
    ;;
  next84)  # twenty-first run: pieces again, now with the split maps (W, U per chunk and a state-only walk of each
    # piece over [I | 0], two dots per chunk in the walks' bf16 operands; M kept for the backward): values where the
    # checks cut pieces (fp32 B1 H4) and everywhere (target_programs=1024); the whole op at 2, 4, 8 pieces
    step check 150 python3 benchmarks/gpu_check_regression.py --only "fp32 values,fp32 grads,segments,falcon-3 values" \
      --out "$out/$part/check.json"
    step check_pieces 150 python3 benchmarks/gpu_check_regression.py --only "fp32 values,fp32 grads,bf16,bf16 grads" \
      --kernel-config "target_programs=1024" --out "$out/$part/check_pieces.json"
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0 gated;jla gated" --skip "$WHOLE_OP_VARIANTS" \
      --configs "target_programs=256;target_programs=512;target_programs=1024;target_programs=512,outputs=split" \
      --out "$out/$part/bench.json"
    ;;
  next85)  # twenty-first run: where pieces lose (next84: 2 pieces at 8x2048 0.85 vs 0.37 ms forward): the
    # per-kernel split with 2 pieces at 8x2048 and 4 at 1x32768
    profile_falcon1 150 22 --kernel-config "target_programs=512"
    ;;
  next86)  # twenty-first run: next85 showed the walks bound by bytes, not by their serial steps (4 pieces at
    # 1x32768: the output walk 765 us vs 694 in one piece; every 16-column program re-reads the chunk's key tiles),
    # so pieces with wider value blocks (fewer re-reads, the pieces giving back the programs); the fused maps beside
    step bench 220 python3 benchmarks/bench_regression.py --memory-shapes "" --shapes 2x8192x16x128,1x32768x16x128 \
      --rows "falcon-1 pallas" --skip "$WHOLE_OP_VARIANTS" \
      --configs "block_v=64,split_block_v=64,target_programs=128;block_v=64,split_block_v=64,target_programs=256;block_v=32,split_block_v=32,target_programs=256;block_v=64,split_block_v=64,target_programs=128,piece_maps=fused;block_v=64,split_block_v=64,target_programs=128,outputs=split" \
      --out "$out/$part/bench.json"
    profile_falcon1 120 16 --shapes 1x32768x16x128 --kernel-config "block_v=64,split_block_v=64,target_programs=128"
    ;;
  next87)  # twenty-first run: where "auto" cuts pieces (few batch·heads: B1 H4 gives 32 programs), the split maps
    # against the fused ones and against no pieces
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes "" --shapes 1x8192x4x128,1x32768x4x128 \
      --rows "falcon-1 pallas" --skip "$WHOLE_OP_VARIANTS" --configs "piece_maps=fused;target_programs=1" \
      --out "$out/$part/bench.json"
    ;;
  next88)  # twenty-first run: next87 had no pieces win at 32 programs (B1 H4); fewer heads still (8 and 16 programs)
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes "" \
      --shapes 1x8192x2x128,1x32768x2x128,1x8192x1x128,1x32768x1x128 \
      --rows "falcon-1 pallas" --skip "$WHOLE_OP_VARIANTS" --configs "target_programs=1;target_programs=16" \
      --out "$out/$part/bench.json"
    ;;
  next89)  # twenty-second run: the triangular inverse's diagonal blocks by column (right-looking) elimination, no
    # layout conversion between steps: values and time of each variant alone; the whole op against the row
    # elimination at three shapes; the whole op's bf16 checks with the new default; the XLA fusions at 8x2048
    step check_tri 200 python3 benchmarks/gpu_check_tri_inverse.py --out "$out/$part/check_tri.json"
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes "" \
      --rows "falcon-1 pallas" --skip "$WHOLE_OP_VARIANTS" --configs "tri_elimination=rows" \
      --out "$out/$part/bench.json"
    step check 80 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" --out "$out/$part/check.json"
    step fusions 60 python3 benchmarks/dump_fusions.py --shape 8x2048x16x128 \
      --names loop_convert_fusion,loop_broadcast_fusion.3,input_reduce_fusion.2 --out "$out/$part/hlo"
    ;;
  next90)  # twenty-second run: the diagonal blocks by doubling (blocked substitution down to single rows, 3xTF32 dots
    # for bf16 inputs; 41% fewer instructions than the column elimination, more spills): values and time alone, the
    # whole op against today's default, its bf16 checks; the default's per-kernel split.  Doubling lost (inverse
    # 106.9 vs 93.4 us at 8x2048) and was removed, so this part no longer runs as written
    step check_tri 150 python3 benchmarks/gpu_check_tri_inverse.py --out "$out/$part/check_tri.json"
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes "" \
      --rows "falcon-1 pallas" --skip "$WHOLE_OP_VARIANTS" --configs "tri_elimination=doubling" \
      --out "$out/$part/bench.json"
    step check 80 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" \
      --kernel-config "tri_elimination=doubling" --out "$out/$part/check.json"
    profile_falcon1 120 14
    ;;
  next91)  # twenty-second run: every regression GPU check with the final default (the column elimination)
    step check 540 python3 benchmarks/gpu_check_regression.py --out "$out/$part/check.json"
    ;;
  next92|next93)  # twenty-third run: the walks as Mosaic GPU kernels on thread-block clusters (a head's value blocks share
    # the chunk's key, query, T and score tiles by TMA multicast): values against float64 next to the Triton walk,
    # then both timed alone
    step check_walks 560 python3 benchmarks/gpu_check_mosaic_walks.py --out "$out/$part/check_walks.json"
    ;;
  next94)  # twenty-third run, second call: the Mosaic walks wired into the op (KernelConfig(walks="mosaic"): the
    # register form, 64 columns, 3 stages; Falcon-1's keys shifted by a copy in XLA): their values with the shifted
    # keys, the whole op against the default in one lease, its bf16 checks, and where the time goes
    step check_walks 150 python3 benchmarks/gpu_check_mosaic_walks.py --skip-timing --out "$out/$part/check_walks.json"
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas" \
      --skip "$WHOLE_OP_VARIANTS" \
      --configs "walks=mosaic" --out "$out/$part/bench.json"
    step check 80 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" \
      --kernel-config "walks=mosaic" --out "$out/$part/check.json"
    profile_falcon1 120 14 --kernel-config "walks=mosaic"
    ;;
  next95)  # twenty-third run, third call: walks="auto" (the default: the Mosaic walks where the Triton walks would take
    # 64 value columns) against walks="triton" in one lease, with the compiled peak memory
    step bench 300 python3 benchmarks/bench_regression.py --memory-shapes "8x2048x16x128,1x32768x16x128" \
      --rows "falcon-1 pallas" \
      --skip "$WHOLE_OP_VARIANTS" \
      --configs "walks=triton" --out "$out/$part/bench.json"
    ;;
  next96)  # twenty-third run, fourth call: the split reverse walk as a Mosaic GPU cluster kernel (dR and dh written over V
    # and the q-term through refs aliased in and out of the kernel): values and time alone, the whole op with
    # walks="auto" (now also the reverse walk at 64 columns) against walks="triton", memory, bf16 checks, profile
    step check_walks 150 python3 benchmarks/gpu_check_mosaic_walks.py --reverse-only --out "$out/$part/check_walks.json"
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes "8x2048x16x128" --rows "falcon-1 pallas" \
      --skip "$WHOLE_OP_VARIANTS" \
      --configs "walks=triton" --out "$out/$part/bench.json"
    step check 80 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" \
      --kernel-config "walks=mosaic,dstate_q=prepare" --out "$out/$part/check.json"
    step profile 60 python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128 --impls "falcon-1" --top 14 \
      --out "$out/$part/profile.json"
    ;;
  next97)  # twenty-third run, fifth call: the op's bf16 checks through the Mosaic walks (one piece, so that both
    # walks serve the check's B1 T2048 H4 call; next94/next96's checks took pieces there, hence the Triton walks),
    # and the same configuration with the Triton walks
    step check_mosaic 80 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" \
      --kernel-config "walks=mosaic,dstate_q=prepare,target_programs=1" --out "$out/$part/check_mosaic.json"
    step check_triton 80 python3 benchmarks/gpu_check_regression.py --only "bf16 grads" \
      --kernel-config "walks=triton,dstate_q=prepare,target_programs=1" --out "$out/$part/check_triton.json"
    ;;
  next98)  # twenty-third run, sixth call: the Mosaic reverse walk where the Triton one takes 32 or 16 columns
    # (split_block_v=64 makes "auto" take it at 2x8192 and 1x32768), against the Triton walk at 64 columns
    step bench 250 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas" \
      --skip "$WHOLE_OP_VARIANTS" \
      --configs "split_block_v=64;split_block_v=64,walks=triton" --out "$out/$part/bench.json"
    ;;
  next99)  # twenty-fourth run, first call: the Mosaic reverse walk forming the q-term (c ⊙ Q)ᵀ dO itself (dstate_q=walk:
    # prepare writes V only, the walk reads Q and dO, dh takes its own buffer): values of both q-term modes and each
    # walk alone, then the whole op at every shape and 8x2048's memory and profile against the default (dstate_q
    # from prepare at 8x2048; at 2x8192 and 1x32768 "auto" already forms it in the Triton walks)
    step check_walks 150 python3 benchmarks/gpu_check_mosaic_walks.py --reverse-only --out "$out/$part/check_walks.json"
    step bench 220 python3 benchmarks/bench_regression.py --memory-shapes "8x2048x16x128" --rows "falcon-1 pallas" \
      --skip "$WHOLE_OP_VARIANTS" --configs "dstate_q=walk" --out "$out/$part/bench.json"
    step profile 60 python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128 --impls "falcon-1" --top 14 \
      --kernel-config "dstate_q=walk" --out "$out/$part/profile.json"
    ;;
  next100)  # twenty-fourth run, second call: the Mosaic reverse walk forming V too (dstate_v, "auto": no prepare pass
    # at 8x2048): values of the three modes and each walk alone, the whole op at every shape against dstate_v=prepare,
    # 8x2048's memory
    step check_walks 200 python3 benchmarks/gpu_check_mosaic_walks.py --reverse-only --out "$out/$part/check_walks.json"
    step bench 220 python3 benchmarks/bench_regression.py --memory-shapes "8x2048x16x128" --rows "falcon-1 pallas" \
      --skip "$WHOLE_OP_VARIANTS" --configs "dstate_v=prepare" --out "$out/$part/bench.json"
    ;;
  next101)  # twenty-fourth run, third call: the op's bf16 checks through the Mosaic walks, the reverse one forming the
    # q-term (the default) and also V (dstate_v=walk), in one piece (the check's B1 T2048 H4 call); the profile at 8x2048
    step check 120 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads" \
      --kernel-config "walks=mosaic,target_programs=1" --out "$out/$part/check.json"
    step check_v 120 python3 benchmarks/gpu_check_regression.py --only "bf16 grads" \
      --kernel-config "walks=mosaic,target_programs=1,dstate_v=walk" --out "$out/$part/check_v.json"
    step profile 60 python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128 --impls "falcon-1" --top 14 \
      --out "$out/$part/profile.json"
    ;;
  next102)  # twenty-fourth run, fourth call: the stored chunk gradients' launch parameters again under today's default
    # (last tuned in the ninth to fifteenth runs, before the Mosaic walks and the in-place dy/dx)
    step bench 300 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas" \
      --shapes "8x2048x16x128,2x8192x16x128" --skip "$WHOLE_OP_VARIANTS" \
      --configs "grad_block_k=64;grad_block_k=16;grad_stages=2;grad_stages=4;grad_warps=8;grad_block_v=32;grad_block_v=128" \
      --out "$out/$part/bench.json"
    ;;
  next103)  # twenty-fourth run, fifth call: the new default grad_block_v (128 value columns for 16-bit inputs) against
    # the old 64 at 8x2048 (Falcon-1 and Falcon-3) and 1x32768 with its memory, then the op's bf16 checks under it
    step bench 260 python3 benchmarks/bench_regression.py --memory-shapes "1x32768x16x128" \
      --rows "falcon-1 pallas;falcon-3 W=4" --shapes "8x2048x16x128,1x32768x16x128" --skip "$WHOLE_OP_VARIANTS" \
      --configs "grad_block_v=64" --out "$out/$part/bench.json"
    step check 150 python3 benchmarks/gpu_check_regression.py --only "long bf16,segments,bf16 grads" \
      --out "$out/$part/check.json"
    ;;
  next104)  # twenty-fourth run, sixth call: today's default at every shape in one lease, and where its time goes
    step bench 150 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas (ours)" \
      --skip "$WHOLE_OP_VARIANTS" --out "$out/$part/bench.json"
    profile_falcon1 120 16
    ;;
  next105)  # twenty-fourth run, seventh call: the remaining op checks under today's defaults (extreme gates, the pass
    # choices' fp32 and bf16 cases, Falcon-3's values)
    step check 400 python3 benchmarks/gpu_check_regression.py --only "extreme op,falcon-3 values,pass choices" \
      --out "$out/$part/check.json"
    ;;
  next106)  # twenty-fifth run, first call: the walks and the forward's parallel passes at 128-row chunks against
    # 64 (the long shapes; the walks are latency-bound per chunk step)
    step probe 420 python3 benchmarks/probe_walk_chunk.py --out "$out/$part/probe.json"
    ;;
  next107)  # twenty-sixth run: the backward's walks over 128-row chunks (bwd_walk_chunks=2, T joined from the 64-row
    # inverses, states and state gradients stored at every 64-row boundary): the op's checks through them (one piece),
    # then the whole op at every shape against the default, with the reverse walk's stages and prepare's warps.  That
    # code lost and was reverted: it is commit 5595674 (check it out to run this part again)
    step check 150 python3 benchmarks/gpu_check_regression.py --only "segments,bf16 grads,fp32 grads" \
      --kernel-config "bwd_walk_chunks=2,target_programs=1" --out "$out/$part/check.json"
    step bench 330 python3 benchmarks/bench_regression.py --memory-shapes "1x32768x16x128" --rows "falcon-1 pallas" \
      --skip "$WHOLE_OP_VARIANTS" \
      --configs "bwd_walk_chunks=2;bwd_walk_chunks=2,state_stages=2;bwd_walk_chunks=2,prepare_warps=8" \
      --out "$out/$part/bench.json"
    # run as a call of its own after the above (the reverse walk at 3 stages is out of shared memory)
    step profile 120 python3 benchmarks/profile_kernels.py --shapes 1x32768x16x128,2x8192x16x128 --impls "falcon-1" \
      --kernel-config "bwd_walk_chunks=2,state_stages=2" --top 16 --out "$out/$part/profile.json"
    ;;
  next108)  # twenty-sixth run, third call: pieces at 1x32768 with the fused output walk in each piece (outputs=pallas;
    # "auto" takes the split forward whenever there are pieces), 2 and 4 pieces at 16, 32 and 64 value columns
    step bench 400 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas" \
      --shapes "1x32768x16x128" --skip "$WHOLE_OP_VARIANTS" \
      --configs "target_programs=256,outputs=pallas;target_programs=512,outputs=pallas;block_v=32,target_programs=256,outputs=pallas;block_v=64,target_programs=128,outputs=pallas;target_programs=512" \
      --out "$out/$part/bench.json"
    ;;
  next109)  # twenty-sixth run, fourth call: the Triton walks' warps and stages again at the long shapes (the step is
    # latency-bound; 2 warps and 4 stages were last timed before the bf16 walk operands)
    step bench 300 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas" \
      --shapes "1x32768x16x128,2x8192x16x128" --skip "$WHOLE_OP_VARIANTS" \
      --configs "fwd_warps=2;state_warps=2;fwd_stages=4;state_stages=4;fwd_warps=2,state_warps=2" \
      --out "$out/$part/bench.json"
    ;;
  next110)  # twenty-sixth run, fifth call: the output walk at 4 stages against 3 (next109: 2% faster forward), repeated
    # within the lease
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas" \
      --shapes "1x32768x16x128,2x8192x16x128" --skip "$WHOLE_OP_VARIANTS" \
      --configs "fwd_stages=4;fwd_stages=3;fwd_stages=4,fwd_warps=4;fwd_stages=3,fwd_warps=4" --out "$out/$part/bench.json"
    ;;
  next111)  # twenty-sixth run, sixth call: the new default (4 stages for an output walk of few programs at 16 bf16
    # columns) against the old 3 at every shape, and the op's bf16 and extreme-gate checks under it
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas" \
      --skip "$WHOLE_OP_VARIANTS" --configs "fwd_stages=3" --out "$out/$part/bench.json"
    step check 250 python3 benchmarks/gpu_check_regression.py --only "long bf16,bf16 grads,extreme op" \
      --out "$out/$part/check.json"
    ;;
  next112)  # twenty-sixth run, seventh call: the 4-stage rule gated on the GPU's shared memory (common.large_shared_memory)
    # still picks 4 stages on the H200: the helper's answer, then 1x32768 default vs fwd_stages=3
    step helper 30 python3 -c "import jax; from falcon_jax.kernels.common import large_shared_memory as f; \
print(jax.devices()[0].compute_capability, 'large_shared_memory', f())"
    step bench 120 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas" \
      --shapes "1x32768x16x128" --skip "$WHOLE_OP_VARIANTS" --configs "fwd_stages=3" --out "$out/$part/bench.json"
    ;;
  next113)  # twenty-sixth run, eighth call: with 4-stage narrow output walks, do 16 columns pay at 2x8192 (256 programs)
    # and does the walk forming its own scores pay at 1x32768?
    step bench 200 python3 benchmarks/bench_regression.py --memory-shapes "" --rows "falcon-1 pallas" \
      --shapes "2x8192x16x128,1x32768x16x128" --skip "$WHOLE_OP_VARIANTS" \
      --configs "block_v=16;fwd_scores=walk;block_v=16,fwd_scores=walk" --out "$out/$part/bench.json"
    ;;
  next114)  # twenty-seventh run, first call: Falcon-3's λmax by elementwise Jacobi rotations against eigh (the
    # statistic alone and the whole op, W = 2, 4, 8), Falcon-3's GPU values under it, and the per-kernel split of
    # Falcon-2 and Falcon-3 at 8x2048 (what bounds them)
    step probe 300 python3 benchmarks/probe_lambda_max.py --shape 8x2048x16x128 --windows 2,4,8 \
      --out "$out/$part/probe.json"
    step check 90 python3 benchmarks/gpu_check_regression.py --only "falcon-3 values" --out "$out/$part/check.json"
    step profile 180 python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128 --impls "falcon-2,falcon-3" \
      --iters 5 --top 16 --out "$out/$part/profile.json"
    ;;
  next115)  # twenty-seventh run, second call: the window Gram as a product and a sum (rules.window_gram) instead of
    # a batched fp32 dot (next114: 632 us of cuBLAS gemv per forward at 8x2048, W = 4); the statistic on the old
    # dot for comparison, Falcon-3's GPU values, the per-kernel split again
    step probe 240 python3 benchmarks/probe_lambda_max.py --shape 8x2048x16x128 --windows 2,4,8 \
      --out "$out/$part/probe.json"
    step probe_dot 90 python3 benchmarks/probe_lambda_max.py --shape 8x2048x16x128 --windows 2,4,8 --gram dot \
      --skip-op --out "$out/$part/probe_dot.json"
    step check 90 python3 benchmarks/gpu_check_regression.py --only "falcon-3 values" --out "$out/$part/check.json"
    step profile 120 python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128 --impls "falcon-3" \
      --iters 5 --top 16 --out "$out/$part/profile.json"
    ;;
  next116)  # prepared in the twenty-seventh session, run in the twenty-eighth (after next119, with the wheels in .whl/):
    # today's code with every peer in one lease (jla gated_deltanet / deltanet,
    # fla chunk_gated_delta_rule / chunk_delta_rule), Falcon-2 and Falcon-3 (8x2048) for the ratios, peak memory at
    # 1x32768 and 1x131072
    step bench 540 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128,1x131072x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0;fla 0.6.0;falcon-2 per-column pallas (ours);falcon-3 W=4;jla gated" \
      --skip "row-by-row,$WHOLE_OP_VARIANTS" --out "$out/$part/bench.json"
    ;;
  next117)  # twenty-eighth run, first call: Falcon-3's λmax through u = Xᵀv (gradient 2 v uᵀ, no [W, W, dk] product)
    # and the window Gram over the pairs i <= j only; Falcon-3's GPU values, the statistic and whole op at W = 2, 4, 8,
    # the per-kernel split again
    step check 90 python3 benchmarks/gpu_check_regression.py --only "falcon-3 values" --out "$out/$part/check.json"
    step probe 240 python3 benchmarks/probe_lambda_max.py --shape 8x2048x16x128 --windows 2,4,8 \
      --out "$out/$part/probe.json"
    step profile 120 python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128 --impls "falcon-3" \
      --iters 5 --top 16 --out "$out/$part/profile.json"
    ;;
  next118)  # twenty-eighth run, second call: next117 with the full W x W window Gram back (the pairs i <= j made the
    # forward slower) and the gradient through u = Xᵀv kept; the check gets the cold machine's compile time
    step check 180 python3 benchmarks/gpu_check_regression.py --only "falcon-3 values" --out "$out/$part/check.json"
    step probe 240 python3 benchmarks/probe_lambda_max.py --shape 8x2048x16x128 --windows 2,4,8 \
      --out "$out/$part/probe.json"
    step profile 120 python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128 --impls "falcon-3" \
      --iters 5 --top 16 --out "$out/$part/profile.json"
    ;;
  next119)  # twenty-eighth run, third call: the value vᵀGv from the Gram again (next118's ‖Xᵀv‖² cost the forward a
    # second pass over the windows), the gradient 2 v uᵀ by a custom VJP; then next116's table (every peer in one
    # lease, Falcon-2/3, memory at 1x32768 and 1x131072), the statistic and Falcon-3's split, its GPU values
    step bench 330 python3 benchmarks/bench_regression.py --memory-shapes 1x32768x16x128,1x131072x16x128 \
      --rows "falcon-1 pallas;jla 0.1.0;fla 0.6.0;falcon-2 per-column pallas (ours);falcon-3 W=4;jla gated" \
      --skip "row-by-row,$WHOLE_OP_VARIANTS" --out "$out/$part/bench.json"
    step probe 110 python3 benchmarks/probe_lambda_max.py --shape 8x2048x16x128 --windows 2,4 \
      --out "$out/$part/probe.json"
    step profile 60 python3 benchmarks/profile_kernels.py --shapes 8x2048x16x128 --impls "falcon-3" \
      --iters 5 --top 16 --out "$out/$part/profile.json"
    step check 90 python3 benchmarks/gpu_check_regression.py --only "falcon-3 values" --out "$out/$part/check.json"
    ;;
  next120)  # twenty-eighth run, last call (~4 minutes of device time left): Falcon-1's checks on today's code before
    # issue #4 is closed: fp32 values at T = 8192, T = 65536 finite, extreme gates, bf16 gradients
    step check 140 python3 benchmarks/gpu_check_regression.py --only "fp32 values,long bf16,extreme op,bf16 grads" \
      --out "$out/$part/check.json"
    ;;
  *) echo "unknown part $part (checks|bench|all|split|next|next2|next3|next4|next5|next6|next7|next8|next9|next10|next11|next12|next13|next14|next15|next16|next17|next18|next19|next20|next21|next22|next23|next24|next25|next26|next27|next28|next29|next30|next31|next32|next33|next34|next35|next36|next37|next38|next39|next40|next41|next42|next43|next44|next45|next46|next47|next48|next49|next50|next51|next52|next53|next54|next55|next56|next57|next58|next59|next60|next61|next62|next63|next64|next65|next66|next67|next68|next69|next70|next71|next72|next73|next74|next75|next76|next77|next78|next79|next80|next81|next82|next83|next84|next85|next86|next87|next88|next89|next90|next91|next92|next93|next94|next95|next96|next97|next98|next99|next100|next101|next102|next103|next104|next105|next106|next107|next108|next109|next110|next111|next112|next113|next114|next115|next116|next117|next118|next119|next120)"; exit 2 ;;
esac
tar czf "$out/$part.tar.gz" -C "$out" "$part" && echo "packed $out/$part.tar.gz"

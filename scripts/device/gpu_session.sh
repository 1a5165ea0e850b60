#!/usr/bin/env bash
# One device-machine session: environment facts, GPU correctness checks, benchmarks.
# Usage (on the GPU machine, repo root): bash scripts/device/gpu_session.sh [sections...]
# Sections: env check packing kernels bench layer packbench   (default: env check)
# Logs go to $OUT (or ./out) so the device tool brings them back.
set -u
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
sections=${*:-env check}
run() { local name=$1; shift; local t0=$(date +%s)
  echo "=== $name: $*"; timeout "${TMO:-420}" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n "${TAIL:-40}"
  echo "=== $name rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 ))s"; }
for s in $sections; do case $s in
  env) nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
       nvidia-smi topo -m | head -5
       python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' ;;
  packing) run packing torchrun --nproc-per-node="$NGPU" tests/gpu/packing_check.py ;;
  check) run check1 torchrun --nproc-per-node=1 tests/gpu/dist_check.py --quick ${CHECK_ARGS:-}
         [ "$NGPU" -ge 2 ] && run check2 torchrun --nproc-per-node=2 tests/gpu/dist_check.py ${CHECK_ARGS:-} ;;
  kernels) run kernels python3 -m pytest -q -x tests/gpu -m gpu -k "not cuda_backend" ;;
  bench) run bench_gemm python3 benchmarks/bench_grouped_gemm.py --csv "$OUT/bench_gemm.csv" ;;
  layer) run layer torchrun --nproc-per-node="$NGPU" benchmarks/bench_layer.py --out "$OUT" ${LAYER_ARGS:-} ;;
  packbench) run packbench torchrun --nproc-per-node="$NGPU" benchmarks/bench_packing.py --out "$OUT" ${PACK_ARGS:-} ;;
  *) echo "unknown section $s" ;;
esac; done

#!/usr/bin/env bash
# One device-machine session: environment facts, GPU correctness checks, benchmarks.
# Usage (on the GPU machine, repo root): bash scripts/device/gpu_session.sh [sections...]
# Sections: env check packing kernels traps bench claimsweep candcheck candbench ab scoregrads
#           rowgather pdl gaps sustained nvlink cutlass wgradcl floor wgradf32 wgradstore weights
#           wgradinto layer packbench megatron pack
#           (default: env check)
# Knobs: CHECK_ARGS LAYER_ARGS PACK_ARGS BENCH_ARGS (extra arguments), TMO (seconds per step),
#        CANDS (opt-in switches for 'candcheck' / 'candbench'), AB_A AB_B AB_ARGS ('ab'), SEEDS, STEPS, MB (microbatches) and
#        MOE_BACKEND (cuda | reference: isolates the CUDA backend's numerics), PERTURB (the repeat
#        alltoall model starts from weights x (1 + PERTURB N(0,1)): a rounding-sized noise band) and MEGATRON_ARGS
#        (e.g. --fp32, with MOE_BACKEND=reference) for 'megatron'.
# megatron-core travels as a wheel in .whl/ (carry it); it is installed into /tmp/site here.
# Logs go to $OUT (or ./out) so the device tool brings them back.
set -u
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
# the csrc/ CUTLASS library: a build made on the CPU machine can be carried in .csrc_cache (its
# key covers the sources, flags, nvcc version and CUTLASS version; a mismatch rebuilds here)
export DIST_MOE_CSRC_CACHE=${DIST_MOE_CSRC_CACHE:-$PWD/.csrc_cache}
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/megatron ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PYTHONPATH
sections=${*:-env check}
# each step runs under a time limit: $TMO when set, else the step's LIMIT (about three times
# what it took on 2xH200), else 420 s, so a hung step cannot eat the session's device time
run() { local name=$1; shift; local t0=$(date +%s)
  echo "=== $name: $*"; timeout "${TMO:-${LIMIT:-420}}" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n "${TAIL:-40}"
  echo "=== $name rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 ))s"; }
for s in $sections; do case $s in
  env) nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
       nvidia-smi topo -m | head -5
       python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' ;;
  packing) LIMIT=90 run packing torchrun --nproc-per-node="$NGPU" tests/gpu/packing_check.py ;;
  check) LIMIT=100 run check1 torchrun --nproc-per-node=1 tests/gpu/dist_check.py --quick ${CHECK_ARGS:-}
         [ "$NGPU" -ge 2 ] && LIMIT=150 run check2 torchrun --nproc-per-node=2 tests/gpu/dist_check.py ${CHECK_ARGS:-} ;;
  kernels) run kernels python3 -m pytest -q -x tests/gpu -m gpu -k "not cuda_backend" ;;
  traps) run traps python3 -m pytest -q tests/gpu/test_cuda_backend.py -m gpu -k device_traps ;;
  bench) run bench_gemm python3 benchmarks/bench_grouped_gemm.py --csv "$OUT/bench_gemm.csv" ${BENCH_ARGS:-} ;;
  claimsweep) run claimsweep python3 benchmarks/bench_grouped_gemm.py --kernels fwd_swiglu_claim,dgrad_w2_claim \
                 --peer --claim-sweep --csv "$OUT/claim_sweep.csv" ;;
  candcheck|candbench) # opt-in changes not yet default (CANDS: space-separated VAR=value; each
          # variable once). Routing/bookkeeping/fused SwiGLU bwd/claim slices became defaults
          # after the 2026-11-30 run; W13 WGRAD on a side stream stayed opt-in (noise-level).
          CANDS=${CANDS:-DIST_MOE_WGRAD_OVERLAP=1}
          if [ "$s" = candcheck ]; then   # correctness with every candidate on
            LIMIT=200 run cand_check env $CANDS torchrun --nproc-per-node="$NGPU" tests/gpu/dist_check.py --engines triton
            LIMIT=90 run cand_packing env $CANDS torchrun --nproc-per-node="$NGPU" tests/gpu/packing_check.py
          else                             # guide bench: defaults, each candidate alone, all together
            for v in default $CANDS all; do
              case $v in all) vars=$CANDS ;; default) vars="" ;; *) vars=$v ;; esac
              TAIL=12 run "cand_${v%%=*}" env $vars torchrun --nproc-per-node="$NGPU" benchmarks/bench_layer.py \
                  --out "$OUT/cand_${v%%=*}" --cases guide --paths dist_moe,dist_moe_staged,a2a
            done
            python3 benchmarks/compare_candidates.py "$OUT"
          fi ;;
  megatron) # ~0.3 s per step per model at 2 microbatches; 3 models (alltoall twice: the noise band):
            # one seed of 300 steps takes ~6 min
            for seed in ${SEEDS:-1234}; do
              TMO=${TMO:-590} run "megatron_$seed" torchrun --nproc-per-node="$NGPU" \
                examples/tiny_gpt_dist_moe.py --preset small --num-microbatches "${MB:-2}" \
                --steps "${STEPS:-300}" --compare --te off --seed "$seed" \
                --dist-moe-backend "${MOE_BACKEND:-cuda}" --repeat-alltoall \
                ${PERTURB:+--repeat-perturb "$PERTURB"} ${MEGATRON_ARGS:-} \
                --csv "$OUT/megatron_cmp_${MOE_BACKEND:-cuda}_$seed.csv"
            done ;;
  ab) # interleaved A/B in one process (benchmarks/ab_layer.py): AB_B (required), AB_A, AB_ARGS
      LIMIT=150 run ab torchrun --nproc-per-node="$NGPU" benchmarks/ab_layer.py --out "$OUT" \
          --a "${AB_A:-}" --b "${AB_B?set AB_B, e.g. AB_B=DIST_MOE_WGRAD_OVERLAP=1 (empty: the defaults)}" ${AB_ARGS:-} ;;
  scoregrads) # the guide's layout, Config.save_route_outputs=True (the default is False since
          # 2026-11-30): correctness on 1 and 2 GPUs, then A/B against the default
          LIMIT=100 run sg_check1 torchrun --nproc-per-node=1 tests/gpu/dist_check.py --quick --save-route-outputs 1
          [ "$NGPU" -ge 2 ] && LIMIT=150 run sg_check2 torchrun --nproc-per-node=2 tests/gpu/dist_check.py --save-route-outputs 1
          LIMIT=90 run sg_packing torchrun --nproc-per-node="$NGPU" tests/gpu/packing_check.py --save-route-outputs 1
          LIMIT=150 run sg_ab torchrun --nproc-per-node="$NGPU" benchmarks/ab_layer.py --out "$OUT" \
              --b-config save_route_outputs=1 ;;
  rowgather) # DIST_MOE_GATHER_FANOUT=0 (one peer read per route; the default since 2026-11-30
          # reads each token row once): kernel tests, correctness on 1 and 2 GPUs, packing, A/B
          LIMIT=60 run rg_kernels python3 -m pytest -q tests/gpu/test_routing_gpu.py -m gpu -k fanout
          LIMIT=100 run rg_check1 env DIST_MOE_GATHER_FANOUT=0 torchrun --nproc-per-node=1 tests/gpu/dist_check.py --quick
          [ "$NGPU" -ge 2 ] && LIMIT=150 run rg_check2 env DIST_MOE_GATHER_FANOUT=0 torchrun --nproc-per-node=2 tests/gpu/dist_check.py
          LIMIT=90 run rg_packing env DIST_MOE_GATHER_FANOUT=0 torchrun --nproc-per-node="$NGPU" tests/gpu/packing_check.py
          LIMIT=150 run rg_ab torchrun --nproc-per-node="$NGPU" benchmarks/ab_layer.py --out "$OUT" \
              --b DIST_MOE_GATHER_FANOUT=0 ;;
  pdl) # DIST_MOE_PDL=1 (programmatic dependent launch of our kernels, against the idle time
       # between kernels): correctness on 1 and 2 GPUs, packing, kernel tests, then A/B
       LIMIT=100 run pdl_check1 env DIST_MOE_PDL=1 torchrun --nproc-per-node=1 tests/gpu/dist_check.py --quick
       [ "$NGPU" -ge 2 ] && LIMIT=150 run pdl_check2 env DIST_MOE_PDL=1 torchrun --nproc-per-node=2 tests/gpu/dist_check.py
       LIMIT=90 run pdl_packing env DIST_MOE_PDL=1 torchrun --nproc-per-node="$NGPU" tests/gpu/packing_check.py
       LIMIT=150 run pdl_ab torchrun --nproc-per-node="$NGPU" benchmarks/ab_layer.py --out "$OUT" \
           --b DIST_MOE_PDL=1 ;;
  gaps) # what one kernel boundary costs in a CUDA graph (tiny, after a big-smem GEMM, after a
        # row copy, after peer stores), plain and with programmatic dependent launch
        LIMIT=90 run gaps torchrun --nproc-per-node="$NGPU" benchmarks/bench_kernel_gaps.py --out "$OUT" ;;
  sustained) # the same CUDA graph replayed back to back from idle: per-replay ms next to the SM
             # clock and power (dense bf16 mm 8192^3, guide-load fwd and fwd+bwd)
             LIMIT=150 run sustained torchrun --nproc-per-node="$NGPU" benchmarks/bench_sustained.py --out "$OUT" ;;
  nvlink) # pull (peer loads) vs push (peer stores) row traffic, alone and next to a dense GEMM
          run nvlink torchrun --nproc-per-node=2 benchmarks/bench_nvlink_rows.py --out "$OUT" --gemm ;;
  cutlass) # CUTLASS's warp-specialized grouped GEMM (csrc/): build, kernel tests, the FPROP
           # kernels against ours and torch, then the W13 FPROP on it (DIST_MOE_W13_CUTLASS):
           # correctness on 1 and 2 GPUs and an interleaved A/B against the defaults
           LIMIT=300 run cl_build python3 -c 'from megatron_dist_moe.kernels import grouped_gemm_sm90 as g; print(g.build_library(verbose=True))'
           LIMIT=120 run cl_kernels python3 -m pytest -q tests/gpu/test_grouped_gemm_sm90_gpu.py -m gpu
           LIMIT=180 run cl_bench python3 benchmarks/bench_grouped_gemm.py --kernels fwd_swiglu,fwd_w2_scatter \
               --cutlass --csv "$OUT/bench_gemm_cutlass.csv"
           LIMIT=100 run cl_check1 env DIST_MOE_W13_CUTLASS=${CL_CONFIG:-coop} torchrun --nproc-per-node=1 tests/gpu/dist_check.py --quick
           [ "$NGPU" -ge 2 ] && LIMIT=150 run cl_check2 env DIST_MOE_W13_CUTLASS=${CL_CONFIG:-coop} torchrun --nproc-per-node=2 tests/gpu/dist_check.py
           LIMIT=150 run cl_ab torchrun --nproc-per-node="$NGPU" benchmarks/ab_layer.py --out "$OUT" \
               --b DIST_MOE_W13_CUTLASS=${CL_CONFIG:-coop} ;;
  wgradcl) # both WGRADs on CUTLASS's grouped GEMM (DIST_MOE_WGRAD_CUTLASS): kernel tests, the
           # one-GPU WGRAD burst/settled rates against ours and torch, then correctness in the
           # layer on 1 and 2 GPUs (the A/B: 'ab' with AB_B=DIST_MOE_WGRAD_CUTLASS=coop)
           LIMIT=300 run wg_build python3 -c 'from megatron_dist_moe.kernels import grouped_gemm_sm90 as g; print(g.build_library(verbose=True))'
           LIMIT=180 run wg_kernels python3 -m pytest -q tests/gpu/test_grouped_gemm_sm90_gpu.py -m gpu
           LIMIT=240 run wg_sustained torchrun --nproc-per-node="$NGPU" benchmarks/bench_sustained.py \
               --out "$OUT/wg_sustained" --seconds 3 --idle-s 2 \
               --workloads dense_mm,wgrad_triton,wgrad_cutlass_coop,wgrad_torch
           LIMIT=100 run wg_check1 env DIST_MOE_WGRAD_CUTLASS=${WG_CONFIG:-coop} torchrun --nproc-per-node=1 tests/gpu/dist_check.py --quick
           [ "$NGPU" -ge 2 ] && LIMIT=150 run wg_check2 env DIST_MOE_WGRAD_CUTLASS=${WG_CONFIG:-coop} torchrun --nproc-per-node=2 tests/gpu/dist_check.py ;;
  floor) # the fwd+bwd floor on this GPU: the layer's six GEMMs alone (ours, torch's) next to the
         # dense mm and the whole layer, settled; then the guide layer with both ranks' profiles
         LIMIT=240 run floor_sustained torchrun --nproc-per-node="$NGPU" benchmarks/bench_sustained.py \
             --out "$OUT/floor" --seconds 3 --idle-s 2 \
             --workloads dense_mm,gemms_triton,gemms_torch,dist_moe_fwd,dist_moe_fwdbwd
         LIMIT=240 run floor_layer torchrun --nproc-per-node="$NGPU" benchmarks/bench_layer.py \
             --out "$OUT/floor" --cases guide --paths dist_moe,a2a --profile ;;
  wgradf32) # fp32 weight gradients (Config's default): CUTLASS WGRAD vs Triton, correctness on
            # 2 GPUs (dist_check has an fp32 case), then an interleaved A/B with fp32 on both sides
            [ "$NGPU" -ge 2 ] && LIMIT=150 run wf_check2 env DIST_MOE_WGRAD_CUTLASS=${WG_CONFIG:-coop} \
                torchrun --nproc-per-node=2 tests/gpu/dist_check.py
            LIMIT=200 run wf_ab torchrun --nproc-per-node="$NGPU" benchmarks/ab_layer.py --out "$OUT/wgradf32" \
                --a "${AB_A:-}" --b "${AB_B:-DIST_MOE_WGRAD_CUTLASS=coop}" \
                --a-config wgrad_dtype=fp32 --b-config wgrad_dtype=fp32 ;;
  wgradstore) # the WGRADs store the weights' dtype (bf16) even for wgrad_dtype=fp32: the bit-equality
              # kernel tests, correctness on 2 GPUs, then an A/B fp32 config vs bf16 config
              LIMIT=240 run ws_kernels python3 -m pytest -q tests/gpu/test_grouped_gemm_gpu.py \
                  tests/gpu/test_grouped_gemm_sm90_gpu.py -m gpu -k "bf16_store or wgrad"
              [ "$NGPU" -ge 2 ] && LIMIT=150 run ws_check2 torchrun --nproc-per-node=2 tests/gpu/dist_check.py
              LIMIT=200 run ws_ab torchrun --nproc-per-node="$NGPU" benchmarks/ab_layer.py --out "$OUT/wgradstore" \
                  --a-config wgrad_dtype=fp32 --b-config wgrad_dtype=bf16 ;;
  weights) # the Megatron plugin's weight plumbing per layer call (stack, main_grad adds), 1 GPU
           LIMIT=120 run weights python3 benchmarks/bench_expert_weights.py --out "$OUT/weights" ;;
  wgradinto) # routed_experts(wgrad_into=...): WGRADs adding into per-expert fp32 buffers (Megatron's
             # main_grad): kernel tests, dist_check (has _wgrad_into cases) on 1 and 2 GPUs, the
             # plugin's weight plumbing bench, then a short Megatron run (DDP: the new path)
             LIMIT=180 run wi_kernels python3 -m pytest -q tests/gpu/test_grouped_gemm_gpu.py -m gpu \
                 -k "wgrad_into or bf16_store or test_wgrad"
             LIMIT=100 run wi_check1 torchrun --nproc-per-node=1 tests/gpu/dist_check.py --quick
             [ "$NGPU" -ge 2 ] && LIMIT=150 run wi_check2 torchrun --nproc-per-node=2 tests/gpu/dist_check.py
             LIMIT=120 run wi_weights python3 benchmarks/bench_expert_weights.py --out "$OUT/weights" ;;
  layer) run layer torchrun --nproc-per-node="$NGPU" benchmarks/bench_layer.py --out "$OUT" ${LAYER_ARGS:-} ;;
  packbench) run packbench torchrun --nproc-per-node="$NGPU" benchmarks/bench_packing.py --out "$OUT" ${PACK_ARGS:-} ;;
  pack) # the device tool brings back few files: fold everything into one archive
        tar czf /tmp/session.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/session.tgz "$OUT/" \
          && ls -la "$OUT" ;;
  *) echo "unknown section $s" ;;
esac; done
